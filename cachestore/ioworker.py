"""The I/O worker: one thread that runs the cache store's disk jobs in the order they came.

The engine thread evaluates a snapshot's arrays and hands them here, so a
turn's segment write (the file, two fsyncs, the index commit) and a
compaction's rewrite of a whole history never hold up a decode step. One
thread, first in first out: a session's writes, drops and deletions reach
disk in the order the engine decided them, which is what keeps a deleted or
rewound session from getting a stale segment indexed after the fact.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger("kvd.cache")


class IOWorker:
    def __init__(self, name: str = "kvd-io"):
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._changed = threading.Condition()
        self._submitted = 0
        self._done = 0
        # A daemon thread: a process that dies without close() must not hang on it
        # (close() is what drains it on a clean stop).
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        """Run `job` on the worker after every job submitted before it; it must not raise to stop it."""
        with self._changed:
            self._submitted += 1
        self._jobs.put(job)

    def flush(self) -> None:
        """Wait until every job submitted so far has run (shutdown, tests, tools; never a turn)."""
        with self._changed:
            target = self._submitted
            self._changed.wait_for(lambda: self._done >= target)

    def pending(self) -> int:
        """Jobs submitted and not yet finished."""
        with self._changed:
            return self._submitted - self._done

    def close(self) -> None:
        """Run what is queued, then end the thread."""
        if self.thread.is_alive():
            self._jobs.put(None)
            self.thread.join()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except Exception:
                log.exception("a cache disk job failed")
            finally:
                with self._changed:
                    self._done += 1
                    self._changed.notify_all()
