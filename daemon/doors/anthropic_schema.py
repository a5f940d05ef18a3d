"""The Anthropic Messages request, validated and read as kvd's conversation; errors in Anthropic's shape.

pydantic in strict mode, with the shared shapes of protocol/shapes.py for a
turn's parameters and text (the same bounds as the chat door's, whose
wording of a validation error, openai_schema._refusal, is reused). What a
request says becomes what every door hands placement: a system prompt and
the user, assistant and tool messages the transcript keeps (`Said`):

- ``system``: a string, or text blocks joined by blank lines;
- a message whose role is ``system`` (Claude Code sends them mid-conversation)
  is text in the user's turn: consecutive user texts are one user message;
- a user message's text blocks are joined into one user message, and each
  ``tool_result`` block becomes a tool message answering its ``tool_use_id``
  (an ``is_error`` result says so to the model: "Error: " before its text);
- an assistant message's text is its content and its ``tool_use`` blocks its
  calls, their ``input`` as JSON text (as the turn core keeps a call);
- an assistant message's ``thinking`` blocks are its reasoning (joined by
  newlines), which the chat template renders where it renders reasoning
  (Qwen3: in <think>), as vLLM-style clients' ``reasoning_content``;
  ``redacted_thinking`` blocks hold no text, and are dropped;
- ``image`` and ``document`` blocks are refused: kvd serves text models (the
  door rules, rules.py, word it as every door does).

``cache_control`` on any block is accepted and means nothing: kvd caches every
conversation. Unknown fields are ignored, as Anthropic's clients add new ones.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from http import HTTPStatus
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from common.limits import MAX_MESSAGES, MAX_TOOLS
from protocol.shapes import Stop, Temperature, TopP

from ..config import Config
from .httpdoor import ApiError
from .openai_schema import JsonSchemaFormat, ResponseFormat, checked_body, fits, validated
from .placement import Said
from .rules import OutputLimit, text_only
from .toolturns import stray_result

#: Anthropic's error type for each status kvd answers with.
ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "invalid_request_error",
    HTTPStatus.UNAUTHORIZED: "authentication_error",
    HTTPStatus.FORBIDDEN: "permission_error",
    HTTPStatus.NOT_FOUND: "not_found_error",
    HTTPStatus.METHOD_NOT_ALLOWED: "invalid_request_error",
    HTTPStatus.CONFLICT: "invalid_request_error",
    HTTPStatus.REQUEST_TIMEOUT: "timeout_error",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "request_too_large",
    HTTPStatus.TOO_MANY_REQUESTS: "rate_limit_error",
    HTTPStatus.SERVICE_UNAVAILABLE: "overloaded_error",
}

#: Content block types a request may carry, for the refusal of any other.
BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


def error_body(e: ApiError) -> dict[str, Any]:
    """An ApiError (every door's refusal) in Anthropic's shape."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"), "message": e.message}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextBlock(_Strict):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=128)
    input: dict[str, Any]


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: str | list[TextBlock] | None = None
    is_error: bool = False

    def text(self) -> str:
        body = self.content if isinstance(self.content, str) else "\n".join(b.text for b in self.content or ())
        return f"Error: {body}" if self.is_error else body


class ThinkingBlock(_Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Strict):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
                  Field(discriminator="type")]


class AnthropicMessage(_Strict):
    # "system": Claude Code's mid-conversation system messages (its beta mid-conversation-system-2026-04-07)
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]

    @field_validator("content")
    @classmethod
    def _fits(cls, content: str | list[Any], info: ValidationInfo) -> str | list[Any]:
        return fits(content, info, _texts)


def _texts(blocks: list[Any]) -> Iterator[str]:
    for b in blocks:
        if isinstance(b, TextBlock):
            yield b.text
        elif isinstance(b, ToolResultBlock):
            yield b.text()
        elif isinstance(b, ThinkingBlock):  # the template shows it too
            yield b.thinking


