"""Paging a session's prefix in from disk: which files restore it, reading them, prefetch after a start.

`PageIn.plan` chooses, reading nothing yet, the files that restore the
longest prefix of the wanted ids: the session's own chain (its blocks, then
its private segments) or the blocks any session wrote whose keys are the
wanted ids' own, as the block table's walk found them (table.py).
`PageIn.restore` reads a plan into live caches (straight into their
buffers for plain KV, direct.py; else read, merged, restored);
a file that fails verification is reported to the store (`dropped`), which
unlists it and what follows it, so the session prefills from there.
`prefetch_plan` and `prefetch` page sessions only on disk into free memory
after a start, before anyone asks.

Its own module because these are the engine thread's only file reads, a
job with its own failure handling that needs none of the tiers' bookkeeping.
It keeps its own statistics (the I/O worker keeps its own; the store merges
them on read) and changes no state of the store's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from common.tokenids import pack_tokens

from . import direct
from .errors import CannotSplit, CorruptSegment
from .index import BlockRow, SegmentIndex, SegmentRow
from .lru import DiskStats, Tier
from .prefix import MIN_SHARED, common_prefix_len
from .segments import read_segment
from .snapshot import Snapshot, merge, restore, truncate
from .table import BlockTable, Walk
from .warm import Cache, WarmTier

log = logging.getLogger("kvd.cache")

DiskRow = BlockRow | SegmentRow
#: Queue an index write (the job, the session it belongs to, if any) behind the disk jobs before it.
Later = Callable[[Callable[[SegmentIndex], object], str | None], None]
#: Tell the store a file failed verification (the session, the file's row, why).
Dropped = Callable[[str, DiskRow, CorruptSegment], None]

PREFETCH_ROOM = 64  # tokens a prefetched live cache can take before it grows: a typical next message


@dataclass
class DiskPlan:
    rows: list[DiskRow]
    end: int  # tokens the plan restores (the last piece is cut there if it ends later)
    own: int  # of those, the tokens the session's own chain holds


class PageIn:
    """Reading session prefixes back from disk (engine thread; index writes are queued with `later`)."""

    def __init__(self, table: BlockTable, *, fingerprint: str, later: Later, dropped: Dropped,
                 clock: Callable[[], float]) -> None:
        self.table = table
        self.fingerprint = fingerprint
        self.block = table.block
        self._later = later
        self._dropped = dropped
        self.stats = DiskStats()  # the engine thread's own figures
        self.clock = clock

    def plan(self, key: str, wanted: Sequence[int], limit: int, walk: Walk) -> DiskPlan:  # noqa: C901 - 16: the one
        # place that weighs the session's own chain against the shared blocks; split, the choice would be in two
        """Which files restore the longest prefix of `wanted` (at most `limit` ids), read nothing yet.

        Either the session's own chain (its blocks, then its private
        segments), or the blocks any session wrote whose keys are the
        wanted ids' own (`walk`, down the block table): whichever holds more.
        """
        mine: list[DiskRow] = []
        pos = 0
        s = self.table.sessions.get(key)
        for bk in s.disk_keys if s is not None else []:
            b = self.table.blocks[bk]
            assert b.disk is not None
            if b.start != pos or b.disk.fingerprint != self.fingerprint or (shared := b.agrees(wanted)) == 0:
                break
            mine.append(b.row(self.table.blocks_dir))
            pos = min(b.start + shared, limit)
            if pos < b.end:
                break
        else:
            for row in s.disk_tail if s is not None else []:
                if row.start != pos or row.fingerprint != self.fingerprint:
                    break
                shared = common_prefix_len(row.tokens, wanted[row.start:row.end])
                if shared == 0:
                    break
                mine.append(row)
                pos = min(row.start + shared, limit)
                if pos < row.end:
                    break
        own = DiskPlan(mine, pos, pos)
        found: list[str] = []
        end = 0
        for bk in walk.keys[:walk.disk]:
            b = self.table.blocks[bk]
            assert b.disk is not None
            if b.disk.fingerprint != self.fingerprint or b.start != end or end >= limit \
                    or b.ids != pack_tokens(wanted[b.start:b.end]):
                break
            found.append(bk)
            end = min(b.end, limit)
        if end < limit and end == len(found) * self.block:
            # Past the last whole block in common: the block some session wrote next that
            # agrees longest with the wanted ids, cut where they part (KV blocks cut anywhere).
            best, agree = None, 0
            for child in self.table.after(found[-1] if found else self.table.root)[0]:
                if child.disk is None or child.disk.fingerprint != self.fingerprint or child.start != end:
                    continue
                n = min(child.agrees(wanted), limit - end)
                if n > agree:
                    best, agree = child.key, n
            if best is not None and end + agree >= MIN_SHARED:  # a template's head alone: not worth a read
                found.append(best)
                end += agree
        if end <= own.end:
            return own
        mine_blocks = len(set(s.disk_keys) & set(found)) if s is not None else 0
        rows: list[DiskRow] = [self.table.blocks[bk].row(self.table.blocks_dir) for bk in found]
        return DiskPlan(rows, end, min(mine_blocks * self.block, end))

    def restore(self, key: str, plan: DiskPlan, *, room: int, use: bool = True
                ) -> tuple[Cache, int, int] | None:
        """Live caches holding a plan's tokens: (cache, tokens held, of those the session's own).

        Plain-KV caches are read straight into the live cache's buffers, with
        room for `room` more tokens (direct.py); other layouts are read,
        merged and restored.
        """
        parts = [direct.FileSpan(row.path, row.checksum, row.start, row.end, min(row.end, plan.end))
                 for row in plan.rows]
        got = direct.read_direct(parts, fingerprint=self.fingerprint, room=room) if parts else None
        if got is None:
            merged = self.read(key, plan, use=use)
            return (restore(merged[0]), merged[0].end, merged[1]) if merged is not None else None
        self.stats.bytes_read += got.bytes_read
        if got.bad is not None:
            part, e = got.bad
            self.stats.dropped_corrupt += 1
            self._dropped(key, plan.rows[parts.index(part)], e)
        if got.cache is None:
            return None
        if use:  # a prefetch is not a use
            blocks = [row.block for row in plan.rows if row.start < got.tokens and isinstance(row, BlockRow)]
            now = self.clock()
            self._later(lambda index: index.touch_blocks(blocks, now), None)
            self.stats.hits += 1
            self.stats.page_ins += 1
        return got.cache, got.tokens, min(plan.own, got.tokens)

    def read(self, key: str, plan: DiskPlan, *, use: bool = True) -> tuple[Snapshot, int] | None:
        """Read and merge a plan's files; a bad file ends it there (and is dropped with what follows)."""
        snaps: list[Snapshot] = []
        for row in plan.rows:
            try:
                piece = read_segment(row.path, checksum=row.checksum, fingerprint=self.fingerprint)
            except CorruptSegment as e:
                self.stats.dropped_corrupt += 1
                self._dropped(key, row, e)
                break
            self.stats.bytes_read += row.nbytes
            if piece.end > plan.end:
                try:
                    piece = truncate(piece, plan.end)
                except CannotSplit:
                    break
            snaps.append(piece)
        if not snaps:
            return None
        if use:  # a prefetch is not a use
            blocks = [row.block for row in plan.rows[:len(snaps)] if isinstance(row, BlockRow)]
            now = self.clock()
            self._later(lambda index: index.touch_blocks(blocks, now), None)
            self.stats.hits += 1
            self.stats.page_ins += 1
        merged = merge(*snaps)
        return merged, min(plan.own, merged.end)

    def rows(self, key: str) -> list[DiskRow]:
        """The session's disk chain: its blocks, then its private segments."""
        blocks, tail = self.table.disk_rows(key)
        return [*blocks, *tail]


