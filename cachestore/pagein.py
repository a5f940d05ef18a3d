"""Paging a session's prefix in from disk: which files restore it, reading them, prefetch after a start.

`PageIn.plan` chooses, reading nothing yet, the files that restore the
longest prefix of the wanted ids (diskplan.py).
`PageIn.begin` starts reading a plan and returns at once: the I/O worker's
reader does the reading (ioworker.py), and `arrived` takes in each of its
reports on the engine thread. Plain KV goes the direct way (direct.py): the
reader checks the headers, the engine makes the live buffers (`allocate`, a
few per engine step), the reader reads the data into them, the engine wraps
them in live caches. Other layouts: the reader checks each file (checksum,
header), the engine has MLX load them from the pages just read, and merges
them. A file that fails verification is reported to the store (`dropped`),
which unlists it and what follows it, so the session prefills from there.
A prefetch after a start (prefetch.py) pages sessions in by the same reads.

Decide in one place, execute in another, acknowledge back (SGLang's
HiRadixCache loads the same way): the engine plans and owns each `Reading`;
the reader gets copies of what it needs (the files, views of the buffers)
and answers by the reading's id, so the two threads share nothing mutable.
It keeps its own statistics (the I/O worker's writer keeps its own; the
store merges them on read) and changes no state of the store's.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .direct import Allocation, Buffers, FileSpan, Filled, Filling, FillRate, Scan, finish, scan
from .diskplan import DiskPlan, DiskRow, plan_restore
from .errors import CannotSplit, CorruptSegment
from .index import SegmentIndex
from .lru import DiskStats
from .rows import BlockRow
from .segread import Verified, load_verified, verify_segment
from .snapshot import Snapshot, merge, restore, truncate
from .table import BlockTable, Walk
from .warm import Cache

log = logging.getLogger("kvd.cache")

#: Queue an index write (the job, the session it belongs to, if any) behind the disk jobs before it.
Later = Callable[[Callable[[SegmentIndex], object], str | None], None]
#: Tell the store a file failed verification (the session, the file's row, why).
Dropped = Callable[[str, DiskRow, CorruptSegment], None]

ALLOC_STEP = 16 << 20  # bytes of a restore's buffers made between two engine steps (Allocation)


@dataclass
class Reading:
    """A restore or a prefetch in flight: what the engine planned, and how far the read has got.

    Engine thread only: the reader gets copies of what it needs (the files,
    the buffers' views) and answers with a `ReadReport` by id.
    """

    id: int
    key: str
    plan: DiskPlan
    room: int
    use: bool  # a turn's restore (a use: counted, the blocks touched); a prefetch's is not
    live: bool  # into live caches; else into a snapshot (warm)
    started: float
    stage: str = "scan"  # "scan" -> "alloc" -> "fill" (direct), or "verify" (the general path)
    scan: Scan | None = None
    allocation: Allocation | None = None  # the live buffers, made a few per engine step
    buffers: Buffers | None = None  # the reader writes into their views until `pending` is 0
    filling: Filling | None = None  # the reader's state, handed to each of its fill jobs
    pending: int = 0  # fill jobs with the reader (each reads into the buffers made before it)
    given: int = 0  # buffers handed to the reader so far
    abandoned: bool = False
    done: bool = False
    result: tuple[Cache | Snapshot, int, int] | None = None  # (held, tokens held, of those the session's own)
    ms: float = 0.0  # from `begin` to the end

    def parts(self) -> list[FileSpan]:
        return [FileSpan(row.path, row.checksum, row.start, row.end, min(row.end, self.plan.end))
                for row in self.plan.rows]


@dataclass(frozen=True)
class ReadReport:
    """What the reader hands back for a reading: a Scan, Filled or Checked, None (not the direct
    path's layout), or the exception its job raised."""

    id: int
    payload: object


@dataclass
class Checked:
    """The general path's files, checked by the reader and still open, and the first that failed."""

    files: list[Verified]
    bad: tuple[int, CorruptSegment] | None


def _check(rows: Sequence[DiskRow], fingerprint: str) -> Checked:
    """The reader's half of the general path: every file's checksum and header, no MLX."""
    files: list[Verified] = []
    try:
        for k, row in enumerate(rows):
            try:
                files.append(verify_segment(row.path, checksum=row.checksum, fingerprint=fingerprint))
            except CorruptSegment as e:
                return Checked(files, (k, e))
    except BaseException:
        for v in files:
            v.close()
        raise
    return Checked(files, None)


def _discard(got: object) -> None:
    if isinstance(got, Checked):
        for v in got.files:
            v.close()


class PageIn:
    """Reading session prefixes back from disk: planned on the engine thread, read by the I/O
    worker's reader (`read` hands it a job), finished on the engine thread (index writes are queued
    with `later`)."""

    def __init__(self, table: BlockTable, *, fingerprint: str, later: Later, dropped: Dropped,
                 clock: Callable[[], float], read: Callable[[Callable[[], object]], None]) -> None:
        self.table = table
        self.fingerprint = fingerprint
        self.block = table.block
        self._later = later
        self._dropped = dropped
        self.stats = DiskStats()  # the engine thread's own figures
        self.clock = clock
        self._read = read
        self._reading: dict[int, Reading] = {}  # in flight, by id
        self._stream: Any = None  # MLX's stream that restores' buffers are filled on
        self._fill_rate = FillRate()
        self._next = 0
        #: Whether this model's caches can be cut anywhere (plain KV): a restore may end inside a file. Where they
        #: cannot (a recurrent state, a window: set when the store learns the model's cache), only at a file's end.
        self.cuts = True

    def plan(self, key: str, wanted: Sequence[int], limit: int, walk: Walk) -> DiskPlan:
        """Which files restore the longest prefix of `wanted` (at most `limit` ids), read nothing yet (diskplan.py)."""
        return plan_restore(self.table, self.fingerprint, key, wanted, limit, walk, cuts=self.cuts)

    # --- reading: planned here, read by the I/O worker's reader, finished here ---

    def begin(self, key: str, plan: DiskPlan, *, room: int, use: bool = True, live: bool = True) -> Reading:
        """Start reading a plan's files: into live caches with room for `room` more tokens (`live`),
        else into a snapshot (a warm one). Returns at once; `arrived` finishes it.

        Plain-KV chains go the direct way (direct.py): the reader checks the
        headers, this thread allocates the live buffers at their final size,
        the reader reads the data into them. Other layouts: the reader checks
        every file (checksum and header), then this thread has MLX load them,
        from the pages the check just read, and merges them.
        """
        self._next += 1
        r = Reading(self._next, key, plan, room=room, use=use, live=live, started=time.perf_counter())
        self._reading[r.id] = r
        if not plan.rows:
            self._end(r, None)
        elif live:
            parts = r.parts()
            fingerprint = self.fingerprint
            self._submit(r, lambda: scan(parts, fingerprint=fingerprint))
        else:
            self._verify(r)
        return r

    def arrived(self, report: ReadReport) -> Reading | None:
        """Take in one report of the reader: the next step of its reading, or its end (returned)."""
        r = self._reading.get(report.id)
        if r is None:
            return None
        got = report.payload
        if r.filling is not None:  # one of its fill jobs
            r.pending -= 1
        if r.abandoned:
            _discard(got)
            self._drop(r)
            return r if r.done else None
        try:
            if isinstance(got, BaseException):
                raise got
            if r.stage == "scan":
                assert got is None or isinstance(got, Scan)
                self._scanned(r, got)
            elif r.stage in ("alloc", "fill"):
                if got is not None:  # the last job's: every buffer is made and read
                    assert isinstance(got, Filled) and r.stage == "fill" and r.pending == 0
                    self._filled(r, got)
            else:
                assert isinstance(got, Checked)
                self._checked(r, got)
        except Exception:
            log.exception("reading the cache of %s failed; it will prefill instead", r.key)
            _discard(got)
            self._drop(r)
        return r if r.done else None

    def abandon(self, r: Reading) -> None:
        """Nobody wants this reading any more (its turn was cancelled): its result is dropped."""
        r.abandoned = True
        if r.stage == "alloc":  # no more buffers are made; it ends once the reader has no job of it
            self._drop(r)

    def _drop(self, r: Reading) -> None:
        """End a reading that failed or that nobody wants, with nothing: at once, or, while the
        reader still has fill jobs of it (writing into its buffers), once the last reports."""
        r.abandoned = True
        r.allocation = None
        if r.pending > 0:
            return
        if r.buffers is not None:
            r.buffers.release()
            r.buffers = None
        if not r.done:
            self._end(r, None)

    def reading(self) -> bool:
        """Whether any read is in flight."""
        return bool(self._reading)

    def allocating(self, r: Reading) -> bool:
        return r.stage == "alloc" and not r.done

    def _submit(self, r: Reading, job: Callable[[], object]) -> None:
        rid = r.id

        def run() -> ReadReport:
            try:
                return ReadReport(rid, job())
            except Exception as e:  # reported: the engine must not wait for a read that never ends
                return ReadReport(rid, e)

        self._read(run)

    def _verify(self, r: Reading) -> None:
        r.stage = "verify"
        rows, fingerprint = list(r.plan.rows), self.fingerprint
        self._submit(r, lambda: _check(rows, fingerprint))

    def _scanned(self, r: Reading, found: Scan | None) -> None:
        if found is None:  # not a layout the direct path reads
            self._verify(r)
            return
        if found.shape is None:
            self._bad(r, found.bad)
            self._end(r, None)
            return
        r.stage = "alloc"
        r.scan = found
        if self._stream is None:
            import mlx.core as mx

            self._stream = mx.new_stream(mx.default_device())  # buffers filled beside the decode
        r.allocation = Allocation(found, r.room, self._stream, self._fill_rate)
        r.buffers = r.allocation.buffers
        r.filling = Filling(found, r.allocation.capacity, fingerprint=self.fingerprint)
        self._allocate(r)

    def allocate(self, *, all_of_it: bool = False) -> None:
        """Make the next few buffers of the readings waiting for them (once per engine step), or
        all of them (a caller that waits for the read anyway)."""
        for r in [r for r in self._reading.values() if r.stage == "alloc" and r.allocation is not None]:
            try:
                self._allocate(r, all_of_it=all_of_it)
            except Exception:
                log.exception("reading the cache of %s failed; it will prefill instead", r.key)
                self._drop(r)

    def _allocate(self, r: Reading, *, all_of_it: bool = False) -> None:
        """Make the next of the reading's buffers (`all_of_it`: until all are) and hand them to the
        reader.

        With nobody else running (`all_of_it`), each group made goes to the reader at once: it
        reads the files into them while MLX's stream makes the next, and the restore takes about
        the longer of the two instead of their sum. Beside running turns, the buffers go to the
        reader once all are made: reading, hashing and making buffers at once would leave the
        decode steps less of a small machine's cores for the whole read.
        """
        a = r.allocation
        assert a is not None and r.filling is not None
        while True:
            got = a.step(ALLOC_STEP, now=all_of_it)
            if got is False:  # not plain bytes: nothing was handed to the reader; the general path
                r.allocation, r.buffers, r.filling = None, None, None
                self._verify(r)
                return
            if len(a.made) > r.given and (all_of_it or a.complete):
                r.given = len(a.made)
                r.pending += 1
                self._submit(r, functools.partial(r.filling.advance, a.buffers.made(), last=a.complete))
            if a.complete:
                r.allocation = None
                r.stage = "fill"  # the last job is with the reader: it answers the Filled
                return
            if not all_of_it:
                return  # more next step

    def _filled(self, r: Reading, filled: Filled) -> None:
        assert r.buffers is not None
        r.filling = None
        got = finish(r.buffers, filled)
        r.buffers = None
        self.stats.bytes_read += got.bytes_read
        self._bad(r, got.bad)
        if got.cache is None:
            self._end(r, None)
            return
        self._used(r, [row for row in r.plan.rows if row.start < got.tokens])
        self._end(r, (got.cache, got.tokens, min(r.plan.own, got.tokens)))

    def _checked(self, r: Reading, checked: Checked) -> None:
        snaps: list[Snapshot] = []
        files = list(checked.files)
        bad = checked.bad
        try:
            for k, v in enumerate(files):
                row = r.plan.rows[k]
                try:
                    piece = load_verified(v)
                except CorruptSegment as e:
                    bad = (k, e)
                    break
                self.stats.bytes_read += row.nbytes
                if piece.end > r.plan.end:
                    try:
                        piece = truncate(piece, r.plan.end)
                    except CannotSplit:
                        bad = None
                        break
                snaps.append(piece)
        finally:
            for v in files:
                v.close()
        if bad is not None:
            self.stats.dropped_corrupt += 1
            self._dropped(r.key, r.plan.rows[bad[0]], bad[1])
        if not snaps:
            self._end(r, None)
            return
        self._used(r, r.plan.rows[:len(snaps)])
        merged = merge(*snaps)
        own = min(r.plan.own, merged.end)
        self._end(r, (restore(merged), merged.end, own) if r.live else (merged, merged.end, own))

    def _bad(self, r: Reading, bad: tuple[FileSpan, CorruptSegment] | None) -> None:
        if bad is not None:
            part, e = bad
            self.stats.dropped_corrupt += 1
            self._dropped(r.key, r.plan.rows[r.parts().index(part)], e)

    def _used(self, r: Reading, rows: Sequence[DiskRow]) -> None:
        if r.use:  # a prefetch is not a use
            blocks = [row.block for row in rows if isinstance(row, BlockRow)]
            now = self.clock()
            self._later(lambda index: index.touch_blocks(blocks, now), None)
            self.stats.hits += 1
            self.stats.page_ins += 1

    def _end(self, r: Reading, result: tuple[Cache | Snapshot, int, int] | None) -> None:
        self._reading.pop(r.id, None)
        r.done = True
        r.result = result if not r.abandoned else None
        r.ms = (time.perf_counter() - r.started) * 1000

    def rows(self, key: str) -> list[DiskRow]:
        """The session's disk chain: its blocks, then its private segments."""
        blocks, tail = self.table.disk_rows(key)
        return [*blocks, *tail]


# --- prefetch after a restart ---
