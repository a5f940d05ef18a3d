"""The memory tiers' byte budgets, one per daemon, shared by every loaded model's cache store.

Each loaded model's store (store.py) holds its resident caches and warm
snapshots on its own engine thread; together they count against one resident
and one warm budget. A `Pool` is the accounting between the stores: what each
holds in each tier (its bytes; in the resident tier, also what its running
answers' caches may reach, which nobody evicts), when its least recently used
idle entry was last used, and what a store is waiting for. It touches no cache
and no MLX: it only says who evicts next.

- A store that needs room (`plan`) evicts its own least recently used entry
  while that entry is the oldest of every store's (`EVICT`); when another
  store's is older, that store is asked (`ASKED`: its `wake`, which puts a
  message in its engine's inbox) and evicts on its own thread, at its next
  step, as long as it still holds the oldest entry and someone waits for the
  room (`fit`). The store that asked waits where it can (a turn's admission
  stays queued) and is woken when bytes are given back.
- A store that cannot wait (a cache checked in, window blocks a prefill
  captured) makes room from its own entries, or lets what comes in go (disk
  holds it): `over` says by how much the total would pass the budget.

So the bytes the pool counts never pass a budget (but by a turn larger than
the whole budget, which runs alone once every store is empty: `plan`), and
what leaves memory is the least recently used entry across models wherever a
store can wait for its owner. Thread-safe (one lock; `wake` is called outside it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

__all__ = ["Member", "Pool", "Room"]


class Room(Enum):
    FITS = "fits"  # the bytes fit now
    EVICT = "evict"  # evict your own least recently used entry, then ask again
    ASKED = "asked"  # another store holds the oldest entry: it was asked to evict it; wait to be woken
    STUCK = "stuck"  # nothing idle is left to evict: wait until running answers end


@dataclass
class Holdings:
    """One store's holdings in one tier."""

    nbytes: int = 0  # idle entries' bytes (evictable)
    coldest: float | None = None  # its least recently used idle entry's last use (None: none)
    fixed: int = 0  # bytes nobody evicts: the running answers' caches (resident)
    want: int = 0  # bytes it waits for (a queued turn's cache), 0: none
    asked: bool = False  # woken to evict for another store, and not yet looked (`fit`): not woken again


@dataclass
class Member:
    """One store's place in the pool: what it reports and asks (from its own thread)."""

    pool: Pool
    name: str
    wake: Callable[[], None]
    held: dict[str, Holdings] = field(default_factory=dict)

    def report(self, tier: str, nbytes: int, coldest: float | None, fixed: int | None = None) -> None:
        """What this store holds in `tier` now; waiting stores are woken if that gave bytes back."""
        self.pool.report(self, tier, nbytes, coldest, fixed)

    def plan(self, tier: str, need: int = 0) -> Room:
        """Whether `need` more bytes fit in `tier` beside everything held; if not, who makes room. FITS
        grants them: they count as this store's (`fixed`) until its next report says what it holds."""
        return self.pool.plan(self, tier, need)

    def fit(self, tier: str) -> bool:
        """Woken: whether to evict this store's oldest entry now, for a store waiting or a budget passed."""
        return self.pool.fit(self, tier)

    def want_nothing(self, tier: str | None = None) -> None:
        """Nothing of this store waits for room in `tier` (None: in any) any more."""
        self.pool.want_nothing(self, tier)

    def over(self, tier: str, extra: int = 0) -> int:
        """By how many bytes the tier's total passes its budget (0: within it); with `extra`, once `extra`
        more bytes of this store's are in it, in place of what a grant of its holds for them."""
        return self.pool.over(tier, extra, self if extra else None)

    def others(self, tier: str) -> int:
        """The bytes the other stores hold in `tier` (idle and running): what this one may not use."""
        return self.pool.others(self, tier)

    def leave(self) -> None:
        """The store closed (its model unloaded): its bytes are given back."""
        self.pool.leave(self)


