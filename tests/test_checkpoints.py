"""Checkpoints of state that cannot be cut (cachestore/checkpoints.py), on mlx-lm's cache classes, no model.

A hybrid cache here is a plain `KVCache` beside an `ArraysCache` (a
recurrent state) and a `CacheList` of both (Falcon-H1's layer), filled with
known values, so what a checkpoint keeps and what a rewind gives back can
be read off exactly.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache

from cachestore.checkpoints import Checkpoints
from cachestore.errors import SnapshotError
from cachestore.snapshot import at_point, checkpoint, cuttable, layer_kinds, restore, rewind_to, snapshot


def kv_layer(n: int) -> KVCache:
    c = KVCache()
    c.update_and_fetch(*(mx.arange(n, dtype=mx.float32).reshape(1, 1, n, 1) for _ in range(2)))
    return c


def state_layer(value: float) -> ArraysCache:
    c = ArraysCache(2)
    c[0], c[1] = mx.full((1, 3, 4), value), mx.full((1, 2, 2, 2), value)
    return c


def hybrid(n: int) -> list[Any]:
    """A cache of n ids whose recurrent state says n (what a model would have computed up to there)."""
    return [kv_layer(n), state_layer(float(n)), CacheList(state_layer(float(n)), kv_layer(n))]


def grow(cache: list[Any], to: int) -> list[Any]:
    """The cache fed on to `to` ids: KV appended, the state replaced (as a forward does)."""
    kv, arrays, pair = cache
    n = kv.offset
    new = mx.arange(n, to, dtype=mx.float32).reshape(1, 1, to - n, 1)
    kv.update_and_fetch(new, new)
    pair.caches[1].update_and_fetch(new, new)
    arrays[0], arrays[1] = mx.full((1, 3, 4), float(to)), mx.full((1, 2, 2, 2), float(to))
    pair.caches[0][0], pair.caches[0][1] = mx.full((1, 3, 4), float(to)), mx.full((1, 2, 2, 2), float(to))
    return cache


def holds(cache: list[Any], n: int) -> None:
    """The cache is what `hybrid(n)` is: n positions of KV, the state at n."""
    kv, arrays, pair = cache
    for c in (kv, pair.caches[1]):
        assert c.offset == n and c.keys[..., :n, :].reshape(-1).tolist() == list(range(n))
    for c in (arrays, pair.caches[0]):
        assert c[0].reshape(-1).tolist() == [float(n)] * 12 and c[1].reshape(-1).tolist() == [float(n)] * 8


def test_a_checkpoint_keeps_the_state_and_nothing_of_the_positions() -> None:
    cache = hybrid(10)
    point = checkpoint(cache, 10)
    assert (point.start, point.end) == (10, 10) and not cuttable(cache)
    assert point.nbytes == 2 * (12 + 8) * 4  # the two states, float32; no KV
    assert layer_kinds(cache) == ["kv", "arrays", "arrays", "kv"]


def test_a_live_cache_rewinds_to_its_checkpoint_and_a_snapshot_cuts_at_it() -> None:
    cache = hybrid(10)
    point = checkpoint(cache, 10)
    grow(cache, 25)
    whole = snapshot(cache, 0)
    holds(restore(at_point(whole, point)), 10)  # a snapshot of 25 ids, cut at the checkpoint
    holds(restore(at_point(cache, point)), 10)  # a copy out of the live cache, which stays as it is
    holds(cache, 25)
    holds(rewind_to(cache, point), 10)  # in place: the KV trimmed, the state restored
    tail = at_point(snapshot(grow(hybrid(10), 25), 0), point, start=4)
    assert (tail.start, tail.end) == (4, 10)


def test_a_checkpoint_of_another_layout_or_a_later_point_is_refused_untouched() -> None:
    cache = hybrid(10)
    with pytest.raises(SnapshotError):
        rewind_to(cache, checkpoint([kv_layer(5), state_layer(5.0), state_layer(5.0)], 5))
    with pytest.raises(SnapshotError):
        rewind_to(cache, checkpoint(hybrid(12), 12))  # the cache holds no state at 12
    holds(cache, 10)


def test_a_session_keeps_its_latest_checkpoints_that_agree_with_its_ids() -> None:
    points = Checkpoints(keep=3)
    ids = list(range(100))
    for n in (10, 20, 30, 40):
        points.take("a", hybrid(n), ids[:n])
    assert points.ends("a") == [20, 30, 40]  # the oldest went
    assert points.nbytes("a") == 3 * checkpoint(hybrid(1), 1).nbytes
    got = points.nearest("a", ids[:35] + [999], upto=50)
    assert got is not None and got.end == 30  # the latest at or before where the ids part
    assert points.nearest("a", ids[:15], upto=14) is None  # none kept that early
    points.follow("a", ids[:25] + [7, 7, 7, 7, 7, 7])  # a regenerate's new answer: the later ones go
    assert points.ends("a") == [20]
    cache = grow(hybrid(20), 31)
    rewound = points.rewound("a", cache, ids[:25] + [7] * 6, ids[:22] + [5], limit=22)
    assert rewound is not None and rewound[1:] == (20, True)
    holds(rewound[0], 20)
    points.drop("a")
    assert points.ends("a") == [] and points.nbytes("a") == 0


def test_a_cache_that_can_be_cut_keeps_no_checkpoint() -> None:
    points = Checkpoints()
    points.handed("a", [kv_layer(8)], list(range(8)), checkpoint=False)
    assert points.ends("a") == []
    points.handed("b", hybrid(8), list(range(8)), checkpoint=True)
    assert points.ends("b") == [8] and points.statistics()["restores"] == 1
    assert Checkpoints(keep=0).ends("b") == []


def test_speculation_declines_for_a_cache_with_recurrent_layers() -> None:
    """A verify forward would leave the state past every drafted token: prompt lookup never drafts on it
    (docs/caches.md says why, measured)."""
    from daemon.engine.speculate import speculable

    assert speculable([kv_layer(4)]) and not speculable(hybrid(4)) and not speculable([state_layer(1.0)])
