"""A turn's events: what the turn core publishes, as typed values each door encodes in its own shape.

The turn core (turns.py) publishes these to every listener of a turn, in this
order: `AnswerStarted` once; `AnswerQueued` while it waits for the engine;
`AnswerReading` once the engine has taken the prompt; `AnswerProgress` while
it reads a long prompt; `AnswerDelta` for each piece of shown text; then
`AnswerToolCall` for each call the answer made (parsed once, by the turn core,
when the request offered tools; their text never arrives as a delta); then
exactly one of `AnswerDone` (committed, whatever its finish) or `AnswerError`.
The engine emits `AnswerQueued`, `AnswerProgress`, `AnswerDelta` and
`AnswerError` to the turn core as these same values (engine/jobs.py): the
turn core passes the first two on as they are, numbers the deltas it shows
(a stop sequence or a tool call's text is never shown) and says whether an
error came after text (`answered`).

Each delta carries `written`, which every listener that got it calls right
after writing it to its client (or as soon as it knows it never will: its
client has gone, it sends nothing before the end). The turn core publishes
the next delta, holding everything said meanwhile, only once every listener
has (turn.py, `Turn.show`): a slow reader gets fewer, bigger deltas, and the
engine never waits for it. The first delta's call is also the first token's
hand-off: the engine waits for it, a few milliseconds at most, before its
next step, so that step does not hold the first token back (engine/steps.py,
FIRST_HANDOFF_S). A door that forgets it stalls its answer's text until the
end, and costs the first token that bound.

The websocket door turns them into protocol frames (`protocol.wire`), the
OpenAI doors into their JSON bodies and server-sent events, the Anthropic door
into its own. No door reads another door's wire format. Plain data: no MLX,
no I/O, frozen.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class AnswerStarted:
    """The answer has a place in the session: its message index (the assistant message to come)."""

    message_index: int


@dataclass(frozen=True, slots=True)
class AnswerQueued:
    position: int  # 1: the next to start; published again whenever it moves up


@dataclass(frozen=True, slots=True)
class AnswerReading:
    """The engine has taken the prompt: it fits the model's context and its cache is restored; what the
    cache did not hold is read (prefilled) next. The answer's input figures, known before its first token
    (Anthropic's `message_start` carries them); the same as its `AnswerDone` usage's."""

    prompt_tokens: int  # the prompt's tokens in all
    cached_tokens: int  # of those, restored from a cache instead of read


@dataclass(frozen=True, slots=True)
class AnswerProgress:
    """How far a long prompt's reading has got (a few a second at most)."""

    fed: int  # prompt tokens in the cache now (restored ones included)
    total: int  # prompt tokens in all


@dataclass(frozen=True, slots=True)
class AnswerDelta:
    seq: int  # per turn, from 0, no gaps: a client that reattaches asks for what it missed by seq
    text: str  # everything the answer said since the delta before (one token's text, or many)
    # Call once written to the client (see above); None on a replayed delta (chat.attach).
    written: Callable[[], None] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class AnswerToolCall:
    """One function call of the answer, as kept in the transcript (its id is made once, by the turn core)."""

    index: int  # its place among the answer's calls, from 0
    id: str
    name: str
    arguments: str  # JSON text, as the model wrote it (re-serialized when the parser gave an object)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One token's log-probability under the model (the log-softmax of its logits, before temperature), and the
    `top` most likely tokens at its position with theirs, most likely first (a request's top_logprobs). None
    for a prompt's first token, which nothing before it predicts."""

    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class AnswerDone:
    """The answer is committed (durably). `finish_reason`: "stop", "length" or "cancelled"; a door that
    offered tools and got calls says so in its own words (OpenAI "tool_calls", Anthropic "tool_use")."""

    message_index: int
    finish_reason: str
    usage: Mapping[str, Any]  # the wire's usage object (docs/protocol.md, chat.done): every figure kvd has
    content: str = ""  # the kept answer's text without its tool calls' text
    calls: tuple[AnswerToolCall, ...] = field(default=())
    # Asked for (a request's logprobs): each answer token's, in order (the stop token not among them); and the
    # prompt's, each of its tokens (a text completion's echo).
    logprobs: tuple[TokenLogprob, ...] | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True, slots=True)
class AnswerError:
    """The turn failed or was refused; `code` is one of protocol's error codes, `message` says what to do.
    `answered`: some text had been published before (a door that has not begun its response may still
    answer with an HTTP error status)."""

    code: str
    message: str
    answered: bool = False


TurnEvent = (AnswerStarted | AnswerQueued | AnswerReading | AnswerProgress | AnswerDelta | AnswerToolCall | AnswerDone
             | AnswerError)


CACHE_FIGURES = ("restored_from", "shared_tokens", "ttft_ms", "prefill_tokens", "drafted_tokens", "accepted_tokens",
                 "model", "kept_for", "max_tokens", "max_tokens_asked", "context_full")


def cache_figures(usage: Mapping[str, Any]) -> dict[str, Any]:
    """What the cache did for a finished answer, from its usage: the `kvd` object every HTTP door adds to
    its own usage (where the cache came from, what was shared, read and drafted; the model that answered,
    the others that keep a cache of the session; the output limit, and what was asked when the door rules
    lowered it), one definition for all. A figure the usage lacks is null."""
    return {key: usage.get(key) for key in CACHE_FIGURES}
