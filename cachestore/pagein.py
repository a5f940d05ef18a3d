"""Paging a session's prefix in from disk: which files restore it, reading them, prefetch after a start.

`PageIn.plan` chooses, reading nothing yet, the files that restore the
longest prefix of the wanted ids: the session's own chain (its blocks, then
its private segments) or the blocks any session wrote whose keys are the
wanted ids' own. `PageIn.restore` reads a plan into live caches (straight
into their buffers for plain KV, direct.py; else read, merged, restored);
a file that fails verification is dropped with what follows it, so the
session prefills from there. `prefetch_plan` and `prefetch` page sessions
only on disk into free memory after a start, before anyone asks.

Its own module because these are the engine thread's only file reads, a
job with its own failure handling that needs none of the tiers' bookkeeping:
`PageIn` takes this thread's index, the fingerprint and block size, the disk
statistics, the promised chains (a bad file changes what disk will hold) and
the way to queue an index write, all explicitly; the prefetch functions take
the two memory tiers they fill.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from . import direct
from .blocks import block_keys
from .errors import CannotSplit, CorruptSegment
from .index import BlockRow, SegmentIndex, SegmentRow
from .lru import DiskStats, Tier
from .packing import pack
from .prefix import MIN_SHARED, common_prefix_len
from .segments import read_segment
from .snapshot import Snapshot, merge, restore, truncate
from .warm import Cache, Entry, cache_nbytes
from .writeback import Promise, Writeback

log = logging.getLogger("kvd.cache")

Piece = BlockRow | SegmentRow
#: Queue an index write (the job, the session it belongs to, if any) behind the disk jobs before it.
Later = Callable[[Callable[[], object], str | None], None]

PREFETCH_ROOM = 64  # tokens a prefetched live cache can take before it grows: a typical next message


@dataclass
class DiskPlan:
    pieces: list[Piece]
    end: int  # tokens the plan restores (the last piece is cut there if it ends later)
    own: int  # of those, the tokens the session's own chain holds


class PageIn:
    """Reading session prefixes back from disk (engine thread; index writes are queued with `later`)."""

    def __init__(self, index: Callable[[], SegmentIndex], *, fingerprint: str, root: str, block: int,
                 writer: Writeback, promised: dict[str, Promise], later: Later, stats: DiskStats,
                 clock: Callable[[], float]) -> None:
        self._index = index
        self.fingerprint = fingerprint
        self.root = root
        self.block = block
        self._writer = writer
        self._promised = promised  # the store's own dict: shared, never replaced
        self._later = later
        self.stats = stats
        self.clock = clock

    @property
    def index(self) -> SegmentIndex:
        return self._index()

    def plan(self, key: str, wanted: Sequence[int], limit: int) -> DiskPlan:
        """Which files restore the longest prefix of `wanted` (at most `limit` ids), read nothing yet.

        Either the session's own chain (its blocks, then its private
        segments), or the blocks any session wrote whose keys are the
        wanted ids' own: whichever holds more.
        """
        mine: list[Piece] = []
        pos = 0
        blocks = self.index.blocks_of(key)
        pieces: list[Piece] = [*blocks, *self.valid_chain(key)]
        for piece in pieces:
            if piece.start != pos or piece.fingerprint != self.fingerprint:
                break
            shared = common_prefix_len(piece.tokens, wanted[piece.start:piece.end])
            if shared == 0:
                break
            mine.append(piece)
            pos = min(piece.start + shared, limit)
            if pos < piece.end:
                break
        own = DiskPlan(mine, pos, pos)
        keys = block_keys(wanted[:limit + self.block - 1 if limit else 0], self.block, self.root)
        found = self.index.find_blocks(keys)
        shared_pieces: list[BlockRow] = []
        end = 0
        for b in keys:
            row = found.get(b)
            if row is None or row.fingerprint != self.fingerprint or row.start != end \
                    or tuple(wanted[row.start:row.end]) != row.tokens[:len(wanted[row.start:row.end])]:
                break
            shared_pieces.append(row)
            end = min(row.end, limit)
        if end < limit and end == len(shared_pieces) * self.block:
            # Past the last whole block in common: the block some session wrote next that
            # agrees longest with the wanted ids, cut where they part (KV blocks cut anywhere).
            parent = shared_pieces[-1].block if shared_pieces else self.root
            best, agree = None, 0
            for row in self.index.children(parent):
                n = min(common_prefix_len(row.tokens, wanted[end:limit]), limit - end)
                if n > agree and row.fingerprint == self.fingerprint and row.start == end:
                    best, agree = row, n
            if best is not None and end + agree >= MIN_SHARED:  # a template's head alone: not worth a read
                shared_pieces.append(best)
                end += agree
        if end <= own.end:
            return own
        mine_blocks = sum(1 for b in blocks if b in shared_pieces)
        return DiskPlan(list(shared_pieces), end, min(mine_blocks * self.block, end))

    def restore(self, key: str, plan: DiskPlan, *, room: int, use: bool = True
                ) -> tuple[Cache, int, int] | None:
        """Live caches holding a plan's tokens: (cache, tokens held, of those the session's own).

        Plain-KV caches are read straight into the live cache's buffers, with
        room for `room` more tokens (direct.py); other layouts are read,
        merged and restored.
        """
        parts = [direct.Piece(row.path, row.checksum, row.start, row.end, min(row.end, plan.end))
                 for row in plan.pieces]
        got = direct.read_direct(parts, fingerprint=self.fingerprint, room=room) if parts else None
        if got is None:
            merged = self.read(key, plan, use=use)
            return (restore(merged[0]), merged[0].end, merged[1]) if merged is not None else None
        self.stats.bytes_read += got.bytes_read
        if got.bad is not None:
            part, e = got.bad
            self.drop_bad(key, plan.pieces[parts.index(part)], e)
        if got.cache is None:
            return None
        if use:  # a prefetch is not a use
            blocks = [row.block for row in plan.pieces if row.start < got.tokens and isinstance(row, BlockRow)]
            now = self.clock()
            self._later(lambda: self.index.touch_blocks(blocks, now), None)
            self.stats.hits += 1
            self.stats.page_ins += 1
        return got.cache, got.tokens, min(plan.own, got.tokens)

    def drop_bad(self, key: str, row: Piece, e: CorruptSegment) -> None:
        """A file failed verification: unlist it and what follows it (a block: in every chain)."""
        self.stats.dropped_corrupt += 1
        if isinstance(row, BlockRow):
            block = row.block
            log.warning("dropping cache block %s: %s; every session that lists it will prefill "
                        "from token %d", row.path, e, row.start)
            self._later(lambda: self.index.drop_block(block), None)
            self._promised.clear()  # any chain may list it: plan from the index again
        else:
            log.warning("dropping cache file %s: %s; the session will prefill instead", row.path, e)
            start = row.start
            held = self._promised.get(key)
            self._promised[key] = _cut_promise(held if held is not None else self._writer.promise(key), start)
            self._later(lambda: self.index.drop_from(key, start), key)

    def read(self, key: str, plan: DiskPlan, *, use: bool = True) -> tuple[Snapshot, int] | None:
        """Read and merge a plan's files; a bad file ends it there (and is dropped with what follows)."""
        pieces: list[Snapshot] = []
        for row in plan.pieces:
            try:
                piece = read_segment(row.path, checksum=row.checksum, fingerprint=self.fingerprint)
            except CorruptSegment as e:
                self.drop_bad(key, row, e)
                break
            self.stats.bytes_read += row.nbytes
            if piece.end > plan.end:
                try:
                    piece = truncate(piece, plan.end)
                except CannotSplit:
                    break
            pieces.append(piece)
        if not pieces:
            return None
        if use:  # a prefetch is not a use
            blocks = [row.block for row in plan.pieces[:len(pieces)] if isinstance(row, BlockRow)]
            now = self.clock()
            self._later(lambda: self.index.touch_blocks(blocks, now), None)
            self.stats.hits += 1
            self.stats.page_ins += 1
        merged = merge(*pieces)
        return merged, min(plan.own, merged.end)

    def rows(self, key: str) -> list[Piece]:
        """The session's disk chain: its blocks, then its private segments."""
        return [*self.index.blocks_of(key), *self.valid_chain(key)]

    def valid_chain(self, key: str) -> list[SegmentRow]:
        """The session's private segments, without those another model or layout wrote (dropped on the worker)."""
        chain = self.index.chain(key)
        for row in chain:
            if row.fingerprint != self.fingerprint:
                self._later(lambda: self._writer.valid_chain(key), key)
                return [r for r in chain if r.start < row.start]
        return chain


