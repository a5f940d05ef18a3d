"""Parsing and validating protocol requests: pure functions, no I/O.

Every way a frame can be wrong ends here as a RequestError carrying the
protocol's error code and a message that says what to send instead.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Union

from . import protocol as p
from .config import Config

RequestId = Union[str, int, None]


class RequestError(Exception):
    """A request the daemon answers with an `error` event (the connection stays open)."""

    def __init__(self, code: str, message: str, request_id: RequestId = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id

    def event(self) -> dict[str, Any]:
        return {"type": p.ERROR, "id": self.request_id, "code": self.code, "message": self.message}


@dataclass(frozen=True)
class SessionCreate:
    id: RequestId
    title: str | None
    system: str | None


@dataclass(frozen=True)
class SessionList:
    id: RequestId


@dataclass(frozen=True)
class SessionGet:
    id: RequestId
    session: str


@dataclass(frozen=True)
class ChatSend:
    id: RequestId
    session: str
    text: str
    max_tokens: int
    temperature: float
    top_p: float


@dataclass(frozen=True)
class ChatRegenerate:
    id: RequestId
    session: str
    max_tokens: int
    temperature: float
    top_p: float


@dataclass(frozen=True)
class ChatEdit:
    id: RequestId
    session: str
    message_index: int
    text: str
    max_tokens: int
    temperature: float
    top_p: float


@dataclass(frozen=True)
class ChatCancel:
    id: RequestId
    session: str


@dataclass(frozen=True)
class Ping:
    id: RequestId


@dataclass(frozen=True)
class Status:
    id: RequestId


Request = Union[SessionCreate, SessionList, SessionGet, ChatSend, ChatRegenerate, ChatEdit,
                ChatCancel, Ping, Status]

MAX_TITLE_CHARS = 200


def _request_id(value: Any) -> RequestId:
    if isinstance(value, bool):
        raise RequestError(p.BAD_REQUEST, "id must be a string of 1-64 characters or an integer")
    if isinstance(value, int):
        return value
    if isinstance(value, str) and 1 <= len(value) <= 64:
        return value
    raise RequestError(p.BAD_REQUEST, "id must be a string of 1-64 characters or an integer")


def _field(msg: dict[str, Any], rid: RequestId, name: str, kind: type | tuple[type, ...],
           *, required: bool = True, default: Any = None) -> Any:
    if name not in msg or msg[name] is None:
        if required:
            raise RequestError(p.BAD_REQUEST, f"missing field {name!r}", rid)
        return default
    value = msg[name]
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise RequestError(p.BAD_REQUEST, f"{name!r} has the wrong type", rid)
    if not isinstance(value, kind):
        raise RequestError(p.BAD_REQUEST, f"{name!r} has the wrong type", rid)
    return value


def _session(msg: dict[str, Any], rid: RequestId) -> str:
    sid = _field(msg, rid, "session", str)
    if not p.SESSION_ID_RE.fullmatch(sid):
        raise RequestError(p.BAD_REQUEST, "'session' must be a session id: 16 lowercase hex characters", rid)
    return sid


def _number(msg: dict[str, Any], rid: RequestId, name: str, default: float,
            low: float, high: float, *, low_open: bool = False) -> float:
    value = float(_field(msg, rid, name, (int, float), required=False, default=default))
    if math.isnan(value) or value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise RequestError(p.BAD_REQUEST, f"{name!r} must be in {bracket}{low:g}, {high:g}]", rid)
    return value


def _text(msg: dict[str, Any], rid: RequestId, config: Config) -> str:
    text = _field(msg, rid, "text", str)
    if not text.strip():
        raise RequestError(p.BAD_REQUEST, "'text' is empty", rid)
    if len(text) > config.max_text_chars:
        raise RequestError(p.TOO_LARGE, f"'text' is longer than {config.max_text_chars} characters", rid)
    return text


def parse_request(raw: str | bytes, config: Config) -> Request:
    """Turn one frame into a typed request, or raise RequestError."""
    if isinstance(raw, bytes):
        raise RequestError(p.BAD_JSON, "send JSON text frames, not binary frames")
    try:
        msg = json.loads(raw)
    except ValueError:
        raise RequestError(p.BAD_JSON, "the frame is not valid JSON") from None
    if not isinstance(msg, dict):
        raise RequestError(p.BAD_JSON, "a request must be a JSON object")
    rid = _request_id(msg.get("id"))
    kind = msg.get("type")
    if not isinstance(kind, str):
        raise RequestError(p.BAD_REQUEST, "missing field 'type'", rid)

    if kind == p.PING:
        return Ping(rid)
    if kind == p.STATUS:
        return Status(rid)
    if kind == p.SESSION_LIST:
        return SessionList(rid)
    if kind == p.SESSION_CREATE:
        title = _field(msg, rid, "title", str, required=False)
        if title is not None and not 1 <= len(title) <= MAX_TITLE_CHARS:
            raise RequestError(p.BAD_REQUEST, f"'title' must be 1-{MAX_TITLE_CHARS} characters", rid)
        system = _field(msg, rid, "system", str, required=False)
        if system is not None and len(system) > config.max_text_chars:
            raise RequestError(p.TOO_LARGE, f"'system' is longer than {config.max_text_chars} characters", rid)
        return SessionCreate(rid, title, system)
    if kind == p.SESSION_GET:
        return SessionGet(rid, _session(msg, rid))
    if kind == p.CHAT_CANCEL:
        return ChatCancel(rid, _session(msg, rid))
    if kind in (p.CHAT_SEND, p.CHAT_REGENERATE, p.CHAT_EDIT):
        session = _session(msg, rid)
        max_tokens = _field(msg, rid, "max_tokens", int, required=False, default=config.max_tokens)
        if not 1 <= max_tokens <= config.max_tokens_limit:
            raise RequestError(p.BAD_REQUEST, f"'max_tokens' must be 1-{config.max_tokens_limit}", rid)
        temperature = _number(msg, rid, "temperature", config.temperature, 0.0, 2.0)
        top_p = _number(msg, rid, "top_p", config.top_p, 0.0, 1.0, low_open=True)
        if kind == p.CHAT_REGENERATE:
            return ChatRegenerate(rid, session, max_tokens, temperature, top_p)
        text = _text(msg, rid, config)
        if kind == p.CHAT_SEND:
            return ChatSend(rid, session, text, max_tokens, temperature, top_p)
        index = _field(msg, rid, "message_index", int)
        if index < 0:
            raise RequestError(p.BAD_REQUEST, "'message_index' must be >= 0", rid)
        return ChatEdit(rid, session, index, text, max_tokens, temperature, top_p)
    raise RequestError(p.UNKNOWN_TYPE, f"unknown request type {kind!r}; see docs/protocol.md", rid)
