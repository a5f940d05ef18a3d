"""Byte-budgeted LRU tiers: the eviction policy, with no MLX in it.

A tier holds values with a known size in bytes, least recently used first.
Putting a value evicts from the cold end until the tier is within its budget
again, and hands the evicted entries back so the caller can demote them to the
next tier (resident -> warm -> disk). A budget is a hard limit: a value larger
than the whole budget is refused (handed straight back) rather than kept.
Tested with fakes that have only a size, like mlx-lm's own LRU cache tests.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, Generic, TypeVar

V = TypeVar("V")


@dataclass
class Entry(Generic[V]):
    value: V
    nbytes: int
    last_used: float


@dataclass
class TierStats:
    """What every tier counts, with one meaning for all three (resident, warm, disk)."""

    hits: int = 0
    misses: int = 0
    page_ins: int = 0  # values promoted out of this tier (for disk: sessions read back into memory)
    page_outs: int = 0  # values this tier let go: demoted by budget or idleness (disk: dropped by its budget)


@dataclass
class DiskStats(TierStats):
    """The disk tier's figures: the same TierStats, plus what only disk has."""

    writes: int = 0  # files written (blocks and private segments)
    bytes_written: int = 0
    bytes_read: int = 0
    dropped_corrupt: int = 0  # files that failed verification, dropped with what follows them
    evicted_full: int = 0  # sessions whose files were removed because the filesystem was full
    blocks_written: int = 0
    blocks_reused: int = 0  # whole blocks a turn needed that disk already held (the sharing)


class Tier(Generic[V]):
    def __init__(self, name: str, budget: int, max_entries: int | None = None):
        if budget < 0:
            raise ValueError("a budget is a number of bytes >= 0")
        if max_entries is not None and max_entries < 0:
            raise ValueError("max_entries must be >= 0")
        self.name = name
        self.budget = budget
        self.max_entries = max_entries
        self.nbytes = 0
        #: Bytes of the same budget that something outside the tier holds: the caches of running
        #: turns, which count against the resident budget too (`reserve`).
        self.reserved = 0
        self.stats = TierStats()
        self._entries: OrderedDict[str, Entry[V]] = OrderedDict()
        #: Called after every change (the store reports it to the daemon's shared budget: pool.py).
        self.changed: Callable[[], None] = lambda: None
        #: The bytes of the same budget that other models' tiers hold: room a value does not `fit` in.
        self.others: Callable[[], int] = lambda: 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def peek(self, key: str) -> V | None:
        entry = self._entries.get(key)
        return entry.value if entry is not None else None

    def put(self, key: str, value: V, nbytes: int, now: float) -> list[tuple[str, V]]:
        """Insert as most recently used; return what had to leave (possibly the value itself)."""
        if nbytes < 0:
            raise ValueError("nbytes must be >= 0")
        evicted: list[tuple[str, V]] = []
        if key in self._entries:
            old = self._entries.pop(key)
            self.nbytes -= old.nbytes
        if nbytes + self.reserved > self.budget or self.max_entries == 0:
            self.stats.page_outs += 1
            self.changed()
            return [(key, value)]
        self._entries[key] = Entry(value, nbytes, now)
        self.nbytes += nbytes
        evicted += self._fit()
        self.changed()
        return evicted

    def reserve(self, nbytes: int) -> list[tuple[str, V]]:
        """Hold `nbytes` of the budget for something outside the tier (running caches, all of them
        together); return the least recently used values that had to leave to make room."""
        if nbytes < 0:
            raise ValueError("nbytes must be >= 0")
        self.reserved = nbytes
        evicted = self._fit()
        self.changed()
        return evicted

    def _fit(self) -> list[tuple[str, V]]:
        evicted: list[tuple[str, V]] = []
        while self._entries and (self.nbytes + self.reserved > self.budget or (
                self.max_entries is not None and len(self._entries) > self.max_entries)):
            cold, entry = self._entries.popitem(last=False)
            self.nbytes -= entry.nbytes
            self.stats.page_outs += 1
            evicted.append((cold, entry.value))
        return evicted

    def fits(self, nbytes: int) -> bool:
        """Whether a value of `nbytes` would go in without evicting anything."""
        return self.nbytes + nbytes + self.reserved + self.others() <= self.budget and (
            self.max_entries is None or len(self._entries) < self.max_entries)

    def offer(self, key: str, value: V, nbytes: int, now: float) -> bool:
        """Insert at the cold end if it fits without evicting anything; say whether it did.

        For values nobody asked for yet (prefetched): they go behind everything
        used since, so they are the first to leave, and idle times stay ordered.
        """
        if key in self._entries or nbytes < 0 or not self.fits(nbytes):
            return False
        coldest = next(iter(self._entries.values()), None)
        self._entries[key] = Entry(value, nbytes, min(now, coldest.last_used) if coldest else now)
        self._entries.move_to_end(key, last=False)
        self.nbytes += nbytes
        self.changed()
        return True

    def take(self, key: str) -> V | None:
        """Remove and return a value that is being promoted (counted as a hit)."""
        entry = self._entries.pop(key, None)
        if entry is None:
            self.stats.misses += 1
            return None
        self.nbytes -= entry.nbytes
        self.stats.hits += 1
        self.stats.page_ins += 1
        self.changed()
        return entry.value

    def discard(self, key: str) -> V | None:
        """Remove a value without counting it as a hit (forgotten, superseded)."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self.nbytes -= entry.nbytes
        self.changed()
        return entry.value

    def idle(self, now: float, idle_for: float) -> list[tuple[str, V]]:
        """Remove and return entries not used for `idle_for` seconds."""
        out: list[tuple[str, V]] = []
        for key, entry in list(self._entries.items()):
            if now - entry.last_used < idle_for:
                break  # ordered by use: the rest are more recent
            del self._entries[key]
            self.nbytes -= entry.nbytes
            self.stats.page_outs += 1
            out.append((key, entry.value))
        if out:
            self.changed()
        return out

    def touch(self, key: str, now: float) -> None:
        """The value is in use now (a turn on it was admitted): most recently used, left in the tier."""
        entry = self._entries.get(key)
        if entry is not None:
            entry.last_used = now
            self._entries.move_to_end(key)
            self.changed()

    def size(self, key: str) -> int:
        """The value's bytes (0: not held)."""
        entry = self._entries.get(key)
        return entry.nbytes if entry is not None else 0

    def oldest(self) -> tuple[str, V, float] | None:
        """The least recently used entry (key, value, last use), left where it is."""
        for key, entry in self._entries.items():
            return key, entry.value, entry.last_used
        return None

    def statistics(self) -> dict[str, Any]:
        return {"sessions": len(self._entries), "bytes": self.nbytes, "budget": self.budget,
                "reserved": self.reserved, **asdict(self.stats)}
