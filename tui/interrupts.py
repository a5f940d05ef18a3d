"""What Ctrl-C means: clear the line at the prompt, stop the answer while one streams."""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable, Iterator
from types import FrameType

PATIENCE = 1.0  # seconds after a cancel before another Ctrl-C gives up on the answer


class StopWaiting(Exception):
    """A later Ctrl-C on the same answer: give up on it without the daemon."""


class Interrupts:
    """What Ctrl-C means depends on where the user is.

    At a terminal's prompt it is a key (terminal.py drops the message);
    elsewhere outside an answer it is an ordinary KeyboardInterrupt. While
    an answer streams, the first one asks the daemon to cancel (the answer
    then ends with chat.done "cancelled"); one pressed again after a moment
    (the daemon should have stopped by then) stops waiting for it, and
    presses in quick succession count as one.
    One handler for the whole run, switched by state, so there is no window
    in which the wrong one is installed.
    """

    def __init__(self) -> None:
        self._cancel: Callable[[], None] | None = None
        self._cancelled_at: float | None = None

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        previous = signal.signal(signal.SIGINT, self._handle)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    @contextlib.contextmanager
    def streaming(self, cancel: Callable[[], None]) -> Iterator[None]:
        self._cancel, self._cancelled_at = cancel, None
        try:
            yield
        finally:
            self._cancel = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._cancel is None:
            raise KeyboardInterrupt
        if self._cancelled_at is None:
            self._cancelled_at = time.monotonic()
            self._cancel()  # only queues a call on the network loop
        elif time.monotonic() - self._cancelled_at >= PATIENCE:
            raise StopWaiting

