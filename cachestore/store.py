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

Content-addressed blocks (issue 14). A session's disk chain is its whole
blocks ``[k*B, (k+1)*B)`` (B = `Budgets.block_tokens`) followed by private
segments ``[m*B, n)``, at least one token long. A block is keyed by the hash
chain of every id up to its end (blocks.py) and stored once under
``blocks/``; any session whose ids pass through it lists it in its chain, so
a long system prompt many sessions share is written, stored and counted
against the disk budget once, and a new session resumes from it, also
after a restart. A block's reference count is the number of chains listing
it; when the last one goes (delete, eviction, a rewind), the file goes.

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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from . import pagein
from .blocks import root_key
from .index import SegmentIndex
from .ioworker import IOWorker
from .lru import DiskStats, Tier
from .packing import unpack
from .pagein import PREFETCH_ROOM, PageIn
from .prefix import MIN_SHARED, common_prefix_len
from .rebuild import rebuild_index
from .snapshot import Snapshot, merge, rewind, section, snapshot, trimmable
from .warm import BLOCK_ENTRY, Cache, WarmBlocks, cache_nbytes, copy, cuttable, usable
from .writeback import NOTHING, NOTHING_TO_EVICT, Pieces, Promise, Writeback, plan

__all__ = ["BLOCK_ENTRY", "MIN_SHARED", "NOTHING_TO_EVICT", "PREFETCH_ROOM", "Budgets", "Checkout", "SessionCaches",
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
    prefetched: bool = False  # its own resident/warm cache, paged in from disk after a start, first use


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
            log.info("removed %d cache file(s) or listing(s) left behind by a crash", removed)
        self.resident: Tier[tuple[Cache, list[int]]] = Tier("resident", budgets.resident_bytes,
                                                                  budgets.resident_sessions)
        self.warm: Tier[tuple[Snapshot, list[int]]] = Tier("warm", budgets.warm_bytes)
        self.disk_stats = DiskStats()
        self.shared_stats = {"restores": 0, "tokens": 0}
        self.prefetch_stats = {"planned": 0, "done": 0, "resident": 0, "warm": 0, "bytes": 0}
        self._prefetched_keys: set[str] = set()  # paged in after a start and not checked out since
        self._writer = Writeback(lambda: self.index, fingerprint=fingerprint, root=self.root,
                                 block=self.block, disk_bytes=budgets.disk_bytes,
                                 max_segments=budgets.max_segments, stats=self.disk_stats, clock=clock)
        self._writer.enforce_disk_budget(keep=None)
        self._io = IOWorker()
        self._promised: dict[str, Promise] = {}  # disk chains as they will be once queued jobs are done
        self._warm = WarmBlocks(self.warm, self._io, block=self.block, root=self.root, bits=budgets.warm_bits)
        self._disk = PageIn(lambda: self.index, fingerprint=fingerprint, root=self.root, block=self.block,
                            writer=self._writer, promised=self._promised, later=self._later,
                            stats=self.disk_stats, clock=clock)

    @property
    def index(self) -> SegmentIndex:
        """This thread's connection to the index (a SQLite connection stays on its thread)."""
        index: SegmentIndex | None = getattr(self._indexes, "index", None)
        if index is None:
            index = self._indexes.index = SegmentIndex(self._dir)
        return index

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
        """Take in the worker's finished jobs (engine thread): what they wrote is in the index now."""
        for key in self._io.settle():
            self._promised.pop(key, None)
        if self._warm.held and self._io.idle():
            self._warm.held.clear()  # disk holds them now (or never will: they were not writable)

    def _later(self, job: Callable[[], object], key: str | None = None) -> None:
        """An index write asked for on the engine thread: run on the worker, after the jobs before it."""
        if self._io.on_worker():
            job()
        else:
            self._io.submit(job, key=key)

    # --- resume ---

    def checkout(self, key: str, wanted: Sequence[int]) -> Checkout:
        """Take the session's cache out of the tiers, holding the longest usable prefix anything holds.

        At least one wanted token is always left to feed. Candidates, best
        first on a tie: the session's own resident cache (rewound in place),
        its own warm snapshot, another session's resident cache or warm
        snapshot (a copy of the shared prefix; that session keeps its own),
        then disk (the session's chain, and blocks any session wrote).
        """
        t0 = time.perf_counter()
        limit = len(wanted) - 1
        def ms() -> float:
            return (time.perf_counter() - t0) * 1000

        self._settle()
        prefetched = key in self._prefetched_keys
        self._prefetched_keys.discard(key)

        own: Checkout | None = None
        if (res := self.resident.take(key)) is not None:
            cache, toks = res
            n = min(common_prefix_len(toks, wanted), limit)
            if n > 0 and rewind(cache, len(toks) - n):
                self.warm.discard(key)
                own = Checkout(cache, n, "resident", 0.0, prefetched=prefetched)
            else:
                log.debug("resident cache of %s not reusable (shares %d tokens)", key, n)
        own_warm = self._warm.peek(key) if own is None else None
        own_warm_n = self._warm.usable(own_warm, wanted, limit) if own_warm is not None else 0

        best_n = max(own.tokens if own else 0, own_warm_n)
        other: tuple[str, str, int] | None = None  # (tier, session, tokens)
        for other_key in self.resident:
            res = self.resident.peek(other_key)
            if other_key != key and res is not None:
                n = usable(res, wanted, limit)
                if n > best_n and n >= MIN_SHARED:
                    best_n, other = n, ("resident", other_key, n)
        for other_key in self.warm:
            w = self.warm.peek(other_key)
            if other_key != key and not other_key.startswith(BLOCK_ENTRY) and w is not None:
                n = self._warm.usable(w, wanted, limit)
                if n > best_n and n >= MIN_SHARED:
                    best_n, other = n, ("warm", other_key, n)
        plan = self._disk.plan(key, wanted, limit)
        if plan.end > best_n:
            live = self._disk.restore(key, plan, room=len(wanted) - plan.end)
            if live is not None:
                cache, end, own_tokens = live
                now = self._clock()
                self._later(lambda: self.index.touch(key, now))
                shared = max(end - own_tokens, 0)
                return self._counted(Checkout(cache, end, "shared" if shared else "disk", ms(), shared))
        if other is not None:
            tier_name, other_key, n = other
            if tier_name == "resident":
                value = self.resident.peek(other_key)
                assert value is not None
                copied = copy(value, n)
            else:
                copied = self._warm.copy(other_key, n)
            if copied is not None:
                return self._counted(Checkout(copied, n, "shared", ms(), n))
        if own is not None:
            own.restore_ms = ms()
            return own
        if own_warm is not None and own_warm_n > 0:
            copied = self._warm.copy(key, own_warm_n)
            self.warm.take(key)
            self._warm.held.pop(key, None)
            if copied is not None:
                return Checkout(copied, own_warm_n, "warm", ms(), prefetched=prefetched)
        self.disk_stats.misses += 1
        return Checkout(None, 0, "none", ms())

    def _counted(self, out: Checkout) -> Checkout:
        if out.shared_tokens:
            self.shared_stats["restores"] += 1
            self.shared_stats["tokens"] += out.shared_tokens
        return out

    # --- prefetch after a restart ---

    def prefetch_plan(self) -> list[str]:
        """Sessions only on disk that memory has room for, most recently used first (pagein.py says why)."""
        plan = pagein.prefetch_plan(self._disk, self.resident, self.warm)
        self.prefetch_stats["planned"] += len(plan)
        return plan

    def prefetch(self, key: str) -> str | None:
        """Page one session's whole disk chain into memory if it fits; the tier it went to (pagein.py)."""
        got = pagein.prefetch(self._disk, key, self.resident, self.warm, warm_bits=self.budgets.warm_bits)
        if got is None:
            return None
        tier, nbytes = got
        self._prefetched(tier, nbytes)
        self._prefetched_keys.add(key)
        return tier

    def _prefetched(self, tier: str, nbytes: int) -> None:
        self.prefetch_stats["done"] += 1
        self.prefetch_stats[tier] += 1
        self.prefetch_stats["bytes"] += nbytes

    # --- after a turn ---

    def checkin(self, key: str, cache: Cache, tokens: Sequence[int]) -> None:
        """Keep a session's live cache resident and queue the writing of its new tokens behind it."""
        tokens = list(tokens)
        self._settle()
        self._write_behind(key, cache, tokens)
        self.warm.discard(key)
        self._warm.held.pop(key, None)
        now = self._clock()
        for cold, (c, toks) in self.resident.put(key, (cache, tokens), cache_nbytes(cache), now):
            self._warm.demote(cold, c, toks, now)

    def _write_behind(self, key: str, cache: Cache | Snapshot, tokens: list[int], *,
                      evict: bool = True) -> None:
        """Evaluate what disk will lack of `tokens` and queue its writing (engine thread).

        `cache` is a live cache, or a snapshot of all of `tokens` (page_out_all).
        The plan is taken on the chain as it will be once the jobs queued
        before are done; the worker checks it against the index as it is.
        """
        n = len(tokens)
        splittable = trimmable(cache) if isinstance(cache, Snapshot) else all(cuttable(c) for c in cache)
        held = self._promised.get(key)
        if held is None:
            held = self._writer.promise(key)
        rewrite = isinstance(cache, Snapshot) and not splittable  # a window: written whole or not at all
        blocks_from, private_from, after = plan(held, tokens, splittable=splittable, block=self.block,
                                                max_segments=self.budgets.max_segments, rewrite=rewrite)
        pieces: Pieces = {}
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
        self._io.submit(lambda: self._writer.persist(key, pieces, tokens, splittable=splittable, evict=evict,
                                                     rewrite=rewrite), key=key)

    # --- housekeeping ---

    def maintain(self) -> None:
        """Idle demotions: resident -> warm after resident_idle, warm dropped after warm_idle."""
        self._settle()
        now = self._clock()
        for key, (cache, toks) in self.resident.idle(now, self.budgets.resident_idle):
            self._warm.demote(key, cache, toks, now)
        self._warm.leave(self.warm.idle(now, self.budgets.warm_idle))

    def page_out_all(self) -> None:
        """Make sure disk holds every session kept in memory (on shutdown).

        No evictions for this: it must not push out caches used more recently.
        The writes are queued like a turn's, then waited for.
        """
        self.flush()
        for key in self.resident:
            entry = self.resident.peek(key)
            if entry is not None:
                try:
                    self._write_behind(key, entry[0], entry[1], evict=False)
                except Exception as e:
                    log.warning("could not page out %s: %s", key, e)
        for key in [*self.warm, *self._warm.held]:
            w = self._warm.peek(key)
            if w is None or key.startswith(BLOCK_ENTRY):
                continue
            parts = self._warm.parts(w)
            if not parts or parts[0].start != 0:
                continue
            try:
                # A packed snapshot is saved at its rounded precision: the best there is.
                snap = merge(*[unpack(p) for p in parts])
                self._write_behind(key, snap, w[1][:snap.end], evict=False)
            except Exception as e:
                log.warning("could not page out %s: %s", key, e)
        self.flush()

    def forget(self, key: str) -> None:
        """A deleted session: its caches go, and every block no other session lists."""
        self.resident.discard(key)
        self._warm.forget(key)
        self._later(lambda: self.index.drop_from(key, 0), key)  # after its queued writes, which it undoes
        self._promised[key] = NOTHING

    def locations(self) -> dict[str, str]:
        """Where each session's cache lives now: its fastest tier."""
        self._settle()
        where = {key: "disk" for key in self.index.keys()}
        where.update({key: "warm" for key in [*self._warm.held, *self.warm] if not key.startswith(BLOCK_ENTRY)})
        where.update({key: "resident" for key in self.resident})
        return where

    def statistics(self) -> dict[str, Any]:
        self._settle()
        sessions, segments = self.index.count()
        return {
            "resident": self.resident.statistics(),
            "warm": {**self.warm.statistics(), **self._warm.statistics()},
            "prefetched": {"sessions": self.prefetch_stats["done"], "bytes": self.prefetch_stats["bytes"],
                           "resident": self.prefetch_stats["resident"], "warm": self.prefetch_stats["warm"]},
            "disk": {"sessions": sessions, "segments": segments, "bytes": self.index.total_bytes(),
                     "budget": self.budgets.disk_bytes, "block_tokens": self.block,
                     **self.index.sharing(), **asdict(self.disk_stats)},
            "shared": dict(self.shared_stats),
        }
