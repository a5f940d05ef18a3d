"""The OpenAI chat-completions request, validated; errors in OpenAI's shape.

pydantic in strict mode: "5" is not a number and true is not a count, as
for the websocket protocol (requests.py). A turn's parameters (max_tokens,
temperature, top_p, stop, seed, a message's text) are the shared shapes of
protocol/shapes.py, checked against config's limits; this module words their
errors as OpenAI's 400s, `param` naming the field. Fields the API defines but kvd
does not implement are refused when they ask for something and
ignored when they are left at their defaults; unknown fields are ignored, as OpenAI's clients
add new ones often. The sampling knobs (`Knobs`: top_k, min_p, the penalties, logit_bias) and
logprobs are the engine's (engine/processing.py, engine/logprobs.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from http import HTTPStatus
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic_core import ErrorDetails

from common.limits import MAX_MESSAGES, MAX_TOOLS
from protocol.shapes import (
    ABOVE_LIMIT,
    BAD_KEY,
    LOGIT_BIAS,
    MAX_LOGIT_BIAS,
    STOP_TOO_LONG,
    TEXT_TOO_LONG,
    TOO_MANY_STOPS,
    Limits,
    MinP,
    Penalty,
    RepetitionPenalty,
    Seed,
    Stop,
    Temperature,
    TopK,
    TopP,
    fits_text,
    lone_surrogate,
)
from protocol.shapes import stops as stop_list

from ..config import Config
from .httpdoor import ApiError
from .rules import OutputLimit, text_only

MAX_TOP_LOGPROBS = 20  # alternatives per token (OpenAI's own limit)
Choices = Annotated[int, Field(ge=1)]  # `n`: answers drawn for one request, at most limits.max_generations
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}  # pydantic names union members in error paths


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class OpenAICalledFunction(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class OpenAIToolCall(_Strict):
    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: OpenAICalledFunction

    def stored(self) -> dict[str, str]:
        """As the transcript keeps a call: {"id", "name", "arguments"}."""
        return {"id": self.id, "name": self.function.name, "arguments": self.function.arguments}


class ChatMessage(_Strict):
    # "developer" is OpenAI's newer name for a system message, and is one here.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # an assistant's may be null (as clients send it back)
    name: str | None = None  # accepted and ignored: the chat template has no place for it
    tool_calls: list[OpenAIToolCall] | None = None  # an assistant's calls, sent back as the answer gave them
    tool_call_id: str | None = Field(default=None, max_length=256)  # a tool message: the call it answers
    # An assistant's reasoning sent back apart from its content (vLLM-style clients; `reasoning` is vLLM's
    # newer name): the chat template renders it where it renders reasoning (Qwen3: in <think>).
    reasoning_content: str | None = None
    reasoning: str | None = None

    @field_validator("content")
    @classmethod
    def _fits(cls, content: str | list[TextPart] | None, info: ValidationInfo) -> str | list[TextPart] | None:
        return fits(content, info)

    @field_validator("reasoning_content", "reasoning")
    @classmethod
    def _reasoning_fits(cls, text: str | None, info: ValidationInfo) -> str | None:
        return fits(text, info)

    def thought(self) -> str | None:
        """An assistant's reasoning as sent (`reasoning_content`, else `reasoning`); None for other roles."""
        if self.role != "assistant":
            return None
        return self.reasoning_content if self.reasoning_content is not None else self.reasoning

    @property
    def instructs(self) -> bool:
        return self.role in ("system", "developer")

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


Content = TypeVar("Content", bound=str | Sequence[Any] | None)


def _part_texts(parts: Any) -> Iterable[str]:
    return (part.text for part in parts)


def fits(content: Content, info: ValidationInfo, texts: Callable[[Any], Iterable[str]] = _part_texts) -> Content:
    """The same bound as the websocket door's text (limits.max_text_chars), on a message's parts joined
    (their `texts`), in every HTTP door."""
    if isinstance(info.context, Limits) and content is not None:
        fits_text(content if isinstance(content, str) else "".join(texts(content)), info.context)
    return content


