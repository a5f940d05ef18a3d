"""Every session's cache across the tiers, resident, warm and disk: the policy (engine thread).

The engine thread holds the live caches and only evaluates what a turn writes; the I/O worker writes it (writeback.py,
queued by disktier.py), and its reader reads what a restore or a prefetch (prefetch.py) needs, planned by pagein.py: a
checkout that needs disk returns its pending read, which the caller holds and turns into the checkout once it has ended
(`restored`), so no decode step waits on disk. Each thread has its own index connection.

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

from common.tiers import DISK, RESIDENT, SHARED, WARM

from .blocks import root_key
from .checkpoints import Checkpoints
from .disktier import DiskTier, open_disk
from .index import SegmentIndex
from .ioworker import FirstTokens
from .lru import DiskStats, Tier
from .pagein import PageIn, Reading, ReadReport
from .pool import Pool
from .prefetch import PREFETCH_ROOM, Prefetcher
from .prefix import MIN_SHARED
from .resume import Resume
from .shares import Share
from .snapshot import cuttable
from .terms import Budgets, Checkout, Pending
from .told import Abandoned, Arrived, Idle, ReadsReported, Stepped, Stopping, Told, Took, Woken
from .warm import Cache, WarmTier, cache_nbytes
from .windows import Captures, attach
from .writeback import NOTHING_TO_EVICT

__all__ = ["MIN_SHARED", "NOTHING_TO_EVICT", "PREFETCH_ROOM", "Budgets", "Checkout", "SessionCaches",
           "cache_nbytes"]

log = logging.getLogger("kvd.cache")


class SessionCaches:
    """One model's caches in every tier. The engine's door is ten calls, each for what it needs: `connect` once its
    model is warm (what a cache of n ids takes comes back), `admit` (room or no room, as a value), `checkout` and,
    for one that reads disk, `restored`, `windows` (where a prefill keeps a window's blocks), `checkin`, `forget`,
    `tell` (what happened: told.py), `statistics` and `prefetch` (after a start). The rest is the store's own (and
    its tests' and tools'): tests/test_arrows.py fails if the daemon calls more than ten."""

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
        #: This store's place in the memory budgets (`admit` asks it for a turn's room).
        self.share = Share(self.pool.join(model or fingerprint), self.resident, self.warm, self.table, clock)
        self._disk = PageIn(self.table, fingerprint=fingerprint, later=self._disktier.later,
                            dropped=self._disktier.dropped, clock=clock,
                            read=lambda job: self._io.read(job, done=self._read_done))
        # What the engine tells the store (`connect`); until then, nothing runs and nobody is told.
        self.on_read: Callable[[], None] | None = None
        self.restoring: Callable[[str], bool] = lambda key: False
        self.running_bytes: Callable[[], int] = lambda: 0
        self._read_event = threading.Event()  # a read reported: what a waiting `checkout` waits for
        self._captured = Captures(self.table)  # a window's blocks a prefill took
        self._prefetch = Prefetcher(self._disk, self.table, self.resident, self.warm,
                                    attach=partial(attach, self.table), make_room=self.make_room, clock=clock,
                                    wait=self._wait)
        self._resume = Resume(self.table, self.resident, self.warm, self._disk, self._disktier, self._prefetch,
                              self._captured, self.points, settle=self._settle, wait=self._wait, clock=clock)

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
        self._read_event.set()
        if (wake := self.on_read) is not None:
            wake()

    def _wait(self, r: Reading) -> None:
        """Wait for a read here (a checkout or prefetch asked to wait: tools, tests, ranks in lockstep)."""
        while not r.done:
            if self._disk.allocating(r):
                self._disk.allocate(all_of_it=True)
                continue
            self._read_event.wait()
            self._read_event.clear()
            self._settle()

    def _on_idle(self) -> None:
        self.warm.release_held()  # disk holds them now (or never will: they were not writable)

    # --- resume ---

    def checkout(self, key: str, wanted: Sequence[int], *, wait: bool = True) -> Checkout:
        """Take the session's cache out of the tiers (`_checkout`), then let idle caches leave memory for what the
        admitted answers may reach."""
        self._settle()
        out = self._resume.checkout(key, wanted, wait=wait)
        self.make_room()
        return out

    def restored(self, pending: Pending) -> Checkout | None:
        """The checkout a pending read ends in, once it has (None: still reading); the reports are taken in first."""
        self._settle()
        return self._resume.read_out(pending) if pending.reading.done else None

    def find(self, key: str, wanted: Sequence[int]) -> tuple[str, int]:
        """Where checkout would restore the longest prefix of `wanted` from, and how many ids; moves nothing."""
        self._settle()
        return self._resume.find(key, wanted)

    # --- the memory budgets every loaded model shares (shares.py) ---

    def connect(self, probe: Cache, *, running_bytes: Callable[[], int], restoring: Callable[[str], bool],
                on_read: Callable[[], None] | None = None,
                on_room: Callable[[], None] | None = None) -> Callable[[int], int]:
        """What the store needs of its engine once the model is warm: a live cache's bytes by length (`probe`, the
        warm-up's, holds a token); the bytes the running answers may reach (idle resident caches make room for them);
        whether a session's answer waits for its read (a prefetch leaves it alone); whom to tell, from any thread,
        never blocking: `on_read` when the reader reported (the engine tells `READS_REPORTED`), `on_room` when another
        model's store wants room this one's older caches hold, or room this one waits for came back, or the budgets
        changed (the engine tells `WOKEN`, and tries its queued answers again). Returns what the engine needs back: the
        bytes a live cache of n ids takes, its buffers in whole steps, with the checkpoints its session may keep (an
        answer's `need`)."""
        self.share.measure(probe)
        self._disk.cuts = cuttable(probe)  # (else a restore from disk ends at a file's end: its state is there)
        self.points.learn(probe, most=self.share.point_bytes(1 << 62))
        self.running_bytes, self.restoring, self.on_read = running_bytes, restoring, on_read
        self.share.on_room = on_room
        return self.bytes_for

    def bytes_for(self, tokens: int) -> int:
        """The bytes a live cache of `tokens` ids takes with the checkpoints its session may keep (0 before
        `connect`)."""
        return self.share.bytes_for(tokens) + self.points.keep * self.share.point_bytes(tokens)

    def admit(self, key: str, need: int) -> bool:
        """Room or no room, as a value: whether an answer on `key` whose cache may reach `need` bytes starts now,
        beside every model's caches (shares.py's `room`; the running answers' bytes counted afresh first). True
        holds the bytes for it; False: it waits, and `on_room` says when to ask again."""
        self.make_room()
        return self.share.room(key, need)

    def tell(self, what: Told) -> bool:
        """What happened (told.py); whether caches moved between tiers (the engine publishes where they are)."""
        first = self._io.first_tokens
        match what:  # (a step's first: told after every one)
            case Stepped(running=running, wanting=wanting, waiting=waiting):
                if self._disk.reading():
                    self._disk.allocate(all_of_it=not running)  # the next buffers of the reads under way
                first.engine(wanting)
                if not waiting:
                    self.share.want_nothing()  # (a queued answer may have been cancelled)
            case Arrived():
                first.arrived()  # the writes give way until it is taken (ioworker.py)
            case Took(wanting=wanting):
                first.taken(wanting)
            case ReadsReported():
                self._settle()
            case Woken():
                return self.share.fit()
            case Idle():
                self.maintain()
            case Abandoned(read=read):
                self._disk.abandon(read.reading)
            case Stopping():
                self.page_out_all()
                self.close()
        return False

    # --- prefetch after a restart ---

    def prefetch_plan(self, limit: int | None = None) -> list[str]:
        """Sessions only on disk that memory has room for (`limit`: bytes at most), latest first (prefetch.py)."""
        return self._prefetch.plan(self.index.keys_by_use(), limit)

    def prefetch(self, limit: int | None = None, *, in_step: bool = False) -> int:
        """Page the sessions only disk holds back into memory after a start, latest first, while they fit
        (`limit`: bytes at most): planned at the first call; how many are left to read. Queued to the reader, a
        read at a time at the lowest priority, each kept as it arrives unless its session was checked out since;
        `in_step` (ranks in lockstep, which must read alike): nothing is queued, and each later call reads the
        next one here, waiting for it (prefetch.py)."""
        return self._prefetch.after_start(self.index.keys_by_use, limit, in_step=in_step, busy=self.restoring)

    def page_in(self, key: str) -> str | None:
        """Page a session's disk chain into memory if it fits, waiting here (tools, tests); its tier."""
        return self._prefetch.page_in(key)

    # --- windows: blocks captured during a prefill (windows.py) ---

    def windows(self, key: str, cache: Cache) -> tuple[int, Callable[..., None]] | None:
        """A prefill of session `key` into `cache`: every how many ids it stops (and before its prompt's last id), and
        what it calls there to keep the state there (`capture`); None: a cache that can be cut needs none."""
        return None if cuttable(cache) else (self.block, partial(self.capture, key))

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

    def statistics(self, *, where: bool = False, written: Callable[[], object] | None = None) -> dict[str, Any]:
        """The tiers' figures; `where`: with each session's tier (`locations`) and the other models disk keeps its
        cache for (`kept_for`); `written`: called on the I/O worker once disk holds what was asked of it so far
        (`after_writes`: fresh figures then count what finished turns wrote)."""
        if written is not None:
            self.after_writes(written)
        self._settle()
        return ({"locations": self.locations(), "kept_for": self.kept_for()} if where else {}) | {
            "running": {"bytes": self.running_bytes(), "budget": self.pool.budgets[RESIDENT]},
            RESIDENT: self.resident.statistics(),
            WARM: self.warm.statistics(),
            "prefetched": {"sessions": (p := self._prefetch.stats)["done"], "bytes": p["bytes"],
                           RESIDENT: p[RESIDENT], WARM: p[WARM],
                           "reading": self._prefetch.reading is not None or bool(self._prefetch.queue)},
            DISK: {**self._disktier.statistics(self.budgets.disk_bytes), "block_tokens": self.block,
                   **asdict(self.disk_stats)},
            SHARED: dict(self._resume.shared),
            "checkpoints": self.points.statistics(),
        }

