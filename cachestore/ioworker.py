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
back like a write; `on_read` tells the engine thread the reader reported,
so it takes the report in and starts the answer whose read has ended.

Writes give way to a turn that waits for its first token (`FirstTokens`).
On two cores a write-behind that runs beside the next turn's prefill takes
the CPU and the GIL that prefill needs: back to back, the forward of a
short turn on builtin:tiny took 1.2x (at 1.6k tokens) to 1.4x (at 5.8k)
as long as after a pause. So a write-behind job (`submit(defer=True)`)
starts no sooner than `GRACE` after it was queued (it is queued as a turn
ends, and a client that continues at once, a script or an agent's tool
loop, sends its next turn within a few milliseconds), and before it starts
and between its files it waits while the engine has a turn arrived,
waiting, restoring or prefilling: at most `YIELD_MAX` seconds a job, so a
stream of turns never starves the disk tier. Its snapshot was taken when
its turn ended, so waiting changes nothing it writes. Other jobs (drops,
index changes, callbacks) never wait, nor do reads: a restore is what a
waiting turn waits for. A turn that needs its own session's queued writes
(its live cache could not serve it) has the engine wait for them, hurried
(`hurry`): then no write gives way or lingers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator

from common.threadname import name_thread

log = logging.getLogger("kvd.cache")

NICENESS = 10  # the worker's scheduling priority below the engine's: see IOWorker._run
YIELD_MAX = 0.25  # seconds a write job waits at most, in all, for turns that want their first token
GRACE = 0.03  # seconds a write job waits after it was queued, for the next turn a client sends at once


class FirstTokens:
    """Whether a turn waits for its first token: what the I/O worker's writes give way to.

    The event loop says when a turn is submitted (`arrived`); the engine
    thread when it has taken it (`taken`) and, after each step, whether any
    turn still waits, restores or prefills (`engine`). Any thread may `wait`.
    A rank that follows another (docs/distributed.md) is never told of
    arrivals: its writes wait only for its own prefills.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._arrived = 0  # submitted, not yet taken by the engine thread
        self._busy = False  # the engine has a turn waiting, restoring or prefilling
        self._calm = threading.Event()
        self._calm.set()

    def arrived(self) -> None:
        with self._lock:
            self._arrived += 1
            self._calm.clear()

    def taken(self, busy: bool) -> None:
        """The engine thread took a submitted turn; `busy` as in `engine`, with it counted."""
        with self._lock:
            self._arrived = max(self._arrived - 1, 0)
            self._busy = busy
            self._settle()

    def engine(self, busy: bool) -> None:
        with self._lock:
            self._busy = busy
            self._settle()

    def _settle(self) -> None:
        if self._arrived or self._busy:
            self._calm.clear()
        else:
            self._calm.set()

    def calm(self) -> bool:
        return self._calm.is_set()

    def wait(self, timeout: float) -> float:
        """Wait until no turn wants its first token, at most `timeout` seconds; the seconds waited."""
        if timeout <= 0 or self._calm.is_set():
            return 0.0
        t0 = time.monotonic()
        self._calm.wait(timeout)
        return time.monotonic() - t0


class IOWorker:
    def __init__(self, name: str = "kvd-io", first_tokens: FirstTokens | None = None):
        self.first_tokens = first_tokens or FirstTokens()
        self._yield_left = YIELD_MAX  # of the running write job's wait (worker thread only)
        self._hurry = threading.Event()  # the engine waits for writes: none gives way, none lingers
        # (when it may start: 0 at once, else a deferred write's monotonic time), the job
        self._jobs: queue.SimpleQueue[tuple[float, Callable[[], object]] | None] = queue.SimpleQueue()
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

    def submit(self, job: Callable[[], object], *, key: str | None = None, defer: bool = False) -> None:
        """Run `job` on the worker after every job submitted before it.

        `key`: the session it writes for, counted as queued until it has run
        (call from the engine thread only when giving a key). What `job`
        returns comes back through `settle`. `defer`: a cache file's writing
        (a write-behind), which starts no sooner than `GRACE` after now and
        gives way to turns that want their first token; other jobs (drops,
        index changes, callbacks) run as soon as those before them have.
        """
        if key is not None:
            self._pending[key] = self._pending.get(key, 0) + 1
        with self._changed:
            self._submitted += 1
        self._jobs.put((time.monotonic() + GRACE if defer else 0.0, self._reporting(job, key)))

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

    def pause(self) -> None:
        """From a running write job (worker thread), between its steps: give way to a turn that
        wants its first token, within what is left of the job's `YIELD_MAX`."""
        if self.on_worker() and not self._hurry.is_set():
            self._yield_left -= self.first_tokens.wait(self._yield_left)

    def done_count(self) -> int:
        """How many jobs have run so far (for `wait_done`)."""
        with self._changed:
            return self._done

    def wait_done(self, seen: int, timeout: float) -> None:
        """Wait until more than `seen` jobs have run, at most `timeout` seconds."""
        with self._changed:
            self._changed.wait_for(lambda: self._done > seen, timeout)

    @contextlib.contextmanager
    def hurry(self) -> Iterator[None]:
        """While the engine thread waits for writes (a turn needs what they write): none gives way."""
        self._hurry.set()
        try:
            yield
        finally:
            self._hurry.clear()

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
        name_thread(self.reader.name)  # the kernel's name too (top -H, py-spy)
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
        name_thread(self.thread.name)  # the kernel's name too (top -H, py-spy)
        self._nice()
        while (queued := self._jobs.get()) is not None:
            start, job = queued
            try:
                self._yield_left = YIELD_MAX if start else 0.0
                if (early := start - time.monotonic()) > 0:
                    self._hurry.wait(early)
                self.pause()
                job()
            except Exception:
                log.exception("a cache disk job failed")
            finally:
                with self._changed:
                    self._done += 1
                    self._changed.notify_all()

    # --- the engine thread ---

    def queued(self, key: str) -> bool:
        """Writes for the session are queued or running (as of the last `settle`)."""
        return self._pending.get(key, 0) > 0

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
