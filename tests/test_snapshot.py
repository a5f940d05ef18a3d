"""Snapshot / restore / merge / split / rewind: every path must be exact.

"Exact" means the greedy continuation after a restore equals the one after a
fresh full prefill of the same tokens (DESIGN.md, "Cache tiers"). The
built-in models are tiny and seeded, so these run in seconds on a CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from cachestore.errors import CacheError, CannotSplit, SnapshotError
from cachestore.snapshot import (
    LayerSnapshot,
    Snapshot,
    cuttable,
    layout,
    merge,
    restore,
    rewind,
    rewindable,
    snapshot,
    split,
    truncate,
)
from snapshots import assert_same, assert_same_layer  # noqa: F401

N = 12  # greedy tokens compared after each restore
WINDOW = 64  # builtin:tiny-swa's sliding window
# A fixed, varied prompt inside the vocabulary (below the special ids).
TOKENS = [(i * 37 + 11) % 1600 + 10 for i in range(150)]
MORE = [(i * 13 + 5) % 1600 + 10 for i in range(30)]


@pytest.fixture(params=["builtin:tiny", "builtin:tiny-swa"])
def model(request: pytest.FixtureRequest, models: dict[str, Any]) -> Any:
    return models[request.param]


@pytest.fixture
def kv_model(models: dict[str, Any]) -> Any:
    return models["builtin:tiny"]


@pytest.fixture
def swa_model(models: dict[str, Any]) -> Any:
    return models["builtin:tiny-swa"]


# -- helpers ------------------------------------------------------------------


def prefill(model: Any, cache: list[Any], tokens: Sequence[int]) -> list[Any]:
    if tokens:
        model(mx.array([list(tokens)]), cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def decode_each(model: Any, cache: list[Any], tokens: Sequence[int]) -> list[Any]:
    """Feed tokens one at a time: the path that wraps a rotating cache's ring."""
    for t in tokens:
        model(mx.array([[t]]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def greedy(model: Any, cache: list[Any], last: int, n: int = N) -> list[int]:
    """Feed `last`, then argmax step by step on `cache`."""
    out: list[int] = []
    y = mx.array([[last]])
    for _ in range(n):
        t = int(mx.argmax(model(y, cache=cache)[0, -1]))
        out.append(t)
        y = mx.array([[t]])
    return out


def fresh_greedy(model: Any, tokens: Sequence[int], n: int = N) -> list[int]:
    cache = prefill(model, make_prompt_cache(model), tokens[:-1])
    return greedy(model, cache, tokens[-1], n)


def batch_greedy(
    model: Any,
    prompt: Sequence[int],
    *,
    cache: list[Any] | None = None,
    cached: Sequence[int] = (),
    n: int = N,
) -> list[int]:
    """Greedy tokens from mlx-lm's BatchGenerator, the way the daemon runs it."""
    gen = BatchGenerator(model, max_tokens=n)
    try:
        (uid,) = gen.insert(
            [list(prompt)],
            caches=None if cache is None else [cache],
            all_tokens=None if cache is None else [list(cached)],
        )
        out: list[int] = []
        while True:
            for r in gen.next_generated():
                assert r.uid == uid
                out.append(r.token)
                if r.finish_reason is not None:
                    return out
    finally:
        gen.close()


def copy_of(s: Snapshot) -> Snapshot:
    def layer(x: LayerSnapshot) -> LayerSnapshot:
        arrays = tuple(mx.array(a) + 0 for a in x.arrays)  # a real copy
        mx.eval(arrays)
        return LayerSnapshot(x.kind, arrays, dict(x.meta), tuple(layer(c) for c in x.children))

    return Snapshot(s.start, s.end, tuple(layer(x) for x in s.layers))


# -- restore exactness --------------------------------------------------------


@pytest.mark.parametrize("length", [40, 64, 65, 100, 149])
def test_restore_matches_fresh_prefill(model: Any, length: int) -> None:
    tokens = TOKENS[: length + 1]
    ref = fresh_greedy(model, tokens)
    snap = snapshot(prefill(model, make_prompt_cache(model), tokens[:-1]))
    assert (snap.start, snap.end) == (0, length)
    assert greedy(model, restore(snap), tokens[-1]) == ref
    # A snapshot restores any number of times: restored caches never write into it.
    kept = copy_of(snap)
    assert greedy(model, restore(snap), tokens[-1]) == ref
    assert_same(snap, kept)


def test_snapshot_holds_only_what_is_used(model: Any) -> None:
    cache = prefill(model, make_prompt_cache(model), TOKENS[:100])
    snap = snapshot(cache, 30)
    for live, layer in zip(cache, snap.layers, strict=True):
        if isinstance(live, RotatingKVCache):
            # After a 100-token prefill the live buffer holds all 100 entries;
            # the next step only ever sees the last window.
            assert live.keys is not None and live.keys.shape[2] == 100
            assert layer.kind == "rotating" and layer.meta == {
                "offset": 100,
                "max_size": WINDOW,
                "keep": 0,
                "idx": WINDOW,
            }
            assert [a.shape[2] for a in layer.arrays] == [WINDOW, WINDOW]
            assert mx.array_equal(layer.arrays[0], live.keys[..., -WINDOW:, :]).item()
        else:
            assert live.keys.shape[2] == 256  # allocated in steps of 256
            assert layer.kind == "kv" and layer.meta == {"start": 30, "offset": 100}
            assert [a.shape[2] for a in layer.arrays] == [70, 70]
            assert mx.array_equal(layer.arrays[1], live.values[..., 30:100, :]).item()
    assert snap.nbytes == sum(a.nbytes for layer in snap.layers for a in layer.arrays)
    # The live cache moving on does not touch the snapshot.
    kept = copy_of(snap)
    decode_each(model, cache, TOKENS[100:110])
    assert_same(snap, kept)


def test_merge_of_two_segments(model: Any) -> None:
    tokens = TOKENS[:150]
    ref = fresh_greedy(model, tokens)
    for b in (30, 70):  # before and after tiny-swa's ring wraps
        cache = prefill(model, make_prompt_cache(model), tokens[:b])
        first = snapshot(cache)
        prefill(model, cache, tokens[b:-1])
        second = snapshot(cache, b)
        merged = merge(first, second)
        assert (merged.start, merged.end) == (0, 149)
        assert_same(merged, snapshot(cache))
        assert greedy(model, restore(merged), tokens[-1]) == ref


def test_merge_chain_of_three(kv_model: Any) -> None:
    tokens = TOKENS[:120]
    cache = make_prompt_cache(kv_model)
    parts = []
    for a, b in ((0, 40), (40, 80), (80, 119)):
        prefill(kv_model, cache, tokens[a:b])
        parts.append(snapshot(cache, a))
    merged = merge(merge(parts[0], parts[1]), parts[2])
    assert greedy(kv_model, restore(merged), tokens[-1]) == fresh_greedy(kv_model, tokens)


def test_split_and_truncate_then_prefill_the_rest(kv_model: Any) -> None:
    tokens = TOKENS[:150]
    ref = fresh_greedy(kv_model, tokens)
    snap = snapshot(prefill(kv_model, make_prompt_cache(kv_model), tokens[:-1]))
    first, second = split(snap, 90)
    assert (first.start, first.end, second.start, second.end) == (0, 90, 90, 149)
    assert_same(merge(first, second), snap)
    assert_same(truncate(snap, 90), first)
    assert truncate(snap, snap.end) is snap
    cache = prefill(kv_model, restore(first), tokens[90:-1])
    assert greedy(kv_model, cache, tokens[-1]) == ref
    # A split of a later segment, and the empty edges.
    a, b = split(second, 120)
    assert (a.start, a.end, b.start, b.end) == (90, 120, 120, 149)
    assert merge(split(snap, 0)[0], snap).end == 149
    for bad in (-1, 150):
        with pytest.raises(CannotSplit):
            split(snap, bad)
    with pytest.raises(CannotSplit):
        truncate(second, 50)


def test_restore_needs_a_prefix(kv_model: Any) -> None:
    cache = prefill(kv_model, make_prompt_cache(kv_model), TOKENS[:20])
    with pytest.raises(SnapshotError, match="merge"):
        restore(snapshot(cache, 5))
    with pytest.raises(SnapshotError):
        snapshot(cache, 21)
    with pytest.raises(SnapshotError, match="adjacent"):
        merge(snapshot(cache), snapshot(cache, 5))


# -- rewind -------------------------------------------------------------------


def test_rewind_in_place(kv_model: Any) -> None:
    tokens = TOKENS[:100]
    cache = prefill(kv_model, make_prompt_cache(kv_model), tokens[:-1] + MORE[:7])
    assert rewindable(cache)
    assert rewind(cache, 7)
    assert all(c.offset == 99 for c in cache)
    assert greedy(kv_model, cache, tokens[-1]) == fresh_greedy(kv_model, tokens)
    assert rewind(cache, 0)
    assert not rewind(cache, 10_000)  # more than it holds: refused, untouched
    assert all(c.offset == 99 + N for c in cache)
    with pytest.raises(ValueError):
        rewind(cache, -1)


def test_rotating_rewind_before_wrap_only(swa_model: Any) -> None:
    tokens = TOKENS[:41]
    cache = prefill(swa_model, make_prompt_cache(swa_model), tokens[:-1] + MORE[:5])
    assert rewindable(cache)
    assert rewind(cache, 5)
    assert greedy(swa_model, cache, tokens[-1]) == fresh_greedy(swa_model, tokens)

    wrapped = prefill(swa_model, make_prompt_cache(swa_model), TOKENS[:100])
    before = copy_of(snapshot(wrapped))
    assert not rewindable(wrapped)
    assert not rewind(wrapped, 1)
    assert all(c.offset == 100 for c in wrapped)
    assert_same(snapshot(wrapped), before)


# -- rotating caches ----------------------------------------------------------


def test_rotating_ring_wrapped_by_decoding(swa_model: Any) -> None:
    """One-token steps leave the window as a ring whose oldest slot is `_idx`."""
    tokens = TOKENS[:150]
    cache = decode_each(
        swa_model, prefill(swa_model, make_prompt_cache(swa_model), tokens[:20]), tokens[20:-1]
    )
    ring = cache[0]
    assert isinstance(ring, RotatingKVCache)
    assert ring.keys is not None and ring.keys.shape[2] == WINDOW and 0 < ring._idx < WINDOW and ring.offset == 149
    snap = snapshot(cache)
    layer = snap.layers[0]
    assert layer.meta == {"offset": 149, "max_size": WINDOW, "keep": 0, "idx": WINDOW}
    # Temporal order: the oldest entry first, the newest last.
    assert mx.array_equal(layer.arrays[0][..., -1, :], ring.keys[..., ring._idx - 1, :]).item()
    assert mx.array_equal(layer.arrays[0][..., 0, :], ring.keys[..., ring._idx, :]).item()
    restored = restore(snap)
    assert greedy(swa_model, restored, tokens[-1]) == fresh_greedy(swa_model, tokens)
    assert greedy(swa_model, restore(snap), tokens[-1]) == greedy(swa_model, cache, tokens[-1])


def test_rotating_restore_then_prefill_more(swa_model: Any) -> None:
    """Restore after the wrap, then a multi-token prefill (the concat path)."""
    tokens = TOKENS[:150]
    snap = snapshot(prefill(swa_model, make_prompt_cache(swa_model), tokens[:90]))
    cache = prefill(swa_model, restore(snap), tokens[90:-1])
    assert greedy(swa_model, cache, tokens[-1]) == fresh_greedy(swa_model, tokens)


def test_rotating_with_sinks(kv_model: Any) -> None:
    """keep > 0 (mlx-lm's max_kv_size caches): the first `keep` entries survive."""
    tokens = TOKENS[:150]
    for wrap_by_decoding in (False, True):
        cache = make_prompt_cache(kv_model, max_kv_size=48)
        assert cache[0].keep == 4
        if wrap_by_decoding:
            decode_each(kv_model, prefill(kv_model, cache, tokens[:20]), tokens[20:-1])
        else:
            prefill(kv_model, cache, tokens[:-1])
        snap = snapshot(cache)
        assert snap.layers[0].meta == {"offset": 149, "max_size": 48, "keep": 4, "idx": 48}
        assert mx.array_equal(snap.layers[0].arrays[0][..., :4, :], cache[0].keys[..., :4, :]).item()
        assert greedy(kv_model, restore(snap), tokens[-1], 30) == greedy(
            kv_model, cache, tokens[-1], 30
        )


def test_rotating_cannot_split(swa_model: Any) -> None:
    cache = prefill(swa_model, make_prompt_cache(swa_model), TOKENS[:100])
    snap = snapshot(cache)
    assert not cuttable(snap)
    with pytest.raises(CannotSplit, match="rotating"):
        split(snap, 50)
    with pytest.raises(CannotSplit):
        truncate(snap, 99)
    assert truncate(snap, 100) is snap
    # Even before the wrap: a rotating snapshot is one window, not positions.
    early = snapshot(prefill(swa_model, make_prompt_cache(swa_model), TOKENS[:30]))
    with pytest.raises(CannotSplit):
        split(early, 10)
    assert issubclass(CannotSplit, SnapshotError) and issubclass(SnapshotError, CacheError)


# -- quantized caches ---------------------------------------------------------


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized(kv_model: Any, bits: int) -> None:
    tokens = TOKENS[:150]
    # Fresh: a full prefill, then quantized (what mlx-lm's kv_bits does).
    cache = prefill(kv_model, make_prompt_cache(kv_model), tokens[:-1])
    fresh = [c.to_quantized(group_size=32, bits=bits) for c in cache]
    snap = snapshot(fresh)
    assert snap.layers[0].kind == "quantized" and snap.layers[0].meta == {
        "start": 0,
        "offset": 149,
        "group_size": 32,
        "bits": bits,
    }
    assert len(snap.layers[0].arrays) == 6 and snap.layers[0].arrays[0].dtype == mx.uint32
    assert greedy(kv_model, restore(snap), tokens[-1]) == greedy(kv_model, fresh, tokens[-1])
    assert isinstance(restore(snap)[0], QuantizedKVCache)

    # Two segments of one growing quantized cache (the model attends through
    # the quantized cache for the second prefill).
    cache = prefill(kv_model, make_prompt_cache(kv_model), tokens[:70])
    q = [c.to_quantized(group_size=32, bits=bits) for c in cache]
    first = snapshot(q)
    prefill(kv_model, q, tokens[70:-1])
    second = snapshot(q, 70)
    merged = merge(first, second)
    assert_same(merged, snapshot(q))
    head, _ = split(merged, 100)
    assert head.layers[0].arrays[0].shape[2] == 100
    assert greedy(kv_model, restore(merged), tokens[-1]) == greedy(kv_model, q, tokens[-1])
    assert cuttable(merged) and rewind(q, 3)


# -- BatchGenerator: how the daemon uses restored caches ----------------------


@pytest.mark.parametrize("cached", [30, 64, 100, 149])
def test_restored_cache_in_batch_generator(model: Any, cached: int) -> None:
    tokens = TOKENS[:150]
    ref = batch_greedy(model, tokens)
    snap = snapshot(prefill(model, make_prompt_cache(model), tokens[:cached]))
    assert batch_greedy(model, tokens[cached:], cache=restore(snap), cached=tokens[:cached]) == ref


def test_merged_segments_in_batch_generator(swa_model: Any) -> None:
    tokens = TOKENS[:150]
    cache = prefill(swa_model, make_prompt_cache(swa_model), tokens[:50])
    first = snapshot(cache)
    prefill(swa_model, cache, tokens[50:120])
    snap = merge(first, snapshot(cache, 50))
    got = batch_greedy(swa_model, tokens[120:], cache=restore(snap), cached=tokens[:120])
    assert got == batch_greedy(swa_model, tokens)


def test_caches_out_of_batch_generator(model: Any) -> None:
    """Caches from extract/remove: over-long rotating buffers, left-padded batches."""
    extracted: list[tuple[list[Any], list[int]]] = []
    # Removed mid-prompt with a small prefill step: rotating buffers longer than the window.
    gen = BatchGenerator(model, max_tokens=50, prefill_step_size=32)
    uids = gen.insert([TOKENS[:120], TOKENS[5:30]])
    for _ in range(3):
        gen.next()
    removed = gen.remove(uids, return_prompt_caches=True)
    gen.close()
    extracted += [(list(c), list(t)) for c, t in (removed[u] for u in uids)]
    # Finished in one batch with a much shorter neighbour (a rotated, padded batch).
    gen = BatchGenerator(model, max_tokens=30)
    uids = gen.insert([TOKENS[:120], TOKENS[5:15]])
    done: dict[int, tuple[list[Any], list[int]]] = {}
    while len(done) < 2:
        for r in gen.next_generated():
            if r.finish_reason is not None:
                done[r.uid] = (r.prompt_cache, list(r.all_tokens))
    gen.close()
    extracted += [done[u] for u in uids]

    for cache, fed in extracted:
        rotating = [c for c in cache if isinstance(c, RotatingKVCache)]
        if rotating and len(fed) == 96:
            keys = rotating[0].keys
            assert keys is not None and keys.shape[2] > WINDOW  # the max_size - 1 + S case
        snap = snapshot(cache)
        assert snap.end == len(fed)
        prompt = fed + MORE[:8]
        assert batch_greedy(model, MORE[:8], cache=restore(snap), cached=fed) == batch_greedy(
            model, prompt
        )


# -- errors, recurrent and nested caches (arrays only) ------------------------


def _kv(tokens: int, seed: int, heads: int = 2, dim: int = 8) -> KVCache:
    c = KVCache()
    k = mx.random.normal((1, heads, tokens, dim), key=mx.random.key(seed))
    c.update_and_fetch(k, k * 2)
    return c


def _recurrent(seed: int) -> ArraysCache:
    c = ArraysCache(3)
    c[0] = mx.random.normal((1, 3, 16), key=mx.random.key(seed))
    c[2] = mx.random.normal((1, 4, 8, 8), key=mx.random.key(seed + 1))  # slot 1 stays empty
    return c


def _hybrid(tokens: int) -> list[Any]:
    ids = ArraysCache(1)
    ids[0] = mx.arange(tokens, dtype=mx.int32)[None]
    return [_recurrent(0), CacheList(_kv(tokens, 1), ids), _kv(tokens, 2)]


def _advance(cache: list[Any], n: int, seed: int) -> None:
    """What a forward does to a hybrid cache: new state, longer KV."""
    rec, lst, kv = cache
    rec[0] = rec[0] * 0.5 + 1
    rec[2] = rec[2] - 1
    k = mx.random.normal((1, 2, n, 8), key=mx.random.key(seed))
    for c in (lst[0], kv):
        c.update_and_fetch(k, k * 2)
    lst[1][0] = mx.concatenate([lst[1][0], mx.arange(n, dtype=mx.int32)[None]], axis=1)


def test_arrays_and_cache_list_round_trip() -> None:
    cache = _hybrid(10)
    snap = snapshot(cache)
    kinds = [layer.kind for layer in snap.layers]
    assert kinds == ["arrays", "list", "kv"]
    assert snap.layers[0].meta == {"offset": 10, "slots": 3, "present": 0b101}
    assert [c.kind for c in snap.layers[1].children] == ["kv", "arrays"]
    assert layout(cache) == ["arrays(3)", "list(kv,arrays(1))", "kv"]
    restored = restore(snap)
    assert isinstance(restored[0], ArraysCache) and restored[0][1] is None
    assert isinstance(restored[1], CacheList) and isinstance(restored[1][0], KVCache)
    assert_same(snapshot(restored), snap)
    for a, b in zip(
        (cache[0][0], cache[0][2], cache[1][1][0]),
        (restored[0][0], restored[0][2], restored[1][1][0]),
        strict=True,
    ):
        assert mx.array_equal(a, b).item()
    # Restored objects work as live caches and leave the snapshot alone, and
    # in-place writes to the live state do not reach it either.
    kept = copy_of(snap)
    _advance(restored, 3, 9)
    restored[0][0][..., 0] = 99.0
    cache[0][0][..., 0] = 99.0
    assert_same(snap, kept)


def test_arrays_merge_keeps_the_later_state() -> None:
    cache = _hybrid(10)
    first = snapshot(cache)
    _advance(cache, 4, 7)
    second = snapshot(cache, 10)
    assert second.layers[2].arrays[0].shape[2] == 4
    merged = merge(first, second)
    assert_same(merged, snapshot(cache))
    assert merged.layers[0] is second.layers[0]
    assert not cuttable(merged) and not rewindable(cache)
    with pytest.raises(CannotSplit, match="arrays"):
        split(merged, 12)
    with pytest.raises(CannotSplit):
        truncate(merged, 12)
    before = copy_of(snapshot(cache))
    assert not rewind(cache, 1)
    assert rewind(cache, 0)
    assert_same(snapshot(cache), before)


def test_cache_list_of_kv_splits() -> None:
    cache: list[Any] = [CacheList(_kv(12, 1), _kv(12, 2)), _kv(12, 3)]
    snap = snapshot(cache)
    assert cuttable(snap) and rewindable(cache)
    a, b = split(snap, 5)
    assert a.layers[0].children[1].arrays[0].shape[2] == 5
    assert_same(merge(a, b), snap)
    assert rewind(cache, 2) and all(c.offset == 10 for c in (cache[0][0], cache[0][1], cache[1]))


def test_recurrent_only_cache_needs_its_offset() -> None:
    cache = [_recurrent(0), _recurrent(5)]
    with pytest.raises(SnapshotError, match="offset="):
        snapshot(cache)
    snap = snapshot(cache, offset=42)
    assert snap.end == 42
    assert_same(snapshot(restore(snap), offset=42), snap)
    assert not rewind(cache, 1)


def test_refuses_inconsistent_or_unknown_caches() -> None:
    with pytest.raises(SnapshotError, match="disagree"):
        snapshot([_kv(5, 1), _kv(6, 2)])
    with pytest.raises(SnapshotError, match="disagree"):
        rewind([_kv(5, 1), _kv(6, 2)], 1)
    with pytest.raises(SnapshotError, match="hold 5"):
        snapshot([_kv(5, 1)], offset=6)
    with pytest.raises(SnapshotError, match="ChunkedKVCache"):
        snapshot([ChunkedKVCache(16)])
    with pytest.raises(SnapshotError, match="BatchKVCache"):
        snapshot([BatchKVCache([0, 1])])
    batched = KVCache()
    k = mx.zeros((2, 2, 4, 8))
    batched.update_and_fetch(k, k)
    with pytest.raises(SnapshotError, match="batch"):
        snapshot([batched])
    ring = RotatingKVCache(16)
    ring.update_and_fetch(mx.zeros((1, 2, 8, 8)), mx.zeros((1, 2, 8, 8)))
    with pytest.raises(SnapshotError, match="rotating"):
        merge(snapshot([_kv(5, 1)]), snapshot([ring], 5))


def test_empty_cache_round_trips(model: Any) -> None:
    snap = snapshot(make_prompt_cache(model))
    assert (snap.start, snap.end, snap.nbytes) == (0, 0, 0)
    assert all(not layer.arrays for layer in snap.layers)
    restored = restore(snap)
    assert [type(c) for c in restored] == [type(c) for c in make_prompt_cache(model)]
    assert greedy(model, restored, TOKENS[0]) == greedy(model, make_prompt_cache(model), TOKENS[0])


def test_fixture_models_are_what_the_tests_assume(models: dict[str, Any]) -> None:
    assert layout(make_prompt_cache(models["builtin:tiny"])) == ["kv"] * 4
    assert (
        layout(make_prompt_cache(models["builtin:tiny-swa"]))
        == [f"rotating(max_size={WINDOW},keep=0)", "kv"] * 2
    )
