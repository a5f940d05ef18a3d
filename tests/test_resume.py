"""Resume from every tier is exact: the answer equals a fresh full prefill's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cachestore.index import SegmentIndex
from conftest import client, fed_tokens, greedy_reference, running_daemon

pytestmark = pytest.mark.anyio

MODELS = ["builtin:tiny", "builtin:tiny-swa"]
# Budgets that force each path: 0 bytes resident demotes every cache to warm
# at once; 0 bytes warm as well leaves only disk.
TIERS: dict[str, dict[str, Any]] = {
    "resident": {},
    "warm": {"resident_bytes": 0},
    "disk": {"resident_bytes": 0, "warm_bytes": 0},
}
# Long enough that tiny-swa's 64-token sliding window has wrapped.
FIRST = "Tell me everything about caches. " * 3


def check_exact(tmp_path: Path, model: str, session: str, done: dict[str, Any]) -> None:
    u = done["usage"]
    tokens = fed_tokens(tmp_path / "kvd.sqlite", session)
    prompt = tokens[: u["prompt_tokens"]]
    reference = greedy_reference(tmp_path / "models" / model.split(":", 1)[1], prompt,
                                 u["completion_tokens"])
    assert tokens[u["prompt_tokens"]:] == reference


@pytest.mark.parametrize("tier", list(TIERS))
@pytest.mark.parametrize("model", MODELS)
async def test_resume_from_each_tier_is_exact(tmp_path: Path, model: str, tier: str) -> None:
    async with running_daemon(tmp_path, model=model, **TIERS[tier]) as d:
        async with client(d) as c:
            sid = (await c.request("session.create"))["session"]["id"]
            _, first = await c.chat(sid, FIRST, max_tokens=16, temperature=0)
            assert first["usage"]["restored_from"] == "none"
            # Answered once turn one's segment is written: until disk holds it, a cache
            # with no room in memory is kept aside there (it would resume as "warm").
            await c.request("status")
            _, done = await c.chat(sid, "And then?", max_tokens=16, temperature=0)
            status = await c.request("status")
    u, u1 = done["usage"], first["usage"]
    assert u["restored_from"] == tier
    assert u["restored_tokens"] == u["cached_tokens"] == u1["prompt_tokens"] + u1["completion_tokens"]
    assert u["prefill_tokens"] == u["prompt_tokens"] - u["cached_tokens"]
    assert u["restore_ms"] >= 0 and u["prefill_ms"] > 0
    assert status["tiers"][tier]["hits"] >= 1
    # One per turn, written behind it; a window's also ends one at the checkpoint each prompt kept (its end less
    # one id), so a regenerate after a restart reads to there.
    assert status["tiers"]["disk"]["segments"] == (4 if model == "builtin:tiny-swa" else 2)
    check_exact(tmp_path, model, sid, done)


@pytest.mark.parametrize("model", MODELS)
async def test_partial_disk_plus_suffix_prefill_is_exact(tmp_path: Path, model: str) -> None:
    """The disk holds turn one only (turn two's segment was lost): restore it, prefill the rest."""
    async with running_daemon(tmp_path, model=model, **TIERS["disk"]) as d:
        async with client(d) as c:
            sid = (await c.request("session.create"))["session"]["id"]
            _, first = await c.chat(sid, FIRST, max_tokens=16, temperature=0)
            _, second = await c.chat(sid, "And then?", max_tokens=16, temperature=0)
            await c.request("status")  # answered once turn two's segment is written
            turn_two = second["usage"]["cached_tokens"]
            # As if a crash had come before turn two's segment was written:
            index = SegmentIndex(tmp_path / "cache")
            assert index.drop_from(sid, turn_two) > 0
            index.close()
            _, done = await c.chat(sid, "Go on.", max_tokens=16, temperature=0)
    u = done["usage"]
    assert u["restored_from"] == "disk"
    assert u["restored_tokens"] == turn_two
    assert u["prefill_tokens"] == u["prompt_tokens"] - turn_two
    check_exact(tmp_path, model, sid, done)


def corrupt(path: Path, how: str, other: Path | None) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "bit-flipped":
        data[-100] ^= 0x01  # in the tensor data, past the header
        path.write_bytes(data)
    elif how == "swapped":
        assert other is not None
        path.write_bytes(other.read_bytes())


@pytest.mark.parametrize("how", ["truncated", "bit-flipped", "swapped"])
async def test_damaged_cache_file_is_dropped_and_session_rebuilt(tmp_path: Path, how: str) -> None:
    async with running_daemon(tmp_path, **TIERS["disk"]) as d:
        async with client(d) as c:
            sid = (await c.request("session.create"))["session"]["id"]
            other = (await c.request("session.create"))["session"]["id"]
            await c.chat(sid, FIRST, max_tokens=16, temperature=0)
            await c.chat(other, "Something else entirely, at some length.", max_tokens=16, temperature=0)
            await c.request("status")  # answered once both segments are written
            files = sorted((tmp_path / "cache" / "segments" / sid).rglob("*.safetensors"))
            others = sorted((tmp_path / "cache" / "segments" / other).rglob("*.safetensors"))
            assert len(files) == 1 and len(others) == 1
            corrupt(files[0], how, others[0])
            _, done = await c.chat(sid, "And then?", max_tokens=16, temperature=0)
            status = await c.request("status")
    assert done["type"] == "chat.done"
    assert done["usage"]["restored_from"] == "none"
    assert status["tiers"]["disk"]["dropped_corrupt"] == 1
    check_exact(tmp_path, "builtin:tiny", sid, done)


async def test_budgets_hold_while_many_sessions_cycle(tmp_path: Path) -> None:
    """The real model through small budgets: no tier ever holds more than its budget."""
    budgets: dict[str, Any] = {"resident_bytes": 600_000, "warm_bytes": 400_000, "disk_bytes": 1_500_000}
    async with running_daemon(tmp_path, **budgets) as d:
        async with client(d) as c:
            sids = [(await c.request("session.create"))["session"]["id"] for _ in range(6)]
            for round_ in range(3):
                for sid in sids:
                    _, done = await c.chat(sid, f"Round {round_}: tell me more.", max_tokens=12,
                                           temperature=0)
                    assert done["type"] == "chat.done"
                    tiers = (await c.request("status"))["tiers"]
                    for name in ("resident", "warm", "disk"):
                        assert tiers[name]["bytes"] <= tiers[name]["budget"], (name, tiers[name])
            assert tiers["resident"]["page_outs"] > 0 and tiers["warm"]["page_outs"] > 0
            disk = sum(f.stat().st_size for f in (tmp_path / "cache" / "segments").rglob("*") if f.is_file())
            assert disk <= budgets["disk_bytes"]


@pytest.mark.parametrize("model", MODELS)
async def test_regenerate_and_edit_rewind_the_cache_and_stay_exact(tmp_path: Path, model: str) -> None:
    async with running_daemon(tmp_path, model=model) as d:
        async with client(d) as c:
            sid = (await c.request("session.create"))["session"]["id"]
            _, t1 = await c.chat(sid, FIRST, max_tokens=16, temperature=0)
            _, t2 = await c.chat(sid, "And then?", max_tokens=16, temperature=0)
            turn_one = t1["usage"]["prompt_tokens"] + t1["usage"]["completion_tokens"]

            # Regenerate the last answer: its prompt is reused, not prefilled again.
            await c.send({"id": "regen", "type": "chat.regenerate", "session": sid,
                          "max_tokens": 16, "temperature": 0})
            while (regen := await c.recv())["type"] not in ("chat.done", "error"):
                pass
            assert regen["type"] == "chat.done", regen
            u = regen["usage"]
            assert u["prompt_tokens"] == t2["usage"]["prompt_tokens"]
            assert u["cached_tokens"] >= turn_one and u["prefill_tokens"] < u["prompt_tokens"] - turn_one + 1
            if model == "builtin:tiny":  # plain KV: rewound to one token short of the prompt
                assert u["cached_tokens"] == u["prompt_tokens"] - 1
            msgs = (await c.request("session.get", session=sid))["messages"]
            assert len(msgs) == 4 and msgs[3]["status"] == "complete"
            check_exact(tmp_path, model, sid, regen)

            # Edit the second user message: turn one stays cached.
            await c.send({"id": "edit", "type": "chat.edit", "session": sid, "message_index": 2,
                          "text": "Something else instead.", "max_tokens": 16, "temperature": 0})
            while (edit := await c.recv())["type"] not in ("chat.done", "error"):
                pass
            assert edit["type"] == "chat.done", edit
            # Turn one and the template text that opens the next user turn are still shared.
            assert turn_one <= edit["usage"]["cached_tokens"] < t2["usage"]["prompt_tokens"]
            msgs = (await c.request("session.get", session=sid))["messages"]
            assert [m["content"] for m in msgs][2] == "Something else instead." and len(msgs) == 4

            # Edit the first message: nothing before it to keep, still exact.
            await c.send({"id": "edit0", "type": "chat.edit", "session": sid, "message_index": 0,
                          "text": "Start over.", "max_tokens": 16, "temperature": 0})
            while (edit0 := await c.recv())["type"] not in ("chat.done", "error"):
                pass
            assert edit0["type"] == "chat.done", edit0
            assert len((await c.request("session.get", session=sid))["messages"]) == 2
            # A normal turn after all that appends to the rewound history.
            _, after = await c.chat(sid, "Fine.", max_tokens=8, temperature=0)
            assert after["usage"]["cached_tokens"] == (edit0["usage"]["prompt_tokens"]
                                                       + edit0["usage"]["completion_tokens"])
    check_exact(tmp_path, model, sid, after)


async def test_regenerate_and_edit_refuse_what_makes_no_sense(tmp_path: Path) -> None:
    async with running_daemon(tmp_path) as d:
        async with client(d) as c:
            sid = (await c.request("session.create"))["session"]["id"]
            e = await c.request("chat.regenerate", session=sid)
            assert e["type"] == "error" and e["code"] == "bad_request"
            await c.chat(sid, "hi", max_tokens=3, temperature=0)
            for index in (1, 7):  # an answer, and no message at all
                e = await c.request("chat.edit", session=sid, message_index=index, text="x")
                assert e["type"] == "error" and e["code"] == "bad_request"
            e = await c.request("chat.edit", session=sid, message_index=-1, text="x")
            assert e["code"] == "bad_request"
            assert len((await c.request("session.get", session=sid))["messages"]) == 2


# Random weights soon loop, so a greedy answer repeats its own context: prompt lookup drafts.
SPECULATED = [("builtin:tiny", 0), ("builtin:tiny", 8), ("builtin:tiny-swa", 0)]


def greedy_kv(model_dir: Path, prompt: list[int], n: int, kv_bits: int) -> list[int]:
    """A fresh prefill's greedy continuation: mlx-lm's own, or with kvd's quantized cache for kv_bits."""
    if not kv_bits:
        return greedy_reference(model_dir, prompt, n)
    import mlx.core as mx
    from mlx_lm.utils import load

    from daemon.engine.quantized import make_cache
    from test_quantized import run

    model = load(str(model_dir))[0]
    model.set_dtype(mx.float32)
    (ref,), _ = run(model, [prompt], caches=[make_cache(model, kv_bits)], n=n)
    return ref


@pytest.mark.parametrize("tier", list(TIERS))
@pytest.mark.parametrize(("model", "kv_bits"), SPECULATED)
async def test_a_speculative_turn_is_exact_and_resumes_exactly_from_each_tier(
        tmp_path: Path, model: str, kv_bits: int, tier: str) -> None:
    async with running_daemon(tmp_path, model=model, kv_bits=kv_bits, **TIERS[tier]) as d:
        async with client(d) as c:
            sid = (await c.request("session.create"))["session"]["id"]
            _, first = await c.chat(sid, FIRST, max_tokens=64, temperature=0)
            await c.request("status")  # turn one is on disk
            _, done = await c.chat(sid, "And then?", max_tokens=32, temperature=0)
    u1, u2 = first["usage"], done["usage"]
    assert u1["drafted_tokens"] > 0 and 0 < u1["accepted_tokens"] <= u1["drafted_tokens"]
    assert u2["restored_from"] == tier
    assert u2["cached_tokens"] == u1["prompt_tokens"] + u1["completion_tokens"]
    tokens = fed_tokens(tmp_path / "kvd.sqlite", sid)
    model_dir = tmp_path / "models" / model.split(":", 1)[1]
    p1, p2 = u1["prompt_tokens"], u2["prompt_tokens"]
    # Turn one (speculated) is plain greedy decoding's answer; turn two, from the cache it left, a fresh prefill's.
    assert tokens[p1:p1 + u1["completion_tokens"]] == greedy_kv(model_dir, tokens[:p1], u1["completion_tokens"],
                                                                kv_bits)
    assert tokens[p2:] == greedy_kv(model_dir, tokens[:p2], u2["completion_tokens"], kv_bits)
    if model == "builtin:tiny-swa":
        assert p1 + u1["completion_tokens"] > 64  # the window wrapped during the speculative turn
