"""A turn's parameters as typed shapes: each rule about them is written here, once.

config.toml's `[generation]`, the websocket's chat requests and `session.update`
params, and the OpenAI door's body all validate through these pydantic types,
with the configured `Limits` as the validation context. A door never restates a
range: it catches the `ValidationError` and words it in its own shape (a
`bad_request` / `too_large` event, an OpenAI 400 with `param`, a config line),
reading the rule's words from `bounds` and the error types named below.

The ranges themselves live in `common/limits.py` (a table every package may
read); this module turns them into validators. It imports pydantic, so only
the daemon imports it: kvchat reads `protocol/__init__` alone and starts
without it (tests/test_tui_render.py checks).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo
from pydantic_core import PydanticCustomError

from common.limits import MAX_STOP_CHARS, MAX_STOPS, SEED_MAX, TEMPERATURE, TOP_P

from . import PARAMS


@dataclass(frozen=True)
class Limits:
    """What a request may ask for (config.toml's [limits]): the context every shape validates against."""

    max_text_chars: int  # a message's or a system prompt's characters
    max_tokens_limit: int  # the most a request's max_tokens may be


# The error types this module raises (pydantic's own name the rest: int_type, greater_than, ...).
ABOVE_LIMIT = "above_max_tokens_limit"  # ctx: limit
TEXT_TOO_LONG = "text_too_long"  # ctx: limit
TOO_MANY_STOPS = "too_many_stops"  # ctx: limit, count
STOP_TOO_LONG = "stop_too_long"  # ctx: limit, index, length

# pydantic's error types for "a value of the wrong type" (strict mode: "5" is not a number, true not a count).
TYPE_ERRORS = frozenset({"int_type", "float_type", "string_type", "list_type", "dict_type", "bool_type",
                         "int_from_float", "model_type", "model_attributes_type", "literal_error"})


def _limits(info: ValidationInfo) -> Limits:
    if not isinstance(info.context, Limits):
        raise TypeError("validate a turn's parameters with context=Limits(...)")
    return info.context


def _within_max_tokens_limit(value: int, info: ValidationInfo) -> int:
    limit = _limits(info).max_tokens_limit
    if value > limit:
        raise PydanticCustomError(ABOVE_LIMIT, "max_tokens may be at most {limit} "
                                  "(limits.max_tokens_limit in kvd's config.toml)", {"limit": limit})
    return value


def fits_text(text: str, limits: Limits) -> str:
    """The text bound of a message or a system prompt: at most `max_text_chars` characters."""
    if len(text) > limits.max_text_chars:
        raise PydanticCustomError(TEXT_TOO_LONG, "is longer than {limit} characters "
                                  "(limits.max_text_chars in kvd's config.toml)", {"limit": limits.max_text_chars})
    return text


def _fits_text(text: str, info: ValidationInfo) -> str:
    return fits_text(text, _limits(info))


def _check_stops(stop: str | list[str] | None) -> str | list[str] | None:
    if isinstance(stop, list) and len(stop) > MAX_STOPS:
        raise PydanticCustomError(TOO_MANY_STOPS, "at most {limit} stop sequences (got {count})",
                                  {"limit": MAX_STOPS, "count": len(stop)})
    for i, one in enumerate(stops(stop)):
        if len(one) > MAX_STOP_CHARS:
            raise PydanticCustomError(STOP_TOO_LONG, "a stop sequence may be at most {limit} characters "
                                      "(stop[{index}] has {length})",
                                      {"limit": MAX_STOP_CHARS, "index": i, "length": len(one)})
    return stop


# The knobs a request may add to its sampling (its own only: no session or config default; None: off).
KNOBS = ("top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "penalty_window",
         "logit_bias")
LOGIT_BIAS = 100.0  # a logit_bias value is within +-this, as OpenAI's
MAX_LOGIT_BIAS = 300  # token ids one request may bias, as OpenAI's
MAX_PENALTY_WINDOW = 4096  # recent tokens a repetition penalty looks at, at most

# One type per rule. strict: a number is not a string, and true is not 1.
MaxTokens = Annotated[int, Field(ge=1, strict=True), AfterValidator(_within_max_tokens_limit)]
Temperature = Annotated[float, Field(ge=TEMPERATURE.low, le=TEMPERATURE.high, allow_inf_nan=False, strict=True)]
TopP = Annotated[float, Field(gt=TOP_P.low, le=TOP_P.high, allow_inf_nan=False, strict=True)]
Seed = Annotated[int, Field(ge=0, le=SEED_MAX, strict=True)]
Text = Annotated[str, Field(strict=True), AfterValidator(_fits_text)]
Stop = Annotated[str | list[str] | None, AfterValidator(_check_stops)]
TopK = Annotated[int, Field(ge=0, strict=True)]  # 0: off
MinP = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False, strict=True)]  # 0: off
RepetitionPenalty = Annotated[float, Field(gt=0.0, le=10.0, allow_inf_nan=False, strict=True)]  # 1: off
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False, strict=True)]  # presence, frequency: 0 off
PenaltyWindow = Annotated[int, Field(ge=1, le=MAX_PENALTY_WINDOW, strict=True)]


