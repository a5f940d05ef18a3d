"""SessionCaches policy on real (tiny) caches: idle demotion, compaction, fingerprints, disk budget."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from cachestore.manager import Budgets, SessionCaches

A, B, C = "aaaa", "bbbb", "cccc"


@pytest.fixture
def model(models: dict[str, Any]) -> Any:
    return models["builtin:tiny"]


def grow(model: Any, cache: list[Any] | None, tokens: list[int], more: list[int]) -> tuple[list[Any], list[int]]:
    """Feed `more` tokens to the cache holding `tokens`."""
    cache = cache if cache is not None else make_prompt_cache(model)
    model(mx.array([more]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache, tokens + more


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def budgets(**kw: Any) -> Budgets:
    base: dict[str, Any] = dict(resident_bytes=1 << 30, warm_bytes=1 << 30, disk_bytes=1 << 30,
                                resident_idle=60.0, warm_idle=600.0, max_segments=16)
    return Budgets(**{**base, **kw})


def test_idle_caches_move_down_and_disk_keeps_them(model: Any, tmp_path: Path) -> None:
    clock = Clock()
    caches = SessionCaches(tmp_path, "fp", budgets(), clock=clock)
    cache, toks = grow(model, None, [], list(range(10, 50)))
    caches.checkin(A, cache, toks)
    caches.flush()  # the I/O worker has written it
    assert A in caches.resident
    clock.now += 61
    caches.maintain()
    assert A not in caches.resident and A in caches.warm
    clock.now += 601
    caches.maintain()
    assert A not in caches.warm
    got = caches.checkout(A, toks + [7])
    assert got.source == "disk" and got.tokens == len(toks)
    caches.close()


def test_many_turns_compact_into_one_segment(model: Any, tmp_path: Path) -> None:
    caches = SessionCaches(tmp_path, "fp", budgets(max_segments=3), clock=Clock())
    cache, toks = None, []
    for turn in range(5):
        cache, toks = grow(model, cache, toks, [100 + turn] * 7)
        caches.checkin(A, cache, toks)
        got = caches.checkout(A, toks + [1])
        assert got.source == "resident"
        cache = got.cache
    caches.flush()
    chain = caches.index.chain(A)
    # Segments 1-3 were written per turn, turn 4 compacted them into one, turn 5 appended.
    assert [(r.start, r.end) for r in chain] == [(0, 28), (28, 35)]
    caches.resident.discard(A)
    got = caches.checkout(A, toks + [1])
    assert got.source == "disk" and got.tokens == len(toks)
    caches.close()


def test_another_fingerprint_is_never_loaded(model: Any, tmp_path: Path) -> None:
    first = SessionCaches(tmp_path, "model-one", budgets(), clock=Clock())
    cache, toks = grow(model, None, [], list(range(10, 40)))
    first.checkin(A, cache, toks)
    first.close()
    second = SessionCaches(tmp_path, "model-two", budgets(), clock=Clock())
    got = second.checkout(A, toks + [1])
    assert got.source == "none" and got.cache is None
    second.flush()
    assert second.index.chain(A) == []  # dropped, not kept around
    assert not list((tmp_path / "segments").rglob("*.safetensors"))
    second.close()


def test_disk_budget_evicts_least_recently_used_sessions(model: Any, tmp_path: Path) -> None:
    clock = Clock()
    one_session = 30 * 2048 + 4096  # ~30 tokens of tiny KV plus the file header
    caches = SessionCaches(tmp_path, "fp", budgets(disk_bytes=2 * one_session), clock=clock)
    for key in (A, B, C):
        clock.now += 1
        cache, toks = grow(model, None, [], list(range(10, 40)))
        caches.checkin(key, cache, toks)
        caches.flush()
        assert caches.index.total_bytes() <= 2 * one_session
    assert [k for k, _ in caches.index.keys_by_use()] == [B, C]
    caches.close()


def test_prefetch_pages_the_most_recent_sessions_into_warm_within_its_room(model: Any, tmp_path: Path) -> None:
    clock = Clock()
    caches = SessionCaches(tmp_path, "fp", budgets(), clock=clock)
    kept: dict[str, tuple[list[Any], list[int]]] = {}
    for key in (A, B, C):  # C used last
        clock.now += 10
        cache, toks = grow(model, None, [], list(range(10, 50)))
        caches.checkin(key, cache, toks)
        cache, toks = grow(model, cache, toks, list(range(60, 70)))  # a second turn: a second segment
        caches.checkin(key, cache, toks)
        kept[key] = (cache, toks)
    caches.flush()
    per_session = caches.index.keys_by_use()[0][1]
    caches.close()

    # After a restart: room in warm for two sessions' caches, not three.
    caches = SessionCaches(tmp_path, "fp", budgets(warm_bytes=2 * per_session + per_session // 2), clock=clock)
    plan = caches.prefetch_plan()
    assert plan == [C, B]
    for key in plan:
        assert caches.prefetch(key)
    assert caches.locations() == {A: "disk", B: "warm", C: "warm"}
    assert not caches.prefetch(C)  # already warm
    stats = caches.statistics()
    assert stats["warm"]["prefetched"] == 2 and stats["warm"]["prefetched_bytes"] == caches.warm.nbytes
    assert stats["disk"]["hits"] == 0  # a prefetch is not a use

    cache, toks = kept[C]
    got = caches.checkout(C, toks + [7])
    assert got.source == "warm" and got.tokens == len(toks)
    assert got.cache is not None
    for restored, live in zip(got.cache, cache):
        assert mx.array_equal(restored.keys[..., :len(toks), :], live.keys[..., :len(toks), :])
        assert mx.array_equal(restored.values[..., :len(toks), :], live.values[..., :len(toks), :])
    assert caches.checkout(A, kept[A][1] + [7]).source == "disk"
    caches.close()


def test_prefetch_plans_nothing_that_does_not_fit(model: Any, tmp_path: Path) -> None:
    caches = SessionCaches(tmp_path, "fp", budgets())
    cache, toks = grow(model, None, [], list(range(10, 50)))
    caches.checkin(A, cache, toks)
    caches.flush()
    nbytes = caches.index.total_bytes()
    caches.close()
    caches = SessionCaches(tmp_path, "fp", budgets(warm_bytes=nbytes - 1))
    assert caches.prefetch_plan() == []
    caches.close()


def _state(cache: list[Any]) -> list[Any]:
    return [mx.array(a) for c in cache for a in c.state]


@pytest.mark.parametrize("tier", ["resident", "warm", "disk"])
def test_copy_prefix_leaves_the_source_as_it_was(model: Any, tmp_path: Path, tier: str) -> None:
    """A branch copies another session's prefix from any tier; the source keeps its cache, intact."""
    clock = Clock()
    caches = SessionCaches(tmp_path, "fp", budgets(), clock=clock)
    cache, toks = grow(model, None, [], list(range(10, 50)))
    caches.checkin(A, cache, toks)
    caches.flush()
    if tier != "resident":
        clock.now += 61
        caches.maintain()  # resident -> warm
    if tier == "disk":
        clock.now += 601
        caches.maintain()  # warm dropped; disk holds it
    kept = _state(caches.checkout(A, toks + [7]).cache or []) if tier == "resident" else None
    if kept is not None:
        caches.checkin(A, cache, toks)  # back where it was, resident
    branch = toks[:30] + [3, 4, 5]
    got = caches.copy_prefix(A, branch)
    assert got.source == tier and got.tokens == 30 and got.cache is not None
    # The copy is fed the branch's own tokens: the source must not see them.
    model(mx.array([branch[30:]]), cache=got.cache)
    mx.eval([c.state for c in got.cache])
    assert got.cache[0].offset == 33
    again = caches.checkout(A, toks + [7])
    assert again.source == tier and again.tokens == len(toks)
    assert again.cache is not None and again.cache[0].offset == len(toks)
    if kept is not None:
        assert all(mx.array_equal(x, y).item() for x, y in zip(kept, _state(again.cache)))
    caches.close()
