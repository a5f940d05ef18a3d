"""What goes into the engine and what comes out of it: the types the turn core shares with the engine.

A turn core (turns.py) submits an AnswerJob; the engine thread answers
through the job's `emit` with EngineEvents, in this order: `Queued` (only
past max_generations, again whenever its place moves up), `Started`,
`Progress` (long prefills), `Delta`s, then exactly one `Done` or `Failed`.
Plain data: nothing here touches MLX, so the event loop side imports it freely.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from protocol.shapes import Resolved

# --- jobs in ---------------------------------------------------------------


@dataclass
class AnswerJob:
    """A turn's prompt as token ids, made by the turn core's tokenizer stage: the engine never tokenizes."""

    session_id: str
    tokens: list[int]
    sampling: Resolved  # max_tokens, temperature, top_p: resolved once, by the turn core
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
        return self.sampling.max_tokens

    @property
    def temperature(self) -> float:
        return self.sampling.temperature

    @property
    def top_p(self) -> float:
        return self.sampling.top_p


class PromptTooLong(Exception):
    """The prompt plus max_tokens does not fit the model's context (answered as `too_large`)."""


# --- events out ------------------------------------------------------------


@dataclass
class Started:
    prompt_tokens: int
    cached_tokens: int
    retokenized: bool  # the fed ids were rebuilt from the transcript, not appended to


@dataclass
class Queued:
    position: int  # 1: the next to start; sent again whenever it moves up


@dataclass
class Progress:
    """How far a long prefill has got: sent after its first chunk, then at most every PROGRESS_EVERY."""

    fed: int  # prompt tokens in the cache now (restored ones included)
    total: int  # prompt tokens in all


@dataclass
class Delta:
    text: str


@dataclass
class Done:
    finish_reason: str  # "stop" | "length" | "cancelled"
    usage: dict[str, Any]
    tokens: list[int] | None  # every id the session's cache now holds; None: unchanged


@dataclass
class Failed:
    code: str
    message: str


EngineEvent = Queued | Started | Progress | Delta | Done | Failed


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
class RoomFreed:
    """The memory budgets every loaded model shares changed (cachestore's pool): another model waits for
    room this one's older caches hold, or room a queued answer waits for was given back."""


@dataclass
class ReadReported:
    """The I/O worker's reader reported on a read (cachestore's `on_read`): the engine takes the
    report in and starts the answers whose read has ended (`Steps.read_reported`)."""


@dataclass
class Status:
    reply: Callable[[dict[str, Any]], None]  # called on the engine thread
    written: bool = False  # sent back by the I/O worker once the disk writes queued before it are done
