"""One turn, as the turn core (turns.py) holds it: its state, its listeners, and what it shows.

A `Turn` is a session's next answer while it is generated and committed;
its `Listener`s (a websocket client's `Connection`, an HTTP door's
`EventStream`) hear its typed events (events.py); a `StopScan` keeps a
stop sequence from ever being shown, and a `CallSplit` (toolcalls.py) takes
the answer's tool calls out of its text. Plain objects on the event loop:
the turn core drives them.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import anyio

from protocol.requests import RequestId
from protocol.shapes import Sampling

from .engine.thread import Engine
from .events import AnswerDelta, TurnEvent
from .prompt import Prompt
from .transcripts import HeldSession, Write

# The least time between two deltas of one answer (50 a second): a model faster than that (a small one on a
# GPU) has each delta carry several tokens, so the event loop's work and the socket's sends do not grow with
# the decode rate (each websocket frame cost the loop a send: ~60% of its time per token, py-spy). The
# answer's first delta, and its last text, go out at once.
DELTA_INTERVAL = 0.02
ASKED_NOTHING = Sampling()  # a request that leaves every sampling value to the session's params and the config


class Listener(Protocol):
    """Whoever wants a turn's events (a websocket client, an HTTP response): it encodes them in its
    door's own shape (events.py), with what it needs of the turn (its request and session ids), and
    calls the first delta's `written` once it has written it (or knows it never will); must not block."""

    def hear(self, turn: Turn, event: TurnEvent) -> None: ...


class EventStream:
    """A turn's events for one HTTP response (its Listener): the response reads them from `receive`.

    Unbounded, but a turn publishes at most max_tokens deltas plus a handful
    of others, and max_tokens is bounded by config. A first delta published
    after the response has closed its end is handed off at once (nobody will write it).
    """

    def __init__(self) -> None:
        self._send, self.receive = anyio.create_memory_object_stream[TurnEvent](math.inf)

    def hear(self, turn: Turn, event: TurnEvent) -> None:
        try:
            self._send.send_nowait(event)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):  # the response is over
            if isinstance(event, AnswerDelta) and event.written is not None:
                event.written()


class Chosen(NamedTuple):
    """One event of a request's choices (n of them, each a turn), with its choice's index (`Turn.choice`)."""

    choice: int
    event: TurnEvent


class ChoiceStream:
    """The events of a request's choices for one HTTP response (its Listener, for each choice's turn), each
    with its choice's index (0: the session's own answer; one turn alone is choice 0). As EventStream."""

    def __init__(self) -> None:
        self._send, self.receive = anyio.create_memory_object_stream[Chosen](math.inf)

    def hear(self, turn: Turn, event: TurnEvent) -> None:
        try:
            self._send.send_nowait(Chosen(turn.choice, event))
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):  # the response is over
            if isinstance(event, AnswerDelta) and event.written is not None:
                event.written()


class CallSplit(Protocol):
    """An answer's tool calls taken out of its text as it streams (doors/toolcalls.py's StreamSplit,
    made by the door that offered tools): text before a call streams, the calls come at the end."""

    content: str  # after `finish`: the kept answer's text without its calls' text

    def feed(self, delta: str) -> str: ...  # the text that may be shown now

    def finish(self) -> tuple[str, list[dict[str, str]]]: ...  # the text left to show, and the calls


# --- stop sequences -------------------------------------------------------


