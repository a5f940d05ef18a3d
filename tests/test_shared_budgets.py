"""Two models' cache stores under one pair of memory budgets (cachestore/pool.py, shares.py), on real caches.

builtin:tiny's and builtin:tiny-swa's stores share one `Pool`, as two loaded
models' engines do in one daemon. Each store is driven here as its engine
drives it, and where the pool wakes a store (`on_room`) the test plays that
engine's part (`share.fit()`), so every step is deterministic. What must hold:
the second model's caches push out the first model's least recently used
ones (and the reverse), in the resident and the warm tier, never its more
recent ones, and the bytes every store holds never pass a budget.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from cachestore.index import SegmentIndex
from cachestore.pool import Pool
from cachestore.store import Budgets, SessionCaches

TINY, SWA = "builtin:tiny", "builtin:tiny-swa"
R, W = "resident", "warm"
KiB = 1024


def ids(key: str, n: int) -> list[int]:
    """A session's ids: its own from the first (no two sessions share a prefix), `n` of them."""
    base = 10 + 97 * sum(map(ord, key)) % 1500
    return [base + i % 150 for i in range(n)]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 1.0  # every use is later than the last
        return self.now


class Two:
    """The two stores, their pool, and who the pool woke."""

    def __init__(self, root: Path, models: dict[str, Any], resident: int, warm: int) -> None:
        self.pool = Pool({R: resident, W: warm})
        self.clock = Clock()
        self.models = models
        b = Budgets(resident_bytes=resident, warm_bytes=warm, disk_bytes=1 << 30, resident_idle=600.0,
                    warm_idle=6000.0, max_segments=16)
        self.stores = {m: SessionCaches(root, f"fp-{m}", b, clock=self.clock, model=m, pool=self.pool)
                       for m in (TINY, SWA)}
        self.woken: list[str] = []  # still to play
        self.history: list[str] = []  # every wake, in order
        self.peak = {R: 0, W: 0}
        for m, s in self.stores.items():
            s.share.on_room = functools.partial(self.wake, m)
            s.running_bytes = lambda: 0

    def wake(self, model: str) -> None:
        """The pool woke `model`'s engine (it would get a RoomFreed in its inbox)."""
        self.woken.append(model)
        self.history.append(model)

    def check(self) -> None:
        """The bytes every store holds, idle and running, within each budget."""
        for tier, t in self.pool.statistics().items():
            self.peak[tier] = max(self.peak[tier], t["bytes"])
            assert t["bytes"] <= t["budget"], (tier, t)

    def turn(self, model: str, key: str, n: int = 40, need: int = 700 * KiB) -> None:
        """A turn of `n` new ids on `key`, admitted by the shared budget (the test plays the engine that
        the pool wakes) with `need` bytes (what its cache may reach); its cache is checked in resident."""
        s = self.stores[model]
        self.admit(model, key, need)
        got = s.checkout(key, ids(key, n) + [1])
        cache = got.cache if got.cache is not None else make_prompt_cache(self.models[model])
        self.models[model](mx.array([ids(key, n)[got.tokens:]]), cache=cache)
        mx.eval([c.state for c in cache])
        s.running_bytes = lambda: need
        s.make_room()
        self.check()
        s.running_bytes = lambda: 0
        s.checkin(key, cache, ids(key, n))
        self.check()

    def admit(self, model: str, key: str, need: int) -> None:
        s = self.stores[model]
        for _ in range(10):
            if s.share.room(key, need):
                self.check()
                return
            self.check()
            while self.woken:  # each woken engine's turn: it evicts for the other (then asks again)
                other = self.woken.pop(0)
                self.stores[other].share.fit()
                if other != model:  # its step then finds no turn of its own queued (Steps.admit_waiting)
                    self.stores[other].share.want_nothing()
                self.check()
        raise AssertionError(f"{model} never got room for {need} bytes")

    def close(self) -> None:
        for s in self.stores.values():
            s.close()


@pytest.fixture
def two(tmp_path: Path, models: dict[str, Any]) -> Iterator[Two]:
    # Room for two live caches (512 KiB for tiny's, 296 KiB for swa's after 40 ids) or one beside a turn
    # that may reach 700 KiB, not for two of tiny's beside it.
    t = Two(tmp_path, models, resident=1400 * KiB, warm=1 << 30)
    yield t
    t.close()


def where(t: Two, model: str) -> dict[str, str]:
    return t.stores[model].locations()


def test_the_second_models_turn_pushes_out_the_first_models_least_recently_used_cache(two: Two) -> None:
    two.turn(TINY, "a1")
    two.turn(TINY, "a2")
    assert where(two, TINY) == {"a1": R, "a2": R}
    two.history.clear()
    two.turn(SWA, "b1")  # the tiny model's a1 is the oldest of all: tiny's engine is asked to demote it
    assert two.history[0] == TINY
    assert where(two, TINY) == {"a1": W, "a2": R}  # only the least recently used one went
    assert where(two, SWA)["b1"] == R
    assert two.stores[TINY].resident.stats.page_outs == 1


