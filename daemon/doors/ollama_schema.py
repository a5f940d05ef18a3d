"""Ollama's API requests (/api/chat, /api/generate and the model endpoints), validated and read as kvd's
conversation; errors in Ollama's shape, `{"error": "..."}` with the HTTP status (docs/ollama.md).

pydantic in strict mode with the shared shapes of protocol/shapes.py, as every
HTTP door (openai_schema.py words a validation error; it is reused). Unknown
fields and `options` kvd has no use for (num_gpu, num_thread, use_mmap: the
machine's business, not a request's) are ignored, as Ollama ignores options a
model does not take.

What a request says becomes what every door hands placement: a system prompt
and the user, assistant and tool messages the transcript keeps (`Said`):

- leading ``system`` messages are the system prompt (joined by blank lines);
  a later one is refused, as on the chat door;
- an assistant's ``tool_calls`` carry their arguments as an object (Ollama's
  shape); they are kept as JSON text, and a call without an ``id`` (Ollama's
  clients send none back) gets the one kvd gave it: ``call_<m>_<k>``, the
  message's place in the conversation and the call's in the message
  (`call_id`), so that a conversation sent back is placed on the session
  that holds it;
- a ``tool`` message answers the call of the assistant message before its
  run whose function it names (``tool_name``), else the next one in order;
- ``images`` anywhere are refused: kvd serves text models.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from http import HTTPStatus
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from common.limits import MAX_MESSAGES, MAX_STOP_CHARS, MAX_STOPS, MAX_TOOLS, TEMPERATURE, TOP_P
from protocol.shapes import stops as stop_list

from ..config import Config
from .httpdoor import ApiError
from .openai_schema import JsonSchemaFormat, OpenAITool, ResponseFormat, checked_body, fits, validated
from .placement import Said

#: An Ollama client's `stop` may list more than OpenAI's four; kvd scans each against every delta.
NUM_PREDICT_ALL = (-1, -2)  # "until the model stops" and "fill the context": as much as fits


def error_body(e: ApiError) -> dict[str, Any]:
    """Every refusal in Ollama's shape."""
    return {"error": e.message}


def call_id(message: int, call: int) -> str:
    """The id kvd gives the `call`-th call of the conversation's `message`-th message (see the module)."""
    return f"call_{message}_{call}"


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class Options(_Strict):
    """The `options` kvd reads (Ollama's Modelfile parameters); the rest are ignored."""

    temperature: float | None = Field(default=None, ge=TEMPERATURE.low, le=TEMPERATURE.high, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=TOP_P.low, le=TOP_P.high, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0, allow_inf_nan=False)
    repeat_penalty: float | None = Field(default=None, gt=0.0, le=10.0, allow_inf_nan=False)
    repeat_last_n: int | None = Field(default=None, ge=-1)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    num_predict: int | None = Field(default=None, ge=-2)
    num_ctx: int | None = Field(default=None, ge=1)
    stop: list[str] | None = Field(default=None, max_length=MAX_STOPS)
    seed: int | None = None  # Ollama's -1 (or any negative): a random one

    @field_validator("stop")
    @classmethod
    def _short(cls, stop: list[str] | None) -> list[str] | None:
        for i, one in enumerate(stop or ()):
            if len(one) > MAX_STOP_CHARS:
                raise ValueError(f"a stop sequence may be at most {MAX_STOP_CHARS} characters (stop[{i}] has "
                                 f"{len(one)})")
        return stop


class OllamaCalledFunction(_Strict):
    name: str = Field(min_length=1, max_length=128)
    arguments: dict[str, Any] | str  # Ollama's: an object; a string is taken as JSON text


class OllamaToolCall(_Strict):
    id: str | None = Field(default=None, min_length=1, max_length=256)
    function: OllamaCalledFunction


class OllamaMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""
    images: list[Any] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = Field(default=None, max_length=128)  # a tool message: the function it answers
    tool_call_id: str | None = Field(default=None, max_length=256)
    thinking: str | None = None  # an assistant's reasoning sent back: kvd keeps none, so none is shown

    @field_validator("content")
    @classmethod
    def _fits(cls, content: str | None, info: ValidationInfo) -> str | None:
        return fits(content, info)


class _Asked(_Strict):
    """What chat and generate share."""

    model: str = Field(min_length=1, max_length=512)
    stream: bool = True
    options: Options | None = None
    format: Literal["", "json"] | dict[str, Any] | None = None
    keep_alive: float | int | str | None = None
    think: bool | Literal["low", "medium", "high"] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


class OllamaChatRequest(_Asked):
    messages: list[OllamaMessage] = Field(default_factory=list, max_length=MAX_MESSAGES)
    tools: list[OpenAITool] | None = Field(default=None, max_length=MAX_TOOLS)


class GenerateRequest(_Asked):
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[Any] | None = None

    @field_validator("prompt", "suffix", "system")
    @classmethod
    def _fits(cls, text: str | None, info: ValidationInfo) -> str | None:
        return fits(text, info)


class ModelRequest(_Strict):
    """/api/show, /api/delete, /api/pull: a model's name (`name` is the older field)."""

    model: str | None = Field(default=None, min_length=1, max_length=512)
    name: str | None = Field(default=None, min_length=1, max_length=512)
    stream: bool = True
    insecure: bool | None = None
    verbose: bool | None = None

    def named(self) -> str:
        if self.model is None and self.name is None:
            raise ApiError(HTTPStatus.BAD_REQUEST, "model is required (the name `kvd models` or /api/tags lists)")
        return self.model or self.name or ""


