"""An answer: what the turn core asks of the engine, and the engine's state of it (its phase, its read,
prefill or decode row, its timings), one object from its submission to its Done.

The turn core makes it (its ids, its sampling, where its events go) and
submits it; from then on it is engine-thread state (the detokenizer, the
draws and the prefill's cache are live objects), but for `handed`, which
the listener that wrote its first delta sets. What leaves the thread is a
copy: the `usage` of the Done event and the AnswerStatistics of
`Engine.statistics()` (what `kvd status` shows of an answer in progress).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import protocol as p
from protocol.shapes import Sampling

from ..events import AnswerDelta, AnswerError, TokenLogprob
from .jobs import Done, EngineEvent
from .scheduler import Phase

if TYPE_CHECKING:
    from cachestore import Pending

    from .decode import Row
    from .draws import Draws
    from .grammar import Constraint
    from .handoff import Handoff
    from .prefill import Prefill
    from .processing import Processing
    from .profile import Mark
    from .speculate import Speculation

MIN_ANSWER = 16  # tokens: below this, a lower max_tokens is not worth suggesting


@dataclass(frozen=True)
class AnswerStatistics:
    phase: str  # "prefill" | "decode"
    prompt_tokens: int
    fed: int  # prompt tokens in the cache so far (restored ones included)
    generated: int  # answer tokens sampled so far


@dataclass(frozen=True)
class EngineStatistics:
    running: int
    waiting: int
    prefilling: int
    decoding: int
    answers: Mapping[str, AnswerStatistics]  # the started answers (prefilling or decoding), by session id


@dataclass(eq=False)
class Answer:
    """One answer, from its submission to its Done: the one object, with the one field saying where it
    is (`phase`, moved by the scheduler only). Its prompt comes as token ids, made by the turn core's
    tokenizer stage: the engine never tokenizes."""

    session_id: str
    tokens: list[int]
    sampling: Sampling  # max_tokens, temperature, top_p: every one set (resolved once, by the turn core)
    # Where its events go (the turn core's sink): handed over at the end of each engine step, through
    # the engine's Handoff (handoff.py: one wake-up of the sink's event loop per step); must not block.
    emit: Callable[[EngineEvent], None]
    seed: int | None = None  # seeds MLX's sampler when the answer starts
    retokenized: bool = False  # the session's fed ids were rebuilt from the transcript, not appended to
    fed_before: int = 0  # ids the session had fed in earlier turns (what a re-read is counted against)
    history: bool = True  # earlier turns come before this one's messages (what a too-long error advises)
    grammar: str | None = None  # llguidance's grammar the answer must follow (the API's response_format)
    raw: bool = False  # a prompt fed as it is (a text completion): its answer's first space is its text's too
    logprobs: int | None = None  # each answer token's log-probability and this many alternatives (None: none)
    prompt_logprobs: bool = False  # the prompt's too (a text completion's echo): read whole, no cache restored
    # The request's other choices (n > 1), made by the turn core, each in a session of its own: they ride on
    # this answer (admitted with it, its prompt read once) until its prompt is read; then each draws its own
    # first token from the same logits and decodes from a copy of the cache (steps.py), an answer of its own.
    choices: list[Answer] = field(default_factory=list)
    # Set by the listener that wrote the first delta to its client (events.py, AnswerDelta.written): the
    # engine waits for it (at most FIRST_HANDOFF_S) before its next step, so the event loop sends the
    # first token without waiting behind that step for a core and the GIL. None: nobody sends it (a
    # follower rank, a test).
    handed: threading.Event | None = None
    arrived: float = field(default_factory=time.perf_counter)
    # The engine's, from here on.
    out: Handoff | None = None  # the engine's hand-off to the loop, once it has taken the answer
    phase: Phase = Phase.WAITING
    need: int = 0  # bytes its cache may reach (its prompt plus max_tokens): held while admitted
    told: int = 0  # the queue position it was last told, while it waits
    # Restoring: its checkout's disk read, until it reports (cachestore's `Checkout.read`).
    read: Pending | None = None
    # Prefilling: its prompt fed into its cache a chunk per step.
    prefill: Prefill | None = None
    # Decoding: its row of the decode batch.
    row: Row | None = None
    # From its start (`never_started` values before: what a cancelled waiting answer reports).
    detokenizer: Any = None
    prompt: list[int] = field(default_factory=list)
    cached_len: int = 0
    restored_from: str = p.NO_CACHE
    restore_ms: float = 0.0
    inserted: float = 0.0  # when it started (its arrival until then)
    draws: Draws | None = None  # how its tokens are chosen (None: never started)
    progress_at: float | None = None  # when the last AnswerProgress event was sent
    said: int = 0  # deltas emitted (the next one's seq)
    generated: int = 0
    t_first: float | None = None
    t_last: float | None = None
    shared_tokens: int = 0  # of cached_len, those another session's cache or shared disk blocks supplied
    prefetched: bool = False  # restored_from's tier got the cache by a prefetch from disk after the start
    checkpoint: bool = False  # the cache was restored at a checkpoint (recurrent state, a window: cachestore)
    constraint: Constraint | None = None  # the grammar its answer is held to (JSON output), from the first token
    spec: Speculation | None = None  # its drafts and their fate, while speculation is on for it
    processing: Processing | None = None  # its logits processors (its sampling's knobs), from its start
    token_logprobs: list[TokenLogprob] = field(default_factory=list)  # asked for: its shown tokens', in order
    prompt_token_logprobs: list[TokenLogprob] = field(default_factory=list)
    profiled: Mark | None = None  # the step profiler's totals when it began decoding (profile.py), when on

    def __post_init__(self) -> None:
        self.inserted = self.inserted or self.arrived

    @property
    def key(self) -> str:
        return self.session_id

    @property
    def rows(self) -> int:
        """The decode rows it will take: its own and its choices' (the scheduler admits them together)."""
        return 1 + len(self.choices)

    @property
    def members(self) -> list[Answer]:
        """This answer and the choices riding on it."""
        return [self, *self.choices]

    def taken(self, out: Handoff) -> None:
        """The engine took it: its events, and its choices', go through the engine's hand-off from now on."""
        for m in self.members:
            m.out = out

    def refuse(self, error: AnswerError) -> None:
        """It failed or was refused before its prompt was read: so did its choices."""
        for m in self.members:
            m.tell(error)

    def never_started(self, context_window: int | None) -> None:
        """Cancelled before it started: it and its choices end holding nothing (their sessions' ids unchanged)."""
        for m in self.members:
            m.tell(Done("cancelled", m.usage(context_window), None))

    def forked(self, lead: Answer) -> None:
        """A choice starts from `lead`'s read prompt: the same ids, all of them from `lead`'s cache (a copy:
        `shared`, in the usage's words), its wait counted from `lead`'s arrival."""
        self.tokens = self.prompt = lead.prompt
        self.cached_len = self.shared_tokens = len(lead.prompt)
        self.restored_from = p.SHARED
        self.arrived, self.inserted = lead.arrived, lead.inserted

    @property
    def max_tokens(self) -> int:
        assert self.sampling.max_tokens is not None, "an answer's sampling is resolved"
        return self.sampling.max_tokens

    @property
    def temperature(self) -> float:
        assert self.sampling.temperature is not None, "an answer's sampling is resolved"
        return self.sampling.temperature

    @property
    def top_p(self) -> float:
        assert self.sampling.top_p is not None, "an answer's sampling is resolved"
        return self.sampling.top_p

    def took(self, token: int, now: float, *, shown: bool) -> bool:
        """One generated token: counted and timed; streamed as text if `shown` (not a stop token).
        Whether a delta went out (a token that ends inside a character shows nothing yet)."""
        self.generated += 1
        self.t_first = self.t_first or now
        self.t_last = now
        if shown:
            self.detokenizer.add_token(token)
            if text := self.detokenizer.last_segment:
                self.say(text)
                return True
        return False

    def say(self, text: str) -> None:
        """Emit a piece of the answer's text (its seq: the engine's count; the turn core numbers what it shows)."""
        self.tell(AnswerDelta(self.said, text))
        self.said += 1

    def tell(self, event: EngineEvent) -> None:
        """An event for the turn core: into the engine's hand-off (out at the end of the step), or straight
        to `emit` before the engine has taken the answer."""
        if self.out is not None:
            self.out.put(self.emit, event)
        else:
            self.emit(event)

    def statistics(self) -> AnswerStatistics:
        pre = self.prefill if self.phase is Phase.PREFILLING else None
        return AnswerStatistics(phase="prefill" if pre is not None else "decode", prompt_tokens=len(self.prompt),
                              fed=pre.fed if pre is not None else len(self.prompt), generated=self.generated)

    def usage(self, context_window: int | None) -> dict[str, Any]:
        """The Done event's figures (the wire's `usage`)."""
        ttft = (self.t_first - self.arrived) * 1000 if self.t_first else None
        tps = None
        if self.generated > 1 and self.t_first and self.t_last and self.t_last > self.t_first:
            tps = (self.generated - 1) / (self.t_last - self.t_first)
        prefill_ms = (self.t_first - self.inserted) * 1000 if self.t_first else None
        return {
            "prompt_tokens": len(self.prompt),
            "cached_tokens": self.cached_len,
            "completion_tokens": self.generated,
            "ttft_ms": round(ttft, 1) if ttft is not None else None,
            "decode_tps": round(tps, 1) if tps is not None else None,
            "restored_from": self.restored_from,
            "prefetched": self.prefetched,
            "restored_tokens": self.cached_len,
            # Restored at a checkpoint: state kept at an earlier point than the end of the cache it came from (a
            # model with recurrent or sliding-window layers); prefill_tokens is then what was computed again.
            "checkpoint": self.checkpoint,
            # Of those, the tokens another session's cache or shared disk blocks supplied.
            "shared_tokens": self.shared_tokens,
            "restore_ms": round(self.restore_ms, 2),
            "prefill_tokens": len(self.prompt) - self.cached_len,
            "prefill_ms": round(prefill_ms, 1) if prefill_ms is not None else None,
            # Tokens fed in an earlier turn that had to be fed again (a new system prompt, an edit
            # before the cache's end, a lost cache): what a status line should own up to.
            "reread_tokens": max(min(self.fed_before, len(self.prompt)) - self.cached_len, 0),
            "context_tokens": len(self.prompt) + self.generated if self.prompt else 0,
            "context_window": context_window,
            # Speculative decoding: tokens guessed, and those of them the model kept (0 and 0: none ran).
            **(self.spec.usage() if self.spec is not None else {"drafted_tokens": 0, "accepted_tokens": 0}),
        }


def detokenizer_for(tokenizer: Any, *, raw: bool) -> Any:
    """A new streaming detokenizer for an answer. mlx-lm's drop the leading space of an answer's first text, as
    a chat answer wants ("Hello", not " Hello"); the continuation of a raw prompt keeps it (" Paris" after "The
    capital of France is"): SentencePiece's is told so (`trim_space`), and a byte-level BPE one, which always
    trims text that comes first, is given a first character that is never shown (its `last_segment` starts
    after it)."""
    detokenizer = tokenizer.detokenizer
    if raw:
        if hasattr(detokenizer, "trim_space"):
            detokenizer.trim_space = False
        elif type(detokenizer).__name__ == "BPEStreamingDetokenizer":
            detokenizer.text, detokenizer.offset = "\x00", 1
    return detokenizer


def fit_advice(prompt: int, context: int, *, history: bool = True) -> str:
    """What to do about a conversation that no longer fits, in the error a client shows.

    Without `history` (the first message alone does not fit) there is nothing to leave behind.
    """
    room = context - prompt
    new = ("start a new session carrying less of the history (kvchat: /compact)" if history
           else "send a shorter message")
    if room >= MIN_ANSWER:
        return f"lower max_tokens to {room} or less, or {new}"
    return new
