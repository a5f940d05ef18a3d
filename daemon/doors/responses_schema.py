"""The Responses API's request (`POST /v1/responses`), validated, and its input as a conversation.

The same strict shapes and limits as the chat door (openai_schema.py:
pydantic in strict mode, protocol/shapes.py's ranges, errors as OpenAI's
400s with `param`), over the Responses body: `input` is a string or a list
of items (messages whose content is a string or `input_text`/`output_text`
parts, `function_call`, `function_call_output`), `instructions`, `text.format`,
`max_output_tokens`. Unknown fields are ignored, as OpenAI's clients add new
ones often; what kvd cannot do is refused when asked for (images and files,
`background`, `truncation: "auto"`, a forced tool call: the door rules,
rules.py, for what every door refuses). An `item_reference` names an item kvd
issued; the door replaces it with that item (responses_stored.referenced).

`conversation` makes the items the messages the transcript keeps (the chat
door's `Said`): an assistant's text and the calls that follow it are one
message, as the turn core keeps an answer; each `function_call_output` is a
tool message answering the call it names; a `reasoning` item is the reasoning
of the answer it comes with (its `reasoning_text` content, else its summary's
text), which the chat template renders where it renders reasoning (Qwen3: in
<think>), as the chat door's `reasoning_content`; its `encrypted_content`
means nothing to kvd.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from common import jsondepth
from common.limits import MAX_TOOLS
from protocol.shapes import Limits, Temperature, TopP, fits_text

from ..config import Config
from .httpdoor import ApiError
from .openai_schema import JsonSchemaFormat, ResponseFormat, _Strict, checked_body, validated
from .placement import Said
from .rules import OutputLimit, text_only

METADATA_KEYS = 16  # OpenAI's limits on metadata: 16 pairs, keys of 64 characters, values of 512
METADATA_KEY_CHARS = 64
METADATA_VALUE_CHARS = 512


class ContentPart(_Strict):
    # What is not text is refused first (rules.text_only); the last two: a reasoning item's.
    type: Literal["input_text", "output_text", "refusal", "reasoning_text", "summary_text"]
    text: str | None = None
    refusal: str | None = None


class InputItem(_Strict):
    """One item of `input`: its fields are checked by its type in `conversation`."""

    type: Literal["message", "function_call", "function_call_output", "reasoning", "item_reference"] = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[ContentPart] | None = None
    id: str | None = Field(default=None, max_length=256)
    call_id: str | None = Field(default=None, min_length=1, max_length=256)
    name: str | None = Field(default=None, min_length=1, max_length=64)
    arguments: str | None = None
    output: str | list[ContentPart] | None = None
    summary: list[ContentPart] | None = None  # a reasoning item's

    @field_validator("content", "output", "summary")
    @classmethod
    def _fits(cls, value: str | list[ContentPart] | None, info: ValidationInfo) -> str | list[ContentPart] | None:
        """The websocket door's bound on a message's text (limits.max_text_chars), on the parts joined."""
        if isinstance(info.context, Limits) and value is not None:
            fits_text(value if isinstance(value, str) else "".join(p.text or p.refusal or "" for p in value),
                      info.context)
        return value


class ToolSpec(_Strict):
    """A tool as the Responses API describes one: a function's name, description and JSON Schema at the top
    level. Other kinds (web_search, custom, ...) are accepted and not shown to the model."""

    type: str = Field(min_length=1, max_length=64)
    name: str | None = Field(default=None, min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def for_template(self) -> dict[str, Any]:
        """As a chat template takes a tool (the chat-completions shape)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}


class NamedTool(_Strict):
    type: str
    name: str | None = None


