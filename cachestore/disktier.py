"""The engine thread's half of the disk tier: what disk will hold, the queue to the I/O worker, its reports.

Decide in one place, execute in another, acknowledge back (as SGLang's
scheduler and cache controller do). The engine decides what a turn writes
(`write_behind`: writeback.plan on the chain as it will be once the jobs
queued before are done, a `Promise` this class alone keeps), evaluates
those snapshots and queues their writing; the I/O worker executes against
the index as it is (writeback.py) and every job reports back the index
rows it changed (a `DiskNews`), which `settle` applies to the block table
on the engine thread. The two threads share no dict and no statistics:
the worker's figures are its Writeback's, the engine's its PageIn's.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable
from typing import Any

from .blocks import whole_blocks
from .errors import CorruptSegment
from .index import SegmentIndex
from .ioworker import FirstTokens, IOWorker
from .lru import Tier
from .packing import unpack
from .rebuild import rebuild_index
from .rows import BlockRow, DiskNews, SegmentRow
from .snapshot import Snapshot, cuttable, merge
from .sweep import sweep
from .table import BlockTable
from .terms import Budgets
from .warm import WarmTier
from .writeback import NOTHING, Promise, Writeback, evaluate, plan, promise_of

log = logging.getLogger("kvd.cache")


def open_disk(index: Callable[[], SegmentIndex], budgets: Budgets, *, fingerprint: str, root: str, model: str,
              sweep_files: bool, clock: Callable[[], float]) -> tuple[Writeback, BlockTable]:
    """The disk tier as a start finds it: the index rebuilt from the files if it was lost, the files a crash left
    incomplete removed (`sweep_files`: no other model's store writes there now), the disk budget kept, and the
    block table loaded from the index (`index`: the calling thread's connection)."""
    if (lost := index().lost) is not None:
        rebuild_index(index(), lost)
    if sweep_files and (removed := sweep(index())):
        log.info("removed %d cache file(s) left incomplete by a crash", removed)
    writer = Writeback(index, fingerprint=fingerprint, root=root, block=budgets.block_tokens,
                       disk_bytes=budgets.disk_bytes, max_segments=budgets.max_segments, clock=clock)
    if model:
        index().name_model(model)
    writer.enforce_disk_budget(keep=None)
    table = BlockTable(root, budgets.block_tokens, index().blocks)
    table.load(*index().load_all())
    index().news()  # what start-up changed is loaded already
    return writer, table

WRITTEN_WAIT = 5.0  # seconds a checkout waits at most for its session's own queued writes (`written`)
DROPPING = "drop"  # the I/O worker's key for a block drop's job (session keys are hex: never this)


class DiskTier:
    def __init__(self, index: Callable[[], SegmentIndex], table: BlockTable, writer: Writeback, *,
                 max_segments: int, on_idle: Callable[[], None], first_tokens: FirstTokens | None = None) -> None:
        self._index = index  # the calling thread's own connection
        self.table = table
        self.writer = writer
        self.io = IOWorker(first_tokens=first_tokens)
        writer.indexed = lambda: self.io.report(self._index().news())
        writer.pause = self.io.pause
        self.max_segments = max_segments
        self._on_idle = on_idle
        self._promised: dict[str, Promise] = {}  # disk chains as they will be once queued jobs are done
        # A block drop is queued: until it has run, the table still lists the block, so every plan
        # assumes disk holds nothing (and the worker writes what the index lacks, reusing the rest).
        self._dropping = False
        self._kept_for: dict[str, list[str]] | None = None  # other models' caches by session, read when changed
        self.by_model: dict[str, int] = {}  # every model's bytes on disk: replaced wholesale by `count`

    def settle(self) -> list[object]:
        """Take in the worker's reports: the index rows its jobs changed, and which sessions have
        nothing queued any more; `on_idle` once the worker has nothing left to do. Returns the
        other reports (the reader's), in order."""
        idle = self.io.idle()  # before draining: every report of a finished job is queued by then
        done, results = self.io.settle()
        others = []
        for news in results:
            if isinstance(news, DiskNews):
                self.table.apply(news)
                self._kept_for = None if news.others else self._kept_for
            else:
                others.append(news)
        for key in done:
            self._promised.pop(key, None)
        if DROPPING in done:
            self._dropping = False
        if idle:
            self._on_idle()
        return others

    def later(self, job: Callable[[SegmentIndex], object], key: str | None = None, *, defer: bool = False) -> None:
        """An index write: run on the worker, after the jobs before it, reporting the rows it changed
        (`defer`: a write-behind's, which gives way to turns: IOWorker.submit)."""
        if self.io.on_worker():
            job(self._index())
            return

        def run() -> DiskNews:
            index = self._index()
            try:
                job(index)
            except Exception:
                log.exception("a cache disk job failed")
            return index.news()

        self.io.submit(run, key=key, defer=defer)

    def promise(self, key: str) -> Promise:
        held = self._promised.get(key)
        if held is None and self._dropping:
            return NOTHING
        if held is None:
            blocks, tail = self.table.disk_rows(key)
            held = promise_of(blocks, tail, block=self.table.block, fingerprint=self.writer.fingerprint)
        return held

    def written(self, key: str, settle: Callable[[], None]) -> bool:
        """Wait, on the engine thread, for the session's own writes still queued: at most
        WRITTEN_WAIT seconds; whether there were any (`settle`: the store's, taking in reports).

        One of the two places the engine waits for the disk while it serves (the
        other: ranks in lockstep wait for a read; docs/architecture.md, "Threads"). A checkout asks only when
        the session's live cache and warm snapshot cannot serve its turn (a
        window cache rewound by a regenerate or an edit, a cache paged out) and
        those queued writes hold what can: rare, and a few milliseconds, for
        the writes neither give way to turns nor linger meanwhile (`hurry`).
        """
        if not self.io.queued(key):
            return False
        deadline = time.monotonic() + WRITTEN_WAIT
        with self.io.hurry():
            while (left := deadline - time.monotonic()) > 0:
                seen = self.io.done_count()
                settle()
                if not self.io.queued(key):
                    break
                self.io.wait_done(seen, timeout=left)
        return True

    def write_behind(self, key: str, cache: list[Any] | Snapshot, tokens: list[int], keys: list[str], *,
                     evict: bool = True, captured: dict[int, Snapshot] | None = None,
                     points: dict[int, Snapshot] | None = None) -> None:
        """Evaluate what disk will lack of `tokens` and queue its writing.

        `cache` is a live cache, or a snapshot of all of `tokens` (paging out at
        shutdown); `keys` the keys of the whole blocks its chain lists, hashed
        once by the table; `captured` a window's blocks (writeback.evaluate);
        `points` the checkpoints of a live cache that cannot be cut (end -> its
        checkpoint): the private tail ends a segment at each, so that disk keeps
        the state there too (a regenerate after a restart comes back to it).
        """
        rewrite = isinstance(cache, Snapshot) and not cuttable(cache)  # a window: written whole or not at all
        splits = sorted(points) if points and isinstance(cache, list) and not cuttable(cache) else []
        blocks_from, private_from, after = plan(self.promise(key), tokens, whole=len(keys),
                                                block=self.table.block, max_segments=self.max_segments,
                                                rewrite=rewrite, splits=splits)
        pieces = evaluate(cache, tokens, blocks_from, private_from, after, self.table.block, captured, points)
        self._promised[key] = after
        writer = self.writer
        self.later(lambda _: writer.persist(key, pieces, tokens, keys, evict=evict, rewrite=rewrite, splits=splits),
                   key, defer=True)

    def dropped(self, key: str, row: BlockRow | SegmentRow, e: CorruptSegment) -> None:
        """A file failed verification: unlist it and what follows it (a block: in every chain)."""
        if isinstance(row, BlockRow):
            block = row.block
            log.warning("dropping cache block %s: %s; every session that lists it will prefill "
                        "from token %d", row.path, e, row.start)
            self.later(lambda index: index.drop_block(block), DROPPING)
            self._promised.clear()  # any chain may list it: plan from what the worker reports
            self._dropping = True
        else:
            log.warning("dropping cache file %s: %s; the session will prefill instead", row.path, e)
            start = row.start
            self._promised[key] = self.promise(key).cut(start)
            self.later(lambda index: index.drop_from(key, start), key)

    def kept_for(self) -> dict[str, list[str]]:
        """By session, the other models disk keeps a cache for: read from the index at start and again
        only once the worker reported a change to another model's rows (an eviction, a deletion)."""
        if self._kept_for is None:
            self._kept_for = self._index().models_of()
        return self._kept_for

    def count(self) -> dict[str, int]:
        """Count every model's bytes on disk (`by_model`): on the I/O worker, where the index is read."""
        try:
            self.by_model = self._index().bytes_by_model()
        except sqlite3.Error:  # a busy or full disk: the last count stays
            log.debug("counting the disk's bytes failed", exc_info=True)
        return self.by_model

    def statistics(self, budget: int) -> dict[str, Any]:
        """The disk tier's figures: this model's sessions, segments and bytes; every model's bytes (one
        budget holds them all), as `count` last found them, in all and by model."""
        t, by_model = self.table, dict(self.by_model)
        return {"sessions": len(t.on_disk), "segments": t.disk_segments, "model_bytes": t.disk_bytes,
                "bytes": sum(by_model.values()) if by_model else t.disk_bytes, "by_model": by_model,
                "budget": budget, **t.sharing()}

    def forget(self, key: str) -> None:
        self.later(lambda index: index.forget(key), key)  # every model's; after its queued writes, which it undoes
        self._promised[key] = NOTHING

    def page_out(self, resident: Tier[list[Any]], warm: WarmTier) -> None:
        """Queue the writing of every session memory holds (on shutdown; the caller waits for it).

        No evictions for this: it must not push out caches used more recently.
        """
        for key in resident:
            cache = resident.peek(key)
            if cache is not None:
                s = self.table.session(key)
                try:
                    self.write_behind(key, cache, s.tokens, s.keys, evict=False)
                except Exception as e:
                    log.warning("could not page out %s: %s", key, e)
        for key in warm.held_or_warm():
            got = warm.parts(key)
            if got is None or not got[0] or got[0][0].start != 0:
                continue
            parts, toks = got
            toks = toks[:parts[-1].end]
            if self.promise(key).tokens[:len(toks)] == tuple(toks):
                # Disk holds it already (written behind its turn, or prefetched from there). Written again,
                # a window's snapshot, which cannot be cut, would replace the session's blocks and files
                # with one file from 0: the only places a turn parting from its ids before the end (a
                # regenerate, an OpenAI request's new render of the answer) can restore at (issue 51).
                continue
            try:
                # A packed snapshot is saved at its rounded precision: the best there is.
                snap = merge(*[unpack(p) for p in parts])
                keys = self.table.keys_for(key, toks)[:whole_blocks(len(toks), self.table.block)] \
                    if cuttable(snap) else []
                self.write_behind(key, snap, toks, keys, evict=False)
            except Exception as e:
                log.warning("could not page out %s: %s", key, e)