class StopScan:
    """Finds the first stop sequence in streamed text without ever showing a piece of one.

    Text that could be the start of a stop sequence is held back until the
    next delta settles it; `feed` returns what may be shown now.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.longest = max((len(s) for s in self.stops), default=0)
        self.text = ""  # everything fed, up to (not including) a stop once one is found
        self.shown = 0
        self.hit = False
        self.found: str | None = None  # the stop sequence that ended the answer (Anthropic's stop_sequence)

    def feed(self, delta: str) -> str:
        """Work per delta grows with the delta and the stops' lengths, never with the answer so far."""
        if self.hit:
            return ""
        since = max(0, len(self.text) - self.longest + 1)  # a stop starting earlier was found before
        self.text += delta
        at, self.found = min(((i, s) for s in self.stops if (i := self.text.find(s, since)) >= 0),
                             default=(-1, None), key=lambda found: found[0])
        if at >= 0:
            self.hit = True
            self.text = self.text[:at]
            return self._release(len(self.text))
        return self._release(len(self.text) - self._held())

    def _held(self) -> int:
        """How long an end of the text is that begins some stop sequence (shown once settled)."""
        held = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text)), held, -1):
                if self.text.endswith(s[:k]):
                    held = k
                    break
        return held

    def flush(self) -> str:
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        out = self.text[self.shown:upto]
        self.shown = max(self.shown, upto)
        return out


# --- one turn -------------------------------------------------------------


@dataclass(frozen=True)
class TurnSpec:
    """What a door (or the turn core's own send, regenerate and edit) asks of a turn: the one value
    `Turns.start` takes. The session holds the turn's new messages, from `first_new`, already."""

    request_id: RequestId
    session_id: str
    first_new: int
    sampling: Sampling = ASKED_NOTHING  # the request's (None: the session's params, then the config)
    prompt: Prompt | None = None  # the turn's ids; None: the transcript under the fed-token rule
    stop: Sequence[str] = ()
    seed: int | None = None
    door: str = "websocket"  # which front door asked (the log's turn line says)
    history: bool | None = None  # the prompt holds an earlier exchange (None: first_new > 1)
    grammar: str | None = None  # the answer held to a JSON schema (doors/jsonoutput.py)
    tools: CallSplit | None = None  # the request offered tools: the answer's calls are taken out of its text
    model: str | None = None  # the model that answers, from now on, for the session; None: the session's
    # max_tokens is a ceiling, not an exact ask (an agent's "as much as fits"): lowered to the room the
    # context leaves instead of the turn being refused (Turns._fit)
    fit: bool = False
    context: int | None = None  # a context smaller than the model's the answer must fit in (Ollama's num_ctx)
    raw: bool = False  # a prompt fed as it is (a text completion): its answer's first space is kept
    logprobs: int | None = None  # each answer token's log-probability and this many alternatives (None: none)
    prompt_logprobs: bool = False  # the prompt's too (a text completion's echo)


