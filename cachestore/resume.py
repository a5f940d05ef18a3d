"""A checkout: the longest prefix of a session's wanted ids that anything holds, taken out of the tiers.

The store (store.py) owns the tiers and hands a `Resume` what a checkout looks in: the session's own
live cache and warm snapshot, other sessions' memory through the block table (sharing.py), and disk
(pagein.py plans the read, the I/O worker's reader reads it); one walk down the wanted ids' block
keys finds what restores the most, never a scan of the other sessions. Engine thread only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from common.tiers import DISK, NO_CACHE, RESIDENT, SHARED, WARM

from .checkpoints import Checkpoints
from .diskplan import DiskPlan
from .disktier import DiskTier
from .lru import Tier
from .pagein import PageIn, Reading
from .prefetch import Prefetcher
from .prefix import common_prefix_len
from .sharing import Found, find_shared
from .snapshot import cuttable
from .table import BlockTable
from .terms import Checkout, Pending
from .warm import Cache, WarmTier
from .windows import Captures

log = logging.getLogger("kvd.cache")


@dataclass
class Resume:
    """What one store's checkouts look in, and how many ids other sessions' caches supplied (`shared`)."""

    table: BlockTable
    resident: Tier[Cache]
    warm: WarmTier
    disk: PageIn
    disktier: DiskTier
    prefetch: Prefetcher
    captured: Captures
    points: Checkpoints  # where caches cannot be cut: state kept at earlier points (checkpoints.py)
    settle: Callable[[], None]  # take in the I/O worker's and the reader's reports
    wait: Callable[[Reading], None]  # wait here for a read (tools, tests, ranks in lockstep)
    clock: Callable[[], float]
    shared: dict[str, int] = field(default_factory=lambda: {"restores": 0, "tokens": 0})

    def checkout(self, key: str, wanted: Sequence[int], *, wait: bool = True) -> Checkout:
        """Take the session's cache out of the tiers, holding the longest usable prefix anything holds.

        At least one wanted token is always left to feed. Candidates, best first on a tie: the session's own resident
        cache (rewound in place), its own warm snapshot, another session's resident cache or warm snapshots (a copy of
        the shared prefix; that session keeps its own), then disk (the session's chain, and blocks any session wrote).

        Disk is read by the I/O worker's reader, never here: with `wait`, this waits for the read (tools, tests, ranks
        in lockstep); without, a checkout that needs disk returns at once with its pending `read`, which `read_out`
        turns into the checkout once the read has ended (the store's `restored`; the engine keeps stepping the other
        sessions meanwhile).
        """
        t0 = time.perf_counter()
        limit = len(wanted) - 1
        prefetched = self.prefetch.checked_out(key)
        self.captured.pop(key)  # a prefill that did not end in a checkin
        own: Checkout | None = None
        if (cache := self.resident.take(key)) is not None:
            if (got := self.points.rewound(key, cache, self.table.session(key).tokens, wanted, limit)) is not None:
                own = Checkout(got[0], got[1], RESIDENT, 0.0, prefetched=prefetched, checkpoint=got[2])
            else:
                log.debug("resident cache of %s not reusable for this turn", key)
            self.warm.discard(key)
            self.table.detach(key)  # the live cache is the engine's now
        own_warm_n = self.warm.usable(key, wanted, limit) if own is None else 0
        if own is None and own_warm_n < limit and self.disktier.written(key, self.settle):
            own_warm_n = self.warm.usable(key, wanted, limit)
        best_n = max(own.tokens if own else 0, own_warm_n)
        other, disk = self._others(key, wanted, limit, best_n)
        if disk.end > max(best_n, other[0] if other else 0):
            r = self.disk.begin(key, disk, room=len(wanted) - disk.end)
            pending = Pending(key, list(wanted), t0, r, own, prefetched)
            if wait:
                self.wait(r)
                return self.read_out(pending)
            return Checkout(None, 0, DISK, 0.0, read=pending)
        return self._from_memory(key, wanted, t0, own, own_warm_n, other, prefetched)

    def read_out(self, pending: Pending) -> Checkout:
        """A checkout whose read ended: what it read, or, if that failed, the best memory holds now."""
        key, wanted, r = pending.key, pending.wanted, pending.reading
        if r.result is not None:
            held, end, own_tokens = r.result
            assert isinstance(held, list)
            now = self.clock()
            self.disktier.later(lambda index: index.touch(key, now), key)
            shared = max(end - own_tokens, 0)
            ms = (time.perf_counter() - pending.t0) * 1000
            point = not cuttable(held) and (shared > 0 or end < r.plan.chain)
            return self._handed(key, wanted, Checkout(held, end, SHARED if shared else DISK, ms, shared,
                                                      checkpoint=point))
        limit = len(wanted) - 1
        own = pending.own
        own_warm_n = self.warm.usable(key, wanted, limit) if own is None else 0
        other, _ = self._others(key, wanted, limit, max(own.tokens if own else 0, own_warm_n))
        return self._from_memory(key, wanted, pending.t0, own, own_warm_n, other, pending.prefetched)

    def _from_memory(self, key: str, wanted: Sequence[int], t0: float, own: Checkout | None, own_warm_n: int,
                     other: Found | None, prefetched: bool) -> Checkout:
        def ms() -> float:
            return (time.perf_counter() - t0) * 1000

        if other is not None:
            n, copy, point = other
            if (copied := copy()) is not None:
                return self._handed(key, wanted, Checkout(copied, n, SHARED, ms(), n, checkpoint=point))
        if own is not None:
            own.restore_ms = ms()
            return self._handed(key, wanted, own)
        if own_warm_n > 0:
            point = own_warm_n < self.warm.held_ids(key) and not self.warm.cuttable(key)
            copied = self.warm.copy(key, own_warm_n)
            self.warm.take(key)
            self.table.detach(key)
            if copied is not None:
                return self._handed(key, wanted, Checkout(copied, own_warm_n, WARM, ms(), prefetched=prefetched,
                                                          checkpoint=point))
        self.disk.stats.misses += 1
        return Checkout(None, 0, NO_CACHE, ms())

    def _others(self, key: str, wanted: Sequence[int], limit: int, best: int) -> tuple[Found | None, DiskPlan]:
        """One walk down the wanted ids' blocks: the best copy of another session's memory (more than `best` ids),
        and the disk plan."""
        walk = self.table.walk(self.table.keys_for(key, wanted))
        other = find_shared(self.table, self.resident, self.warm, key, wanted, limit, walk, best)
        return other, self.disk.plan(key, wanted, limit, walk)

    def find(self, key: str, wanted: Sequence[int]) -> tuple[str, int]:
        """Where checkout would restore the longest prefix of `wanted` from, and how many ids; moves nothing."""
        limit = len(wanted) - 1
        cache, s = self.resident.peek(key), self.table.sessions.get(key)
        own = min(common_prefix_len(s.tokens, wanted), limit) if cache is not None and s is not None else 0
        own_warm = self.warm.usable(key, wanted, limit) if not own else 0
        other, disk = self._others(key, wanted, limit, max(own, own_warm))
        if disk.end > max(own, own_warm, other[0] if other else 0):
            return (SHARED if disk.end > disk.own else DISK), disk.end
        if other is not None:
            return SHARED, other[0]
        return (RESIDENT, own) if own else (WARM, own_warm) if own_warm else (NO_CACHE, 0)

    def _handed(self, key: str, wanted: Sequence[int], out: Checkout) -> Checkout:
        """A checkout's cache goes to the engine: where it cannot be cut, its state there is kept as a checkpoint
        first (checkpoints.py's `handed`)."""
        self.points.handed(key, out.cache, wanted[:out.tokens], checkpoint=out.checkpoint)
        return self._counted(out)

    def _counted(self, out: Checkout) -> Checkout:
        if out.shared_tokens:
            self.shared["restores"] += 1
            self.shared["tokens"] += out.shared_tokens
        return out
