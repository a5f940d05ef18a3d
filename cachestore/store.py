"""Every session's cache across the tiers: resident, warm, disk.

Runs on the engine thread (it holds live MLX caches), except the disk
writes: the engine thread only evaluates what a turn writes, and the I/O
worker (ioworker.py) runs writeback.py's half of the store, so no decode
step waits on disk (warm.py lays out the warm tier; pagein.py reads disk
back and prefetches). Each thread has its own connection to the index; every
index write after start-up runs on the worker, in the order the engine
asked for it. The policy:

- After a turn, the session's live cache is *resident*, and what the turn
  added is written *behind* it to disk: the whole blocks it completed (see
  below) and a rewritten private tail, so page-out cost grows with the new
  tokens, not the history.
- Resident over budget or idle: the least recently used cache is demoted to
  *warm*, a compact evaluated snapshot trimmed to its offset.
- Warm over budget or idle: dropped; disk already holds it (while disk
  writes are queued, the snapshot is kept aside until the worker is done).
- Disk over budget: the least recently used sessions are forgotten on disk
  (their private files, and the blocks no other session lists).
- Resume (`checkout`) restores the longest prefix of the wanted token ids
  that anything kvd holds: the session's own cache (resident, warm, disk),
  another session's resident or warm cache (a copy of the shared prefix),
  or blocks on disk that any session wrote; the caller prefills the rest.
  Finding it is one walk down the wanted ids' block keys in the block table
  (table.py), which knows every block's tiers: no scan of other sessions.

Content-addressed blocks (issue 14). A session's disk chain is its whole
blocks ``[k*B, (k+1)*B)`` (B = `Budgets.block_tokens`) followed by private
segments ``[m*B, n)``, at least one token long. A block is keyed by the hash
chain of every id up to its end (blocks.py) and stored once under
``blocks/``; any session whose ids pass through it lists it in its chain, so
a long system prompt many sessions share is written, stored and counted
against the disk budget once, and a new session resumes from it, also
after a restart. A block's reference count is the number of chains listing
it; when the last one goes (delete, eviction, a rewind), the file goes.
The index (SQLite) is the durable record; the engine thread reads it once,
at start, into the block table, which the worker's reports keep current.

Only a cache that can be cut anywhere (plain and quantized KV layers)
yields blocks: the live cache at n holds every position, so each block is a
slice of it. A sliding-window layer at n holds only the window ending at n,
not the window at an earlier block boundary, and a window restored at the
wrong position would be silently wrong; so caches with rotating or
recurrent layers keep a private chain from 0 (as before issue 14) and share
only through other sessions' resident or warm caches, at exactly their end.

A disk file that fails its checksum, fingerprint or invariants is dropped
with everything after it (a bad block: in every chain that lists it); the
sessions then prefill from there: slower, never wrong.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import mlx.core as mx

from . import pagein
from .blocks import root_key, whole_blocks
from .errors import CorruptSegment
from .index import BlockRow, DiskNews, SegmentIndex
from .ioworker import IOWorker
from .lru import DiskStats, Tier
from .packing import unpack
from .pagein import PREFETCH_ROOM, DiskRow, PageIn
from .prefix import MIN_SHARED, common_prefix_len
from .rebuild import rebuild_index
from .sharing import find_shared
from .snapshot import Snapshot, cuttable, merge, rewind, section, snapshot
from .table import BlockTable
from .warm import Cache, WarmTier, cache_nbytes
from .writeback import NOTHING, NOTHING_TO_EVICT, Evaluated, Promise, Writeback, plan, promise_of

__all__ = ["MIN_SHARED", "NOTHING_TO_EVICT", "PREFETCH_ROOM", "Budgets", "Checkout", "SessionCaches",
           "cache_nbytes"]

log = logging.getLogger("kvd.cache")


@dataclass(frozen=True)
class Budgets:
    """Hard byte limits and idle times; the defaults live in the daemon's config."""

    resident_bytes: int
    warm_bytes: int
    disk_bytes: int
    resident_idle: float
    warm_idle: float
    max_segments: int
    resident_sessions: int | None = None  # at most this many live caches, whatever their size
    warm_bits: int = 0  # 4 | 8: warm snapshots kept quantized (packing.py); 0: exact copies
    block_tokens: int = 128  # token ids per content-addressed disk block


