"""An answer that ends at its first token keeps the session's cache whole: over the websocket, the next turn
appends to the ids that were fed, the empty answer included (as the API door keeps it), and restores
everything it fed before (issue 45: before, the empty answer was dropped from the rendered history, the
next turn re-tokenized the transcript and re-read all but the ids up to the first difference)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from conftest import client, running_daemon
from daemon.models.builtin import ensure_builtin
from daemon.prompt import conversation_ids
from test_render_exact import fed_ids

pytestmark = pytest.mark.anyio


def _silent_model(root: Path) -> Path:
    """builtin:tiny with weights that end every answer at once: each position's hidden state is its own
    token's embedding (every layer's output projections are zero), and the generation prompt's last token
    ("\\n" after "<|im_start|>assistant") points at <|im_end|> in the output head."""
    from transformers import PreTrainedTokenizerFast

    out = root / "silent"
    shutil.copytree(ensure_builtin("builtin:tiny", root / "models"), out)
    config = json.loads((out / "config.json").read_text())
    config.pop("kvd_builtin", None)
    (out / "config.json").write_text(json.dumps(config))
    fast: Any = PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))  # type: ignore[no-untyped-call]
    newline = fast.encode("<|im_start|>assistant\n", add_special_tokens=False)[-1]
    weights = {k: np.array(v) for k, v in mx.load(str(out / "model.safetensors")).items()}  # type: ignore[union-attr]
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = np.zeros_like(weights[name])
    embed = np.zeros_like(weights["model.embed_tokens.weight"])
    head = np.zeros_like(weights["lm_head.weight"])
    embed[newline, 0] = 1.0
    head[config["eos_token_id"], 0] = 1.0
    weights.update({"model.embed_tokens.weight": embed, "lm_head.weight": head,
                    "model.norm.weight": np.ones_like(weights["model.norm.weight"])})
    mx.save_safetensors(str(out / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()})
    return out


async def test_an_answer_that_ends_at_once_keeps_the_whole_cache_for_the_next_turn(tmp_path: Path) -> None:
    model = _silent_model(tmp_path)
    async with running_daemon(tmp_path / "kvd", model=str(model)) as d:
        fed = fed_ids(d)
        async with client(d) as c:
            sid = (await c.request("session.create", system="Be brief."))["session"]["id"]
            before = 0
            for turn, text in enumerate(["hello there", "are you there?", "say something", "anything at all"]):
                deltas, done = await c.chat(sid, text, max_tokens=8, temperature=0)
                assert done["type"] == "chat.done" and done["finish_reason"] == "stop", done
                assert not deltas  # the first token ended the turn
                u = done["usage"]
                if turn:  # the whole cache restored; only the new message and the prompt prefilled
                    assert (u["cached_tokens"], u["reread_tokens"]) == (before, 0), u
                    assert u["prefill_tokens"] == u["prompt_tokens"] - before
                before = u["context_tokens"] - 1  # what the cache holds: the last token was sampled, not fed
            messages = [{"role": m["role"], "content": m["content"]} for m in d.store.messages(sid)]
        tokenizer = d.daemon.engine.tokenizer
    assert [m["content"] for m in messages if m["role"] == "assistant"] == [""] * 4
    # What the last turn was fed is the transcript rendered whole, its empty answers in it: no two user
    # turns in a row.
    assert fed[-1] == conversation_ids(tokenizer, messages[:-1], "Be brief.")
