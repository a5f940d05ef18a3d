"""The disk-writing half of the tiered store: what a turn writes behind it, on the I/O worker.

`plan` (pure, on the engine thread) says from which token the files a turn
needs start, given what disk will hold once the jobs queued before are done
(a `Promise`), so the engine snapshots and evaluates only that much.
`Writeback.persist` (on the I/O worker) then makes the session's disk chain
hold the turn's tokens against the index as it really is: the whole blocks
no session wrote yet, the chain listing them, the private tail appended to
or compacted; each file durable before it is indexed; the disk budget and a
full disk handled by forgetting least recently used sessions. Should disk
no longer hold what the plan assumed (another session's write evicted this
one's files, or an earlier write failed), the snapshot cannot reach back far
enough: nothing is written, and the session's next turn writes from disk's
real state.
"""

from __future__ import annotations

import errno
import logging
import sqlite3
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from common.diskfull import is_disk_full

from .blocks import whole_blocks
from .index import SegmentIndex
from .lru import DiskStats
from .prefix import common_prefix_len
from .rows import BlockRow, SegmentRow
from .segments import write_segment
from .snapshot import Snapshot, at_point, cuttable, section, snapshot

log = logging.getLogger("kvd.cache")

NOTHING_TO_EVICT = "no other session's cache is left to remove"


@dataclass(frozen=True)
class Promise:
    """A session's disk chain as it will be once its queued jobs are done."""

    tokens: tuple[int, ...]  # the ids it holds, from 0
    base: int  # of those, the ids in whole blocks
    ends: tuple[int, ...]  # where the private segments after them end


    def cut(self, start: int) -> Promise:
        """This chain once its private segments from `start` on are dropped."""
        ends = tuple(e for e in self.ends if e <= start)
        end = ends[-1] if ends else self.base
        return Promise(self.tokens[:end], self.base, ends)


NOTHING = Promise((), 0, ())


Evaluated = dict[tuple[int, int], Snapshot]  # evaluated snapshots of [start, end), for the I/O worker


def promise_of(blocks: Sequence[BlockRow], segments: Sequence[SegmentRow], *, block: int,
               fingerprint: str) -> Promise:
    """What a disk chain holds (its blocks' rows, then its private segments), as a promise."""
    toks: list[int] = []
    for row in blocks:
        if row.start != len(toks):
            break
        toks.extend(row.tokens)
    base = len(blocks) * block if len(toks) == len(blocks) * block else 0
    toks = toks[:base]
    ends: list[int] = []
    for seg in segments:
        if seg.start != len(toks) or seg.fingerprint != fingerprint:
            break
        toks.extend(seg.tokens)
        ends.append(seg.end)
    return Promise(tuple(toks), base, tuple(ends))