class JsonSchemaFormat(_Strict):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionSpec(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema; the chat template shows it to the model
    strict: bool | None = None


class OpenAITool(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Strict):
    include_usage: bool = False


class Knobs(_Strict):
    """The sampling knobs beyond temperature and top_p a request may set (vLLM's and mlx_lm.server's names,
    OpenAI's penalties and logit_bias): carried to the engine as the turn's Sampling (protocol/shapes.py)."""

    top_k: TopK | None = None
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-LOGIT_BIAS, le=LOGIT_BIAS, allow_inf_nan=False)]] | None = \
        Field(default=None, max_length=MAX_LOGIT_BIAS)

    def knobs(self) -> dict[str, Any]:
        """The knobs set, as Sampling takes them (logit_bias as (token id, bias) pairs)."""
        out: dict[str, Any] = {k: v for k in ("top_k", "min_p", "repetition_penalty", "presence_penalty",
                                               "frequency_penalty") if (v := getattr(self, k)) not in (None, 0)}
        if self.logit_bias:
            pairs = []
            for key, bias in self.logit_bias.items():
                if not key.isdigit() or len(key) > 9:
                    raise ApiError(HTTPStatus.BAD_REQUEST, f"logit_bias: {key[:20]!r} is not a token id (a string of "
                                   "digits)", param="logit_bias")
                pairs.append((int(key), float(bias)))
            out["logit_bias"] = tuple(pairs)
        return out


class OpenAIChatRequest(Knobs):
    model: str | None = None  # a model `kvd models` lists, an alias, or none (the default): the registry resolves it
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: OutputLimit | None = None  # a ceiling: lowered to what fits (rules.py)
    max_completion_tokens: OutputLimit | None = None  # wins over max_tokens when both are given
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stop: Stop = None
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Choices | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[OpenAITool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # accepted: the model calls as many as it writes
    response_format: ResponseFormat | None = None
    prompt_cache_key: str | None = None  # the client's name for its conversation: its sessions are one row

    def forced(self) -> tuple[str | None] | None:
        """A forced call: (None,) for any of the tools ("required"), (name,) for that function; None if not."""
        if self.tool_choice == "required":
            return (None,)
        if isinstance(self.tool_choice, NamedToolChoice):
            return (self.tool_choice.function.name,)
        return None

    def offered_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template shows the model: none when tool_choice is "none"."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]


def parse(body: Any, config: Config, *, surrogates: bool = True) -> OpenAIChatRequest:
    """A request body (already JSON-decoded) as an OpenAIChatRequest, or the ApiError that says what to fix.

    `surrogates=False`: the caller saw that the body's bytes cannot hold a lone surrogate
    (`may_hold_surrogates`), so its strings are not walked for one.
    """
    checked = checked_body(body, surrogates=surrogates)
    text_only(checked.get("messages"), "messages")
    req = validated(OpenAIChatRequest, checked, config)
    _check_asks(req, config)
    _check_messages(req)
    return req


def checked_body(body: Any, *, surrogates: bool = True, listed: str = "messages") -> dict[str, Any]:
    """What every HTTP door checks of a decoded body before validating it: an object, a bounded number of
    messages (`listed`: the Responses door's are its `input`; counted before validating each one: pydantic
    holds the GIL throughout, and every client waits), no lone surrogate (unless the caller saw that its
    bytes cannot hold one)."""
    if not isinstance(body, dict):
        raise ApiError(HTTPStatus.BAD_REQUEST, "the request body must be a JSON object")
    if isinstance(body.get(listed), list) and len(body[listed]) > MAX_MESSAGES:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"at most {MAX_MESSAGES} {listed} per request "
                       f"(got {len(body[listed])})", param=listed)
    if surrogates and (path := lone_surrogate(body)) is not None:
        where = where_of(path[:-1] if path[-1] == BAD_KEY else path) or "body"
        raise ApiError(HTTPStatus.BAD_REQUEST, f"{'a key in ' if path[-1] == BAD_KEY else ''}{where} holds a lone "
                       "UTF-16 surrogate (such as \\ud800), which is not text; send valid Unicode", param=where)
    return body


Shape = TypeVar("Shape", bound=BaseModel)


def validated(shape: type[Shape], body: dict[str, Any], config: Config) -> Shape:
    """The body as `shape`, checked against config's limits; the ApiError naming the field otherwise."""
    try:
        return shape.model_validate(body, context=config.request_limits())
    except ValidationError as e:
        # A union (content: a string or a list of parts) reports one error per member; the
        # deepest says most (a part's wrong type, rather than "not a string").
        raise refusal(max(e.errors(), key=lambda err: len(err["loc"]))) from None


def where_of(loc: tuple[str | int, ...]) -> str:
    """A field's path as OpenAI's `param` spells it: messages[0].content."""
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")


