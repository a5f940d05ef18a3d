"""The transcript's one writer: a thread that owns the store and commits in groups.

The event loop never touches SQLite while kvd serves: every read and write
of the store is an operation handed to this thread (`submit`), which runs
what is queued in one transaction and commits it once (group commit). A
batch that holds a durable operation (one somebody will acknowledge: a
finished answer, a new session) commits with ``synchronous=FULL``, so the
fsync covers every operation in it; a batch of streamed chunks alone
commits unsynced, as before. Each operation runs inside its own savepoint,
so one that fails (a full disk, an unknown session) fails alone and the
others in its batch still commit. A batch committed with an fsync is counted
in the same transaction and its count noted beside the database once it is
back (commits.py: how a start tells a lost WAL from a cache's tail).

Operations run in the order they were submitted, reads included: a read
sees every write submitted before it, which is how the turn core loads a
session while its last writes are still queued, and how a door answers
`session.get` with what a client was already told.

The caller waits for the operation it needs and no more: the turn core
queues a turn's first writes and hands the job to the engine at once, and
publishes `chat.done` only when the answer's commit is back (docs/caches.md
says what a crash leaves at each point).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from common.threadname import name_thread

from .commits import Noter, count_one, note_path
from .store import Store

log = logging.getLogger("kvd.transcript")

T = TypeVar("T")

MAX_BATCH = 256  # operations per transaction: a long queue still commits every so often

# Test hook (tests/crashing_kvd.py): called around each commit with
# "transcript:before-commit:LABEL" and "transcript:after-commit:LABEL", once for
# each label of an operation in it, to die there like kill -9.
crash_hook: Callable[[str], None] | None = None


@dataclass
class _Op:
    fn: Callable[[Store], Any]
    durable: bool
    future: concurrent.futures.Future[Any]
    label: str = ""  # what it writes, for crash_hook


class Writer:
    """The thread that runs every store operation, in order, committing in groups."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._queue: queue.SimpleQueue[_Op | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.batches = 0  # statistics: transactions committed
        self.operations = 0
        # Every fsynced commit is counted in it and noted beside it (commits.py): a lost WAL is found so.
        self._noter = Noter(note_path(store.path), store) if store.path is not None else None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvd-writer", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Run what is queued, then stop (the store stays open: its opener closes it)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def submit(self, fn: Callable[[Store], T], *, durable: bool = False,
               label: str = "") -> concurrent.futures.Future[T]:
        """Queue `fn(store)`; its future holds the result or the exception (never raised here)."""
        op = _Op(fn, durable, concurrent.futures.Future(), label)
        if self._thread is None:  # before serving (and in tests that drive the turn core alone): run it now
            self._batch([op])
        else:
            self._queue.put(op)
        return op.future

    async def run(self, fn: Callable[[Store], T], *, durable: bool = True) -> T:
        """`fn(store)` on the writer, committed (fsynced when durable) before this returns."""
        return await asyncio.wrap_future(self.submit(fn, durable=durable))

    async def settled(self) -> None:
        """Return once everything submitted before this call is committed."""
        await self.run(lambda store: None, durable=False)

    def _run(self) -> None:
        name_thread("kvd-writer")  # the kernel's name too (top -H, py-spy, bench/hostcost.py)
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            stop = False
            while len(batch) < MAX_BATCH:
                try:
                    op = self._queue.get_nowait()
                except queue.Empty:
                    break
                if op is None:
                    stop = True
                    break
                batch.append(op)
            self._batch(batch)
            if stop:
                return

    def _batch(self, batch: list[_Op]) -> None:
        try:
            results = self._together(batch)
        except Exception as e:
            # The group's transaction is gone (SQLite rolls a whole transaction back on some errors,
            # a full disk among them, or the commit failed): nothing of it was kept, so each
            # operation runs again alone, and fails alone.
            log.info("a transcript commit of %d operation(s) failed (%s); running each alone", len(batch), e)
            results = [self._alone(op) for op in batch]
        self.batches += 1
        self.operations += len(batch)
        for op, result, error in results:
            _settle(op.future, result, error)

    def _together(self, batch: list[_Op]) -> list[tuple[_Op, Any, BaseException | None]]:
        """One transaction, one commit (fsynced if any operation is durable); each in a savepoint."""
        db = self.store.db
        durable = any(op.durable for op in batch)
        self._synchronous(durable)
        results: list[tuple[_Op, Any, BaseException | None]] = []
        with db.atomic():
            for op in batch:
                try:
                    with db.atomic():  # a savepoint: this operation fails alone
                        result = op.fn(self.store)
                    results.append((op, result, None))
                except Exception as e:
                    if not db.conn.in_transaction:
                        raise
                    results.append((op, None, e))
            commits = self._count(durable)
            self._hook("transcript:before-commit", batch)
        self._noted(commits)
        self._hook("transcript:after-commit", batch)
        return results

    def _alone(self, op: _Op) -> tuple[_Op, Any, BaseException | None]:
        try:
            self._synchronous(op.durable)
            with self.store.db.atomic():
                result = op.fn(self.store)
                commits = self._count(op.durable)
                self._hook("transcript:before-commit", [op])
            self._noted(commits)
            self._hook("transcript:after-commit", [op])
            return op, result, None
        except Exception as e:
            return op, None, e

    def _count(self, durable: bool) -> int | None:
        """One more fsynced commit, counted in the transaction that makes it (None: not fsynced, not counted)."""
        return count_one(self.store) if durable and self._noter is not None else None

    def _noted(self, commits: int | None) -> None:
        """The commit is back: note its count beside the database (it may trail it, never lead it)."""
        if commits is not None and self._noter is not None:
            self._noter.committed(commits)

    def _synchronous(self, durable: bool) -> None:
        level = self.store.synchronous if durable else self.store.streamed_synchronous
        self.store.db.execute(f"PRAGMA synchronous = {level}")

    @staticmethod
    def _hook(point: str, batch: list[_Op]) -> None:
        if crash_hook is not None:
            for label in {op.label for op in batch if op.label}:
                crash_hook(f"{point}:{label}")


def _settle(future: concurrent.futures.Future[Any], result: Any, error: BaseException | None) -> None:
    """Hand an operation's outcome to whoever waits for it.

    A waiter that stopped waiting (an awaiting task cancelled, as at shutdown:
    `asyncio.wrap_future` cancels the future it wraps) has cancelled the future;
    the operation ran all the same (a write is kept), and nobody reads its
    outcome. Setting one on a cancelled future raises, which would end this thread.
    """
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass  # cancelled, by now or just now
