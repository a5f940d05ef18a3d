"""Hybrid models end to end: recurrent or linear-attention layers beside attention, on a real `kvd serve`.

For each of five real mlx-lm hybrid architectures (Qwen3.5's Gated DeltaNet,
LFM2's short convolutions, Nemotron-H's and Granite 4's Mamba-2 layers, and
Falcon-H1's Mamba-2 beside attention in every layer) and a sliding-window
model with attention sinks (gpt-oss), a random-weight tiny model built from
mlx-lm's own classes (tests/hybrids.py) goes through everything a rewind can
be: three turns; a regenerate and an edit; over the OpenAI door, a
conversation that branches and a retry of its first request; a second
conversation with the same system prompt; a stop and a start; a kill -9 and
a start. Every answer is compared with what a fresh prefill of the same ids
gives (mlx-lm's own generate_step), and every rewind must restore from a
checkpoint (state kept at an earlier point), never from zero.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI
from rich.console import Console

import hybrids
from conftest import fed_tokens
from daemon.models.catalog import folder_entry
from daemon.service.status import human, render_status
from daemonproc import DaemonProcess, SyncClient

MAX = 6  # tokens per answer
BLOCK = 16  # small blocks: the shared system prompt spans several, each captured as a checkpoint on disk
SYSTEM = ("You keep the lighthouse log: every ship that passes, the weather at dawn, the colour of the sea, "
          "written in the ledger your grandfather started.")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hybrids")
    return {arch: hybrids.build(arch, root / arch) for arch in hybrids.ARCHS}


class Turns:
    """What each answer was fed and gave, read from the transcript store as it was acknowledged."""

    def __init__(self, data: Path) -> None:
        self.db = data / "kvd.sqlite"
        self.seen: list[tuple[str, list[int], list[int], str]] = []  # (what, prompt ids, answer ids, finish)

    def add(self, what: str, sid: str, usage: dict[str, Any], finish: str) -> dict[str, Any]:
        ids = fed_tokens(self.db, sid)
        p, n = usage["prompt_tokens"], usage["completion_tokens"]
        assert n > 0, (what, usage)
        self.seen.append((what, ids[:p], ids[p:p + n], finish))
        return usage


def ws_turn(c: SyncClient, turns: Turns, what: str, type: str, sid: str, **fields: Any) -> dict[str, Any]:
    return ws_turns(c, turns, [(what, type, sid, fields)])[0]


def ws_turns(c: SyncClient, turns: Turns, asks: list[tuple[str, str, str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Requests sent at once (their answers decode in one batch), each one's usage once all are done."""
    rids = {c.send(type=type, session=sid, max_tokens=MAX, temperature=0, **fields): (what, sid)
            for what, type, sid, fields in asks}
    done: dict[str, dict[str, Any]] = {}
    while len(done) < len(rids):
        if (e := c.recv()).get("id") in rids and e["type"] in ("chat.done", "error"):
            assert e["type"] == "chat.done", (rids[e["id"]], e)
            done[e["id"]] = e
    return [turns.add(*rids[rid], done[rid]["usage"], done[rid]["finish_reason"]) for rid in rids]


def api_turn(api: OpenAI, turns: Turns, what: str, messages: list[Any]) -> tuple[str, dict[str, Any]]:
    """One chat completion; its answer's text, and its usage with the `kvd` object's figures."""
    r = api.chat.completions.create(model="kvd", messages=messages, max_tokens=MAX, temperature=0)
    assert r.usage is not None and r.usage.prompt_tokens_details is not None and r.model_extra is not None
    kvd = r.usage.model_extra["kvd"] if r.usage.model_extra else r.model_extra["kvd"]
    usage = {**kvd, "prompt_tokens": r.usage.prompt_tokens, "completion_tokens": r.usage.completion_tokens,
             "cached": r.usage.prompt_tokens_details.cached_tokens}
    turns.add(what, kvd["session"], usage, r.choices[0].finish_reason)
    return r.choices[0].message.content or "", usage


def end(u: dict[str, Any]) -> int:
    """Where a turn's cache ends: its prompt and its answer."""
    return int(u["prompt_tokens"] + u["completion_tokens"])


def restored(u: dict[str, Any], tier: str, *, point: bool) -> None:
    """A rewind restored from `tier` at a checkpoint (`point`), and recomputed only the rest."""
    assert u["restored_from"] == tier and u["restored_tokens"] > 0 and u["checkpoint"] is point, u
    assert u["prefill_tokens"] == u["prompt_tokens"] - u["restored_tokens"], u


