"""One store's memory tiers within the budgets every loaded model shares (pool.py): its engine thread's half.

The store (store.py) keeps its resident caches and warm snapshots as before;
this reports what they hold to the daemon's `Pool` after every change, and
makes room the pool's way: a turn's `room` demotes this store's least
recently used resident cache while it is the oldest of every model's (and
only once the warm tier has room for it), and waits when another model's is
older (that store was asked). `fit` is that other side: woken by the pool,
this store lets its oldest caches go while someone waits for the room. Where
a store cannot wait (`within`, and warm.py's `room`: a cache checked in,
demoted, a window's blocks captured) it keeps the totals within the budgets
from its own caches, or lets what comes in go (disk holds it).
Engine thread only (the pool itself is thread-safe).
"""

from __future__ import annotations

from collections.abc import Callable

from common.tiers import RESIDENT, WARM

from .cost import CacheCost, cache_cost
from .lru import Tier
from .pool import Member, Room
from .table import BlockTable
from .warm import Cache, WarmTier, cache_nbytes


class Share:
    def __init__(self, member: Member, resident: Tier[Cache], warm: WarmTier, table: BlockTable,
                 clock: Callable[[], float]) -> None:
        self.member = member
        self.resident = resident
        self.warm = warm
        self.table = table
        self.clock = clock
        #: Called (from any thread, never blocking) when another model's store waits for room this one's
        #: older caches hold, or room this one waits for was given back: the engine then calls `fit` and
        #: tries its queued turns again (`room`). None: nobody is told (tests, tools).
        self.on_room: Callable[[], None] | None = None
        member.wake = lambda: self.on_room() if self.on_room is not None else None
        resident.changed, warm.changed = self._report_resident, self._report_warm
        resident.others = lambda: member.others(RESIDENT)
        warm.others = lambda: member.others(WARM)
        warm.room = self._room_in_warm
        self.cost: CacheCost | None = None  # a live cache's bytes by its length (`measure`)

    def measure(self, cache: Cache) -> None:
        """Learn what a live cache of this model takes by its length, from one that holds a token (the engine's
        warm-up cache)."""
        self.cost = cache_cost(cache)

    def bytes_for(self, tokens: int) -> int:
        """The bytes a live cache of `tokens` ids takes, its buffers in whole steps (0 before `measure`)."""
        return self.cost(tokens) if self.cost is not None else 0

    def point_bytes(self, tokens: int) -> int:
        """The bytes of one checkpoint at `tokens` ids (0 before `measure`, and for a cache that can be cut)."""
        return self.cost.point(tokens) if self.cost is not None else 0

    def room(self, key: str, need: int) -> bool:
        """Whether a turn on session `key` whose cache may reach `need` bytes may start now, beside every
        model's running and idle resident caches; this store's idle ones are demoted while they are the
        least recently used of all (never the session's own: it is in use now, and its bytes are part of
        `need`). False: it waits (another store was asked to make room; `on_room` says when to ask
        again). True holds the bytes for the turn: they count as running from now."""
        self.resident.touch(key, self.clock())
        while True:
            own = self.resident.size(key)  # checked out next: from then on it is the turn's running cache
            r = self.member.plan(RESIDENT, max(0, need - own))
            if r is Room.FITS:
                self.resident.reserved += need
                self.member.want_nothing()  # (warm room its demotions asked for, too)
                return True
            if r is not Room.EVICT or not self.evict_resident(wait=True):
                return False

    def want_nothing(self) -> None:
        """No turn of this store waits for resident room any more (the warm room a demotion for another
        store waits for is that demotion's: `fit` asks for it again while it is needed)."""
        self.member.want_nothing(RESIDENT)

    def fit(self) -> bool:
        """Woken by the pool: let this store's least recently used caches go while they are the oldest of
        every model's and another store waits for the room (or a budget is passed); whether any went."""
        budgets = self.member.pool.budgets
        self.resident.budget, self.warm.budget = budgets[RESIDENT], budgets[WARM]
        self.member.want_nothing(WARM)  # asked again below while a demotion still waits for warm room
        went = False
        while self.member.fit(RESIDENT) and self.evict_resident(wait=True):
            went = True
        while self.member.fit(WARM) and self.warm.evict_oldest():
            went = True
        return went

    def evict_resident(self, *, wait: bool) -> bool:
        """Demote the least recently used idle resident cache to warm. `wait`: only once the warm tier has
        room for it (False: another store was asked for that room); else warm makes room from this
        store's own snapshots."""
        got = self.resident.oldest()
        if got is None or (wait and not self._warm_room(self._snapshot_bytes(got[0], got[1]))):
            return False
        key, cache, _ = got
        self.resident.discard(key)
        self.resident.stats.page_outs += 1
        self.table.set_live(key, False)
        self.warm.demote(key, cache, self.clock())
        self._within_warm()
        return True

    def _snapshot_bytes(self, key: str, cache: Cache) -> int:
        """At most what a warm snapshot of a session's live cache takes: its ids' bytes, not its buffers'."""
        s = self.table.sessions.get(key)
        return min(cache_nbytes(cache), cache_cost(cache)(len(s.tokens) if s else 0, whole_steps=False))

    def _warm_room(self, nbytes: int) -> bool:
        """Room in the warm tier for a snapshot of at most `nbytes`: this store's oldest snapshots go while
        they are the oldest of all; False when another store's are (it was asked). A snapshot larger than
        the whole budget is not waited for, nor other stores asked for it: it cannot stay (warm.py's own
        budget lets it go at once)."""
        if nbytes > self.member.pool.budgets[WARM]:
            return True
        while True:
            r = self.member.plan(WARM, nbytes)
            if r is Room.FITS:
                return True
            if r is not Room.EVICT or not self.warm.evict_oldest():
                return False

    def within(self) -> None:
        """Where this store cannot wait: keep every model's total within the budgets by letting this
        store's own least recently used caches go."""
        while self.member.over(RESIDENT) and self.evict_resident(wait=False):
            pass
        self._within_warm()

    def _room_in_warm(self, nbytes: int) -> bool:
        """`nbytes` of this store's come into warm now: its own oldest snapshots go first while the total
        would pass the budget (it cannot wait; where it could, `_warm_room` asked the oldest's owner);
        False when that is not enough (they are let go at once)."""
        while self.member.over(WARM, nbytes) and self.warm.evict_oldest():
            pass
        return not self.member.over(WARM, nbytes)

    def _within_warm(self) -> None:
        while self.member.over(WARM) and self.warm.evict_oldest():
            pass

    def leave(self) -> None:
        """The store closed: its bytes are given back to the others."""
        self.member.leave()

    def _report_resident(self) -> None:
        o = self.resident.oldest()
        self.member.report(RESIDENT, self.resident.nbytes, o[2] if o is not None else None,
                           fixed=self.resident.reserved)

    def _report_warm(self) -> None:
        self.member.report(WARM, self.warm.nbytes, self.warm.oldest(), fixed=0)
