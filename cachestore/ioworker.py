"""The I/O worker: one thread that runs the cache store's disk jobs in the order they came.

The engine thread evaluates a snapshot's arrays and hands them here, so a
turn's segment write (the file, two fsyncs, the index commit) and a
compaction's rewrite of a whole history never hold up a decode step. One
thread, first in first out: a session's writes, drops and deletions reach
disk in the order the engine decided them, which is what keeps a deleted or
rewound session from getting a stale segment indexed after the fact.

The engine side keeps what it must plan with while jobs are queued: each
session's queued chain changes (a job counts as done until the worker says it
finished, so the engine never plans a segment twice), and the warm snapshots
that had to leave the warm tier before disk held them (kept aside until it
does). That bookkeeping is the engine thread's alone; the worker only reports
finished jobs through a queue.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from .index import SegmentRow

log = logging.getLogger("kvd.cache")

V = TypeVar("V")

NICENESS = 10  # the worker's scheduling priority below the engine's: see IOWorker._run


@dataclass(frozen=True)
class Change:
    """What a queued job will do to a session's chain: write [start, end), or drop from start (end None)."""

    start: int
    end: int | None
    tokens: tuple[int, ...] = ()


class IOWorker(Generic[V]):
    def __init__(self, name: str = "kvd-io"):
        self._jobs: queue.SimpleQueue[Callable[[], object] | None] = queue.SimpleQueue()
        self._changed = threading.Condition()
        self._submitted = 0
        self._done = 0
        self._finished: queue.SimpleQueue[tuple[str, int]] = queue.SimpleQueue()
        self._tickets = 0
        self._queued: dict[str, list[tuple[int, Change]]] = {}  # engine side, by session
        self._held: dict[str, V] = {}  # engine side: left warm before disk held them
        # A daemon thread: a process that dies without close() must not hang on it
        # (close() is what drains it on a clean stop).
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    # --- any thread ---

    def on_worker(self) -> bool:
        return threading.current_thread() is self.thread

    def submit(self, job: Callable[[], object], *, key: str | None = None, change: Change | None = None) -> None:
        """Run `job` on the worker after every job submitted before it.

        `change`: what it will do to session `key`'s chain, for `planned` to count
        until it finished (engine thread only).
        """
        if key is not None:
            job = self._reporting(job, key, change)
        with self._changed:
            self._submitted += 1
        self._jobs.put(job)

    def _reporting(self, job: Callable[[], object], key: str, change: Change | None) -> Callable[[], object]:
        self._tickets += 1
        ticket = self._tickets
        if change is not None:
            self._queued.setdefault(key, []).append((ticket, change))

        def run() -> None:
            try:
                job()
            finally:
                self._finished.put((key, ticket))

        return run

    def flush(self) -> None:
        """Wait until every job submitted so far has run (shutdown, tests, tools; never a turn)."""
        with self._changed:
            target = self._submitted
            self._changed.wait_for(lambda: self._done >= target)

    def close(self) -> None:
        """Run what is queued, then end the thread."""
        if self.thread.is_alive():
            self._jobs.put(None)
            self.thread.join()

    def _run(self) -> None:
        # Copying and checksumming a segment takes CPU too; on a machine with few cores the
        # decode's BLAS threads must win it, and the write takes the cycles they leave.
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICENESS)
        except (AttributeError, OSError):  # not Linux (per-thread niceness), or not allowed
            pass
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

    def settle(self) -> None:
        """Take in what the worker finished: a session with nothing queued lets its held snapshot go."""
        while True:
            try:
                key, ticket = self._finished.get(block=False)
            except queue.Empty:
                return
            left = [q for q in self._queued.get(key, []) if q[0] != ticket]
            if left:
                self._queued[key] = left
            else:
                self._queued.pop(key, None)
                self._held.pop(key, None)  # disk holds it now (or never will: it was not writable)

    def queued(self, key: str) -> bool:
        return key in self._queued

    def planned(self, key: str, rows: list[SegmentRow]) -> list[SegmentRow]:
        """The chain `rows` (as the index has it) once the jobs queued for `key` are done."""
        for _, c in self._queued.get(key, []):
            rows = [r for r in rows if r.start < c.start]
            if c.end is not None:
                rows.append(SegmentRow(key, c.start, c.end, Path(), 0, "", "", c.tokens))
        return rows

    def hold(self, key: str, value: V) -> None:
        self._held[key] = value

    def held(self, key: str) -> V | None:
        return self._held.get(key)

    def release(self, key: str) -> V | None:
        return self._held.pop(key, None)

    def held_keys(self) -> Iterator[str]:
        return iter(list(self._held))
