"""Every session's cache across the tiers, resident, warm and disk: the policy (engine thread).

The engine thread holds the live caches and only evaluates what a turn writes; the I/O worker writes it (writeback.py,
queued by disktier.py), and its reader reads what a restore or a prefetch (prefetch.py) needs, planned by pagein.py: a
checkout that needs disk returns its pending read, which the caller holds and turns into the checkout once it has ended
(`read_out`), so no decode step waits on disk. Each thread has its own index connection.

- After a turn the live cache stays *resident*, and what the turn added is written *behind* it: the whole blocks it
  completed and a private tail, so page-out cost grows with the new tokens, not the history.
- Resident over budget or idle: the least recently used cache is demoted to *warm* (warm.py). Warm over budget or idle:
  dropped, disk holds it (while writes are queued the snapshot is kept aside until the worker is done). Disk over
  budget: the least recently used sessions are forgotten on disk. Every budget is the daemon's, one for all loaded
  models' stores: least recently used across them (pool.py, shares.py).
- `checkout` restores the longest prefix of the wanted ids anything holds: the session's own cache, another session's
  memory (sharing.py), or blocks on disk any session wrote; one walk down the ids' block keys in the block table
  (table.py), no scan of other sessions. The caller prefills the rest.

A session's disk chain is its whole content-addressed blocks (blocks.py, stored once, listed by every chain through
them) and then private segments. The index (SQLite) is the durable record, read once at start into the block table,
which the worker's reports keep current. A file that fails verification is dropped with everything after it; the
sessions prefill.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, fields
from functools import partial
from pathlib import Path
from typing import Any

from common.tiers import DISK, NO_CACHE, RESIDENT, SHARED, WARM

from .blocks import root_key
from .checkpoints import Checkpoints
from .diskplan import DiskPlan
from .disktier import DiskTier, open_disk
from .index import SegmentIndex
from .ioworker import FirstTokens
from .lru import DiskStats, Tier
from .pagein import PageIn, ReadReport
from .pool import Pool
from .prefetch import PREFETCH_ROOM, Prefetcher
from .prefix import MIN_SHARED, common_prefix_len
from .shares import Share
from .sharing import Found, find_shared
from .snapshot import cuttable
from .terms import Budgets, Checkout, Pending
from .warm import Cache, WarmTier, cache_nbytes
from .windows import Captures, attach
from .writeback import NOTHING_TO_EVICT

__all__ = ["MIN_SHARED", "NOTHING_TO_EVICT", "PREFETCH_ROOM", "Budgets", "Checkout", "SessionCaches",
           "cache_nbytes"]

log = logging.getLogger("kvd.cache")


class SessionCaches:
    def __init__(self, root: Path, fingerprint: str, budgets: Budgets,
                 *, clock: Callable[[], float] = time.time, first_tokens: FirstTokens | None = None,
                 model: str = "", pool: Pool | None = None):
        if budgets.block_tokens < 1:
            raise ValueError("block_tokens must be at least 1")
        self.fingerprint = fingerprint
        self.budgets = budgets
        self.block = budgets.block_tokens
        self.root = root_key(fingerprint)
        self._clock = clock
        self._dir = root
        self._indexes = threading.local()  # each thread's own connection to the index
        self._indexes.index = SegmentIndex(root, fingerprint)
        self._writer, self.table = open_disk(lambda: self.index, budgets, fingerprint=fingerprint, root=self.root,
                                             model=model, sweep_files=not (pool and pool.stores()), clock=clock)
        self._disktier = DiskTier(lambda: self.index, self.table, self._writer,
                                  max_segments=budgets.max_segments, on_idle=self._on_idle,
                                  first_tokens=first_tokens)
        self._io = self._disktier.io
        self.pool = pool or Pool({RESIDENT: budgets.resident_bytes, WARM: budgets.warm_bytes})  # (every model's)
        self.resident: Tier[Cache] = Tier("resident", self.pool.budgets[RESIDENT], budgets.resident_sessions)
        self.points = Checkpoints(budgets.checkpoints)  # where caches cannot be cut: state kept at earlier points
        self.warm = WarmTier(self.table, self.pool.budgets[WARM], bits=budgets.warm_bits,
                             busy=lambda: not self._io.idle(), points=self.points)
        #: This store's place in the memory budgets (the engine asks it for a turn's `room`).
        self.share = Share(self.pool.join(model or fingerprint), self.resident, self.warm, self.table, clock)
        self._disk = PageIn(self.table, fingerprint=fingerprint, later=self._disktier.later,
                            dropped=self._disktier.dropped, clock=clock,
                            read=lambda job: self._io.read(job, done=self._read_done))  # (its `wait`s)
        # What the engine tells the store (`connect`); until then, nothing runs and nobody is told.
        self.on_read: Callable[[], None] | None = None
        self.restoring: Callable[[str], bool] = lambda key: False
        self.running_bytes: Callable[[], int] = lambda: 0
        self._captured = Captures(self.table)  # a window's blocks a prefill took
        self.shared_stats = {"restores": 0, "tokens": 0}
        self._prefetch = Prefetcher(self._disk, self.table, self.resident, self.warm,
                                    attach=partial(attach, self.table), make_room=self.make_room, clock=clock)

    @property
    def index(self) -> SegmentIndex:
        """This thread's connection to the index (a SQLite connection stays on its thread)."""
        index: SegmentIndex | None = getattr(self._indexes, "index", None)
        if index is None:
            index = self._indexes.index = SegmentIndex(self._dir, self.fingerprint)
        return index

    @property
    def disk_stats(self) -> DiskStats:
        """The disk tier's figures: the engine thread's (reads) and the worker's (writes), merged."""
        mine, theirs = self._disk.stats, self._writer.stats
        return DiskStats(**{f.name: getattr(mine, f.name) + getattr(theirs, f.name) for f in fields(DiskStats)})

    def close(self) -> None:
        """Finish every queued disk job, then close the index; the memory budgets' share is given back."""
        self._io.submit(self._close_index)
        self._io.close()
        self._close_index()
        self.share.leave()

    def _close_index(self) -> None:
        index = getattr(self._indexes, "index", None)
        if index is not None:
            index.close()
            del self._indexes.index

    # --- the I/O worker ---

    def flush(self) -> None:
        """Wait until disk holds everything asked of it so far (shutdown, tests, tools; never a turn)."""
        self._io.flush()
        self._settle()

    def after_writes(self, fn: Callable[[], object]) -> None:
        """`fn` on the I/O worker once the disk jobs queued so far are done, every model's disk bytes counted first."""
        self._io.submit(lambda: (self._disktier.count(), fn()))

    def arrived(self) -> None:
        """An answer is on its way to the engine (any thread): the writes give way until it is taken (ioworker.py)."""
        self._io.first_tokens.arrived()

    def answering(self, busy: bool, *, took: bool = False) -> None:
        """Whether the engine's answers still want their first token (waiting, restoring or prefilling): the engine
        thread says after each step, and as it takes an arrived answer (`took`)."""
        (self._io.first_tokens.taken if took else self._io.first_tokens.engine)(busy)

    def before_reads(self, fn: Callable[[], object]) -> None:
        """Call `fn` on the I/O worker's reader before any later read (a test holds the reader so)."""
        self._io.read(fn)

    def _settle(self) -> None:
        """Take in the worker's reports (disktier.py) and the reader's: a read's next step, or its end."""
        for report in self._disktier.settle():
            if isinstance(report, ReadReport) and (r := self._disk.arrived(report)) is not None:
                self._prefetch.arrived(r, busy=self.restoring)

    def _read_done(self) -> None:
        """On the reader: a read reported."""
        self._disk.reported.set()
        if (wake := self.on_read) is not None:
            wake()

    def _on_idle(self) -> None:
        self.warm.release_held()  # disk holds them now (or never will: they were not writable)

    # --- resume ---

    def checkout(self, key: str, wanted: Sequence[int], *, wait: bool = True) -> Checkout:
        """Take the session's cache out of the tiers, holding the longest usable prefix anything holds.

        At least one wanted token is always left to feed. Candidates, best first on a tie: the session's own resident
        cache (rewound in place), its own warm snapshot, another session's resident cache or warm snapshots (a copy of
        the shared prefix; that session keeps its own), then disk (the session's chain, and blocks any session wrote).

        Disk is read by the I/O worker's reader, never here: with `wait`, this waits for the read (tools, tests, ranks
        in lockstep); without, a checkout that needs disk returns at once with its pending `read`, which `read_out`
        turns into the checkout once the read has ended (the engine keeps stepping the other sessions meanwhile).
        """
        t0 = time.perf_counter()
        limit = len(wanted) - 1
        self._settle()
        prefetched = self._prefetch.checked_out(key)
        self._captured.pop(key)  # a prefill that did not end in a checkin
        own: Checkout | None = None
        if (cache := self.resident.take(key)) is not None:
            if (got := self.points.rewound(key, cache, self.table.session(key).tokens, wanted, limit)) is not None:
                own = Checkout(got[0], got[1], RESIDENT, 0.0, prefetched=prefetched, checkpoint=got[2])
            else:
                log.debug("resident cache of %s not reusable for this turn", key)
            self.warm.discard(key)
            self.table.detach(key)  # the live cache is the engine's now
        own_warm_n = self.warm.usable(key, wanted, limit) if own is None else 0
        if own is None and own_warm_n < limit and self._disktier.written(key, self._settle):
            own_warm_n = self.warm.usable(key, wanted, limit)
        best_n = max(own.tokens if own else 0, own_warm_n)
        other, disk = self._others(key, wanted, limit, best_n)
        if disk.end > max(best_n, other[0] if other else 0):
            r = self._disk.begin(key, disk, room=len(wanted) - disk.end)
            pending = Pending(key, list(wanted), t0, r, own, prefetched)
            if wait:  # (tools, tests, ranks in lockstep)
                self._disk.wait(r, self._settle)
                return self._read_out(pending)
            return Checkout(None, 0, DISK, 0.0, read=pending)
        return self._from_memory(key, wanted, t0, own, own_warm_n, other, prefetched)

    def take_reports(self) -> None:
        """Take in what the I/O worker and its reader reported (`on_read`): a read goes on, or ends."""
        self._settle()

    def allocate(self, *, others: bool) -> None:
        """Make the buffers the reads under way wait for (engine thread, once per step while a checkout's read is
        pending or a prefetch's is under way). `others`: other answers are running, so they are made a few per call,
        beside their steps; with none, all at once (nobody waits on this thread meanwhile)."""
        self._disk.allocate(all_of_it=not others)

    def read_out(self, pending: Pending) -> Checkout | None:
        """The checkout a pending read ends in, once it has (None: still reading)."""
        return self._read_out(pending) if pending.reading.done else None

    def abandon(self, pending: Pending) -> None:
        """A checkout waiting for its read is not wanted any more (its answer was cancelled)."""
        self._disk.abandon(pending.reading)

    def _read_out(self, pending: Pending) -> Checkout:
        """A checkout whose read ended: what it read, or, if that failed, the best memory holds now."""
        key, wanted, r = pending.key, pending.wanted, pending.reading
        if r.result is not None:
            held, end, own_tokens = r.result
            assert isinstance(held, list)
            now = self._clock()
            self._disktier.later(lambda index: index.touch(key, now), key)
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
        self._disk.stats.misses += 1
        return Checkout(None, 0, NO_CACHE, ms())

    def _handed(self, key: str, wanted: Sequence[int], out: Checkout) -> Checkout:
        self.points.handed(key, out.cache, wanted[:out.tokens], checkpoint=out.checkpoint)
        return self._counted(out)

    def _others(self, key: str, wanted: Sequence[int], limit: int, best: int) -> tuple[Found | None, DiskPlan]:
        """One walk down the wanted ids' blocks: the best copy of another session's memory (more than `best` ids),
        and the disk plan."""
        walk = self.table.walk(self.table.keys_for(key, wanted))
        other = find_shared(self.table, self.resident, self.warm, key, wanted, limit, walk, best)
        return other, self._disk.plan(key, wanted, limit, walk)

    def find(self, key: str, wanted: Sequence[int]) -> tuple[str, int]:
        """Where checkout would restore the longest prefix of `wanted` from, and how many ids; moves nothing."""
        self._settle()
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

    # --- the memory budgets every loaded model shares (shares.py) ---

    def connect(self, probe: Cache, *, running_bytes: Callable[[], int], restoring: Callable[[str], bool],
                on_read: Callable[[], None] | None = None, on_room: Callable[[], None] | None = None) -> None:
        """What the store needs of its engine once the model is warm: a live cache's bytes by length (`probe`, the
        warm-up's, holds a token); the bytes the running answers may reach (idle resident caches make room for them);
        whether a session's answer waits for its read (a prefetch leaves it alone); whom to tell, from any thread,
        never blocking: `on_read` when the reader reported (the engine calls `take_reports`), `on_room` when another
        model's store wants room this one's older caches hold, or room this one waits for came back (`fit`, `room`)."""
        self.share.measure(probe)
        self._disk.cuts = cuttable(probe)  # (else a restore from disk ends at a file's end: its state is there)
        self.points.learn(probe, most=self.share.point_bytes(1 << 62))
        self.running_bytes, self.restoring, self.on_read = running_bytes, restoring, on_read
        self.share.on_room = on_room

    def bytes_for(self, tokens: int) -> int:
        """The bytes a live cache of `tokens` ids takes with the checkpoints its session may keep (0 before
        `connect`)."""
        return self.share.bytes_for(tokens) + self.points.keep * self.share.point_bytes(tokens)

    def room(self, key: str, need: int) -> bool:
        """Whether a turn on `key` whose cache may reach `need` bytes starts now, beside every model's
        caches (shares.py's `room`), once the running answers' bytes are counted afresh; True holds them."""
        self.make_room()
        return self.share.room(key, need)

    def want_nothing(self) -> None:  # no turn of this store waits for room any more
        self.share.want_nothing()

    def fit(self) -> bool:
        """Woken through `on_room`: let this store's oldest caches go while another store waits for the room."""
        return self.share.fit()

    def _counted(self, out: Checkout) -> Checkout:
        if out.shared_tokens:
            self.shared_stats["restores"] += 1
            self.shared_stats["tokens"] += out.shared_tokens
        return out

    # --- prefetch after a restart ---

    def prefetch_plan(self, limit: int | None = None) -> list[str]:
        """Sessions only on disk that memory has room for (`limit`: bytes at most), latest first (prefetch.py)."""
        return self._prefetch.plan(self.index.keys_by_use(), limit)

    def prefetch(self, key: str) -> str | None:
        """Page a session's disk chain into memory if it fits, waiting here (tools, tests, ranks); its tier."""
        return self._prefetch.now(key, wait=lambda r: self._disk.wait(r, self._settle))

    def prefetch_later(self, keys: Sequence[str]) -> None:
        """Page sessions' whole disk chains into memory where they fit, a read at a time, waiting for none: each kept
        as it arrives (`_settle`) unless the session was checked out since."""
        self._prefetch.later(keys, busy=self.restoring)

    def prefetching(self) -> bool:
        """Whether prefetch reads are planned or under way."""
        return self._prefetch.reading is not None or bool(self._prefetch.queue)

    # --- windows: blocks captured during a prefill (windows.py) ---

    def boundary(self, cache: Cache) -> int | None:
        """Every how many ids a prefill into `cache` stops for `capture`, and before its last id (None: a cache that
        can be cut)."""
        return None if cuttable(cache) else self.block

    def capture(self, key: str, cache: Cache, tokens: Sequence[int], *, last: bool = False) -> None:
        """A prefill into a cache that cannot be cut reached a block boundary (keep the block that ends here) or,
        `last`, its prompt's last id (keep a checkpoint: a regenerate comes back to it)."""
        self._captured.capture(key, cache, tokens)
        if last:
            self.points.take(key, cache, tokens)

    # --- after a turn ---

    def make_room(self) -> None:
        """Demote idle resident caches until they fit the budget beside what running turns may reach
        (`running_bytes`): called when a turn is admitted."""
        now = self._clock()
        for cold, c in self.resident.reserve(self.running_bytes()):
            self.table.set_live(cold, False)
            self.warm.demote(cold, c, now)
        self.share.within()

    def checkin(self, key: str, cache: Cache, tokens: Sequence[int]) -> None:
        """Keep a session's live cache resident and queue the writing of its new tokens behind it."""
        tokens = list(tokens)
        self._settle()
        self.make_room()  # the turn that ended holds nothing any more
        self.warm.discard(key)
        captured = self._captured.pop(key)
        keys = attach(self.table, key, cache, tokens, captured)
        by_end = {self.table.blocks[bk].end: snap for bk in keys
                  if (snap := captured.get(bk) or self.warm.exact_copy(bk)) is not None}
        self.points.follow(key, tokens)
        self._disktier.write_behind(key, cache, tokens, keys, captured=by_end, points=self.points.of(key))
        self.warm.add_copies({bk: captured[bk] for bk in keys if bk in captured})
        self.table.set_live(key, True)
        now = self._clock()
        for cold, c in self.resident.put(key, cache, cache_nbytes(cache) + self.points.nbytes(key), now):
            self.table.set_live(cold, False)
            self.warm.demote(cold, c, now)
        self.share.within()

    # --- housekeeping ---

    def maintain(self) -> None:
        """Idle demotions: resident -> warm after resident_idle, warm dropped after warm_idle."""
        self._settle()
        now = self._clock()
        for key, cache in self.resident.idle(now, self.budgets.resident_idle):
            self.table.set_live(key, False)
            self.warm.demote(key, cache, now)
        self.warm.idle(now, self.budgets.warm_idle)
        self.make_room()  # (and within the budgets every model shares)

    def page_out_all(self) -> None:
        """Make sure disk holds every session kept in memory (on shutdown; disktier.py)."""
        self.flush()
        self._disktier.page_out(self.resident, self.warm)
        self.flush()

    def forget(self, key: str) -> None:
        """A deleted session: its caches go, and every block no other session lists."""
        if self.resident.discard(key) is not None:
            self.table.set_live(key, False)
        self.warm.discard(key)
        self.points.drop(key)
        self.table.detach(key)
        self._captured.pop(key)
        self._disktier.forget(key)
        self.table.forget(key)  # now if disk holds nothing of it; else when the worker reports the drop

    def locations(self) -> dict[str, str]:
        """Where each session's cache lives now: its fastest tier."""
        self._settle()
        where = dict.fromkeys(self.table.on_disk, DISK)
        where.update({key: WARM for key in self.warm.held_or_warm()})
        where.update({key: RESIDENT for key in self.resident})
        return where

    def kept_for(self) -> dict[str, list[str]]:
        """By session, the other models disk keeps its cache for (never restored here), latest first."""
        self._settle()
        return self._disktier.kept_for()

    def statistics(self) -> dict[str, Any]:
        self._settle()
        return {
            "running": {"bytes": self.running_bytes(), "budget": self.pool.budgets[RESIDENT]},
            RESIDENT: self.resident.statistics(),
            WARM: self.warm.statistics(),
            "prefetched": {"sessions": (p := self._prefetch.stats)["done"], "bytes": p["bytes"],
                           RESIDENT: p[RESIDENT], WARM: p[WARM]},
            DISK: {**self._disktier.statistics(self.budgets.disk_bytes), "block_tokens": self.block,
                   **asdict(self.disk_stats)},
            SHARED: dict(self.shared_stats),
            "checkpoints": self.points.statistics(),
        }