# --- prefetch after a restart ---

def prefetch_plan(disk: PageIn, by_use: list[tuple[str, int]], resident: Tier[Cache], warm: WarmTier) -> list[str]:
    """Sessions only on disk that memory has room for, most recently used first.

    Planned once the model is ready after a start (`by_use`: the index's
    sessions, least recently used first): the sessions people were just
    using are paged in before anyone asks, so the first turn after a restart
    finds its cache in memory. Only free room is planned (the resident
    tier's, then the warm tier's); a prefetch never evicts anything.
    """
    resident_room = resident.budget - resident.nbytes
    warm_room = warm.budget - warm.nbytes
    plan = []
    for key, nbytes in reversed(by_use):
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


def prefetch(disk: PageIn, key: str, *, resident_fits: Callable[[int], bool]
             ) -> tuple[Cache | Snapshot, list[int]] | None:
    """Read one session's whole disk chain for memory: a live cache if `resident_fits` its
    bytes, else a warm snapshot; with the ids it holds.

    Resident first: after a restart that tier is empty, and a live cache
    there (read straight into its buffers by direct.py, with room for a
    typical next message) makes the first turn cost what a turn before the
    restart did; a warm snapshot still needs a copy into a live cache.
    Not a use: the session keeps its place in the disk LRU (the store puts
    it at the tier's cold end, behind what people used since), so
    prefetching never changes what is evicted first.
    """
    rows = disk.rows(key)
    tokens = [t for row in rows for t in row.tokens]
    if not tokens:
        return None
    plan = disk.plan(key, tokens, len(tokens), Walk([]))
    if not plan.rows:
        return None
    if resident_fits(live_bytes(rows)):
        live = disk.restore(key, plan, room=PREFETCH_ROOM, use=False)
        return (live[0], tokens[:live[1]]) if live is not None else None
    got = disk.read(key, plan, use=False)
    if got is None:
        return None
    snap = got[0]
    return snap, tokens[:snap.end]


def live_bytes(rows: Sequence[DiskRow]) -> int:
    """An upper bound of a prefetched live cache's bytes: its buffers are whole steps, the files' headers count."""
    tokens = rows[-1].end if rows else 0
    return sum(row.nbytes for row in rows) * direct.capacity(tokens, PREFETCH_ROOM) // tokens if tokens else 0