@pytest.mark.parametrize("arch", list(hybrids.ARCHS))
def test_every_rewind_restores_a_checkpoint_exactly(model_dirs: dict[str, Path], tmp_path: Path,
                                                    arch: str) -> None:
    model = model_dirs[arch]
    # `kvd models` says what the model's caches keep, from its config and mlx-lm's class, loading nothing.
    assert folder_entry(arch, "here", model).caches == ("plain + rotating" if arch == "gpt_oss" else
                                                        "plain + recurrent")
    data = tmp_path / "kvd"
    turns = Turns(data)
    d = DaemonProcess(data, "--model", str(model), block_tokens=BLOCK)
    try:
        with d.client() as c:
            sid = c.request("session.create", system=SYSTEM)["session"]["id"]
            u = [ws_turn(c, turns, f"turn {i}", "chat.send", sid, text=t) for i, t in enumerate(
                ("What passed today?", "And the weather at dawn?", "Which colour was the sea?"))]
            assert [x["restored_from"] for x in u] == ["none", "resident", "resident"]
            assert not u[1]["checkpoint"] and u[1]["restored_tokens"] == end(u[0])
            # A regenerate comes back to the prompt's end less its last id: one id computed again.
            regen = ws_turn(c, turns, "regenerate", "chat.regenerate", sid)
            restored(regen, "resident", point=True)
            assert regen["restored_tokens"] == regen["prompt_tokens"] - 1
            # An edit of the last message comes back to the end of the answer before it; at once, a second
            # conversation with the same system prompt starts from the blocks the first one's prefill captured.
            # The two answers decode side by side in one batch.
            other = c.request("session.create", system=SYSTEM)["session"]["id"]
            edit, second = ws_turns(c, turns, [
                ("edit", "chat.edit", sid, {"message_index": 4, "text": "Was it grey?"}),
                ("second session", "chat.send", other, {"text": "Who started the ledger?"})])
            restored(edit, "resident", point=True)
            assert edit["restored_tokens"] == end(u[1])
            restored(second, "shared", point=True)
            assert second["restored_tokens"] % BLOCK == 0

        api = OpenAI(base_url=d.base_url, api_key=d.token, max_retries=0)
        first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Any ships tonight?"}]
        answer, a1 = api_turn(api, turns, "api 1", first)
        on = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "How many?"}]
        _, a2 = api_turn(api, turns, "api 2", on)
        assert a2["session"] == a1["session"] and a2["restored_from"] == "resident"
        # The conversation branches: a new session from the first one's state at the end of its answer.
        # (Or from a block its prefill captured in the few ids of the next message's head both share.)
        _, branch = api_turn(api, turns, "api branch", [*on[:3], {"role": "user", "content": "Which flags?"}])
        assert branch["session"] != a1["session"] and branch["restored_from"] == "shared", branch
        assert branch["checkpoint"] and end(a1) <= branch["cached"] < a2["prompt_tokens"], (a1, branch)
        # A retry of the first request: the first session's state at that prompt's end less one id.
        _, retry = api_turn(api, turns, "api retry", first)
        assert retry["restored_from"] == "shared" and retry["checkpoint"], retry
        assert retry["cached"] == a1["prompt_tokens"] - 1, retry
        with d.client() as c:
            status = c.request("status")  # (answered once the writes queued before it are on disk)
        # `kvd status` and /v1/models say what the model's cache keeps, and what its checkpoints cost.
        points = status["tiers"]["checkpoints"]
        kind = "rotating" if arch == "gpt_oss" else "arrays"
        assert points["kinds"][kind] > 0 and points["each_bytes"] > 0 and points["held"] > 0, points
        assert points["restores"] >= 4 and 0 < points["bytes"] <= points["held"] * points["each_bytes"], points
        console = Console(width=200, color_system=None, record=True)
        render_status(status, console)
        assert f"checkpoints: {human(points['each_bytes'])} each at most, up to 4 per session" in console.export_text()
        (listed,) = [m for m in api.models.list().data if m.id == str(model)]
        assert listed.model_extra is not None and listed.model_extra["kvd"]["cache"]["kinds"][kind] > 0
        assert listed.model_extra["kvd"]["cache"]["checkpoint_bytes"] == points["each_bytes"]
    finally:
        assert d.terminate() == 0

    d = DaemonProcess(data, "--model", str(model), block_tokens=BLOCK)
    try:
        with d.client() as c:
            # Disk ends a segment at each checkpoint too: a regenerate right after a start reads to the last.
            regen = ws_turn(c, turns, "regenerate after a stop", "chat.regenerate", sid)
            restored(regen, "disk", point=True)
            assert regen["restored_tokens"] == regen["prompt_tokens"] - 1
            after = ws_turn(c, turns, "after a stop", "chat.send", sid, text="And at night?")
            restored(after, "resident", point=False)
            assert after["restored_tokens"] == end(regen)
            c.request("status")
        d.kill()
    except BaseException:
        d.kill()
        raise
    d = DaemonProcess(data, "--model", str(model), block_tokens=BLOCK)
    try:
        with d.client() as c:
            killed = ws_turn(c, turns, "after kill -9", "chat.send", sid, text="Tomorrow?")
            restored(killed, "disk", point=False)  # the whole cache, its state at the chain's end
            assert killed["restored_tokens"] == end(after)
            edit = ws_turn(c, turns, "edit after kill -9", "chat.edit", sid, message_index=8, text="Tonight?")
            restored(edit, "resident", point=True)
            assert edit["restored_tokens"] == killed["restored_tokens"]
    finally:
        d.terminate()

    want = reference(model, [(prompt, len(answer)) for _, prompt, answer, _ in turns.seen])
    for (what, _, got, finish), ref in zip(turns.seen, want, strict=True):
        # An answer ended by its end-of-turn token does not feed it: the reference has it, the ids do not.
        assert got == ref[:len(got)] and (len(got) == len(ref) or finish == "stop"), (what, got, ref)


def reference(model_dir: Path, prompts: list[tuple[list[int], int]]) -> list[list[int]]:
    """What a fresh full prefill of each prompt continues with: mlx-lm's own generate_step, kvd's CPU attention
    installed as kvd runs it (conftest.greedy_reference, the model loaded once)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load

    from daemon.engine import attention

    model = load(str(model_dir))[0]
    model.set_dtype(mx.float32)
    attention.install()
    return [[int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=n)] for p, n in prompts]
