"""Prefixes shared across sessions (issue 14), through a real daemon on real caches.

Each answer is checked against a fresh full prefill outside kvd (check_exact).
`block_tokens` is small here so the tiny models' short conversations span
several content-addressed blocks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import mlx.core as mx
import pytest
from mlx_lm.utils import load
from rich.console import Console

from cachestore.index import SegmentIndex
from conftest import client, fed_tokens, greedy_reference, running_daemon
from daemon.engine.quantized import make_cache
from daemon.service.status import render_status

MODEL = "builtin:tiny"  # the name the test daemon serves; another name is a 404

pytestmark = pytest.mark.anyio

BLOCK = 16
SYSTEM = "You are a careful assistant who answers about caches. " * 3
FIRST = "Tell me everything about caches. " * 3
DISK_ONLY: dict[str, Any] = {"resident_bytes": 0, "warm_bytes": 0}


def check_exact(tmp_path: Path, model: str, session: str, done: dict[str, Any], kv_bits: int = 0) -> None:
    u = done["usage"]
    tokens = fed_tokens(tmp_path / "kvd.sqlite", session)
    prompt = tokens[: u["prompt_tokens"]]
    model_dir = tmp_path / "models" / model.split(":", 1)[1]
    if kv_bits:
        reference = _quantized_reference(model_dir, prompt, u["completion_tokens"], kv_bits)
    else:
        reference = greedy_reference(model_dir, prompt, u["completion_tokens"])
    got = tokens[u["prompt_tokens"]:]
    # A stop token ends the answer without being fed: the reference has it, the session's ids do not.
    stopped = done["finish_reason"] == "stop" and len(reference) == len(got) + 1
    assert got == reference[:len(got)] and (len(got) == len(reference) or stopped)


def _quantized_reference(model_dir: Path, prompt: list[int], n: int, bits: int) -> list[int]:
    """A fresh prefill into a quantized cache, then greedy steps (what kvd's kv_bits computes)."""
    model = load(str(model_dir))[0]
    model.set_dtype(mx.float32)
    cache = make_cache(model, bits)
    logits = model(mx.array([prompt]), cache=cache)
    out = []
    for _ in range(n):
        tok = int(mx.argmax(logits[0, -1]).item())  # type: ignore[arg-type]
        out.append(tok)
        logits = model(mx.array([[tok]]), cache=cache)
    return out


async def _session(c: Any, system: str | None = SYSTEM) -> str:
    return str((await c.request("session.create", system=system))["session"]["id"])


CASES = [("builtin:tiny", 0), ("builtin:tiny", 8), ("builtin:tiny-swa", 0)]


@pytest.mark.parametrize("model, kv_bits", CASES)
@pytest.mark.parametrize("tiers", ["resident", "warm", "disk"])
async def test_a_new_session_starting_like_another_reuses_its_prefix_exactly(
        tmp_path: Path, model: str, kv_bits: int, tiers: str) -> None:
    budgets: dict[str, Any] = {"resident": {}, "warm": {"resident_bytes": 0}, "disk": DISK_ONLY}[tiers]
    async with running_daemon(tmp_path, model=model, kv_bits=kv_bits, block_tokens=BLOCK, **budgets) as d:
        async with client(d) as c:
            first = await _session(c)
            _, a = await c.chat(first, FIRST, max_tokens=8, temperature=0)
            await c.request("status")  # answered once the first session's cache is written
            second = await _session(c)
            _, b = await c.chat(second, FIRST, max_tokens=8, temperature=0)
            status = await c.request("status")
    u = b["usage"]
    prompt = a["usage"]["prompt_tokens"]
    assert u["prompt_tokens"] == prompt
    if model == "builtin:tiny-swa":
        # A sliding window is restored only where it was taken (window 64, blocks of 16: it has wrapped): in
        # memory, the first session's checkpoint at its prompt's end less one id; from disk, the blocks its
        # prefill captured at each block boundary.
        assert u["restored_from"] == "shared" and u["shared_tokens"] == u["cached_tokens"] and u["checkpoint"]
        assert u["cached_tokens"] == (prompt - 1 if tiers != "disk" else (prompt - 1) // BLOCK * BLOCK) > 64
    elif tiers != "disk":  # a copy out of the first session's resident cache or warm blocks, token-exact
        assert u["restored_from"] == "shared" and u["shared_tokens"] == u["cached_tokens"] == prompt - 1
    else:  # blocks on disk: the whole ones in common, then the next one cut where the ids part
        assert u["restored_from"] == "shared" and u["shared_tokens"] == u["cached_tokens"]
        written = (a["usage"]["context_tokens"] - 1) // BLOCK * BLOCK  # the first session's blocks
        assert u["cached_tokens"] == min(prompt - 1, written)
        assert status["tiers"]["disk"]["shared_bytes"] > 0
        assert status["tiers"]["disk"]["saved_bytes"] == status["tiers"]["disk"]["shared_bytes"]
    if tiers == "warm" and model == "builtin:tiny":  # both sessions' tails follow the same warm blocks
        warm = status["tiers"]["warm"]
        assert warm["sessions"] == 2 and warm["blocks"] == (a["usage"]["context_tokens"] - 1) // BLOCK
    check_exact(tmp_path, model, second, b, kv_bits)
    check_exact(tmp_path, model, first, a, kv_bits)


@pytest.mark.parametrize("model, kv_bits", [("builtin:tiny", 0), ("builtin:tiny", 8), ("builtin:tiny-swa", 0)])
async def test_sessions_share_blocks_across_a_restart(tmp_path: Path, model: str, kv_bits: int) -> None:
    async with running_daemon(tmp_path, model=model, kv_bits=kv_bits, block_tokens=BLOCK) as d:
        async with client(d) as c:
            first = await _session(c)
            await c.chat(first, FIRST, max_tokens=8, temperature=0)
            _, a2 = await c.chat(first, "And then?", max_tokens=8, temperature=0)
    # A cold restart: nothing in memory; the blocks on disk are all there is.
    async with running_daemon(tmp_path, model=model, kv_bits=kv_bits, block_tokens=BLOCK) as d:
        async with client(d) as c:
            second = await _session(c)
            _, b = await c.chat(second, FIRST, max_tokens=8, temperature=0)
            _, a3 = await c.chat(first, "Go on.", max_tokens=8, temperature=0)
            status = await c.request("status")
    assert b["usage"]["restored_from"] == "shared" and b["usage"]["shared_tokens"] >= 2 * BLOCK
    assert a3["usage"]["restored_from"] == "disk"  # its own chain: blocks it shares, then its own tail
    if model == "builtin:tiny-swa":  # a window is restored only at the end of a block or of a file
        assert a3["usage"]["cached_tokens"] >= 2 * BLOCK
    else:
        assert a3["usage"]["cached_tokens"] == a2["usage"]["prompt_tokens"] + a2["usage"]["completion_tokens"]
    assert status["tiers"]["disk"]["blocks"] > 0 and status["tiers"]["disk"]["saved_bytes"] > 0
    check_exact(tmp_path, model, second, b, kv_bits)
    check_exact(tmp_path, model, first, a3, kv_bits)


async def test_a_branch_from_the_middle_of_a_conversation_through_the_api(tmp_path: Path) -> None:
    """An API request that shares two turns with a stored session, then says something else."""
    import openai

    async with running_daemon(tmp_path, block_tokens=BLOCK, **DISK_ONLY) as d:
        api = openai.AsyncOpenAI(base_url=d.url.replace("ws://", "http://"), api_key=d.token, max_retries=0)
        convo: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": FIRST}]
        r1 = await api.chat.completions.create(model=MODEL, messages=convo, max_tokens=8, temperature=0)
        convo += [{"role": "assistant", "content": r1.choices[0].message.content},
                  {"role": "user", "content": "And then?"}]
        r2 = await api.chat.completions.create(model=MODEL, messages=convo, max_tokens=8, temperature=0)
        convo += [{"role": "assistant", "content": r2.choices[0].message.content}]
        # The branch: the first turn, then another question.
        branch = convo[:3] + [{"role": "user", "content": "Something else instead."}]
        raw = await api.chat.completions.with_raw_response.create(
            model=MODEL, messages=branch, max_tokens=8, temperature=0)
        r3 = raw.parse()
        sid = raw.headers["x-kvd-session"]
        original = (await api.chat.completions.with_raw_response.create(
            model=MODEL, messages=convo + [{"role": "user", "content": "Go on."}], max_tokens=8,
            temperature=0)).headers["x-kvd-session"]
        await api.close()
    kvd: dict[str, Any] = r3.model_extra["kvd"]  # type: ignore[index]
    assert sid != original  # the stored conversation goes on in its own session
    assert kvd["restored_from"] == "shared" and kvd["shared_tokens"] >= 2 * BLOCK
    assert r3.usage is not None
    done = {"finish_reason": r3.choices[0].finish_reason,
            "usage": {"prompt_tokens": r3.usage.prompt_tokens, "completion_tokens": r3.usage.completion_tokens}}
    check_exact(tmp_path, "builtin:tiny", sid, done)


async def test_deleting_a_session_leaves_the_blocks_another_shares(tmp_path: Path) -> None:
    async with running_daemon(tmp_path, block_tokens=BLOCK, **DISK_ONLY) as d:
        async with client(d) as c:
            first, second = await _session(c), await _session(c)
            await c.chat(first, FIRST, max_tokens=8, temperature=0)
            _, b1 = await c.chat(second, FIRST, max_tokens=8, temperature=0)
            before = (await c.request("status"))["tiers"]["disk"]
            assert (await c.request("session.delete", session=first))["type"] != "error"
            after = (await c.request("status"))["tiers"]["disk"]
            _, b2 = await c.chat(second, "And then?", max_tokens=8, temperature=0)
            final = (await c.request("status"))["tiers"]["disk"]
    assert before["shared_bytes"] > 0 and before["sessions"] == 2
    # The first session's own files went; every block the second lists stayed.
    assert after["sessions"] == 1 and after["shared_bytes"] == 0 and after["blocks"] == before["blocks"]
    assert after["bytes"] < before["bytes"]
    assert b2["usage"]["restored_from"] == "disk"
    assert b2["usage"]["cached_tokens"] == b1["usage"]["prompt_tokens"] + b1["usage"]["completion_tokens"]
    files = {p.name for p in (tmp_path / "cache").rglob("*.safetensors")}
    assert len([f for f in files if len(f.split("-")[0]) == 32]) == final["blocks"] > after["blocks"]
    check_exact(tmp_path, "builtin:tiny", second, b2)


async def test_a_corrupted_shared_block_is_dropped_from_every_chain(tmp_path: Path) -> None:
    async with running_daemon(tmp_path, block_tokens=BLOCK, **DISK_ONLY) as d:
        async with client(d) as c:
            first, second = await _session(c), await _session(c)
            await c.chat(first, FIRST, max_tokens=8, temperature=0)
            await c.chat(second, FIRST, max_tokens=8, temperature=0)
            await c.request("status")
            index = SegmentIndex(tmp_path / "cache")  # its own connection, as another process would
            chain = index.blocks_of(first)
            assert [b.block for b in chain] == [b.block for b in index.blocks_of(second)] and len(chain) >= 3
            bad = chain[1]  # the second block: both sessions keep the first
            data = bytearray(bad.path.read_bytes())
            data[-100] ^= 0x01
            bad.path.write_bytes(data)
            index.close()
            _, a = await c.chat(first, "And then?", max_tokens=8, temperature=0)
            await c.request("status")
            # The second session's chain was cut at the bad block too, its private tail with it.
            index = SegmentIndex(tmp_path / "cache")
            assert [x.block for x in index.blocks_of(second)] == [chain[0].block] and index.chain(second) == []
            index.close()
            _, b = await c.chat(second, "And then?", max_tokens=8, temperature=0)
            status = await c.request("status")
    assert a["usage"]["restored_from"] == "disk"
    assert a["usage"]["cached_tokens"] == BLOCK  # up to the bad block, then prefilled
    # The first session's turn wrote the blocks again (the same keys): the second finds them.
    assert b["usage"]["restored_from"] == "shared" and b["usage"]["cached_tokens"] > BLOCK
    assert status["tiers"]["disk"]["dropped_corrupt"] == 1
    assert bad.path.read_bytes() != bytes(data)  # dropped, then written whole again under its key
    check_exact(tmp_path, "builtin:tiny", first, a)
    check_exact(tmp_path, "builtin:tiny", second, b)


async def test_two_sessions_extend_one_shared_prefix_at_once(tmp_path: Path) -> None:
    async with running_daemon(tmp_path, block_tokens=BLOCK, max_generations=4) as d:
        async with client(d) as c:
            origin = await _session(c)
            await c.chat(origin, FIRST, max_tokens=8, temperature=0)
            sids = [await _session(c), await _session(c)]
        dones: dict[str, dict[str, Any]] = {}

        async def one(sid: str, text: str) -> None:
            async with client(d) as c:
                _, dones[sid] = await c.chat(sid, FIRST + text, max_tokens=24, temperature=0)

        async with anyio.create_task_group() as tg:
            tg.start_soon(one, sids[0], "Left?")
            tg.start_soon(one, sids[1], "Right?")
        async with client(d) as c:
            status = await c.request("status")
    for sid in sids:
        assert dones[sid]["usage"]["restored_from"] == "shared"
        check_exact(tmp_path, "builtin:tiny", sid, dones[sid])
    assert status["tiers"]["disk"]["blocks_reused"] > 0  # the second to finish found the first's blocks


async def test_budgets_hold_and_count_a_shared_block_once(tmp_path: Path) -> None:
    """Many sessions over one long shared prefix through a small disk budget."""
    async with running_daemon(tmp_path, block_tokens=BLOCK, disk_bytes=900_000, **DISK_ONLY) as d:
        async with client(d) as c:
            for i in range(6):
                sid = await _session(c)
                _, done = await c.chat(sid, FIRST + f"Question {i}?", max_tokens=8, temperature=0)
                assert done["type"] == "chat.done"
                disk = (await c.request("status"))["tiers"]["disk"]
                on_disk = sum(f.stat().st_size for f in (tmp_path / "cache").rglob("*.safetensors"))
                assert disk["bytes"] == on_disk <= disk["budget"]
            status = await c.request("status")
    assert disk["saved_bytes"] > 0 and disk["sessions"] >= 2
    console = Console(width=100, color_system=None, record=True)
    render_status(status, console)
    text = console.export_text()
    assert f"disk blocks: {disk['blocks']} of {BLOCK} tokens" in text and "saved by sharing" in text