def refusal(error: ErrorDetails) -> ApiError:
    """One validation error as a 400; the shared shapes' own errors keep the wording docs/openai.md shows."""
    where = where_of(tuple(part for part in error["loc"] if isinstance(part, int) or part.isidentifier()
                         and part not in _UNION_TAGS))
    kind = error["type"]
    if kind == TEXT_TOO_LONG:
        return ApiError(HTTPStatus.BAD_REQUEST, f"{where.removesuffix('.content')} {error['msg']}", param=where,
                        code="string_above_max_length")
    if kind in (ABOVE_LIMIT, TOO_MANY_STOPS, STOP_TOO_LONG):  # whole sentences, naming the limit
        return ApiError(HTTPStatus.BAD_REQUEST, error["msg"], param=where,
                        code="string_above_max_length" if kind == STOP_TOO_LONG else None)
    got = repr(error.get("input"))
    got = got if len(got) <= 60 else got[:57] + "..."
    return ApiError(HTTPStatus.BAD_REQUEST, f"{where or 'body'}: {error['msg']} (got {got})", param=where or None)


def _check_asks(req: OpenAIChatRequest, config: Config) -> None:
    """What the request asks for that kvd does not do (the model it names: the door asks the registry)."""
    check_choices(req.n, config)
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(HTTPStatus.BAD_REQUEST, "top_logprobs needs logprobs: true", param="top_logprobs")
    req.knobs()  # logit_bias's keys are token ids
    if req.tool_choice not in (None, "none") and not req.tools:
        raise ApiError(HTTPStatus.BAD_REQUEST, "tool_choice asks for a tool but there are no tools; send tools "
                       "or leave tool_choice out", param="tool_choice")
    if isinstance(req.tool_choice, NamedToolChoice) and req.tools and req.tool_choice.function.name not in {
            t.function.name for t in req.tools}:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"tool_choice names {req.tool_choice.function.name[:64]!r}, which is "
                       "not among tools", param="tool_choice.function.name")
    if req.forced() is not None and req.response_format is not None and req.response_format.type != "text":
        raise ApiError(HTTPStatus.BAD_REQUEST, "tool_choice forces a tool call, whose arguments are JSON already; "
                       "leave response_format out", param="response_format")


def check_choices(n: int | None, config: Config) -> None:
    """`n` within what the engine decodes at once: the choices decode together, a row each."""
    if n is not None and n > config.max_generations:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"n: kvd draws at most {config.max_generations} choices per request "
                       "(limits.max_generations in config.toml: the answers it decodes at once); send n = "
                       f"{config.max_generations} or less, or several requests", param="n")


def _check_messages(req: OpenAIChatRequest) -> None:
    """Who may say what, and where: the roles' rules over the conversation."""
    for i, m in enumerate(req.messages):
        if m.role == "tool" and not m.tool_call_id:
            raise ApiError(HTTPStatus.BAD_REQUEST, f"messages[{i}] is a tool result without tool_call_id; "
                           "send the id of the call it answers", param=f"messages[{i}].tool_call_id")
        if m.tool_calls and m.role != "assistant":
            raise ApiError(HTTPStatus.BAD_REQUEST, f"messages[{i}] has tool_calls; only an assistant's may",
                           param=f"messages[{i}].tool_calls")
        if m.content is None and m.role != "assistant":
            raise ApiError(HTTPStatus.BAD_REQUEST, f"messages[{i}].content is null; only an assistant's may be",
                           param=f"messages[{i}].content")
        if m.instructs and i > 0 and not req.messages[i - 1].instructs:
            raise ApiError(HTTPStatus.BAD_REQUEST, "kvd takes system (or developer) messages only before the "
                           f"conversation; messages[{i}] is one after it began", param=f"messages[{i}].role")
    if all(m.instructs for m in req.messages):
        raise ApiError(HTTPStatus.BAD_REQUEST, "messages has no user or assistant message to answer",
                       param="messages")


def answers_to(name: str, config: Config) -> bool:
    """Whether the default model answers a request naming `name`, a model kvd cannot serve by that name:
    config.toml's [api] model_aliases lists it, or is "*" (every name)."""
    aliases = config.model_aliases
    return name in aliases or "*" in aliases


def instructions(req: OpenAIChatRequest) -> str | None:
    """The leading system and developer messages, joined in order (None when there are none)."""
    lead = []
    for m in req.messages:
        if not m.instructs:
            break
        lead.append(m.text())
    return "\n\n".join(lead) if lead else None


def stops(req: OpenAIChatRequest) -> list[str]:
    return stop_list(req.stop)