class AnthropicTool(_Strict):
    # "custom" (or none): a tool the client runs. Anthropic's server tools (web_search_…, bash_…) are not
    # kvd's to run: accepted and not shown to the model, as the Responses door's other kinds of tool.
    type: str | None = Field(default=None, min_length=1, max_length=64)
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any] | None = None  # a custom tool's: required (_check_tools)

    @property
    def custom(self) -> bool:
        return self.type in (None, "custom")

    def as_function(self) -> dict[str, Any]:
        """As the chat template is shown a tool (the chat door's function tools)."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.input_schema or {}}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(_Strict):
    user_id: str | None = None

    def conversation(self) -> str | None:
        """The client's name for its conversation: Claude Code's user_id is JSON naming its `session_id`."""
        if self.user_id is None:
            return None
        try:
            said = json.loads(self.user_id)
        except ValueError:
            return self.user_id
        session = said.get("session_id") if isinstance(said, dict) else None
        return session if isinstance(session, str) else self.user_id


class OutputFormat(_Strict):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    format: OutputFormat | None = None  # structured output: the answer held to the schema (jsonoutput.py)
    effort: str | None = None  # accepted; kvd's model answers with the effort it has


class MessagesRequest(_Strict):
    # A model kvd can serve, or a name [api] model_aliases lets the default answer (apiturns.ApiTurns.model).
    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: str | list[TextBlock] | None = None
    max_tokens: OutputLimit  # required, as Anthropic's; a ceiling, lowered to what fits (rules.py)
    stop_sequences: Stop = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: int | None = Field(default=None, ge=0)  # accepted; kvd samples with temperature and top_p only
    stream: bool = False
    tools: list[AnthropicTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None

    @field_validator("system")
    @classmethod
    def _fits(cls, system: str | list[TextBlock] | None, info: ValidationInfo) -> str | list[TextBlock] | None:
        return fits(system, info)

    def forced(self) -> tuple[str | None] | None:
        """A forced call (forcedcall.py): (None,) for any tool ("any"), (name,) for that one ("tool")."""
        choice = self.tool_choice
        if choice is not None and choice.type == "any":
            return (None,)
        if choice is not None and choice.type == "tool":
            return (choice.name,)
        return None

    def offered_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template shows the model: none when tool_choice is "none"."""
        if not self.tools or (self.tool_choice is not None and self.tool_choice.type == "none"):
            return None
        return [tool.as_function() for tool in self.tools if tool.custom] or None

    def response_format(self) -> ResponseFormat | None:
        """output_config.format as the chat door's JSON output asks for it (the same grammar, compiled once)."""
        fmt = self.output_config.format if self.output_config is not None else None
        if fmt is None:
            return None
        return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(name="output", schema=fmt.schema_,
                                                                               strict=True))

    def users_texts(self) -> list[str]:
        """The text of each user message, as the user's (not the system messages joined to them: a title's)."""
        return [m.content if isinstance(m.content, str) else "\n".join(b.text for b in m.content
                                                                       if isinstance(b, TextBlock))
                for m in self.messages if m.role == "user"]

    def instructions(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system or None
        return "\n\n".join(b.text for b in self.system) or None


class CountRequest(MessagesRequest):
    """POST /v1/messages/count_tokens: a Messages request without max_tokens."""

    max_tokens: int = Field(default=1, ge=1)


def parse(body: Any, config: Config, *, count: bool = False, surrogates: bool = True) -> MessagesRequest:
    """A decoded body as a Messages request (a CountRequest with `count`), or the ApiError saying what to fix."""
    checked = checked_body(body, surrogates=surrogates)
    _check_blocks(checked)
    req = validated(CountRequest if count else MessagesRequest, checked, config)
    _check_tools(req)
    return req


def _check_blocks(body: dict[str, Any]) -> None:
    """Blocks that are not text refused (the door rules, rules.py), and those of a type kvd does not know
    refused by name, before validation (whose words for them would be a list of the block types it expected)."""
    messages = body.get("messages")
    text_only(messages, "messages")
    for i, m in enumerate(messages if isinstance(messages, list) else ()):
        content = m.get("content") if isinstance(m, dict) else None
        for j, block in enumerate(content if isinstance(content, list) else ()):
            kind = block.get("type") if isinstance(block, dict) else None
            if isinstance(kind, str) and kind not in BLOCK_TYPES:
                where = f"messages[{i}].content[{j}]"
                raise ApiError(HTTPStatus.BAD_REQUEST, f"{where} is a {kind!r} block, which kvd does not "
                               f"take; it takes {', '.join(BLOCK_TYPES)}", param=where)


def _check_tools(req: MessagesRequest) -> None:
    for i, tool in enumerate(req.tools or ()):
        if tool.custom and tool.input_schema is None:
            raise ApiError(HTTPStatus.BAD_REQUEST, f"tools[{i}] has no input_schema; send its JSON Schema",
                           param=f"tools[{i}].input_schema")
    choice = req.tool_choice
    if choice is not None and choice.type != "none" and not req.tools:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"tool_choice is {choice.type!r} but there are no tools; send "
                       "tools or leave tool_choice out", param="tool_choice")
    if choice is not None and choice.type == "tool" and choice.name not in {t.name for t in req.tools or ()}:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"tool_choice names the tool {choice.name!r}, which is not "
                       "among tools", param="tool_choice.name")
    if req.forced() is not None and req.response_format() is not None:
        raise ApiError(HTTPStatus.BAD_REQUEST, "tool_choice forces a tool call, whose input is JSON already; leave "
                       "output_config.format out", param="output_config.format")


