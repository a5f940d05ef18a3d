"""kv_bits: quantized KV caches served through mlx-lm's BatchGenerator."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import QuantizedKVCache, RotatingKVCache
from mlx_lm.utils import load

from cachestore.segments import read_segment, write_segment
from cachestore.snapshot import restore, snapshot
from conftest import client, fed_tokens, running_daemon
from daemon.engine.quantized import (
    BatchQuantizedKVCache,
    KvdQuantizedKVCache,
    as_batchable,
    make_cache,
)

MODELS = ["builtin:tiny", "builtin:tiny-swa"]
BITS = [4, 8]
N = 12
PROMPT = [(7 * i + 3) % 200 + 5 for i in range(40)]
SHORT = [(11 * i + 1) % 150 + 9 for i in range(9)]


def run(model: Any, prompts: list[list[int]], caches: list[list[Any]] | None = None,
        all_tokens: list[list[int]] | None = None, n: int = N) -> tuple[list[list[int]], list[Any]]:
    """Greedy BatchGenerator run: the tokens and the finished caches, per prompt."""
    gen = BatchGenerator(model)
    uids = gen.insert(prompts, max_tokens=[n] * len(prompts), caches=caches, all_tokens=all_tokens)
    toks: dict[int, list[int]] = {u: [] for u in uids}
    done: dict[int, Any] = {}
    while len(done) < len(uids):
        _, responses = gen.next()
        for r in responses:
            toks[r.uid].append(int(r.token))
            if r.finish_reason is not None:
                done[r.uid] = (r.prompt_cache, r.all_tokens)
    return [toks[u] for u in uids], [done[u] for u in uids]


def by_hand(model: Any, prompt: list[int], bits: int, n: int = N) -> list[int]:
    cache = make_cache(model, bits)
    model(mx.array([prompt[:-1]]), cache=cache)
    tok, out = prompt[-1], []
    for _ in range(n):
        logits = model(mx.array([[tok]]), cache=cache)
        tok = cast(int, mx.argmax(logits[0, -1]).item())
        out.append(tok)
    return out


def test_make_cache_layers(models: dict[str, Any]) -> None:
    tiny = make_cache(models["builtin:tiny"], 4)
    assert len(tiny) == 4 and all(type(c) is KvdQuantizedKVCache for c in tiny)
    assert {(c.bits, c.group_size) for c in tiny} == {(4, 32)}
    swa = make_cache(models["builtin:tiny-swa"], 8)
    kinds = {type(c) for c in swa}
    assert kinds == {KvdQuantizedKVCache, RotatingKVCache}
    assert make_cache(models["builtin:tiny"], None)[0].__class__.__name__ == "KVCache"


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("name", MODELS)
def test_batched_equals_single_sequence(models: dict[str, Any], name: str, bits: int) -> None:
    model = models[name]
    (toks,), ((cache, held),) = run(model, [PROMPT], caches=[make_cache(model, bits)])
    assert len(toks) == N and toks == by_hand(model, PROMPT, bits)
    q = [c for c in cache if isinstance(c, QuantizedKVCache)]
    assert q and all(type(c) is KvdQuantizedKVCache and c.offset == len(held) for c in q)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("name", MODELS)
def test_two_sequences_left_padded(models: dict[str, Any], name: str, bits: int) -> None:
    model = models[name]
    alone = [run(model, [p], caches=[make_cache(model, bits)])[0][0] for p in (PROMPT, SHORT)]
    both, _ = run(model, [PROMPT, SHORT], caches=[make_cache(model, bits), make_cache(model, bits)])
    assert both == alone


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("name", MODELS)
def test_restore_continues_exactly(models: dict[str, Any], name: str, bits: int,
                                   tmp_path: Path) -> None:
    model = models[name]
    _, ((cache, prefix),) = run(model, [PROMPT], caches=[make_cache(model, bits)])
    suffix = SHORT
    fresh, _ = run(model, [list(prefix) + suffix], caches=[make_cache(model, bits)])

    snap = snapshot(cache)
    restored = as_batchable(restore(snap))
    assert [type(c) for c in restored] == [type(c) for c in cache]
    got, _ = run(model, [suffix], caches=[restored], all_tokens=[list(prefix)])
    assert got == fresh

    seg = write_segment(tmp_path / "seg.safetensors", snap, fingerprint="fp")
    back = read_segment(seg.path, checksum=seg.checksum, fingerprint="fp")
    got, _ = run(model, [suffix], caches=[as_batchable(restore(back))], all_tokens=[list(prefix)])
    assert got == fresh


@pytest.mark.parametrize("name", MODELS)
def test_cancel_returns_quantized_cache(models: dict[str, Any], name: str) -> None:
    model = models[name]
    gen = BatchGenerator(model)
    (uid,) = gen.insert([PROMPT], max_tokens=[100], caches=[make_cache(model, 8)])
    got = 0
    while got < 5:
        _, responses = gen.next()
        got += len(responses)
    (cache, tokens), = gen.remove([uid], return_prompt_caches=True).values()
    q = [c for c in cache if isinstance(c, QuantizedKVCache)]
    assert q and all(type(c) is KvdQuantizedKVCache and c.bits == 8 for c in q)
    assert all(c.offset == len(tokens) for c in q)
    assert len(tokens) >= len(PROMPT)


def test_batch_cache_filter_extend_extract() -> None:
    """Rows survive filter/extend unchanged: extract returns exactly their tokens."""
    mx.random.seed(0)
    rows: list[KvdQuantizedKVCache] = []
    for n in (5, 9, 3):
        row = KvdQuantizedKVCache(group_size=32, bits=4)
        QuantizedKVCache.update_and_fetch(row, mx.random.normal((1, 2, n, 32)), mx.random.normal((1, 2, n, 32)))
        rows.append(row)
    a = KvdQuantizedKVCache.merge(rows[:2])
    b = KvdQuantizedKVCache.merge(rows[2:])
    assert isinstance(a, BatchQuantizedKVCache)
    a.extend(b)
    a.filter([0, 2])
    for i, src in zip((0, 1), (rows[0], rows[2])):
        out = a.extract(i)
        assert out.offset == src.offset
        assert out.keys is not None and out.values is not None and src.keys is not None and src.values is not None
        for x, y in zip((*out.keys, *out.values), (*src.keys, *src.values)):
            assert mx.array_equal(x, y[..., :src.offset, :])
    assert a.nbytes > 0 and a.size() == 5


@pytest.mark.anyio
async def test_daemon_kv_bits_resume_from_disk(tmp_path: Path) -> None:
    async with running_daemon(tmp_path, kv_bits=8, resident_bytes=0, warm_bytes=0) as d:
        async with client(d) as c:
            sid = (await c.request("session.create"))["session"]["id"]
            _, first = await c.chat(sid, "Tell me everything about caches. " * 3,
                                    max_tokens=12, temperature=0)
            assert first["type"] == "chat.done", first
            # Answered once turn one is on disk: until then, a cache with no room in memory
            # is kept aside there (it would resume as "warm").
            await c.request("status")
            _, done = await c.chat(sid, "And then?", max_tokens=12, temperature=0)
    assert done["type"] == "chat.done", done
    u = done["usage"]
    assert u["restored_from"] == "disk"
    segments = sorted((tmp_path / "cache").rglob("*.safetensors"))
    assert segments and all(b'"U32"' in p.read_bytes()[:4096] for p in segments)  # quantized
    tokens = fed_tokens(tmp_path / "kvd.sqlite", sid)
    prompt = tokens[: u["prompt_tokens"]]
    model = load(str(tmp_path / "models" / "tiny"))[0]
    model.set_dtype(mx.float32)
    (ref,), _ = run(model, [prompt], caches=[make_cache(model, 8)], n=u["completion_tokens"])
    assert tokens[u["prompt_tokens"]:] == ref


@pytest.mark.parametrize("bad", [3, 16, -4, True, "8"])
def test_kv_bits_config_is_validated(bad: Any) -> None:
    from daemon.config import ConfigError, load_config

    assert load_config(None).kv_bits == 0
    assert load_config(None, kv_bits=4).kv_bits == 4
    with pytest.raises(ConfigError, match="cache.kv_bits"):
        load_config(None, kv_bits=bad)