class TextFormat(_Strict):
    model_config = _Strict.model_config | {"populate_by_name": True}

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextOptions(_Strict):
    format: TextFormat | None = None


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=256)
    store: bool = True
    metadata: dict[str, str] | None = None
    # The answer: how long, how sampled, in what format, with which tools.
    max_output_tokens: OutputLimit | None = None  # a ceiling: lowered to what fits (rules.py)
    temperature: Temperature | None = None
    top_p: TopP | None = None

    @field_validator("instructions", "input")
    @classmethod
    def _fits(cls, value: Any, info: ValidationInfo) -> Any:
        """The websocket door's bound on a text (limits.max_text_chars): the instructions, an input string."""
        if isinstance(info.context, Limits) and isinstance(value, str):
            fits_text(value, info.context)
        return value

    text: TextOptions | None = None
    tools: list[ToolSpec] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool | None = None  # accepted: the model calls as many as it writes
    stream: bool = False
    background: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)  # each output token's, with this many alternatives
    conversation: str | dict[str, Any] | None = None
    prompt_cache_key: str | None = None  # the client's name for its conversation (Codex's): its sessions are one row

    def forced(self) -> tuple[str | None] | None:
        """A forced call: (None,) for any function ("required"), (name,) for that one; None if not."""
        if self.tool_choice == "required":
            return (None,)
        if isinstance(self.tool_choice, NamedTool):
            return (self.tool_choice.name,)
        return None

    def functions(self) -> list[ToolSpec]:
        """The function tools the chat template shows the model: none when tool_choice is "none"."""
        if self.tool_choice == "none":
            return []
        return [t for t in self.tools or () if t.type == "function"]

    def response_format(self) -> ResponseFormat | None:
        """`text.format` as the chat door's response_format (jsonoutput.py compiles either). Built from
        the validated values, not validated again: a large schema is not copied."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type != "json_schema":
            return ResponseFormat.model_construct(type=fmt.type, json_schema=None) if fmt is not None else None
        return ResponseFormat.model_construct(type="json_schema", json_schema=JsonSchemaFormat.model_construct(
            name=fmt.name or "response", description=fmt.description, schema_=fmt.schema_, strict=fmt.strict))

    def text_shown(self) -> dict[str, Any] | None:
        """`text` as the response object shows it (the schema the same object, not a copy)."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None:
            return None
        shown: dict[str, Any] = {"type": fmt.type, "name": fmt.name, "description": fmt.description,
                                 "schema": fmt.schema_, "strict": fmt.strict}
        return {"format": {k: v for k, v in shown.items() if v is not None}}


def parse(body: Any, config: Config, *, surrogates: bool = True) -> ResponsesRequest:
    """A decoded body as a ResponsesRequest, or the ApiError (4xx) that says what to fix."""
    checked = checked_body(body, surrogates=surrogates, listed="input")
    text_only(checked.get("input"), "input")
    req = validated(ResponsesRequest, checked, config)
    _check_asks(req, config)
    return req


def _bad(message: str, param: str | None) -> ApiError:
    return ApiError(HTTPStatus.BAD_REQUEST, message, param=param)


def _check_asks(req: ResponsesRequest, config: Config) -> None:
    """What the request asks for that kvd does not do, and the model it names."""
    if req.background:
        raise _bad("kvd answers in the foreground only; leave background out (or false)", "background")
    if req.truncation == "auto":
        raise _bad("kvd never drops part of a conversation to make it fit; send truncation \"disabled\" (or leave "
                   "it out): a conversation past the model's context is refused with an error that says so",
                   "truncation")
    if req.conversation is not None:
        raise _bad("kvd does not serve the Conversations API; continue a conversation with previous_response_id",
                   "conversation")
    if req.forced() is not None:
        names = {t.name for t in req.functions()}
        if not names:
            raise _bad("tool_choice forces a tool call but there are no function tools; send tools or leave "
                       "tool_choice out", "tool_choice")
        if isinstance(req.tool_choice, NamedTool) and (req.tool_choice.type != "function"
                                                       or req.tool_choice.name not in names):
            raise _bad(f"tool_choice names {str(req.tool_choice.name)[:64]!r}, which is not among the function "
                       "tools", "tool_choice.name")
        if req.text is not None and req.text.format is not None and req.text.format.type != "text":
            raise _bad("tool_choice forces a tool call, whose arguments are JSON already; leave text.format out",
                       "text.format")
    for i, tool in enumerate(req.tools or ()):
        if tool.type == "function" and tool.name is None:
            raise _bad(f"tools[{i}] is a function without a name; send its name", f"tools[{i}].name")
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema" and fmt.name is None:
        raise _bad("text.format of type \"json_schema\" needs a name (and its schema)", "text.format.name")
    _check_metadata(req.metadata)
    if isinstance(req.input, list) and not req.input:
        raise _bad("input is empty; send a string or at least one item", "input")


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > METADATA_KEYS:
        raise _bad(f"metadata holds at most {METADATA_KEYS} pairs (got {len(metadata)})", "metadata")
    for key, value in metadata.items():
        if len(key) > METADATA_KEY_CHARS or len(value) > METADATA_VALUE_CHARS:
            raise _bad(f"metadata's keys are at most {METADATA_KEY_CHARS} characters and its values at most "
                       f"{METADATA_VALUE_CHARS}", "metadata")


# --- the input as a conversation ---------------------------------------------------------------


@dataclass(frozen=True)
class ResponsesInput:
    """A request's input as the transcript keeps it: the leading system and developer messages' text
    (they join `instructions` as the system prompt) and the messages, each with the item it began at."""

    lead: tuple[str, ...]
    messages: tuple[Said, ...]
    starts: tuple[int, ...]  # messages[k] began at input[starts[k]]


def _text(parts: str | list[ContentPart] | None, where: str) -> str:
    if parts is None:
        return ""
    if isinstance(parts, str):
        return parts
    out = []
    for j, part in enumerate(parts):
        text = part.refusal if part.type == "refusal" else part.text
        if text is None:
            raise _bad(f"{where}[{j}] ({part.type}) has no text", f"{where}[{j}].text")
        out.append(text)
    return "".join(out)