class Pool:
    """The daemon's resident and warm budgets (bytes, by tier name) and every store's share of them."""

    def __init__(self, budgets: dict[str, int]) -> None:
        if any(b < 0 for b in budgets.values()):
            raise ValueError("a budget is a number of bytes >= 0")
        self.budgets = dict(budgets)
        self._lock = threading.Lock()
        self._members: list[Member] = []

    def join(self, name: str, wake: Callable[[], None] = lambda: None) -> Member:
        """A store's place in the pool; `wake` is called (from any thread, never blocking) when it should
        evict for another store or try its waiting turns again."""
        m = Member(self, name, wake, {tier: Holdings() for tier in self.budgets})
        with self._lock:
            self._members.append(m)
        return m

    def stores(self) -> int:
        """How many stores are in the pool now. A store that opens its cache directory while another is in
        it skips the start's sweep (sweep.py), which would take that one's files in flight (written, not
        yet indexed) for a crash's leftovers and delete them."""
        with self._lock:
            return len(self._members)

    def leave(self, m: Member) -> None:
        with self._lock:
            if m in self._members:
                self._members.remove(m)
            waiting = self._waiting()
        for w in waiting:
            w.wake()

    # --- under the lock ---

    def _total(self, tier: str) -> int:
        return sum(m.held[tier].nbytes + m.held[tier].fixed for m in self._members)

    def _oldest(self, tier: str) -> Member | None:
        holders = [m for m in self._members if m.held[tier].coldest is not None and m.held[tier].nbytes > 0]
        return min(holders, key=lambda m: m.held[tier].coldest or 0.0, default=None)

    def _waiting(self) -> list[Member]:
        return [m for m in self._members if any(h.want for h in m.held.values())]

    # --- what members call ---

    def report(self, m: Member, tier: str, nbytes: int, coldest: float | None, fixed: int | None) -> None:
        with self._lock:
            h = m.held[tier]
            before = h.nbytes + h.fixed
            h.nbytes, h.coldest = nbytes, coldest
            if fixed is not None:
                h.fixed = fixed
            waiting = self._waiting() if h.nbytes + h.fixed < before else []
        for w in waiting:
            if w is not m:
                w.wake()

    def plan(self, m: Member, tier: str, need: int) -> Room:
        budget = self.budgets[tier]
        ask: Member | None = None
        with self._lock:
            h = m.held[tier]
            total = self._total(tier)
            alone = need > budget  # runs only once nothing else runs and nothing idle is held
            if (total + need <= budget) if not alone else total == 0:
                h.want = 0
                h.fixed += need
                return Room.FITS
            oldest = self._oldest(tier)
            if oldest is None:
                h.want = need
                return Room.STUCK
            if oldest is m:
                return Room.EVICT
            h.want = need
            if oldest.held[tier].asked:
                return Room.ASKED  # woken already, not yet looked: once is enough
            oldest.held[tier].asked = True
            ask = oldest
        ask.wake()
        return Room.ASKED

    def fit(self, m: Member, tier: str) -> bool:
        with self._lock:
            m.held[tier].asked = False
            wanted = [w.held[tier].want for w in self._members if w is not m and w.held[tier].want]
            total = self._total(tier)
            budget = self.budgets[tier]
            if total <= budget and all(total + want <= budget or (want > budget and total == 0) for want in wanted):
                return False
            oldest = self._oldest(tier)
            if oldest is m:
                return True
        if oldest is not None:
            oldest.wake()  # the baton passes on: another store holds an older entry
        return False

    def want_nothing(self, m: Member, tier: str | None) -> None:
        with self._lock:
            for t, h in m.held.items():
                if tier is None or t == tier:
                    h.want = 0

    def resize(self, budgets: dict[str, int]) -> None:
        """New budgets (a model loaded: the device's memory left changed); every store is woken, and the
        ones holding the oldest entries evict while a budget is passed."""
        with self._lock:
            self.budgets.update(budgets)
            members = list(self._members)
        for m in members:
            m.wake()

    def over(self, tier: str, extra: int = 0, granted: Member | None = None) -> int:
        with self._lock:
            held = granted.held[tier].fixed if granted is not None else 0
            return max(0, self._total(tier) - held + extra - self.budgets[tier])

    def others(self, m: Member, tier: str) -> int:
        with self._lock:
            return sum(o.held[tier].nbytes + o.held[tier].fixed for o in self._members if o is not m)

    def statistics(self) -> dict[str, dict[str, Any]]:
        """Each tier's budget and the bytes every store holds there (idle and running), in all and by store."""
        with self._lock:
            return {tier: {"budget": budget, "bytes": self._total(tier),
                           "by_model": {m.name: m.held[tier].nbytes + m.held[tier].fixed for m in self._members}}
                    for tier, budget in self.budgets.items()}
