"""Every session's cache across the tiers: resident, warm, disk.

Runs on the engine thread only (it holds live MLX caches). The policy:

- After a turn, the session's live cache is *resident*, and the tokens the
  turn added are written *behind* it to disk as one new segment
  `[a, b)`, so page-out cost grows with the new tokens, not the history.
  The engine thread only evaluates that segment's snapshot; the I/O worker
  (ioworker.py) writes the file and indexes it, so no decode step waits on
  disk. Each thread has its own connection to the index; every index write
  after start-up runs on the worker, in the order the engine asked for it.
- Resident over budget or idle: the least recently used cache is demoted to
  *warm*, a compact evaluated snapshot trimmed to its offset.
- Warm over budget or idle: dropped once disk holds it (a snapshot whose
  write is still queued is kept aside until the worker has written it).
- Disk over budget: the least recently used sessions' segments are deleted.
- Resume (`checkout`) restores the longest prefix of the wanted token ids it
  finds, resident first, then warm, then disk; the caller prefills the rest.

A disk file that fails its checksum, fingerprint or invariants is dropped with
everything after it; the session then prefills from its transcript: slower,
never wrong.
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from .errors import CannotSplit, CorruptSegment, UnsupportedFormat
from .index import SEGMENT_SUFFIX, SegmentIndex, SegmentRow, check_key
from .ioworker import Change, IOWorker
from .packing import pack, unpack
from .prefix import common_prefix_len
from .segments import read_header, read_segment, write_segment
from .snapshot import Snapshot, merge, restore, rewind, snapshot, trimmable, truncate
from .tiers import Tier

log = logging.getLogger("kvd.cache")

Cache = list[Any]

NOTHING_TO_EVICT = "no other session's cache is left to remove"


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


@dataclass
class Checkout:
    cache: Cache | None
    tokens: int  # how many leading ids of the wanted tokens `cache` holds
    source: str  # "resident" | "warm" | "disk" | "none"
    restore_ms: float


def cache_nbytes(cache: Cache) -> int:
    return sum(int(c.nbytes) for c in cache)


class SessionCaches:
    def __init__(self, root: Path, fingerprint: str, budgets: Budgets,
                 *, clock: Callable[[], float] = time.time):
        self.fingerprint = fingerprint
        self.budgets = budgets
        self._clock = clock
        self._root = root
        self._indexes = threading.local()  # each thread's own connection to the index
        self._indexes.index = SegmentIndex(root)
        if self.index.lost is not None:
            self._rebuild_index(self.index.lost)
        if removed := self.index.sweep():
            log.info("removed %d cache file(s) left incomplete by a crash", removed)
        self.resident: Tier[tuple[Cache, list[int]]] = Tier("resident", budgets.resident_bytes,
                                                                  budgets.resident_sessions)
        self.warm: Tier[tuple[Snapshot, list[int]]] = Tier("warm", budgets.warm_bytes)
        self.disk_stats = {"hits": 0, "misses": 0, "page_ins": 0, "page_outs": 0,
                           "bytes_written": 0, "bytes_read": 0, "dropped_corrupt": 0,
                           "evicted_full": 0}
        self.prefetch_stats = {"planned": 0, "done": 0, "bytes": 0}
        self._enforce_disk_budget(keep=None)
        self._io: IOWorker[tuple[Snapshot, list[int]]] = IOWorker()

    @property
    def index(self) -> SegmentIndex:
        """This thread's connection to the index (a SQLite connection stays on its thread)."""
        index: SegmentIndex | None = getattr(self._indexes, "index", None)
        if index is None:
            index = self._indexes.index = SegmentIndex(self._root)
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
        self._io.settle()

    def after_writes(self, fn: Callable[[], None]) -> None:
        """Call `fn` on the I/O worker once every disk job queued so far is done; it must not block."""
        self._io.submit(fn)

    def _drop_later(self, key: str, start: int) -> None:
        """Unlist and delete `key`'s segments from `start` on, in order with the writes queued before."""
        if self._io.on_worker():
            self.index.drop_from(key, start)
        else:
            self._io.submit(lambda: self.index.drop_from(key, start), key=key, change=Change(start, None))

    def _rebuild_index(self, how: str) -> None:
        """List again every segment file whose own header verifies; remove the rest.

        Each file names its session (its directory) and carries its range,
        fingerprint and token ids; what verifies is exactly what the lost
        index would have listed, so no valid cache is thrown away.
        """
        files = sorted(self.index.files.glob(f"*/*{SEGMENT_SUFFIX}"))
        if not files:
            if how not in ("missing", "empty"):
                log.warning("the cache index %s was %s; there were no cache files to rebuild it from",
                            self.index.path, how)
            return
        kept: set[str] = set()
        count = 0
        dropped: list[str] = []
        for path in files:
            key = path.parent.name
            try:
                check_key(key)
                h = read_header(path)
                if path != self.index.path_for(key, h.start, h.end):
                    raise UnsupportedFormat(f"its name does not match its range [{h.start}, {h.end})", path=path)
            except (CorruptSegment, ValueError) as e:
                dropped.append(str(e))
                path.unlink(missing_ok=True)
                continue
            self.index.add(key, h.start, h.end, path, h.nbytes, h.checksum, h.fingerprint, h.tokens,
                           path.stat().st_mtime)
            kept.add(key)
            count += 1
        log.warning("the cache index %s was %s; rebuilt it from the cache files' own headers: "
                    "%d file(s) of %d session(s) kept%s", self.index.path, how, count, len(kept),
                    f", {len(dropped)} that did not verify removed (first: {dropped[0]})" if dropped else "")

    # --- resume ---

    def checkout(self, key: str, wanted: Sequence[int]) -> Checkout:
        """Take the session's cache out of the tiers, holding the longest usable prefix.

        At least one wanted token is always left to feed.
        """
        t0 = time.perf_counter()
        limit = len(wanted) - 1
        ms = lambda: (time.perf_counter() - t0) * 1000  # noqa: E731
        self._io.settle()

        if (res := self.resident.take(key)) is not None:
            cache, toks = res
            n = min(common_prefix_len(toks, wanted), limit)
            if n > 0 and rewind(cache, len(toks) - n):
                self.warm.discard(key)
                return Checkout(cache, n, "resident", ms())
            log.debug("resident cache of %s not reusable (shares %d tokens)", key, n)
        w = self.warm.take(key) or self._io.release(key)
        if w is not None and (got := _from_warm(key, *w, wanted, limit)):
            return Checkout(*got, "warm", ms())
        return self._from_disk(key, wanted, limit, ms)

    def copy_prefix(self, source: str, wanted: Sequence[int]) -> Checkout:
        """A copy of the longest usable prefix another session's cache holds; that session keeps its own.

        For a conversation that branches from a stored one (an edited
        message, a request that shares its beginning): the new session starts
        from the shared prefix while the source stays exactly as it was, in
        whatever tier it is. Arrays are shared copy-on-write (snapshot.py),
        so a copy costs at most one read of the source's state.
        """
        t0 = time.perf_counter()
        limit = len(wanted) - 1
        ms = lambda: (time.perf_counter() - t0) * 1000  # noqa: E731

        if (res := self.resident.peek(source)) is not None:
            cache, toks = res
            n = min(common_prefix_len(toks, wanted), limit)
            if n > 0:
                try:
                    return Checkout(restore(truncate(snapshot(cache, 0), n)), n, "resident", ms())
                except CannotSplit:
                    log.debug("resident cache of %s cannot be cut at %d", source, n)
        w = self.warm.peek(source) or self._io.held(source)
        if w is not None and (got := _from_warm(source, *w, wanted, limit)):
            return Checkout(*got, "warm", ms())
        return self._from_disk(source, wanted, limit, ms)

    def _from_disk(self, key: str, wanted: Sequence[int], limit: int, ms: Callable[[], float]) -> Checkout:
        paged = self._page_in(key, wanted, limit)
        if paged is not None:
            return Checkout(restore(paged), paged.end, "disk", ms())
        return Checkout(None, 0, "none", ms())

    def _page_in(self, key: str, wanted: Sequence[int], limit: int) -> Snapshot | None:
        """The longest prefix of `wanted` the disk chain holds, merged into one snapshot."""
        merged = self._read_chain(key, wanted, limit)
        if merged is None:
            self.disk_stats["misses"] += 1
            return None
        self.disk_stats["hits"] += 1
        self.disk_stats["page_ins"] += 1
        now = self._clock()
        self._io.submit(lambda: self.index.touch(key, now))
        return merged

    def _read_chain(self, key: str, wanted: Sequence[int], limit: int) -> Snapshot | None:
        chain = self._valid_chain(key)
        pieces: list[Snapshot] = []
        for row in chain:
            if row.start != (pieces[-1].end if pieces else 0):
                break
            shared = common_prefix_len(row.tokens, wanted[row.start:row.end])
            whole = shared == row.end - row.start and row.end <= limit
            if not whole and shared == 0:
                break
            try:
                piece = read_segment(row.path, checksum=row.checksum, fingerprint=self.fingerprint)
            except CorruptSegment as e:
                log.warning("dropping cache file %s: %s; the session will prefill instead", row.path, e)
                self.disk_stats["dropped_corrupt"] += 1
                self._drop_later(key, row.start)
                break
            self.disk_stats["bytes_read"] += row.nbytes
            if whole:
                pieces.append(piece)
                continue
            end = min(row.start + shared, limit)
            if end > row.start and trimmable(piece):
                try:
                    pieces.append(truncate(piece, end))
                except CannotSplit:
                    pass
            break
        return merge(*pieces) if pieces else None

    # --- prefetch after a restart ---

    def prefetch_plan(self) -> list[str]:
        """Sessions only on disk that the warm tier has room for, most recently used first.

        Planned once the model is ready after a start: the sessions people were
        just using are paged in before anyone asks, so the first turn after a
        restart is a warm hit. Only free room is planned; a prefetch never
        evicts anything.
        """
        room = self.warm.budget - self.warm.nbytes
        plan = []
        for key, nbytes in reversed(self.index.keys_by_use()):
            if key in self.resident or key in self.warm or not 0 < nbytes <= room:
                continue
            plan.append(key)
            room -= nbytes
        self.prefetch_stats["planned"] += len(plan)
        return plan

    def prefetch(self, key: str) -> bool:
        """Page one session's whole disk chain into the warm tier, if it still fits there.

        Not a use: the session keeps its place in the disk LRU, and the
        snapshot goes in at the warm tier's cold end (behind what people used
        since), so prefetching never changes what is evicted first.
        """
        if key in self.resident or key in self.warm:
            return False
        chain = self._valid_chain(key)
        tokens = [t for row in chain for t in row.tokens]
        snap = self._read_chain(key, tokens, len(tokens)) if chain else None
        if snap is None or snap.start != 0:
            return False
        toks = tokens[:snap.end]
        if self.budgets.warm_bits:
            snap = pack(snap, self.budgets.warm_bits)
        if not self.warm.offer(key, (snap, toks), snap.nbytes, self._clock()):
            return False
        self.prefetch_stats["done"] += 1
        self.prefetch_stats["bytes"] += snap.nbytes
        return True

    def _valid_chain(self, key: str) -> list[SegmentRow]:
        chain = self.index.chain(key)
        for row in chain:
            if row.fingerprint != self.fingerprint:
                # Another model or layout wrote these: never loaded, never kept.
                log.info("dropping cache of %s made by another model or layout", key)
                self._drop_later(key, row.start)
                return [r for r in chain if r.start < row.start]
        return chain

    # --- after a turn ---

    def checkin(self, key: str, cache: Cache, tokens: Sequence[int]) -> None:
        """Keep a session's live cache resident and write its new tokens behind it."""
        tokens = list(tokens)
        self._io.settle()
        self._write_behind(key, cache, tokens)
        self.warm.discard(key)
        now = self._clock()
        for cold, (c, toks) in self.resident.put(key, (cache, tokens), cache_nbytes(cache), now):
            self._demote(cold, c, toks, now)

    def _demote(self, key: str, cache: Cache, tokens: list[int], now: float) -> None:
        snap = snapshot(cache, 0)
        if self.budgets.warm_bits:
            snap = pack(snap, self.budgets.warm_bits)
        self._leave_warm(self.warm.put(key, (snap, tokens), snap.nbytes, now))

    def _leave_warm(self, dropped: list[tuple[str, tuple[Snapshot, list[int]]]]) -> None:
        for cold, entry in dropped:
            if self._io.queued(cold) and entry[0].nbytes <= self.budgets.disk_bytes:
                self._io.hold(cold, entry)  # until the worker has written it (a disk budget too small never will)
                log.debug("warm snapshot of %s kept aside until disk holds it", cold)
            else:
                log.debug("warm snapshot of %s dropped; disk holds it", cold)

    def _covered(self, key: str, tokens: Sequence[int]) -> tuple[list[SegmentRow], int]:
        """The chain's leading segments that agree with `tokens`, and where they end.

        On the engine thread, the chain as it will be once the disk jobs queued
        so far are done; on the worker, as it is.
        """
        rows = self._valid_chain(key)
        if not self._io.on_worker():
            rows = self._io.planned(key, rows)
        kept: list[SegmentRow] = []
        pos = 0
        for row in rows:
            if (row.start != pos or row.end > len(tokens)
                    or tuple(tokens[row.start:row.end]) != row.tokens):
                break
            kept.append(row)
            pos = row.end
        return kept, pos

    def _write_behind(self, key: str, cache: Cache, tokens: list[int], *, evict: bool = True) -> None:
        """Evaluate the snapshot of what disk lacks of `tokens` and queue its write (engine thread)."""
        kept, pos = self._covered(key, tokens)
        now = self._clock()
        if pos == len(tokens):
            self._io.submit(lambda: self._persist(key, None, tokens, now, evict=evict))
            return
        if len(kept) + 1 > self.budgets.max_segments:
            pos = 0  # compaction: one segment for the whole history, from the live cache
        self._queue_write(key, snapshot(cache, pos), tokens, now, evict=evict)

    def _queue_write(self, key: str, snap: Snapshot, tokens: list[int], now: float, *, evict: bool) -> None:
        mx.eval(snap.arrays())  # evaluated here, on the engine thread: the worker only writes bytes
        self._io.submit(lambda: self._persist(key, snap, tokens, now, evict=evict),
                        key=key, change=Change(snap.start, snap.end, tuple(tokens[snap.start:snap.end])))

    def _persist(self, key: str, snap: Snapshot | None, tokens: list[int], now: float, *, evict: bool) -> None:
        """Make disk hold `tokens` of `key`, given an evaluated snapshot of the part it lacks (I/O worker).

        None: disk holds them all already. A snapshot that starts past where the
        disk's chain agrees (an earlier write of this session failed) is not
        written: nothing could reach it; the next turn writes from the gap.
        """
        kept, pos = self._covered(key, tokens)
        if len(self.index.chain(key)) > len(kept):
            self.index.drop_from(key, pos)  # a rewind (regenerate, edit) left these behind
        if snap is None:
            self.index.touch(key, now)
            return
        if snap.start > pos:
            log.debug("not writing [%d, %d) of %s: disk holds only [0, %d)", snap.start, snap.end, key, pos)
            return
        if snap.start < pos:
            self.index.drop_from(key, snap.start)  # compaction; may remove the (then empty) directory
        try:
            self._write(key, snap, tokens, now, evict=evict)
        except OSError as e:
            if not evict:  # paging everything out at shutdown
                log.warning("could not page out %s: %s", key, e)
            elif e.errno in (errno.ENOSPC, errno.EDQUOT):
                log.warning("the disk holding the KV caches is full (%s); the cache of %s stays in "
                            "memory only (after a restart it is rebuilt from the transcript)",
                            e.strerror, key)
            else:
                log.warning("could not write the cache of %s to disk: %s", key, e)
            return
        self._enforce_disk_budget(keep=key)

    def _write(self, key: str, snap: Snapshot, tokens: Sequence[int], now: float, *, evict: bool = True) -> None:
        path = self.index.path_for(key, snap.start, snap.end)
        evicted: set[str] = set()
        while True:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                seg = write_segment(path, snap, fingerprint=self.fingerprint, tokens=tokens[snap.start:snap.end])
                break
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                if not evict or not self._evict_for(key, evicted):
                    raise OSError(e.errno, NOTHING_TO_EVICT if evict else e.strerror) from None
        _maybe_crash("after-write")
        while True:
            try:
                self.index.add(key, snap.start, snap.end, seg.path, seg.nbytes, seg.checksum,
                               self.fingerprint, tokens[snap.start:snap.end], now)
                break
            except sqlite3.OperationalError as e:  # the index shares the full disk
                if getattr(e, "sqlite_errorcode", None) != sqlite3.SQLITE_FULL:
                    seg.path.unlink(missing_ok=True)
                    raise
                if not evict or not self._evict_for(key, evicted):
                    seg.path.unlink(missing_ok=True)
                    raise OSError(errno.ENOSPC, NOTHING_TO_EVICT if evict else str(e)) from None
        self.disk_stats["page_outs"] += 1
        self.disk_stats["bytes_written"] += seg.nbytes

    def _evict_for(self, key: str, evicted: set[str]) -> bool:
        """The cache's filesystem is full: remove the least recently used other session's files.

        The same choice the byte budget makes, forced by the disk instead of
        the config. False when no other session has files left to remove.
        """
        for victim, nbytes in self.index.keys_by_use():
            if victim != key and nbytes > 0 and victim not in evicted:
                evicted.add(victim)
                self.index.evict(victim)
                self.disk_stats["evicted_full"] += 1
                log.warning("the disk holding the KV caches is full: removed the cache files of "
                            "session %s (%d bytes, least recently used) to make room for %s",
                            victim, nbytes, key)
                return True
        return False

    def _enforce_disk_budget(self, keep: str | None) -> None:
        total = self.index.total_bytes()
        if total <= self.budgets.disk_bytes:
            return
        for key, nbytes in self.index.keys_by_use():
            if total <= self.budgets.disk_bytes:
                break
            if key == keep:
                continue
            total -= self.index.drop_from(key, 0)
        if total > self.budgets.disk_bytes and keep is not None:
            log.warning("the cache of %s alone exceeds the disk budget; not keeping it on disk", keep)
            self.index.drop_from(keep, 0)

    # --- housekeeping ---

    def maintain(self) -> None:
        """Idle demotions: resident -> warm after resident_idle, warm dropped after warm_idle."""
        self._io.settle()
        now = self._clock()
        for key, (cache, toks) in self.resident.idle(now, self.budgets.resident_idle):
            self._demote(key, cache, toks, now)
        self._leave_warm(self.warm.idle(now, self.budgets.warm_idle))

    def page_out_all(self) -> None:
        """Make sure disk holds every session kept in memory (on shutdown): queue their writes, wait for them."""
        self._io.settle()
        for key in self.resident:
            entry = self.resident.peek(key)
            if entry is not None:
                try:
                    # No evictions for this: it must not push out caches used more recently.
                    self._write_behind(key, entry[0], entry[1], evict=False)
                except Exception as e:
                    log.warning("could not page out %s: %s", key, e)
        for key in self.warm:
            w = self.warm.peek(key)
            if w is None:
                continue
            snap, toks = w
            _, pos = self._covered(key, toks)
            if pos < snap.end:
                # A packed snapshot is saved at its rounded precision: the best there is.
                self._queue_write(key, unpack(snap), toks, self._clock(), evict=False)
        self.flush()

    def forget(self, key: str) -> None:
        self.resident.discard(key)
        self.warm.discard(key)
        self._io.release(key)
        self._drop_later(key, 0)  # after this session's queued writes, which it undoes

    def locations(self) -> dict[str, str]:
        """Where each session's cache lives now: its fastest tier."""
        self._io.settle()
        where = {key: "disk" for key in self.index.keys()}
        where.update({key: "warm" for key in self._io.held_keys()})
        where.update({key: "warm" for key in self.warm})
        where.update({key: "resident" for key in self.resident})
        return where

    def statistics(self) -> dict[str, Any]:
        self._io.settle()
        sessions, segments = self.index.count()
        return {
            "resident": self.resident.statistics(),
            "warm": {**self.warm.statistics(), "prefetched": self.prefetch_stats["done"],
                     "prefetched_bytes": self.prefetch_stats["bytes"]},
            "disk": {"sessions": sessions, "segments": segments, "bytes": self.index.total_bytes(),
                     "budget": self.budgets.disk_bytes, **self.disk_stats},
        }


def _from_warm(key: str, snap: Snapshot, toks: list[int], wanted: Sequence[int],
               limit: int) -> tuple[Cache, int] | None:
    """Live caches restored from a warm snapshot, holding its longest usable prefix of `wanted`."""
    n = min(common_prefix_len(toks, wanted), limit)
    if n > 0:
        try:
            return restore(truncate(unpack(snap), n)), n
        except CannotSplit:
            log.debug("warm snapshot of %s cannot be cut at %d", key, n)
    return None


def _maybe_crash(point: str) -> None:
    """Fault injection for the crash tests: die like kill -9 at a named point."""
    if os.environ.get("KVD_TEST_CRASH_AT") == point:
        os.kill(os.getpid(), 9)