def conversation(items: str | Sequence[InputItem], issued: Collection[str] = ()) -> ResponsesInput:
    """The request's input as messages (ApiError for an item that cannot be one, or a tool turn that
    answers no call, before anything is stored). `issued`: the calls of the answer the input continues
    (the previous response's), which its first outputs may answer."""
    if isinstance(items, str):
        return ResponsesInput((), (Said("user", items),), (0,))
    lead: list[str] = []
    out: list[Said] = []
    starts: list[int] = []
    thought: list[str] = []  # reasoning items not yet given to the answer they come with
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if item.type == "reasoning":
            if text := _reasoning(item, where):
                thought.append(text)
            continue
        if item.type == "item_reference":  # the door resolves them first (responses_stored.referenced)
            raise _bad(f"{where} is an item_reference kvd did not resolve; send the item itself", f"{where}.id")
        if item.type == "message":
            said = _message(item, where)
            if said is None:  # a system or developer message
                if out:
                    raise _bad(f"kvd takes system (and developer) messages only before the conversation; {where} "
                               "is one after it began: put it in instructions", f"{where}.role")
                lead.append(_text(item.content, f"{where}.content"))
                continue
        elif item.type == "function_call":
            call = _call(item, where)
            if out and out[-1].role == "assistant" and (len(starts) > 0 and _same_answer(items, starts[-1], i)):
                prev = out.pop()
                out.append(prev._replace(tool_calls=(*prev.tool_calls, call),
                                         reasoning="\n".join(filter(None, (prev.reasoning, *thought))) or None))
                thought = []
                continue
            said = Said("assistant", "", (call,))
        else:  # function_call_output
            if item.call_id is None:
                raise _bad(f"{where} is a function_call_output without call_id; send the id of the call it answers",
                           f"{where}.call_id")
            said = Said("tool", _text(item.output, f"{where}.output"), (), item.call_id)
        if said.role == "assistant" and thought:
            said = said._replace(reasoning="\n".join(thought))
        thought = []  # reasoning before a user or tool message belongs to no answer
        out.append(said)
        starts.append(i)
    _check_calls(out, starts, issued)
    if not out:
        raise _bad("input has no user message to answer (only system or developer messages)", "input")
    return ResponsesInput(tuple(lead), tuple(out), tuple(starts))


def _reasoning(item: InputItem, where: str) -> str:
    """A reasoning item's text: its reasoning_text content, else its summary (what the client has of it)."""
    if item.content:
        return _text(item.content, f"{where}.content")
    return "\n".join(_text([p], f"{where}.summary") for p in item.summary or ())


def _same_answer(items: Sequence[InputItem], start: int, i: int) -> bool:
    """Whether items start..i-1 are one answer's: an assistant message and the calls after it."""
    return all(items[k].type in ("function_call", "reasoning") or (k == start and items[k].role == "assistant")
               for k in range(start, i))


def _message(item: InputItem, where: str) -> Said | None:
    if item.role is None:
        raise _bad(f"{where} is a message without a role; send user, assistant, system or developer",
                   f"{where}.role")
    if item.content is None:
        raise _bad(f"{where} is a message without content", f"{where}.content")
    if item.role in ("system", "developer"):
        return None
    return Said(item.role, _text(item.content, f"{where}.content"))


def _call(item: InputItem, where: str) -> dict[str, str]:
    for name in ("call_id", "name", "arguments"):
        if getattr(item, name) is None:
            raise _bad(f"{where} is a function_call without {name}; send it as the response gave it",
                       f"{where}.{name}")
    assert item.call_id is not None and item.name is not None and item.arguments is not None
    try:
        jsondepth.loads(item.arguments)
    except (ValueError, RecursionError):
        raise _bad(f"{where}.arguments is not JSON text; send the arguments as the call gave them (a JSON object "
                   "as a string)", f"{where}.arguments") from None
    return {"id": item.call_id, "name": item.name, "arguments": item.arguments}


def _check_calls(messages: Sequence[Said], starts: Sequence[int], issued: Collection[str]) -> None:
    """Each function_call_output answers a call of the answer before it (as the chat door's tool messages)."""
    for m, start in zip(messages, starts):
        if m.role == "assistant":
            issued = {c["id"] for c in m.tool_calls}
        elif m.role == "tool":
            if m.tool_call_id not in issued:
                raise _bad(f"input[{start}] is the output of call {m.tool_call_id!r:.80}, which the answer before "
                           "it did not make; send the function_call item before its output (or continue the "
                           "response that made it with previous_response_id)", f"input[{start}].call_id")
        else:
            issued = set()


def calls_of(history: Sequence[Said]) -> set[str]:
    """The calls a continuation's first outputs may answer: those of the history's last answer."""
    return {c["id"] for c in history[-1].tool_calls} if history and history[-1].role == "assistant" else set()