# --- prefetch after a restart ---

def prefetch_plan(disk: PageIn, resident: Tier[tuple[Cache, list[int]]], warm: Tier[Entry]) -> list[str]:
    """Sessions only on disk that memory has room for, most recently used first.

    Planned once the model is ready after a start: the sessions people were
    just using are paged in before anyone asks, so the first turn after a
    restart finds its cache in memory. Only free room is planned (the
    resident tier's, then the warm tier's); a prefetch never evicts anything.
    """
    resident_room = resident.budget - resident.nbytes
    warm_room = warm.budget - warm.nbytes
    plan = []
    for key, nbytes in reversed(disk.index.keys_by_use()):
        if key in resident or key in warm or nbytes <= 0:
            continue
        if (live := live_bytes(disk.rows(key))) <= resident_room:
            resident_room -= live
        elif nbytes <= warm_room:
            warm_room -= nbytes
        else:
            continue
        plan.append(key)
    return plan


def prefetch(disk: PageIn, key: str, resident: Tier[tuple[Cache, list[int]]], warm: Tier[Entry], *,
             warm_bits: int) -> tuple[str, int] | None:
    """Page one session's whole disk chain into memory if it fits: (the tier it went to, bytes).

    Resident first: after a restart that tier is empty, and a live cache
    there (read straight into its buffers by direct.py, with room for a
    typical next message) makes the first turn cost what a turn before the
    restart did; a warm snapshot still needs a copy into a live cache.
    Otherwise warm. Not a use: the session keeps its place in the disk
    LRU, and it goes in at the tier's cold end (behind what people used
    since), so prefetching never changes what is evicted first.
    """
    if key in resident or key in warm:
        return None
    rows = disk.rows(key)
    tokens = [t for row in rows for t in row.tokens]
    if not tokens:
        return None
    plan = disk.plan(key, tokens, len(tokens))
    if not plan.pieces:
        return None
    if resident.fits(live_bytes(rows)):
        live = disk.restore(key, plan, room=PREFETCH_ROOM, use=False)
        if live is None:
            return None
        cache, end, _ = live
        nbytes = cache_nbytes(cache)
        if resident.offer(key, (cache, tokens[:end]), nbytes, disk.clock()):
            return "resident", nbytes
        return None
    got = disk.read(key, plan, use=False)
    if got is None:
        return None
    snap = got[0]
    toks = tokens[:snap.end]
    if warm_bits:
        snap = pack(snap, warm_bits)
    if not warm.offer(key, (snap, toks), snap.nbytes, disk.clock()):
        return None
    return "warm", snap.nbytes


def live_bytes(rows: Sequence[Piece]) -> int:
    """An upper bound of a prefetched live cache's bytes: its buffers are whole steps, the files' headers count."""
    tokens = rows[-1].end if rows else 0
    return sum(row.nbytes for row in rows) * direct.capacity(tokens, PREFETCH_ROOM) // tokens if tokens else 0


def _cut_promise(held: Promise, start: int) -> Promise:
    """A promised chain once its private segments from `start` on are dropped."""
    ends = tuple(e for e in held.ends if e <= start)
    end = ends[-1] if ends else held.base
    return Promise(held.tokens[:end], held.base, ends)
