"""What goes into the engine and what comes out of it: the types the turn core shares with the engine.

A turn core (turns.py) submits an AnswerJob; the engine thread answers
through the job's `emit` with EngineEvents, in this order: `AnswerQueued`
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

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from protocol.shapes import Sampling

from ..events import AnswerDelta, AnswerError, AnswerProgress, AnswerQueued

# --- jobs in ---------------------------------------------------------------


@dataclass
class AnswerJob:
    """A turn's prompt as token ids, made by the turn core's tokenizer stage: the engine never tokenizes."""

    session_id: str
    tokens: list[int]
    sampling: Sampling  # max_tokens, temperature, top_p: every one set (resolved once, by the turn core)
    emit: Callable[[EngineEvent], None]  # called on the engine thread; must not block
    seed: int | None = None  # seeds MLX's sampler when the turn starts
    retokenized: bool = False  # the session's fed ids were rebuilt from the transcript, not appended to
    fed_before: int = 0  # ids the session had fed in earlier turns (what a re-read is counted against)
    history: bool = True  # earlier turns come before this one's messages (what a too-long error advises)
    grammar: str | None = None  # llguidance's grammar the answer must follow (the API's response_format)
    # Set by the listener that wrote the first delta to its client (events.py, AnswerDelta.written): the
    # engine waits for it (at most FIRST_HANDOFF_S) before its next step, so the event loop sends the
    # first token without waiting behind that step for a core and the GIL. None: nobody sends it (a
    # follower rank, a test).
    handed: threading.Event | None = None
    arrived: float = field(default_factory=time.perf_counter)

    @property
    def max_tokens(self) -> int:
        assert self.sampling.max_tokens is not None, "a job's sampling is resolved"
        return self.sampling.max_tokens

    @property
    def temperature(self) -> float:
        assert self.sampling.temperature is not None, "a job's sampling is resolved"
        return self.sampling.temperature

    @property
    def top_p(self) -> float:
        assert self.sampling.top_p is not None, "a job's sampling is resolved"
        return self.sampling.top_p


class PromptTooLong(Exception):
    """The prompt plus max_tokens does not fit the model's context (answered as `too_large`)."""


# --- events out ------------------------------------------------------------


@dataclass
class Done:
    finish_reason: str  # "stop" | "length" | "cancelled"
    usage: dict[str, Any]
    tokens: list[int] | None  # every id the session's cache now holds; None: unchanged


EngineEvent = AnswerQueued | AnswerProgress | AnswerDelta | Done | AnswerError


# --- the engine's inbox, besides AnswerJobs ------------------------------


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
class ReadReported:
    """The I/O worker's reader reported on a read (cachestore's `on_read`): the engine takes the
    report in and starts the answers whose read has ended (`Steps.read_reported`)."""


@dataclass
class Status:
    reply: Callable[[dict[str, Any]], None]  # called on the engine thread
    written: bool = False  # sent back by the I/O worker once the disk writes queued before it are done