class Shape(BaseModel):
    """Strict, and deaf to fields it does not know (each door decides whether those are an error)."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class Sampling(Shape):
    """A turn's sampling values, the one value for them from a request's parser to the engine.

    As a request gives them, None leaves one to the next source; `resolve`
    fills every one (the request's, else the session's, else the config's),
    once, in the turn core, and the engine runs with that.
    """

    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    # The knobs (KNOBS): a request's own, carried through `resolve` as given (engine/processing.py applies them).
    top_k: TopK | None = None
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    penalty_window: PenaltyWindow | None = None  # recent tokens the penalties look at (None: mlx-lm's 20)
    logit_bias: tuple[tuple[int, float], ...] | None = None  # (token id, added to its logit), ids checked by the door

    @classmethod
    def of(cls, max_tokens: int, temperature: float, top_p: float) -> Sampling:
        """Every value set, each already checked (the config's, a resolved turn's, rank 0's copy)."""
        return cls.model_construct(max_tokens=max_tokens, temperature=temperature, top_p=top_p)

    def given(self) -> dict[str, int | float | None]:
        return {name: getattr(self, name) for name in PARAMS}

    def knobs(self) -> dict[str, Any]:
        """The knobs the request set (KNOBS, those not None)."""
        return {name: value for name in KNOBS if (value := getattr(self, name)) is not None}


def bounds(field: str, limits: Limits) -> str:
    """What a sampling field must be, in an error's words: `1-4096`, `in [0, 2]`, `in (0, 1]`."""
    if field == "max_tokens":
        return f"1-{limits.max_tokens_limit}"
    return f"in {(TEMPERATURE if field == 'temperature' else TOP_P).describe()}"


def resolve(request: Mapping[str, Any], session: Mapping[str, Any], defaults: Sampling, *,
            max_tokens_limit: int, knobs: Mapping[str, Any] | None = None) -> Sampling:
    """Which value wins, for every door: the request's, else the session's params, else the config's
    (`defaults`, every value set); the result has every value set.

    A session's max_tokens was checked against max_tokens_limit when it was
    set; the limit may have been lowered since, so it is clamped here.
    """

    def pick(name: str) -> Any:
        for source in (request, session):
            if source.get(name) is not None:
                return source[name]
        return getattr(defaults, name)

    resolved = Sampling.of(max_tokens=min(int(pick("max_tokens")), max_tokens_limit),
                           temperature=float(pick("temperature")), top_p=float(pick("top_p")))
    return resolved.model_copy(update=dict(knobs)) if knobs else resolved


def merge(current: Mapping[str, Any], change: Mapping[str, Any]) -> dict[str, Any]:
    """A session's params with `change` applied: a value sets its key, None removes it."""
    merged = dict(current)
    for key, value in change.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = value
    return merged


def stops(stop: str | list[str] | None) -> list[str]:
    """A request's stop sequences as a list (OpenAI's `stop` is a string or a list of them)."""
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


# -- the guard that runs before any parsing ----------------------------------------------------------------


BAD_KEY = "a key"  # the path's last step when a key, not a value, is what is not text


def lone_surrogate(value: Any) -> tuple[str | int, ...] | None:
    """The path of the first string holding a lone UTF-16 surrogate ("\\ud800"), which JSON allows and
    UTF-8 cannot carry; a bad key ends its path with BAD_KEY. None when all is text.

    Both doors run it on the decoded JSON before validating (a bad string must
    never reach the store or a log). Iterative: a value nested just under the
    parser's limit must not overflow the stack here.
    """
    steps: list[tuple[int, str | int]] = []  # (parent's step, key or index): a path costs nothing until it is asked for
    stack: list[tuple[int, Any]] = [(-1, value)]

    def path(at: int, *last: str | int) -> tuple[str | int, ...]:
        keys: list[str | int] = list(last)
        while at >= 0:
            at, key = steps[at]
            keys.append(key)
        return tuple(reversed(keys))

    while stack:
        at, item = stack.pop()
        if isinstance(item, dict):
            for key, inner in item.items():
                if not _encodable(key):
                    return path(at, BAD_KEY)
                steps.append((at, key))
                stack.append((len(steps) - 1, inner))
        elif isinstance(item, list):
            for i, inner in enumerate(item):
                steps.append((at, i))
                stack.append((len(steps) - 1, inner))
        elif isinstance(item, str) and not _encodable(item):
            return path(at)
    return None


def _encodable(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