def plan(held: Promise, tokens: Sequence[int], *, whole: int, block: int, max_segments: int,
         rewrite: bool = False, splits: Sequence[int] = ()) -> tuple[int | None, int | None, Promise]:
    """Where a turn's new blocks start and where its private tail starts (None: none), and disk's chain after.

    `whole`: how many whole blocks the chain lists (blocks.whole_blocks for a
    cache that can be cut anywhere; those captured at block boundaries for a
    window, none for a recurrent state). The same decisions as
    `Writeback.write_behind`, taken on what disk will
    hold rather than on the index: blocks from the first one that differs,
    the private tail appended after the segments that still agree, or
    rewritten from the last block when the chain moved or reaches max_segments
    (or when `rewrite`: a snapshot of a window, which cannot be cut to follow them).
    `splits`: checkpoints of a cache that cannot be cut (checkpoints.py): the tail ends a segment at each one
    it passes, so disk holds the state there too (`spans`).
    """
    n = len(tokens)
    same_ids = common_prefix_len(held.tokens, tokens)
    listed = held.base // block
    same = min(listed, whole, same_ids // block)
    blocks_from = same * block if whole > same else None
    base = whole * block
    kept: list[int] = []
    if whole == listed and same == listed:
        for end in held.ends:
            if end > same_ids:
                break
            kept.append(end)
    pos = kept[-1] if kept else base
    if pos == n:
        return blocks_from, None, Promise(tuple(tokens), base, tuple(kept))
    pos, ends, replace = spans(pos, n, len(kept), base, splits, max_segments=max_segments, rewrite=rewrite)
    return blocks_from, pos, Promise(tuple(tokens), base, (*(kept if not replace else ()), *ends))


def spans(pos: int, n: int, kept: int, base: int, splits: Sequence[int], *, max_segments: int,
          rewrite: bool) -> tuple[int, list[int], bool]:
    """The private segments a tail from `pos` to `n` is written as, after `kept` segments that stay: where the
    first starts, where each ends (at the `splits` it passes, then `n`), and whether they replace the kept ones
    (compaction from the last block, `base`: they would pass max_segments, or a window's snapshot follows none;
    then only the last split is kept, if two files are allowed). The engine's plan and the worker's write share
    this one rule."""
    ends = [e for e in splits if pos < e < n] + [n]
    if kept + len(ends) > max_segments or (rewrite and pos != base):
        last = [e for e in splits if base < e < n][-1:] if max_segments > 1 else []
        return base, [*last, n], True
    return pos, ends, False


def evaluate(cache: list[Any] | Snapshot, tokens: Sequence[int], blocks_from: int | None,
             private_from: int | None, after: Promise, block: int,
             captured: Mapping[int, Snapshot] | None = None, points: Mapping[int, Snapshot] | None = None) -> Evaluated:
    """The snapshots `plan` said a turn writes, evaluated (engine thread: the worker only writes bytes).

    `cache` is a live cache, or a snapshot of all of `tokens` (paging out at
    shutdown). A cache that can be cut gives every span; one with a window
    gives its blocks from `captured` (block end -> the snapshot the prefill
    took there; a block missing from it must be on disk already, or the
    worker writes nothing) and its tail as a snapshot from the tail's start,
    or, where the plan splits it at checkpoints, each part up to one with that
    checkpoint's state (`points`: end -> its checkpoint).
    """
    starts = [s for s in (blocks_from, private_from) if s is not None]
    if not starts:
        return {}
    n = len(tokens)
    spans = [(k, k + block) for k in range(blocks_from, after.base, block)] if blocks_from is not None else []
    if cuttable(cache):
        lo = min(starts)
        whole = snapshot(cache, lo) if isinstance(cache, list) else \
            (cache if lo == cache.start else section(cache, lo, n))
        if private_from is not None:
            spans.append((private_from, n))
        pieces = {(a, b): whole if (a, b) == (whole.start, whole.end) else section(whole, a, b) for a, b in spans}
    else:
        pieces = {(a, b): captured[b] for a, b in spans if captured and b in captured}
        if private_from is not None:
            ends = [e for e in after.ends if e > private_from]
            for a, b in zip([private_from, *ends], ends):
                if b < n and isinstance(cache, list) and points and b in points:
                    pieces[a, b] = at_point(cache, points[b], a)
                elif b == n:
                    pieces[a, b] = snapshot(cache, a) if isinstance(cache, list) else \
                        (cache if a == cache.start else section(cache, a, n))
    mx.eval([x for p in pieces.values() for x in p.arrays()])
    return pieces


class Stale(Exception):
    """Disk no longer holds what the engine planned with: the snapshot does not reach back far enough."""


@dataclass(frozen=True)
class BlockTarget:
    """Where `_write` puts a snapshot: a content-addressed block..."""

    block: str
    parent: str
    key: str  # the session writing it (never evicted to make room for it)


@dataclass(frozen=True)
class Private:
    """... or one of a session's private segments (after its chain's last block, if any)."""

    key: str
    after: str | None


class Writeback:
    def __init__(self, index: Callable[[], SegmentIndex], *, fingerprint: str, root: str, block: int,
                 disk_bytes: int, max_segments: int, clock: Callable[[], float]):
        self._index = index  # the calling thread's own connection
        self.fingerprint = fingerprint
        self.root = root
        self.block = block
        self.disk_bytes = disk_bytes
        self.max_segments = max_segments
        self.stats = DiskStats()  # the worker's own figures (the engine's are PageIn's); merged on read
        self._clock = clock
        #: Called after each file is indexed (worker thread), so the engine sees a block as soon as
        #: it is durable and listed, not only when the whole turn is written.
        self.indexed: Callable[[], None] = lambda: None
        #: Called between files (worker thread): where a write gives way to a turn that wants its
        #: first token (IOWorker.pause).
        self.pause: Callable[[], None] = lambda: None

    @property
    def index(self) -> SegmentIndex:
        return self._index()

    def promise(self, key: str) -> Promise:
        """What disk holds of `key` now, read from the index (tests; the engine asks its block table)."""
        return promise_of(self.index.blocks_of(key), self.index.chain(key), block=self.block,
                          fingerprint=self.fingerprint)

    def persist(self, key: str, pieces: Evaluated, tokens: list[int], keys: list[str], *,
                evict: bool, rewrite: bool = False, splits: Sequence[int] = ()) -> None:
        """Make disk hold `tokens` of `key` from the evaluated pieces the engine planned (I/O worker)."""
        try:
            self.write_behind(key, pieces, tokens, keys, evict=evict, rewrite=rewrite, splits=splits)
        except Stale as e:
            log.debug("not writing the cache of %s: %s; its next turn writes from what disk holds", key, e)
        except OSError as e:
            if not evict:  # paging everything out at shutdown
                log.warning("could not page out %s: %s", key, e)
            elif is_disk_full(e):
                log.warning("the disk holding the KV caches is full (%s); the cache of %s stays in "
                            "memory only (after a restart it is rebuilt from the transcript)",
                            e.strerror, key)
            else:
                log.warning("could not write the cache of %s to disk: %s", key, e)

    def write_behind(self, key: str, pieces: Evaluated, tokens: list[int], keys: list[str], *,
                     evict: bool = True, rewrite: bool = False, splits: Sequence[int] = ()) -> None:
        """Make the disk chain of `key` hold `tokens`, writing only what disk lacks.

        The whole blocks first (each one only if no session wrote it yet:
        that is the sharing), then the chain that lists them, then the
        private segments after them: appended to when they still agree,
        rewritten as one when the chain moved or they reach max_segments.
        `pieces` hold the evaluated state of the files the engine planned;
        `keys` are the keys of the whole blocks the chain lists (the engine hashed them once);
        `splits`: where the tail ends a segment at a checkpoint (`spans`).
        """
        n = len(tokens)
        now = self._clock()

        def cut(lo: int, hi: int) -> Snapshot:
            if (lo, hi) not in pieces:
                raise Stale(f"disk lacks [{lo}, {hi}), which the engine did not plan to write")
            return pieces[lo, hi]

        whole = len(keys)
        if whole > whole_blocks(n, self.block):
            raise ValueError(f"{whole} block keys for {n} ids: a block never holds a session's last id")
        listed = [b.block for b in self.index.blocks_of(key)]
        same = common_prefix_len(listed, keys)
        chain = keys[:same]
        if whole > same:
            found = self.index.find_blocks(keys[same:])
            for k in range(same, whole):
                lo, hi = k * self.block, (k + 1) * self.block
                row = found.get(keys[k])
                if row is not None and row.fingerprint == self.fingerprint and row.tokens == tuple(tokens[lo:hi]):
                    self.stats.blocks_reused += 1
                else:
                    piece = cut(lo, hi)
                    self._write(BlockTarget(keys[k], chain[-1] if chain else self.root, key), piece, tokens, now,
                                evict=evict)
                    self.stats.blocks_written += 1
                chain.append(keys[k])
        base = len(chain) * self.block
        private = self.index.chain(key)
        if chain != listed:
            # The private segments followed the old chain's last block: they go with it.
            self.index.drop_segments(key, 0)
            self.index.set_chain(key, chain, now)
            private = []
        kept: list[SegmentRow] = []
        pos = base
        for seg in private:
            if seg.start != pos or seg.end > n or tuple(tokens[seg.start:seg.end]) != seg.tokens:
                break
            kept.append(seg)
            pos = seg.end
        if len(private) > len(kept):
            self.index.drop_segments(key, pos)  # a rewind (regenerate, edit) left these behind
        if pos == n:
            self.index.touch(key, now)
            return
        # A snapshot of a window cannot be cut: it replaces the private segments it would follow.
        pos, ends, replace = spans(pos, n, len(kept), base, splits, max_segments=self.max_segments, rewrite=rewrite)
        for k, end in enumerate(ends):  # (compaction: from the last block, for everything after the blocks)
            start = ends[k - 1] if k else pos
            self._write(Private(key, chain[-1] if chain else None), cut(start, end), tokens, now,
                        replace=k == 0 and replace and bool(kept), evict=evict)
        self.enforce_disk_budget(keep=key)

    def _write(self, target: BlockTarget | Private, snap: Snapshot, tokens: Sequence[int], now: float, *,
               replace: bool = False, evict: bool = True) -> None:
        """Persist one evaluated snapshot: the file made durable, then its index row.

        The one place a cache file is written (a block or a private segment),
        on the I/O worker: the arrays were evaluated on the engine thread.
        """
        ids = tokens[snap.start:snap.end]
        if isinstance(target, BlockTarget):
            path = self.index.block_path(target.block, target.parent)
        else:
            path = self.index.path_for(target.key, self.fingerprint, snap.start, snap.end, target.after)
            if replace:
                self.index.drop_segments(target.key, snap.start)  # the segments this one replaces
        owner = target.key
        evicted: set[tuple[str, str]] = set()
        self.pause()
        while True:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                seg = write_segment(path, snap, fingerprint=self.fingerprint, tokens=ids)
                break
            except OSError as e:
                if not is_disk_full(e):
                    raise
                if not evict or not self._evict_for(owner, evicted):
                    raise OSError(e.errno, NOTHING_TO_EVICT if evict else e.strerror) from None
        _maybe_crash("after-write")
        while True:
            try:
                if isinstance(target, BlockTarget):
                    self.index.add_block(target.block, target.parent, snap.start, snap.end, seg.path,
                                         seg.nbytes, seg.checksum, self.fingerprint, ids, now)
                else:
                    self.index.add(target.key, snap.start, snap.end, seg.path, seg.nbytes, seg.checksum,
                                   self.fingerprint, ids, now)
                break
            except sqlite3.OperationalError as e:  # the index shares the full disk
                if not is_disk_full(e):
                    seg.path.unlink(missing_ok=True)
                    raise
                if not evict or not self._evict_for(owner, evicted):
                    seg.path.unlink(missing_ok=True)
                    raise OSError(errno.ENOSPC, NOTHING_TO_EVICT if evict else str(e)) from None
        self.stats.writes += 1
        self.stats.bytes_written += seg.nbytes
        self.indexed()

    def _evict_for(self, key: str, evicted: set[tuple[str, str]]) -> bool:
        """The cache's filesystem is full: remove the least recently used other session's files
        (of any model).

        The same choice the byte budget makes, forced by the disk instead of
        the config. False when no other session has files left to remove.
        """
        for victim, model, nbytes in self.index.by_use():
            if (victim, model) != (key, self.fingerprint) and nbytes > 0 and (victim, model) not in evicted:
                evicted.add((victim, model))
                self.index.evict(victim, model)
                self.stats.evicted_full += 1
                self.stats.page_outs += 1
                log.warning("the disk holding the KV caches is full: removed the cache files of "
                            "session %s (%d bytes, least recently used) to make room for %s",
                            victim, nbytes, key)
                return True
        return False

    def enforce_disk_budget(self, keep: str | None) -> None:
        """Forget least recently used sessions' caches on disk, whichever model's, until every byte
        (each block once) fits: one budget for every model's caches."""
        if self.index.total_bytes() <= self.disk_bytes:
            return
        for key, model, _ in self.index.by_use():
            if (key, model) == (keep, self.fingerprint):
                continue
            self.index.drop_from(key, 0, model)
            self.stats.page_outs += 1
            if self.index.total_bytes() <= self.disk_bytes:
                return
        if keep is not None and self.index.total_bytes() > self.disk_bytes:
            log.warning("the cache of %s alone exceeds the disk budget; not keeping it on disk", keep)
            self.index.drop_from(keep, 0)


# Fault injection: None in a daemon; the crash tests set it (tests/crashing_kvd.py) to die like
# kill -9 at a named point ("after-write": a segment file written, not yet in the index).
crash_hook: Callable[[str], None] | None = None


def _maybe_crash(point: str) -> None:
    if crash_hook is not None:
        crash_hook(point)