def parse_chat(body: Any, config: Config, *, surrogates: bool = True) -> OllamaChatRequest:
    req = validated(OllamaChatRequest, checked_body(body, surrogates=surrogates), config)
    _check_common(req)
    for i, m in enumerate(req.messages):
        if m.images:
            raise ApiError(HTTPStatus.BAD_REQUEST, f"messages[{i}] has images; kvd serves text models, which "
                           "read no images: send text only")
        if m.tool_calls and m.role != "assistant":
            raise ApiError(HTTPStatus.BAD_REQUEST, f"messages[{i}] has tool_calls; only an assistant's may")
        if m.role == "system" and i > 0 and req.messages[i - 1].role != "system":
            raise ApiError(HTTPStatus.BAD_REQUEST, "kvd takes system messages only before the conversation; "
                           f"messages[{i}] is one after it began")
    return req


def parse_generate(body: Any, config: Config, *, surrogates: bool = True) -> GenerateRequest:
    req = validated(GenerateRequest, checked_body(body, surrogates=surrogates), config)
    _check_common(req)
    if req.images:
        raise ApiError(HTTPStatus.BAD_REQUEST, "images: kvd serves text models, which read no images; send text only")
    if req.context:
        raise ApiError(HTTPStatus.BAD_REQUEST, "context (the token ids of an earlier answer) is deprecated and kvd "
                       "does not take it; send the conversation to /api/chat, whose every turn kvd caches")
    if req.template:
        raise ApiError(HTTPStatus.BAD_REQUEST, "template: kvd renders a prompt with the model's own chat template; "
                       "leave template out, or send raw: true with the prompt already templated")
    if req.raw and req.system:
        raise ApiError(HTTPStatus.BAD_REQUEST, "raw: true takes the prompt as it is, so a system prompt has no "
                       "place; put it in the prompt, or leave raw out")
    return req


def _check_common(req: _Asked) -> None:
    if req.think not in (None, False):
        raise ApiError(HTTPStatus.BAD_REQUEST, f"think: kvd does not separate a model's thinking from its answer, "
                       f"and {req.model!r} is not served as a thinking model; leave think out or false")
    if req.top_logprobs and not req.logprobs:
        raise ApiError(HTTPStatus.BAD_REQUEST, "top_logprobs needs logprobs: true")


def response_format(fmt: str | dict[str, Any] | None) -> ResponseFormat | None:
    """Ollama's `format` as the OpenAI door's response_format (jsonoutput.py compiles either)."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return ResponseFormat(type="json_object")
    assert isinstance(fmt, dict)
    return ResponseFormat.model_construct(type="json_schema", json_schema=JsonSchemaFormat.model_construct(
        name="format", schema_=fmt, strict=True))


def stops(options: Options | None) -> list[str]:
    return stop_list(options.stop if options is not None else None)


def conversation(messages: Sequence[OllamaMessage]) -> tuple[str | None, list[Said]]:
    """The request's system prompt and the rest as the transcript keeps it (see the module)."""
    lead: list[str] = []
    said: list[Said] = []
    issued: list[dict[str, str]] = []  # the calls of the assistant message before the run of tool messages
    answered: set[str] = set()
    for m in messages:
        text = m.content or ""
        if m.role == "system" and not said:
            lead.append(text)
        elif m.role == "assistant":
            calls = tuple({"id": c.id or call_id(len(said), k), "name": c.function.name,
                           "arguments": _arguments(c.function.arguments)} for k, c in enumerate(m.tool_calls or ()))
            issued, answered = list(calls), set()
            said.append(Said("assistant", text, calls))
        elif m.role == "tool":
            answers = m.tool_call_id or _answers(issued, answered, m.tool_name)
            if answers is not None:
                answered.add(answers)
            said.append(Said("tool", text, (), answers))
        else:
            issued = []
            said.append(Said(m.role, text))
    return ("\n\n".join(lead) if lead else None), said


def _answers(issued: list[dict[str, str]], answered: set[str], name: str | None) -> str | None:
    """The id of the call a tool message answers: the first unanswered one of its function, else in order."""
    open_calls = [c for c in issued if c["id"] not in answered]
    named = [c for c in open_calls if c["name"] == name] if name else []
    pick = named or open_calls
    return pick[0]["id"] if pick else None


def _arguments(arguments: dict[str, Any] | str) -> str:
    if isinstance(arguments, str):
        try:
            json.loads(arguments)
        except ValueError:
            raise ApiError(HTTPStatus.BAD_REQUEST, "a tool call's function.arguments is a string that is not "
                           "JSON; send the arguments as an object") from None
        return arguments
    return json.dumps(arguments, ensure_ascii=False)


def ollama_calls(calls: Sequence[Any]) -> list[dict[str, Any]]:
    """The answer's calls (AnswerToolCall) in Ollama's shape: arguments as an object."""
    out = []
    for i, call in enumerate(calls):
        try:
            arguments: Any = json.loads(call.arguments)
        except ValueError:
            arguments = {}
        out.append({"id": call.id, "function": {"index": i, "name": call.name,
                                                "arguments": arguments if isinstance(arguments, dict) else {}}})
    return out