@dataclass
class Checkout:
    cache: Cache | None
    tokens: int  # how many leading ids of the wanted tokens `cache` holds
    restored_from: str  # "resident" | "warm" | "disk" | "shared" | "none": the wire's word for it too
    restore_ms: float
    shared_tokens: int = 0  # of `tokens`, those another session's cache or blocks supplied


class SessionCaches:
    def __init__(self, root: Path, fingerprint: str, budgets: Budgets,
                 *, clock: Callable[[], float] = time.time):
        if budgets.block_tokens < 1:
            raise ValueError("block_tokens must be at least 1")
        self.fingerprint = fingerprint
        self.budgets = budgets
        self.block = budgets.block_tokens
        self.root = root_key(fingerprint)
        self._clock = clock
        self._dir = root
        self._indexes = threading.local()  # each thread's own connection to the index
        self._indexes.index = SegmentIndex(root)
        if self.index.lost is not None:
            rebuild_index(self.index, self.root, self.index.lost)
        if removed := self.index.sweep():
            log.info("removed %d cache file(s) left incomplete by a crash", removed)
        self._writer = Writeback(lambda: self.index, fingerprint=fingerprint, root=self.root,
                                 block=self.block, disk_bytes=budgets.disk_bytes,
                                 max_segments=budgets.max_segments, clock=clock)
        for key in self.index.foreign(fingerprint):
            self._writer.valid_chain(key)  # another model's or layout's files: never loaded, never kept
        self._writer.enforce_disk_budget(keep=None)
        self.table = BlockTable(self.root, self.block)
        self.table.load(*self.index.load_all())
        self.index.news()  # what start-up changed is loaded already
        self._io = IOWorker()
        self._promised: dict[str, Promise] = {}  # disk chains as they will be once queued jobs are done
        self.resident: Tier[Cache] = Tier("resident", budgets.resident_bytes, budgets.resident_sessions)
        self.warm = WarmTier(self.table, budgets.warm_bytes, bits=budgets.warm_bits,
                             busy=lambda: not self._io.idle())
        self._disk = PageIn(self.table, fingerprint=fingerprint, later=self._later, dropped=self._dropped,
                            clock=clock)
        self.shared_stats = {"restores": 0, "tokens": 0}
        self.prefetch_stats = {"planned": 0, "done": 0, "resident": 0, "warm": 0, "bytes": 0}

    @property
    def index(self) -> SegmentIndex:
        """This thread's connection to the index (a SQLite connection stays on its thread)."""
        index: SegmentIndex | None = getattr(self._indexes, "index", None)
        if index is None:
            index = self._indexes.index = SegmentIndex(self._dir)
        return index

    @property
    def disk_stats(self) -> DiskStats:
        """The disk tier's figures: the engine thread's (reads) and the worker's (writes), merged."""
        mine, theirs = self._disk.stats, self._writer.stats
        return DiskStats(**{f.name: getattr(mine, f.name) + getattr(theirs, f.name) for f in fields(DiskStats)})

    def close(self) -> None:
        """Finish every queued disk job, then close the index."""
        self._io.submit(self._close_index)
        self._io.close()
        self._close_index()

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
        """Call `fn` on the I/O worker once every disk job queued so far is done; it must not block."""
        self._io.submit(fn)

    def _settle(self) -> None:
        """Take in the worker's reports (engine thread): the index rows its jobs changed, and which
        sessions have nothing queued any more."""
        idle = self._io.idle()  # before draining: every report of a finished job is queued by then
        done, results = self._io.settle()
        for news in results:
            if isinstance(news, DiskNews):
                self.table.apply(news)
        for key in done:
            self._promised.pop(key, None)
        if idle:
            self.warm.release_held()  # disk holds them now (or never will: they were not writable)

    def _later(self, job: Callable[[SegmentIndex], object], key: str | None = None) -> None:
        """An index write asked for on the engine thread: run on the worker, after the jobs before it,
        reporting the rows it changed."""
        if self._io.on_worker():
            job(self.index)
            return

        def run() -> DiskNews:
            try:
                job(self.index)
            except Exception:
                log.exception("a cache disk job failed")
            return self.index.news()

        self._io.submit(run, key=key)

    # --- resume ---

    def checkout(self, key: str, wanted: Sequence[int]) -> Checkout:
        """Take the session's cache out of the tiers, holding the longest usable prefix anything holds.

        At least one wanted token is always left to feed. Candidates, best
        first on a tie: the session's own resident cache (rewound in place),
        its own warm snapshot, another session's resident cache or warm
        snapshots (a copy of the shared prefix; that session keeps its own),
        then disk (the session's chain, and blocks any session wrote).
        """
        t0 = time.perf_counter()
        limit = len(wanted) - 1

        def ms() -> float:
            return (time.perf_counter() - t0) * 1000

        self._settle()
        keys = self.table.keys_for(key, wanted)
        own: Checkout | None = None
        if (cache := self.resident.take(key)) is not None:
            toks = self.table.session(key).tokens
            n = min(common_prefix_len(toks, wanted), limit)
            if n > 0 and rewind(cache, len(toks) - n):
                own = Checkout(cache, n, "resident", 0.0)
            else:
                log.debug("resident cache of %s not reusable (shares %d tokens)", key, n)
            self.warm.discard(key)
            self.table.detach(key)  # the live cache is the engine's now
        own_warm_n = self.warm.usable(key, wanted, limit) if own is None else 0
        best_n = max(own.tokens if own else 0, own_warm_n)
        walk = self.table.walk(keys)
        other = find_shared(self.table, self.resident, self.warm, key, wanted, limit, walk, best_n)
        disk = self._disk.plan(key, wanted, limit, walk)
        if disk.end > max(best_n, other[0] if other else 0):
            live = self._disk.restore(key, disk, room=len(wanted) - disk.end)
            if live is not None:
                cache, end, own_tokens = live
                now = self._clock()
                self._later(lambda index: index.touch(key, now), key)
                shared = max(end - own_tokens, 0)
                return self._counted(Checkout(cache, end, "shared" if shared else "disk", ms(), shared))
        if other is not None:
            n, copy = other
            if (copied := copy()) is not None:
                return self._counted(Checkout(copied, n, "shared", ms(), n))
        if own is not None:
            own.restore_ms = ms()
            return own
        if own_warm_n > 0:
            copied = self.warm.copy(key, own_warm_n)
            self.warm.take(key)
            self.table.detach(key)
            if copied is not None:
                return Checkout(copied, own_warm_n, "warm", ms())
        self._disk.stats.misses += 1
        return Checkout(None, 0, "none", ms())

    def _counted(self, out: Checkout) -> Checkout:
        if out.shared_tokens:
            self.shared_stats["restores"] += 1
            self.shared_stats["tokens"] += out.shared_tokens
        return out

    def _dropped(self, key: str, row: DiskRow, e: CorruptSegment) -> None:
        """A file failed verification: unlist it and what follows it (a block: in every chain)."""
        self._disk.stats.dropped_corrupt += 1
        if isinstance(row, BlockRow):
            block = row.block
            log.warning("dropping cache block %s: %s; every session that lists it will prefill "
                        "from token %d", row.path, e, row.start)
            self._later(lambda index: index.drop_block(block), None)
            self._promised.clear()  # any chain may list it: plan from what the worker reports
        else:
            log.warning("dropping cache file %s: %s; the session will prefill instead", row.path, e)
            start = row.start
            self._promised[key] = _cut(self._promise(key), start)
            self._later(lambda index: index.drop_from(key, start), key)

    def _promise(self, key: str) -> Promise:
        held = self._promised.get(key)
        if held is None:
            blocks, tail = self.table.disk_rows(key)
            held = promise_of(blocks, tail, block=self.block, fingerprint=self.fingerprint)
        return held

    # --- prefetch after a restart ---

    def prefetch_plan(self) -> list[str]:
        """Sessions only on disk that memory has room for, most recently used first (pagein.py says why)."""
        plan = pagein.prefetch_plan(self._disk, self.index.keys_by_use(), self.resident, self.warm)
        self.prefetch_stats["planned"] += len(plan)
        return plan

    def prefetch(self, key: str) -> str | None:
        """Page one session's whole disk chain into memory if it fits; the tier it went to (pagein.py)."""
        if key in self.resident or key in self.warm:
            return None
        got = pagein.prefetch(self._disk, key, resident_fits=self.resident.fits)
        if got is None:
            return None
        held, tokens = got
        now = self._clock()
        if isinstance(held, Snapshot):
            self._attach(key, held, tokens)
            if not self.warm.put_snapshot(key, held, now, cold=True):
                self.table.detach(key)
                return None
            tier, nbytes = "warm", held.nbytes
        else:
            nbytes = cache_nbytes(held)
            if not self.resident.offer(key, held, nbytes, now):
                return None
            self._attach(key, held, tokens)
            self.table.set_live(key, True)
            tier = "resident"
        self.prefetch_stats["done"] += 1
        self.prefetch_stats[tier] += 1
        self.prefetch_stats["bytes"] += nbytes
        return tier

    def _attach(self, key: str, held: Cache | Snapshot, tokens: list[int]) -> list[str]:
        """Make the session's memory chain the whole blocks of `tokens` (none for a cache that cannot be cut)."""
        keys = self.table.keys_for(key, tokens)[:whole_blocks(len(tokens), self.block)] if cuttable(held) else []
        self.table.attach(key, tokens, keys)
        return keys

    # --- after a turn ---

    def checkin(self, key: str, cache: Cache, tokens: Sequence[int]) -> None:
        """Keep a session's live cache resident and queue the writing of its new tokens behind it."""
        tokens = list(tokens)
        self._settle()
        self.warm.discard(key)
        keys = self._attach(key, cache, tokens)
        self._write_behind(key, cache, tokens, keys)
        self.table.set_live(key, True)
        now = self._clock()
        for cold, c in self.resident.put(key, cache, cache_nbytes(cache), now):
            self.table.set_live(cold, False)
            self.warm.demote(cold, c, now)

    def _write_behind(self, key: str, cache: Cache | Snapshot, tokens: list[int], keys: list[str], *,
                      evict: bool = True) -> None:
        """Evaluate what disk will lack of `tokens` and queue its writing (engine thread).

        `cache` is a live cache, or a snapshot of all of `tokens` (page_out_all);
        `keys` its whole blocks' keys. The plan is taken on the chain as it will
        be once the jobs queued before are done; the worker checks it against
        the index as it is.
        """
        n = len(tokens)
        can_cut = cuttable(cache)
        rewrite = isinstance(cache, Snapshot) and not can_cut  # a window: written whole or not at all
        blocks_from, private_from, after = plan(self._promise(key), tokens, cuttable=can_cut, block=self.block,
                                                max_segments=self.budgets.max_segments, rewrite=rewrite)
        pieces: Evaluated = {}
        starts = [s for s in (blocks_from, private_from) if s is not None]
        if starts:
            lo = min(starts)
            whole = snapshot(cache, lo) if isinstance(cache, list) else \
                (cache if lo == cache.start else section(cache, lo, n))
            spans = [(k, k + self.block) for k in range(blocks_from, after.base, self.block)] \
                if blocks_from is not None else []
            if private_from is not None:
                spans.append((private_from, n))
            pieces = {(a, b): whole if (a, b) == (whole.start, whole.end) else section(whole, a, b)
                      for a, b in spans}
            mx.eval([x for p in pieces.values() for x in p.arrays()])  # the worker only writes bytes
        self._promised[key] = after
        self._later(lambda index: self._writer.persist(key, pieces, tokens, keys, cuttable=can_cut, evict=evict,
                                                       rewrite=rewrite), key)

    # --- housekeeping ---

    def maintain(self) -> None:
        """Idle demotions: resident -> warm after resident_idle, warm dropped after warm_idle."""
        self._settle()
        now = self._clock()
        for key, cache in self.resident.idle(now, self.budgets.resident_idle):
            self.table.set_live(key, False)
            self.warm.demote(key, cache, now)
        self.warm.idle(now, self.budgets.warm_idle)

    def page_out_all(self) -> None:
        """Make sure disk holds every session kept in memory (on shutdown).

        No evictions for this: it must not push out caches used more recently.
        The writes are queued like a turn's, then waited for.
        """
        self.flush()
        for key in self.resident:
            cache = self.resident.peek(key)
            if cache is not None:
                s = self.table.session(key)
                try:
                    self._write_behind(key, cache, s.tokens, s.keys, evict=False)
                except Exception as e:
                    log.warning("could not page out %s: %s", key, e)
        for key in self.warm.held_or_warm():
            got = self.warm.parts(key)
            if got is None or not got[0] or got[0][0].start != 0:
                continue
            parts, toks = got
            try:
                # A packed snapshot is saved at its rounded precision: the best there is.
                snap = merge(*[unpack(p) for p in parts])
                toks = toks[:snap.end]
                keys = self.table.keys_for(key, toks)[:whole_blocks(len(toks), self.block)] \
                    if cuttable(snap) else []
                self._write_behind(key, snap, toks, keys, evict=False)
            except Exception as e:
                log.warning("could not page out %s: %s", key, e)
        self.flush()

    def forget(self, key: str) -> None:
        """A deleted session: its caches go, and every block no other session lists."""
        if self.resident.discard(key) is not None:
            self.table.set_live(key, False)
        self.warm.discard(key)
        self.table.detach(key)
        self._later(lambda index: index.drop_from(key, 0), key)  # after its queued writes, which it undoes
        self._promised[key] = NOTHING

    def locations(self) -> dict[str, str]:
        """Where each session's cache lives now: its fastest tier."""
        self._settle()
        where = {key: "disk" for key, s in self.table.sessions.items() if s.disk_keys or s.disk_tail}
        where.update({key: "warm" for key in self.warm.held_or_warm()})
        where.update({key: "resident" for key in self.resident})
        return where

    def statistics(self) -> dict[str, Any]:
        self._settle()
        t = self.table
        return {
            "resident": self.resident.statistics(),
            "warm": self.warm.statistics(),
            "prefetched": {"sessions": self.prefetch_stats["done"], "bytes": self.prefetch_stats["bytes"],
                           "resident": self.prefetch_stats["resident"], "warm": self.prefetch_stats["warm"]},
            "disk": {"sessions": t.disk_sessions, "segments": t.disk_segments, "bytes": t.disk_bytes,
                     "budget": self.budgets.disk_bytes, "block_tokens": self.block,
                     **t.sharing(), **asdict(self.disk_stats)},
            "shared": dict(self.shared_stats),
        }


def _cut(held: Promise, start: int) -> Promise:
    """A promised chain once its private segments from `start` on are dropped."""
    ends = tuple(e for e in held.ends if e <= start)
    end = ends[-1] if ends else held.base
    return Promise(held.tokens[:end], held.base, ends)
