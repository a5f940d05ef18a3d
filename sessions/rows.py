"""The session and message objects the store returns (the protocol's, docs/protocol.md)."""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypedDict

Role = Literal["user", "assistant", "tool"]
Status = Literal["complete", "streaming", "cancelled", "error"]


class Session(TypedDict):
    """The protocol's session object (docs/protocol.md), less `cache`: the daemon knows that."""

    id: str
    title: str
    system: str | None
    created_at: float
    updated_at: float
    message_count: int
    last_message: str | None
    tokens: int
    params: dict[str, Any]
    origin: str | None  # who made it: "kvchat", "kvchat one-shot", "api (<User-Agent>)", "websocket"
    model: str | None  # the model that serves it (its fed ids are that model's); None: the daemon's default
    # list_sessions(branches=True): the API conversation this session is a branch of (a retry, an edit):
    # the oldest API session whose first request this one's messages start with; None for the first.
    branch_of: NotRequired[str | None]


class Message(TypedDict):
    """The protocol's message object, plus how and when it ended."""

    index: int
    role: Role
    content: str
    status: Status
    finish_reason: str | None
    usage: dict[str, Any] | None
    fed_end: int | None
    created_at: float
    updated_at: float
    tool_calls: list[dict[str, str]] | None  # an assistant's calls: [{"id", "name", "arguments"}]
    tool_call_id: str | None  # a tool message: the call it answers
    # An assistant's reasoning as a client sent it back apart from its content (chat templates render it);
    # always there in what the store returns.
    reasoning: NotRequired[str | None]
    # How many cuts of its session came before it was written (sessions/migrations.py, m013): names its items.
    gen: NotRequired[int]
