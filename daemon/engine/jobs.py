"""What goes into the engine and what comes out of it: the types the turn core shares with the engine.

A turn core (turns.py) submits an `Answer` (running.py: the one object an
answer is, from its submission to its end); the engine thread answers
through its `emit` with EngineEvents (each engine step's in one hand-off to the
event loop: handoff.py), in this order: `AnswerQueued`
(only past max_generations, again whenever its place moves up),
`AnswerProgress` (long prefills), `AnswerDelta`s, then exactly one `Done` or
`AnswerError`. All but `Done` are the turn's own events (daemon/events.py),
the values the doors read: the turn core passes them on as they are, but
for a delta's `seq` and `written` (its own, after the stop scan and the
tool-call split) and an error's `answered`. `Done` carries what only the
turn core reads: the session's ids. Plain data: nothing here touches MLX, so
the event loop side imports it freely.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..events import AnswerDelta, AnswerError, AnswerProgress, AnswerQueued, TokenLogprob


class PromptTooLong(Exception):
    """The prompt plus max_tokens does not fit the model's context (answered as `too_large`)."""


# --- events out ------------------------------------------------------------


@dataclass
class Done:
    finish_reason: str  # "stop" | "length" | "cancelled"
    usage: dict[str, Any]
    tokens: list[int] | None  # every id the session's cache now holds; None: unchanged
    logprobs: tuple[TokenLogprob, ...] | None = None  # the answer's tokens', when it asked (running.py)
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


EngineEvent = AnswerQueued | AnswerProgress | AnswerDelta | Done | AnswerError


# --- the engine's inbox, besides Answers ------------------------------


@dataclass
class Cancel:
    session_id: str


@dataclass
class Forget:
    session_id: str


@dataclass
class Stop:
    pass


@dataclass
class RoomFreed:
    """The memory budgets every loaded model shares changed (cachestore's pool): another model waits for
    room this one's older caches hold, or room a queued answer waits for was given back."""


@dataclass
class ReadReported:
    """The I/O worker's reader reported on a read (cachestore's `on_read`): the engine takes the
    report in and starts the answers whose read has ended (`Steps.read_reported`)."""


@dataclass
class StatusQuery:
    reply: Callable[[dict[str, Any]], None]  # called on the engine thread
    written: bool = False  # sent back by the I/O worker once the disk writes queued before it are done


class Inbox:
    """The engine thread's queue: what every other thread asks of it, taken in order by that thread alone.

    Closed when the thread ends (a stop): whatever is still in it, and whatever is put after, goes to the
    `late` callback at once, so an answer a turn submitted while the engine stopped (it was tokenizing)
    ends at once instead of waiting for a thread that is gone.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._late: Callable[[Any], None] | None = None

    def put(self, job: Any) -> None:
        with self._lock:
            if self._late is None:
                self._queue.put(job)
                return
        self._late(job)

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        return self._queue.get(block=block, timeout=timeout)

    def empty(self) -> bool:
        return self._queue.empty()

    def close(self, late: Callable[[Any], None]) -> None:
        """The thread ends: `late` gets what is left, and from now on what is put."""
        with self._lock:
            self._late = late
        while True:
            try:
                job = self._queue.get(block=False)
            except queue.Empty:
                return
            late(job)
