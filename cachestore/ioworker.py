"""The I/O worker: one thread that runs the cache store's disk jobs in the order they came.

The engine thread evaluates a snapshot's arrays and hands them here, so a
turn's writes (its blocks, its private tail, two fsyncs each, the index
commits) and a compaction's rewrite never hold up a decode step. One thread,
first in first out: a session's writes, drops and deletions reach disk in the
order the engine decided them, which is what keeps a deleted or rewound
session from getting a stale file indexed after the fact.

The engine side counts each session's queued jobs; the worker only reports
finished jobs, with what each returned (the index rows it changed: the
engine's block table mirrors them), through a queue, which the engine takes
in with `settle()` on its own thread. Nothing mutable is shared.

Reads for a restore or a prefetch run on a second thread of the worker,
the reader (`read`): a turn waiting for its cache must not queue behind
another session's writes, and a read changes nothing on disk, so it needs
no place in the writes' order. It reads the files the engine's block table
lists (indexed, so durable) into memory the engine allocated, and reports
back like a write; `on_read` tells the engine thread a read is done so it
wakes up to admit the turn.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable

log = logging.getLogger("kvd.cache")

NICENESS = 10  # the worker's scheduling priority below the engine's: see IOWorker._run


class IOWorker:
    def __init__(self, name: str = "kvd-io"):
        self._jobs: queue.SimpleQueue[Callable[[], object] | None] = queue.SimpleQueue()
        self._reads: queue.SimpleQueue[Callable[[], object] | None] = queue.SimpleQueue()
        self._changed = threading.Condition()
        self._submitted = 0
        self._done = 0
        self._finished: queue.SimpleQueue[tuple[str | None, object]] = queue.SimpleQueue()
        self._pending: dict[str, int] = {}  # engine side: queued jobs by session
        # A daemon thread: a process that dies without close() must not hang on it
        # (close() is what drains it on a clean stop).
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()
        self.reader = threading.Thread(target=self._read_loop, name=f"{name}-read", daemon=True)
        self.reader.start()

    # --- any thread ---

    def on_worker(self) -> bool:
        return threading.current_thread() is self.thread

    def submit(self, job: Callable[[], object], *, key: str | None = None) -> None:
        """Run `job` on the worker after every job submitted before it.

        `key`: the session it writes for, counted as queued until it has run
        (call from the engine thread only when giving a key). What `job`
        returns comes back through `settle`.
        """
        if key is not None:
            self._pending[key] = self._pending.get(key, 0) + 1
        with self._changed:
            self._submitted += 1
        self._jobs.put(self._reporting(job, key))

    def _reporting(self, job: Callable[[], object], key: str | None) -> Callable[[], object]:
        def run() -> None:
            result: object = None
            try:
                result = job()
            finally:
                self._finished.put((key, result))

        return run

    def read(self, job: Callable[[], object], *, done: Callable[[], None] | None = None) -> None:
        """Run `job` on the reader, beside the writes; what it returns comes back through `settle`,
        then `done` is called (on the reader: it must not block)."""
        def run() -> None:
            result: object = None
            try:
                result = job()
            finally:
                self._finished.put((None, result))
                if done is not None:
                    done()

        self._reads.put(run)

    def report(self, result: object) -> None:
        """From a running job (worker thread): hand `result` to the engine's next `settle` now,
        before the job ends."""
        self._finished.put((None, result))

    def flush(self) -> None:
        """Wait until every job submitted so far has run (shutdown, tests, tools; never a turn)."""
        with self._changed:
            target = self._submitted
            self._changed.wait_for(lambda: self._done >= target)

    def idle(self) -> bool:
        """Whether every job submitted so far has run."""
        with self._changed:
            return self._done >= self._submitted

    def close(self) -> None:
        """Run what is queued, then end the threads."""
        if self.reader.is_alive():
            self._reads.put(None)
            self.reader.join()
        if self.thread.is_alive():
            self._jobs.put(None)
            self.thread.join()

    def _read_loop(self) -> None:
        self._nice()  # the decoding sessions' steps go first; the read takes the cycles they leave
        while (job := self._reads.get()) is not None:
            try:
                job()
            except Exception:
                log.exception("a cache read failed")

    @staticmethod
    def _nice() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICENESS)
        except (AttributeError, OSError):  # not Linux (per-thread niceness), or not allowed
            pass

    def _run(self) -> None:
        # Copying and checksumming a file takes CPU too; on a machine with few cores the
        # decode's BLAS threads must win it, and the write takes the cycles they leave.
        self._nice()
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except Exception:
                log.exception("a cache disk job failed")
            finally:
                with self._changed:
                    self._done += 1
                    self._changed.notify_all()

    # --- the engine thread ---

    def settle(self) -> tuple[set[str], list[object]]:
        """Take in what the worker finished: the sessions with nothing queued any more, and what
        each finished job returned (None for those that returned nothing), in order."""
        done: set[str] = set()
        results: list[object] = []
        while True:
            try:
                key, result = self._finished.get(block=False)
            except queue.Empty:
                return done, results
            if result is not None:
                results.append(result)
            if key is None:
                continue
            left = self._pending.get(key, 1) - 1
            if left > 0:
                self._pending[key] = left
            else:
                self._pending.pop(key, None)
                done.add(key)