def test_the_first_models_turn_pushes_out_the_second_models_cache_when_it_is_older(two: Two) -> None:
    two.turn(SWA, "b1")
    two.turn(TINY, "a1")
    two.turn(TINY, "a1", n=48)  # a1 used again: b1 is now the oldest
    two.history.clear()
    two.turn(TINY, "a2")
    assert two.history[0] == SWA  # the swa model's engine was asked
    assert where(two, SWA)["b1"] == W
    assert where(two, TINY) == {"a1": R, "a2": R}


def test_a_store_evicts_its_own_oldest_without_asking_when_it_is_the_oldest(two: Two) -> None:
    two.turn(TINY, "a1")
    two.turn(SWA, "b1")
    two.turn(SWA, "b2")  # b2 needs room: a1 is the oldest, so tiny is asked
    assert where(two, TINY)["a1"] == W
    two.turn(TINY, "a2")
    two.history.clear()
    two.turn(SWA, "b3")  # b1 is the oldest now: swa demotes its own, nobody is asked
    assert two.history == []
    assert where(two, SWA)["b1"] == W and where(two, TINY)["a2"] == R


def test_warm_snapshots_give_way_across_models_too(tmp_path: Path, models: dict[str, Any]) -> None:
    """A warm tier with room for one snapshot (80 KiB: 40 ids of tiny's): the swa model's demotion waits
    until the tiny model has let its older snapshot go (disk holds it), then takes its place."""
    t = Two(tmp_path, models, resident=1400 * KiB, warm=120 * KiB)
    try:
        t.turn(TINY, "a1")
        t.turn(TINY, "a2")
        t.turn(SWA, "b1")  # a1 demoted to warm (its snapshot: 40 ids)
        assert where(t, TINY)["a1"] == W
        t.turn(SWA, "b2")  # a2 demoted: warm makes room from tiny's own older a1 first
        t.stores[TINY].flush()
        t.history.clear()
        t.turn(TINY, "a3", need=900 * KiB)  # b1 is the oldest resident: its snapshot needs a2's warm room
        assert t.history[:2] == [SWA, TINY]  # swa asked to demote b1; b1's snapshot asks tiny for a2's room
        assert where(t, SWA)["b1"] == W, t.pool.statistics()
        assert where(t, TINY)["a2"] == "disk" and where(t, TINY)["a1"] == "disk"
        got = t.stores[TINY].checkout("a1", ids("a1", 40) + [1])
        assert got.restored_from == "disk" and got.tokens == 40  # nothing lost: disk held it
    finally:
        t.close()


def test_a_model_loaded_later_never_sweeps_away_another_models_writes_in_flight(tmp_path: Path) -> None:
    """The start's sweep deletes files no index row lists (a crash's leftovers). A second model's store
    opening the cache directory while the first one's I/O worker writes there found that one's files in
    flight (written, not yet indexed) and deleted them; now only the first store in the pool sweeps."""
    b = Budgets(resident_bytes=1 << 20, warm_bytes=1 << 20, disk_bytes=1 << 30, resident_idle=600.0,
                warm_idle=6000.0, max_segments=16)
    pool = Pool({R: 1 << 20, W: 1 << 20})
    first = SessionCaches(tmp_path, "fp-tiny", b, model=TINY, pool=pool)
    in_flight = first.index.blocks / ".a-b.safetensors.1234.tmp"  # as a write leaves it before its rename
    in_flight.write_bytes(b"half a block")
    second = SessionCaches(tmp_path, "fp-swa", b, model=SWA, pool=pool)
    assert in_flight.exists()
    second.close()
    first.close()
    alone = SessionCaches(tmp_path, "fp-tiny", b, model=TINY, pool=Pool({R: 1 << 20, W: 1 << 20}))
    assert not in_flight.exists()  # opened first in its pool, a store still sweeps what a crash left
    alone.close()


def test_a_block_another_models_worker_wrote_is_never_collected_before_its_chain_lists_it(tmp_path: Path) -> None:
    """Each model's I/O worker lists a block it wrote, then the chain that needs it (two transactions).
    Another model's worker collecting unlisted blocks in between deleted it, file and row, and the chain
    then listed a block disk no longer had (the session prefilled from 0: 3 of 20 conversations after two
    models' turns in one daemon). A store collects only its own model's blocks."""
    tiny, swa = SegmentIndex(tmp_path, "fp-tiny"), SegmentIndex(tmp_path, "fp-swa")
    block, parent = "a" * 32, "b" * 32
    path = tiny.block_path(block, parent)
    path.write_bytes(b"a whole block")
    tiny.add_block(block, parent, 0, 4, path, 13, "0", "fp-tiny", [1, 2, 3, 4], 1.0)
    swa.set_chain("cccc", [], 2.0)  # the swa model's worker sets a chain: it collects what no chain lists
    swa.drop_from("cccc", 0)  # and forgets a session of its own
    assert path.exists() and block in tiny.find_blocks([block])
    tiny.set_chain("dddd", [block], 3.0)
    assert [b.block for b in tiny.blocks_of("dddd")] == [block]
    swa.drop_from("dddd", 0, "fp-tiny")  # the disk budget evicts across models: the chain's own blocks go
    assert not path.exists() and tiny.find_blocks([block]) == {}
    tiny.close()
    swa.close()
