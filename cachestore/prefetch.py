"""Prefetch after a start: page the sessions people were just using back into memory before anyone asks.

Planned once the model is ready (`plan`): the sessions only on disk that
free room in memory holds, most recently used first, the resident tier's
room first (live caches, as they were before the restart), then the warm
tier's. Each is read by the same reads a restore uses (pagein.py), one at a
time, so a turn's restore never queues behind more than one of them; what a
read brings is kept (`Prefetcher.keep`) unless the session was checked out
meanwhile. A prefetch never evicts anything and is not a use: the session
keeps its place in the disk LRU.

The store (store.py) owns the tiers and hands the prefetcher what it may
touch; the prefetcher owns its queue, the read in flight and its figures.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from common.sizes import human_bytes
from common.tiers import RESIDENT, WARM

from .direct import capacity
from .diskplan import DiskRow
from .lru import Tier
from .pagein import PageIn, Reading
from .snapshot import Snapshot
from .table import BlockTable, Walk
from .warm import Cache, WarmTier, cache_nbytes

log = logging.getLogger("kvd.cache")

PREFETCH_ROOM = 64  # tokens a prefetched live cache can take before it grows: a typical next message


def prefetch_plan(disk: PageIn, by_use: list[tuple[str, int]], resident: Tier[Cache], warm: WarmTier,
                  limit: int | None = None) -> list[str]:
    """Sessions only on disk that memory has room for, most recently used first.

    `by_use`: the index's sessions, least recently used first. Only free room
    is planned (the resident tier's, then the warm tier's, less what other models' caches hold of the
    budgets they share), and at most `limit`
    bytes in all (the device's share of the memory free at start: daemon/device.py).
    """
    resident_room = resident.budget - resident.nbytes - resident.reserved - resident.others()
    warm_room = warm.budget - warm.nbytes - warm.others()
    left = limit if limit is not None else resident_room + warm_room
    plan = []
    for key, nbytes in reversed(by_use):
        if key in resident or key in warm or nbytes <= 0:
            continue
        if (live := live_bytes(disk.rows(key))) <= min(resident_room, left):
            resident_room -= live
            left -= live
        elif nbytes <= min(warm_room, left):
            warm_room -= nbytes
            left -= nbytes
        else:
            continue
        plan.append(key)
    return plan


def prefetch(disk: PageIn, key: str, *, resident_fits: Callable[[int], bool]) -> tuple[Reading, list[int]] | None:
    """Start reading one session's whole disk chain for memory: into a live cache if
    `resident_fits` its bytes, else into a warm snapshot; with the ids the chain holds.

    Resident first: after a restart that tier is empty, and a live cache
    there (read straight into its buffers by direct.py, with room for a
    typical next message) makes the first turn cost what a turn before the
    restart did; a warm snapshot still needs a copy into a live cache.
    """
    rows = disk.rows(key)
    tokens = [t for row in rows for t in row.tokens]
    if not tokens:
        return None
    plan = disk.plan(key, tokens, len(tokens), Walk([]))
    if not plan.rows:
        return None
    live = resident_fits(live_bytes(rows))
    return disk.begin(key, plan, room=PREFETCH_ROOM, use=False, live=live), tokens


def live_bytes(rows: Sequence[DiskRow]) -> int:
    """An upper bound of a prefetched live cache's bytes: its buffers are whole steps, the files' headers count."""
    tokens = rows[-1].end if rows else 0
    return sum(row.nbytes for row in rows) * capacity(tokens, PREFETCH_ROOM) // tokens if tokens else 0


#: Make the session's memory chain the blocks of its ids (the store's `_attach`).
Attach = Callable[[str, Cache | Snapshot, list[int]], object]


@dataclass
class Prefetcher:
    """The prefetch reads of one store: its queue, the read in flight, what it kept (engine thread)."""

    disk: PageIn
    table: BlockTable
    resident: Tier[Cache]
    warm: WarmTier
    attach: Attach
    make_room: Callable[[], None]
    clock: Callable[[], float]
    wait: Callable[[Reading], None]  # the store's: wait here for a read (ranks in lockstep, tools, tests)
    queue: list[str] = field(default_factory=list)  # sessions to prefetch, one read at a time
    reading: tuple[Reading, list[int], int] | None = None  # (its read, ids, the session's uses when it began)
    uses: dict[str, int] = field(default_factory=dict)  # checkouts per session: one overtakes a prefetch
    kept: set[str] = field(default_factory=set)  # paged in after a start and not checked out since
    planned: list[str] | None = None  # `after_start`'s sessions not read yet in step (None: not planned)
    stats: dict[str, int] = field(default_factory=lambda: {"planned": 0, "done": 0, RESIDENT: 0, WARM: 0,
                                                            "bytes": 0})

    def checked_out(self, key: str) -> bool:
        """A checkout of `key`: a prefetch of it under way is dropped; whether memory held it by a prefetch."""
        self.uses[key] = self.uses.get(key, 0) + 1
        was = key in self.kept
        self.kept.discard(key)
        return was

    def plan(self, by_use: list[tuple[str, int]], limit: int | None = None) -> list[str]:
        plan = prefetch_plan(self.disk, by_use, self.resident, self.warm, limit)
        self.stats["planned"] += len(plan)
        return plan

    def after_start(self, by_use: Callable[[], list[tuple[str, int]]], limit: int | None, *, in_step: bool,
                    busy: Callable[[str], bool]) -> int:
        """The store's `prefetch`: the first call plans (`by_use`: the index's sessions, least recently used first)
        and, but `in_step`, queues every read; each later call `in_step` reads the next one, waiting for it. How
        many are left to read (the first call: how many were planned)."""
        if self.planned is None:
            self.planned = self.plan(by_use(), limit)
            planned = len(self.planned)
            if not in_step:
                self.later(self.planned, busy)
                self.planned = []
            return planned
        if self.planned:
            key = self.planned.pop(0)
            try:
                if tier := self.page_in(key):
                    log.debug("prefetched the cache of %s into %s", key, tier)
            except Exception:
                log.exception("prefetching the cache of %s failed; it stays on disk", key)
        return len(self.planned)

    def page_in(self, key: str) -> str | None:
        """Page one session's disk chain into memory if it fits, waiting here for its read; its tier (None: none)."""
        if key in self.resident or key in self.warm or (got := self.start(key)) is None:
            return None
        r, tokens = got
        self.wait(r)
        return self.keep(key, r.result[0], tokens[:r.result[1]]) if r.result is not None else None

    def start(self, key: str) -> tuple[Reading, list[int]] | None:
        """Begin one session's read (None: nothing to read)."""
        self.make_room()
        return prefetch(self.disk, key, resident_fits=self.resident.fits)

    def later(self, keys: Sequence[str], busy: Callable[[str], bool]) -> None:
        """Queue sessions and start the next read if none is under way (`busy`: a restore reads it)."""
        self.queue.extend(keys)
        self.next(busy)

    def next(self, busy: Callable[[str], bool]) -> None:
        while self.reading is None and self.queue:
            key = self.queue.pop(0)
            if key in self.resident or key in self.warm or busy(key):
                continue
            try:
                got = self.start(key)
            except Exception:
                log.exception("prefetching the cache of %s failed; it stays on disk", key)
                continue
            if got is not None:
                self.reading = (got[0], got[1], self.uses.get(key, 0))
        if self.reading is None and self.stats["planned"] and not self.queue:
            s = self.stats
            if s["planned"] != s.get("logged"):
                s["logged"] = s["planned"]
                log.info("prefetched %d session(s) into memory (%d resident, %d warm; %s)",
                         s["done"], s[RESIDENT], s[WARM], human_bytes(s["bytes"]))

    def arrived(self, r: Reading, busy: Callable[[str], bool]) -> None:
        """A read ended: if it was the prefetch's, keep what it read if it still fits and nobody
        checked the session out since; then the next."""
        if self.reading is None or r is not self.reading[0]:
            return
        _, tokens, uses = self.reading
        self.reading = None
        key = r.key
        try:
            if r.result is not None and self.uses.get(key, 0) == uses and key not in self.resident \
                    and key not in self.warm:
                if tier := self.keep(key, r.result[0], tokens[:r.result[1]]):
                    log.debug("prefetched the cache of %s into %s", key, tier)
        except Exception:
            log.exception("prefetching the cache of %s failed; it stays on disk", key)
        self.next(busy)

    def keep(self, key: str, held: Cache | Snapshot, tokens: list[int]) -> str | None:
        """Put what a prefetch read into its tier (None: it no longer fits)."""
        now = self.clock()
        if isinstance(held, Snapshot):
            self.attach(key, held, tokens)
            if not self.warm.put_snapshot(key, held, now, cold=True):
                self.table.detach(key)
                return None
            tier, nbytes = WARM, held.nbytes
        else:
            nbytes = cache_nbytes(held)
            if not self.resident.offer(key, held, nbytes, now):
                return None
            self.attach(key, held, tokens)
            self.table.set_live(key, True)
            tier = RESIDENT
        self.kept.add(key)
        self.stats["done"] += 1
        self.stats[tier] += 1
        self.stats["bytes"] += nbytes
        return tier
