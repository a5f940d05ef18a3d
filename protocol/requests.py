"""Parsing and validating protocol requests: pure functions, no I/O.

Every way a frame can be wrong ends here as a RequestError carrying the
protocol's error code and a message that says what to send instead. The
daemon's limits come in as a `Limits` of plain values, so this module needs
nothing of the daemon.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import protocol as p
from common import origins
from common.keep import KEEP, Keep
from common.limits import TEMPERATURE, TOP_P, Range

RequestId = str | int | None


@dataclass(frozen=True)
class Limits:
    """What a request may ask for (config.toml's [limits])."""

    max_text_chars: int  # a message's or a system prompt's characters
    max_tokens_limit: int  # the most a request's max_tokens may be


class RequestError(Exception):
    """A request the daemon answers with an `error` event (the connection stays open).

    `log_once` names a kind of abuse worth one log line per connection (a
    client must not be able to grow the log at will by repeating it).
    """

    def __init__(self, code: str, message: str, request_id: RequestId = None, *, log_once: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id
        self.log_once = log_once

    def event(self) -> dict[str, Any]:
        return {"type": p.ERROR, "id": self.request_id, "code": self.code, "message": self.message}


@dataclass(frozen=True)
class SessionCreate:
    id: RequestId
    title: str  # DEFAULT_TITLE when the request has none
    system: str | None
    origin: str  # who asks: "kvchat", "kvchat one-shot"; "websocket" when the client does not say


@dataclass(frozen=True)
class SessionList:
    id: RequestId


@dataclass(frozen=True)
class SessionGet:
    id: RequestId
    session: str


@dataclass(frozen=True)
class SessionUpdate:
    id: RequestId
    session: str
    title: str | Keep
    system: str | None | Keep
    params: dict[str, float | int | None] | Keep  # a change: None removes that key


@dataclass(frozen=True)
class SessionDelete:
    id: RequestId
    session: str


# A chat request's max_tokens, temperature and top_p are None when it leaves
# them out: the session's params, then the config, fill them in (sampling.py).


@dataclass(frozen=True)
class ChatSend:
    id: RequestId
    session: str
    text: str
    max_tokens: int | None
    temperature: float | None
    top_p: float | None


@dataclass(frozen=True)
class ChatRegenerate:
    id: RequestId
    session: str
    max_tokens: int | None
    temperature: float | None
    top_p: float | None


@dataclass(frozen=True)
class ChatEdit:
    id: RequestId
    session: str
    message_index: int
    text: str
    max_tokens: int | None
    temperature: float | None
    top_p: float | None


@dataclass(frozen=True)
class ChatAttach:
    id: RequestId
    session: str
    after_seq: int  # the last seq the client has seen; -1: none


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


Request = (SessionCreate | SessionList | SessionGet | SessionUpdate | SessionDelete | ChatSend
           | ChatRegenerate | ChatEdit | ChatCancel | ChatAttach | Ping | Status)

MAX_TITLE_CHARS = 200
MAX_ORIGIN_CHARS = 200


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
    sid: str = _field(msg, rid, "session", str)
    if not p.SESSION_ID_RE.fullmatch(sid):
        raise RequestError(p.BAD_REQUEST, "'session' must be a session id: 16 lowercase hex characters", rid)
    return sid


def _number(msg: dict[str, Any], rid: RequestId, name: str, allowed: Range, *, label: str = "") -> float | None:
    value = _field(msg, rid, name, (int, float), required=False)
    if value is None:
        return None
    if value not in allowed:
        raise RequestError(p.BAD_REQUEST, f"{label or repr(name)} must be in {allowed.describe()}", rid)
    return float(value)


def _max_tokens(msg: dict[str, Any], rid: RequestId, limits: Limits, *, label: str = "") -> int | None:
    value: int | None = _field(msg, rid, "max_tokens", int, required=False)
    if value is not None and not 1 <= value <= limits.max_tokens_limit:
        raise RequestError(p.BAD_REQUEST, f"{label or repr('max_tokens')} must be 1-{limits.max_tokens_limit}", rid)
    return value


def _temperature(msg: dict[str, Any], rid: RequestId, *, label: str = "") -> float | None:
    return _number(msg, rid, "temperature", TEMPERATURE, label=label)


def _top_p(msg: dict[str, Any], rid: RequestId, *, label: str = "") -> float | None:
    return _number(msg, rid, "top_p", TOP_P, label=label)


def _params(msg: dict[str, Any], rid: RequestId, limits: Limits) -> dict[str, float | int | None] | Keep:
    """session.update's `params`: each key a value in the range chat.send allows, or null to clear."""
    if msg.get("params") is None:
        return KEEP
    params = msg["params"]
    if not isinstance(params, dict):
        raise RequestError(p.BAD_REQUEST, "'params' must be an object, e.g. {\"temperature\": 0.2}", rid)
    unknown = sorted(set(params) - set(p.PARAMS))
    if unknown:
        raise RequestError(p.BAD_REQUEST, f"unknown param {unknown[0]!r}; params may set "
                           f"{', '.join(p.PARAMS)}", rid)
    change: dict[str, float | int | None] = {}
    for key in params:
        label = f"'params.{key}'"
        if key == "max_tokens":
            change[key] = _max_tokens(params, rid, limits, label=label)
        elif key == "temperature":
            change[key] = _temperature(params, rid, label=label)
        else:
            change[key] = _top_p(params, rid, label=label)
    return change


def _title(msg: dict[str, Any], rid: RequestId) -> str | None:
    title: str | None = _field(msg, rid, "title", str, required=False)
    if title is not None and not 1 <= len(title) <= MAX_TITLE_CHARS:
        raise RequestError(p.BAD_REQUEST, f"'title' must be 1-{MAX_TITLE_CHARS} characters", rid)
    return title


def _origin(msg: dict[str, Any], rid: RequestId) -> str:
    origin: str | None = _field(msg, rid, "origin", str, required=False)
    if origin is not None and not 1 <= len(origin) <= MAX_ORIGIN_CHARS:
        raise RequestError(p.BAD_REQUEST, f"'origin' must be 1-{MAX_ORIGIN_CHARS} characters", rid)
    return origin or origins.WEBSOCKET


def _system(msg: dict[str, Any], rid: RequestId, limits: Limits) -> str | None:
    system: str | None = _field(msg, rid, "system", str, required=False)
    if system is not None and len(system) > limits.max_text_chars:
        raise RequestError(p.TOO_LARGE, f"'system' is longer than {limits.max_text_chars} characters", rid)
    return system


def _text(msg: dict[str, Any], rid: RequestId, limits: Limits) -> str:
    text: str = _field(msg, rid, "text", str)
    if not text.strip():
        raise RequestError(p.BAD_REQUEST, "'text' is empty", rid)
    if len(text) > limits.max_text_chars:
        raise RequestError(p.TOO_LARGE, f"'text' is longer than {limits.max_text_chars} characters", rid)
    return text


def _surrogate(msg: dict[str, Any]) -> str | None:
    """The first field holding a lone UTF-16 surrogate ("\\ud800"), which JSON allows and UTF-8 cannot carry.

    Iterative: a frame nested just under the parser's limit must not
    overflow the stack here.
    """
    stack: list[tuple[str, Any]] = [(k, v) for k, v in msg.items()]
    while stack:
        name, value = stack.pop()
        if isinstance(value, dict):
            stack.extend((name, k) for k in value)
            stack.extend((name, v) for v in value.values())
        elif isinstance(value, list):
            stack.extend((name, v) for v in value)
        elif isinstance(value, str) and not _encodable(value):
            return name
        if not _encodable(name):
            return "a key"
    return None


def _encodable(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_request(raw: str | bytes, limits: Limits) -> Request:
    """Turn one frame into a typed request, or raise RequestError."""
    if isinstance(raw, bytes):
        raise RequestError(p.BAD_JSON, "send JSON text frames, not binary frames")
    try:
        msg = json.loads(raw)
    except RecursionError:
        raise RequestError(p.BAD_JSON, "the frame is nested too deeply; kvd's requests are at most "
                           "a few levels deep", log_once="frames nested too deeply") from None
    except ValueError:
        raise RequestError(p.BAD_JSON, "the frame is not valid JSON") from None
    if not isinstance(msg, dict):
        raise RequestError(p.BAD_JSON, "a request must be a JSON object")
    if "\\u" in raw and (field := _surrogate(msg)) is not None:
        rid = msg.get("id") if field != "id" else None
        raise RequestError(p.BAD_REQUEST, f"{field!r} holds a lone UTF-16 surrogate (such as \\ud800), "
                           "which is not text; send valid Unicode",
                           rid if isinstance(rid, (str, int)) and not isinstance(rid, bool) else None)
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
        return SessionCreate(rid, _title(msg, rid) or p.DEFAULT_TITLE, _system(msg, rid, limits),
                             _origin(msg, rid))
    if kind == p.SESSION_GET:
        return SessionGet(rid, _session(msg, rid))
    if kind == p.SESSION_UPDATE:
        session = _session(msg, rid)
        title = _title(msg, rid)
        system = _system(msg, rid, limits) if "system" in msg else KEEP  # null clears it
        return SessionUpdate(rid, session, KEEP if title is None else title, system,
                             _params(msg, rid, limits))
    if kind == p.SESSION_DELETE:
        return SessionDelete(rid, _session(msg, rid))
    if kind == p.CHAT_CANCEL:
        return ChatCancel(rid, _session(msg, rid))
    if kind == p.CHAT_ATTACH:
        session = _session(msg, rid)
        after_seq = _field(msg, rid, "after_seq", int, required=False, default=-1)
        if after_seq < -1:
            raise RequestError(p.BAD_REQUEST, "'after_seq' must be >= -1 (-1: nothing seen yet)", rid)
        return ChatAttach(rid, session, after_seq)
    if kind in (p.CHAT_SEND, p.CHAT_REGENERATE, p.CHAT_EDIT):
        session = _session(msg, rid)
        max_tokens = _max_tokens(msg, rid, limits)
        temperature = _temperature(msg, rid)
        top_p = _top_p(msg, rid)
        if kind == p.CHAT_REGENERATE:
            return ChatRegenerate(rid, session, max_tokens, temperature, top_p)
        text = _text(msg, rid, limits)
        if kind == p.CHAT_SEND:
            return ChatSend(rid, session, text, max_tokens, temperature, top_p)
        index = _field(msg, rid, "message_index", int)
        if index < 0:
            raise RequestError(p.BAD_REQUEST, "'message_index' must be >= 0", rid)
        return ChatEdit(rid, session, index, text, max_tokens, temperature, top_p)
    raise RequestError(p.UNKNOWN_TYPE, f"unknown request type {kind!r}; see docs/protocol.md", rid)
