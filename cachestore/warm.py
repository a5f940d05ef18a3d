"""The warm tier: session tails after their whole blocks, each block's warm copy held once.

A warm session is the tail ``[m*B, n)`` of its cache, an evaluated snapshot
(packed to 4 or 8 bits if `Budgets.warm_bits` says so), following the
blocks of its memory chain, whose warm copies live in the block table
(table.py), one per block however many tails follow it. The budget counts
tails and block copies. Eviction takes unreferenced block copies first (no
warm tail needs them), then the least recently used tail, whose blocks may
then become unreferenced: a tail never loses its blocks.

A tail that leaves while disk jobs are queued is kept aside (`held`, with
the block copies it needs) until the worker is idle, so checkout never
loses a cache to a write in flight. Engine thread only.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from .checkpoints import Checkpoints
from .errors import CannotSplit
from .lru import TierStats
from .packing import pack, unpack
from .prefix import common_prefix_len
from .snapshot import Snapshot, at_point, cuttable, merge, restore, section, snapshot, truncate
from .table import BlockTable

log = logging.getLogger("kvd.cache")

Cache = list[Any]


def cache_nbytes(cache: Cache) -> int:
    return sum(int(c.nbytes) for c in cache)


class WarmTier:
    def __init__(self, table: BlockTable, budget: int, *, bits: int, busy: Callable[[], bool],
                 points: Checkpoints | None = None) -> None:
        if budget < 0:
            raise ValueError("a budget is a number of bytes >= 0")
        self.table = table
        #: Every session's checkpoints in memory: a warm session's count here, and go when it leaves.
        self.points = points if points is not None else Checkpoints()
        self.budget = budget
        self.bits = bits
        self._busy = busy  # whether disk jobs are queued
        # Least recently used first: each session's tail, its last use, and the bytes counted for it (the tail's and
        # its checkpoints').
        self.tails: OrderedDict[str, tuple[Snapshot, float, int]] = OrderedDict()
        self.spare: OrderedDict[str, None] = OrderedDict()  # block copies no warm tail needs, oldest first
        self.held: dict[str, tuple[list[Snapshot], list[int]]] = {}  # left while disk jobs were queued
        self.nbytes = 0
        self.block_bytes = 0
        self.blocks = 0  # block copies held
        self.stats = TierStats()
        #: Called after every change (the store reports it to the daemon's shared budget: pool.py).
        self.changed: Callable[[], None] = lambda: None
        #: The bytes of the same budget other models' warm tiers hold: room a cold put does not take.
        self.others: Callable[[], int] = lambda: 0
        #: Called before this many bytes come in (not cold): the store makes room for them first, from its
        #: own least recently used, so the budget every model shares is never passed (shares.py); False:
        #: there is none, and they are let go at once (disk holds them).
        self.room: Callable[[int], bool] = lambda nbytes: True

    def __contains__(self, key: str) -> bool:
        return key in self.tails

    def __iter__(self) -> Any:
        return iter(list(self.tails))

    def __len__(self) -> int:
        return len(self.tails)

    def held_or_warm(self) -> list[str]:
        return [*self.tails, *self.held]

    # --- in ---

    def demote(self, key: str, cache: Cache, now: float) -> None:
        """A live cache becomes warm: its blocks without a warm copy, and its tail (the table has its chain)."""
        if cuttable(cache):
            self.put_snapshot(key, snapshot(cache, 0), now)
            return
        # A window: its blocks are the copies its prefill captured; the tail follows those still held.
        s = self.table.sessions[key]
        have = next((k for k, bk in enumerate(s.keys) if self.table.blocks[bk].warm is None), len(s.keys))
        if have < len(s.keys):
            self.table.attach(key, s.tokens, s.keys[:have])
        self.put(key, self.packed(snapshot(cache, have * self.table.block)), now)

    def put_snapshot(self, key: str, snap: Snapshot, now: float, *, cold: bool = False) -> bool:
        """A snapshot of a session from 0 becomes warm: its memory chain's blocks, then its tail."""
        s = self.table.sessions[key]
        if not cuttable(snap) and s.keys:
            self.table.attach(key, s.tokens, [])  # a window's snapshot cannot be cut into blocks
        tail = self.packed(section(snap, len(s.keys) * self.table.block, snap.end))
        if cold and self.nbytes + snap.nbytes + self.others() > self.budget:
            return False
        for bk in s.keys:
            b = self.table.blocks[bk]
            if b.warm is None:
                b.warm = self.packed(section(snap, b.start, b.end))
                self.block_bytes += b.warm.nbytes
                self.nbytes += b.warm.nbytes
                self.blocks += 1
                self.spare[bk] = None
        return self.put(key, tail, now, cold=cold)

    def put(self, key: str, tail: Snapshot, now: float, *, cold: bool = False) -> bool:
        """Keep a session's tail (after its memory chain's blocks); `cold`: only if it fits, at the cold end."""
        s = self.table.sessions[key]
        if cold and self.nbytes + tail.nbytes + self.others() > self.budget:
            return False
        self.discard(key)
        self.held.pop(key, None)
        for bk in s.keys:
            b = self.table.blocks[bk]
            b.warm_users += 1
            self.spare.pop(bk, None)
        nbytes = tail.nbytes + self.points.nbytes(key)
        kept = cold or self.room(nbytes)  # (its blocks are referenced now: they stay)
        self.tails[key] = (tail, now, nbytes)
        if cold:
            self.tails.move_to_end(key, last=False)
        self.nbytes += nbytes
        if not kept:
            self.leave(key)
            return False
        self._fit()
        return True

    def add_copies(self, blocks: dict[str, Snapshot]) -> None:
        """Warm copies of blocks a prefill captured (a window's), unreferenced until a warm tail needs them."""
        new = {bk: self.packed(snap) for bk, snap in blocks.items() if self.table.blocks[bk].warm is None}
        if not self.room(sum(p.nbytes for p in new.values())):
            return  # no room: disk will hold them (the turn's write-behind has them)
        for bk, packed in new.items():
            b = self.table.blocks[bk]
            if b.warm is None:
                b.warm = packed
                self.block_bytes += b.warm.nbytes
                self.nbytes += b.warm.nbytes
                self.blocks += 1
                if b.warm_users == 0:
                    self.spare[bk] = None
        self._fit()

    def exact_copy(self, bk: str) -> Snapshot | None:
        """A block's warm copy if it is exact (not packed): good enough to write to disk."""
        b = self.table.blocks.get(bk)
        return b.warm if b is not None and b.warm is not None and not self.bits else None

    def packed(self, snap: Snapshot) -> Snapshot:
        return pack(snap, self.bits) if self.bits else snap

    # --- out ---

    def _remove(self, key: str) -> tuple[list[Snapshot], list[int]] | None:
        got = self.tails.pop(key, None)
        if got is None:
            return None
        tail = got[0]
        self.nbytes -= got[2]
        s = self.table.sessions[key]
        parts = [self.table.blocks[bk].warm for bk in s.keys]
        for bk in s.keys:
            b = self.table.blocks[bk]
            b.warm_users -= 1
            if b.warm_users == 0:
                self.spare[bk] = None
        return [*parts, tail], s.tokens

    def discard(self, key: str) -> None:
        """The tail goes without counting as a use (superseded by a newer cache, forgotten)."""
        self._remove(key)
        self.held.pop(key, None)
        self.changed()

    def take(self, key: str) -> None:
        """The tail was copied into a live cache (a hit): it goes."""
        self.stats.hits += self._remove(key) is not None
        self.stats.page_ins += 1
        self.held.pop(key, None)
        self.changed()

    def _fit(self) -> None:
        while self.nbytes > self.budget and self.evict_oldest():
            pass
        self.changed()

    def oldest(self) -> float | None:
        """When what `evict_oldest` takes next was last used (a block copy no tail needs: first of all,
        -inf); None: nothing held."""
        if self.spare:
            return float("-inf")
        return next((used for _, used, _ in self.tails.values()), None)

    def evict_oldest(self) -> bool:
        """Let the least recently used go: a block copy no warm tail needs, else the oldest tail; False
        when nothing is held."""
        if self.spare:
            bk, _ = self.spare.popitem(last=False)
            b = self.table.blocks[bk]
            self.nbytes -= b.warm.nbytes
            self.block_bytes -= b.warm.nbytes
            self.blocks -= 1
            b.warm = None
            self.table._maybe_drop(b)
            self.changed()
            return True
        if self.tails:
            self.leave(next(iter(self.tails)))
            return True
        return False

    def leave(self, key: str) -> None:
        """A tail leaves the tier (budget or idleness); kept aside if disk may not hold it yet."""
        got = self._remove(key)
        self.stats.page_outs += 1
        if got is None:
            return
        self.points.drop(key)  # (disk keeps its own: the ends of its segments and blocks)
        if self._busy():
            self.held[key] = got
            log.debug("warm snapshot of %s kept aside until disk holds it", key)
        else:
            log.debug("warm snapshot of %s dropped; disk holds it", key)
        self.table.detach(key)
        self._fit()

    def idle(self, now: float, idle_for: float) -> None:
        for key, (_, used, _) in list(self.tails.items()):
            if now - used < idle_for:
                break
            self.leave(key)

    def release_held(self) -> None:
        """The worker is idle: disk holds what the held tails hold (or never will: not writable)."""
        self.held.clear()

    # --- reading ---

    def parts(self, key: str) -> tuple[list[Snapshot], list[int]] | None:
        """A session's warm snapshots in order (its blocks' copies, its tail), and its ids."""
        if key in self.held:
            return self.held[key]
        got = self.tails.get(key)
        if got is None:
            return None
        s = self.table.sessions[key]
        return [self.table.blocks[bk].warm for bk in s.keys] + [got[0]], s.tokens

    def usable(self, key: str, wanted: Sequence[int], limit: int) -> int:
        """How many wanted ids the session's warm snapshots can give a copy of: where the ids part, or, for a
        state that cannot be cut there, the latest end of a block or a checkpoint before."""
        got = self.parts(key)
        if got is None:
            return 0
        parts, toks = got
        n = min(common_prefix_len(toks[:parts[-1].end], wanted), limit)
        if n <= 0:
            return 0
        last = next(p for p in parts if p.end >= n)
        if n == last.end or cuttable(last):
            return n
        point = self.points.nearest(key, wanted, n)
        return max((p.end for p in parts if p.end <= n), default=0) if point is None else \
            max([point.end, *(p.end for p in parts if p.end <= n)])

    def copy(self, key: str, n: int) -> Cache | None:
        """Live caches holding the first n ids of a session's warm snapshots (`usable` said how many may be
        had); they stay as they are."""
        got = self.parts(key)
        if got is None:
            return None
        parts = got[0]
        if (point := self.points.at(key, n)) is None or any(p.end == n for p in parts) or cuttable(parts[-1]):
            return copy_parts(parts, n)
        try:
            return restore(at_point(merge(*[unpack(p) for p in parts if p.start < n]), point))
        except CannotSplit:
            return None

    def cuttable(self, key: str) -> bool:
        """Whether the session's warm snapshots can be cut anywhere (plain or quantized KV)."""
        got = self.parts(key)
        return got is None or not got[0] or cuttable(got[0][-1])

    def held_ids(self, key: str) -> int:
        """How many ids the session's warm snapshots hold (0: none)."""
        got = self.parts(key)
        return got[0][-1].end if got is not None and got[0] else 0

    def statistics(self) -> dict[str, Any]:
        return {"sessions": len(self.tails), "bytes": self.nbytes, "budget": self.budget,
                **asdict(self.stats), "blocks": self.blocks, "block_bytes": self.block_bytes}


def copy_parts(parts: list[Snapshot], n: int) -> Cache | None:
    """Live caches holding the first n ids of adjacent snapshots from 0; the snapshots stay as they are."""
    parts = [p for p in parts if p.start < n]
    try:
        return restore(truncate(merge(*[unpack(p) for p in parts]), n)) if parts else None
    except CannotSplit:
        return None


def copy_live_at(cache: Cache, point: Snapshot) -> Cache | None:
    """Live caches holding a resident cache as of its checkpoint `point`; the source is untouched."""
    try:
        return restore(at_point(cache, point))
    except CannotSplit:
        return None


def copy_live(cache: Cache, n: int) -> Cache | None:
    """Live caches holding the first n ids of a resident cache; the source is untouched."""
    try:
        return restore(snapshot(cache, 0, upto=n))
    except CannotSplit:
        return None