@dataclass
class Turn:
    request_id: Any
    session_id: str
    message_index: int
    first_new: int  # the first message this turn added (taken back if it can never fit)
    subscribers: set[Listener] = field(default_factory=set)
    # The answer so far, as kept while it streams (a tool call's text included), in pieces (`text` joins them).
    pieces: list[str] = field(default_factory=list)
    seq: int = 0
    deltas: list[str] = field(default_factory=list)  # each published delta's text, by seq
    unsent: list[str] = field(default_factory=list)  # shown text waiting for the listeners to write the last delta
    writing: int = 0  # listeners that have not yet written the last published delta
    last_delta: float = -math.inf  # when the last delta was published (the event loop's clock)
    _later: asyncio.TimerHandle | None = None  # the next delta's publication, when it waits for DELTA_INTERVAL
    stop: StopScan | None = None
    finished: anyio.Event = field(default_factory=anyio.Event)  # the answer is committed, whatever its end
    cancelled: bool = False  # a cancel arrived (perhaps before the engine had the job)
    door: str = "websocket"  # which front door asked for it (the log's turn line says)
    model: str = ""  # the model answering it (the session's)
    # (the session's chosen model, its fed ids' model) before this turn, when this turn changed them
    switched_from: tuple[str | None, str | None] | None = None
    engine: Engine | None = None  # that model's engine, once loaded
    held: HeldSession | None = None  # the session as the turn core holds it
    tools: CallSplit | None = None  # the request offered tools: the answer's calls are taken out of its text
    # max_tokens is a ceiling, not an exact ask (an agent's "as much as fits"): lowered to the room the
    # context leaves instead of the turn being refused (Turns._fit)
    fit: bool = False
    context: int | None = None  # a context smaller than the model's that `fit` lowers max_tokens to (num_ctx)
    max_tokens_asked: int | None = None  # what the request asked for (None: it left it to the defaults)
    max_tokens: int | None = None  # what the answer may be, once fitted (the engine's answer has it)
    context_bound: bool = False  # max_tokens was lowered to the room the model's context leaves
    writes: list[Write] = field(default_factory=list)  # queued to the writer, not yet seen committed
    # A new session's rows (its own, its first messages), queued once the engine takes the turn:
    # a first turn refused before that leaves nothing stored, so nothing has to be deleted.
    unstored: list[Callable[[], Write]] = field(default_factory=list)
    # Set by the listener that wrote the first delta (AnswerDelta.written), or here when nobody will
    # write one; the engine waits for it (Answer.handed).
    handed: threading.Event = field(default_factory=threading.Event)
    # A request's n choices (n > 1): each a turn in a session of its own over one prompt, read once. `choice`
    # is this one's index (0: the one the others ride on, in the session the request was placed in), and
    # choice 0 lists the others in `choices` (the door cancels them with it).
    choice: int = 0
    choices: list[Turn] = field(default_factory=list)

    @property
    def text(self) -> str:
        """The answer so far (joined once per call, not per piece: read at its end and on failures)."""
        if len(self.pieces) > 1:
            self.pieces[:] = ["".join(self.pieces)]
        return self.pieces[0] if self.pieces else ""

    def publish(self, event: TurnEvent) -> None:
        for listener in list(self.subscribers):
            listener.hear(self, event)

    def show(self, text: str, *, now: bool = False) -> None:
        """Text a client may be shown: published as the next delta once every listener has written the
        last one (`written`) and DELTA_INTERVAL has passed since it, with whatever else came meanwhile;
        `now`: at once (the answer's end).

        So a delta carries everything said since the one before it: one engine step's text when the
        model is slower than DELTA_INTERVAL a token and the client keeps up, more when it is faster or
        the client reads slowly. A slow reader gets bigger deltas, never a slower engine, and its
        outbox holds one delta of a turn at a time. The first delta goes out at once.
        """
        if text:
            self.unsent.append(text)
        if not self.unsent:
            return
        if not now:
            if self.writing:
                return  # `_written` shows it
            loop = asyncio.get_running_loop()
            if (wait := self.last_delta + DELTA_INTERVAL - loop.time()) > 0:
                if self._later is None:
                    self._later = loop.call_later(wait, self._due)
                return
        if self._later is not None:
            self._later.cancel()
            self._later = None
        text, self.unsent[:] = "".join(self.unsent), []
        self.deltas.append(text)
        self.writing = len(self.subscribers)
        event = AnswerDelta(self.seq, text, self._written if self.writing else None)
        self.seq += 1
        self.last_delta = asyncio.get_running_loop().time()
        if not self.writing:
            self.handed.set()  # nobody writes it: the engine need not wait
        self.publish(event)

    def _due(self) -> None:
        self._later = None
        self.show("")

    def _written(self) -> None:
        """A listener wrote the last delta (or never will): the first one's hand-off to the engine, and
        the next delta goes out once every listener has."""
        if not self.handed.is_set():
            self.handed.set()
        self.writing = max(0, self.writing - 1)
        if not self.writing and self.unsent:
            self.show("")

    def attach(self, listener: Listener, after_seq: int) -> None:
        """Re-send the deltas `listener` has not seen, as first published, then subscribe it.

        One synchronous step on the event loop: no delta can be published
        between the replay and the subscription, so there is no gap and no
        duplicate.
        """
        for seq in range(after_seq + 1, len(self.deltas)):
            listener.hear(self, AnswerDelta(seq, self.deltas[seq]))
        self.subscribers.add(listener)