def conversation(req: MessagesRequest) -> list[Said]:
    """The request's messages as the transcript keeps them (module docstring); ApiError for a tool result
    that answers no call of the assistant message before it."""
    said = _Said()
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            said.add(m.role, m.content, f"messages[{i}]")
            continue
        text: list[str] = []
        calls: list[dict[str, str]] = []
        thought = [b.thinking for b in m.content if isinstance(b, ThinkingBlock) and b.thinking]
        for j, b in enumerate(m.content):
            if isinstance(b, TextBlock):
                text.append(b.text)
            elif isinstance(b, ToolUseBlock):
                _only(m.role, "assistant", i, j, "tool_use")
                calls.append({"id": b.id, "name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)})
            elif isinstance(b, ToolResultBlock):
                _only(m.role, "user", i, j, "tool_result")
                if text:  # text before a result: its own message, in order
                    said.add("user", "\n".join(text), f"messages[{i}]")
                    text = []
                said.add("tool", b.text(), f"messages[{i}].content[{j}]", call_id=b.tool_use_id)
        if text or calls or not any(isinstance(b, ToolResultBlock) for b in m.content):
            said.add(m.role, "\n".join(text), f"messages[{i}]", calls=tuple(calls),
                     reasoning="\n".join(thought) if thought and m.role == "assistant" else None)
    if said.messages[-1].role == "assistant":
        raise ApiError(HTTPStatus.BAD_REQUEST, "the last message is the assistant's; kvd answers a user message "
                       "(or tool results) and does not continue a partial answer: end with a user message",
                       param=f"messages[{len(req.messages) - 1}]")
    if (stray := stray_result(said.messages)) is not None:
        where = said.origin[stray.index]
        issued = f"its calls: {', '.join(sorted(stray.issued))[:200]}" if stray.issued else "it made no call"
        raise ApiError(HTTPStatus.BAD_REQUEST, f"{where} is a tool_result for {stray.call_id!r}, which answers no "
                       f"tool_use of the assistant message before it ({issued})", param=f"{where}.tool_use_id")
    return said.messages


class _Said:
    """The conversation being read, with where each message came from (an error's param). A system
    message in the conversation is text for the model in the user's turn, and consecutive user texts
    are one message, as Anthropic reads them (the chat templates want turns to alternate). In that
    turn the system messages' text comes first and the user's own words last, where a model answers
    them: Claude Code sends its list of agents as a system message after the question, and the
    default model went on with the list instead of answering (docs/agents.md)."""

    def __init__(self) -> None:
        self.messages: list[Said] = []
        self.origin: list[str] = []
        self._turn: tuple[list[str], list[str]] = ([], [])  # the last user message's system texts, user texts

    def add(self, role: str, content: str, where: str, *, calls: tuple[dict[str, str], ...] = (),
            call_id: str | None = None, reasoning: str | None = None) -> None:
        last = self.messages[-1] if self.messages else None
        if role not in ("user", "system"):
            self.messages.append(Said(role, content, calls, call_id, reasoning))
        else:
            if last is None or last.role != "user":
                self._turn = ([], [])
                self.messages.append(Said("user", ""))
            self._turn[role == "user"].append(content)
            self.messages[-1] = Said("user", "\n\n".join([*self._turn[0], *self._turn[1]]))
            if last is not None and last.role == "user":
                return
        self.origin.append(where)


def _only(role: str, allowed: str, i: int, j: int, kind: str) -> None:
    if role != allowed:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"messages[{i}].content[{j}] is a {kind} block in a {role} "
                       f"message; only {allowed} messages hold {kind} blocks", param=f"messages[{i}].content[{j}]")
