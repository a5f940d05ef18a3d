"""Parsing and validating protocol requests: pure functions, no I/O.

Every way a frame can be wrong ends here as a RequestError carrying the
protocol's error code and a message that says what to send instead. The
daemon's limits come in as a `Limits` of plain values, so this module needs
nothing of the daemon. A turn's parameters (sampling, text) validate through
the shared shapes (protocol/shapes.py); this module only words their errors
as the websocket's: `bad_request` or `too_large`, naming the field.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError

import protocol as p
from common import jsondepth, origins
from common.keep import KEEP, Keep

from .shapes import TEXT_TOO_LONG, TYPE_ERRORS, Limits, Sampling, Text, bounds, lone_surrogate

RequestId = str | int | None


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
    model: str | None = None  # the model to answer it (`kvd models`, an alias); None: the daemon's default
    # Earlier turns it starts with, (role, content) oldest first, stored without being answered (/compact's)
    messages: tuple[tuple[str, str], ...] = ()


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


# A chat request's sampling: its max_tokens, temperature and top_p, each None when
# it leaves it out: the session's params, then the config, fill them in (shapes.resolve).


@dataclass(frozen=True)
class ChatSend:
    id: RequestId
    session: str
    text: str
    sampling: Sampling
    model: str | None = None  # the model to answer from now on; None: the session's


@dataclass(frozen=True)
class ChatRegenerate:
    id: RequestId
    session: str
    sampling: Sampling


@dataclass(frozen=True)
class ChatEdit:
    id: RequestId
    session: str
    message_index: int
    text: str
    sampling: Sampling


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

_TEXT: TypeAdapter[str] = TypeAdapter(Text)


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


def _refused(e: ValidationError, rid: RequestId, limits: Limits, *, within: str = "") -> RequestError:
    """A shape's first error as the websocket says it: the field named, `bad_request` or `too_large`."""
    error = e.errors()[0]
    name = str(error["loc"][0]) if error["loc"] else ""  # a lone value (a text) has no field of its own
    label = repr(f"{within}{name}")
    if error["type"] in TYPE_ERRORS:
        return RequestError(p.BAD_REQUEST, f"{name!r} has the wrong type", rid)
    if error["type"] == TEXT_TOO_LONG:
        return RequestError(p.TOO_LARGE, f"{label} is longer than {limits.max_text_chars} characters", rid)
    return RequestError(p.BAD_REQUEST, f"{label} must be {bounds(name, limits)}", rid)


def _sampling(msg: dict[str, Any], rid: RequestId, limits: Limits) -> Sampling:
    try:
        return Sampling.model_validate(msg, context=limits)
    except ValidationError as e:
        raise _refused(e, rid, limits) from None


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
    try:
        given = Sampling.model_validate(params, context=limits).given()
    except ValidationError as e:
        raise _refused(e, rid, limits, within="params.") from None
    return {key: given[key] for key in params}


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


MAX_MODEL_CHARS = 1024  # a model's name: a built-in, an alias, an Ollama or Hugging Face name, a path


def _model(msg: dict[str, Any], rid: RequestId) -> str | None:
    """The model a request names (the daemon checks that it can serve it); None when it names none."""
    model: str | None = _field(msg, rid, "model", str, required=False)
    if model is not None and not 1 <= len(model) <= MAX_MODEL_CHARS:
        raise RequestError(p.BAD_REQUEST, f"'model' must be 1-{MAX_MODEL_CHARS} characters "
                           "(a name `kvd models` lists)", rid)
    return model


def _fits(name: str, text: str, rid: RequestId, limits: Limits) -> str:
    try:
        return _TEXT.validate_python(text, context=limits)
    except ValidationError as e:
        raise _refused(e, rid, limits, within=name) from None


def _system(msg: dict[str, Any], rid: RequestId, limits: Limits) -> str | None:
    system: str | None = _field(msg, rid, "system", str, required=False)
    return None if system is None else _fits("system", system, rid, limits)


def _text(msg: dict[str, Any], rid: RequestId, limits: Limits) -> str:
    text: str = _field(msg, rid, "text", str)
    if not text.strip():
        raise RequestError(p.BAD_REQUEST, "'text' is empty", rid)
    return _fits("text", text, rid, limits)


def _no_surrogates(msg: dict[str, Any]) -> None:
    """Before anything else reads the frame: a lone surrogate anywhere is `bad_request`, naming its field."""
    if (path := lone_surrogate(msg)) is None:
        return
    rid = msg.get("id")
    echo = rid if isinstance(rid, (str, int)) and not isinstance(rid, bool) and lone_surrogate(rid) is None else None
    raise RequestError(p.BAD_REQUEST, f"{path[0]!r} holds a lone UTF-16 surrogate (such as \\ud800), "
                       "which is not text; send valid Unicode", echo)


def _decode(raw: str | bytes) -> dict[str, Any]:
    if isinstance(raw, bytes):
        raise RequestError(p.BAD_JSON, "send JSON text frames, not binary frames")
    try:
        msg = jsondepth.loads(raw)
    except RecursionError:
        raise RequestError(p.BAD_JSON, "the frame is nested too deeply; kvd's requests are at most "
                           "a few levels deep", log_once="frames nested too deeply") from None
    except ValueError:
        raise RequestError(p.BAD_JSON, "the frame is not valid JSON") from None
    if not isinstance(msg, dict):
        raise RequestError(p.BAD_JSON, "a request must be a JSON object")
    if "\\u" in raw:  # only an escape can spell a lone surrogate
        _no_surrogates(msg)
    return msg


# -- one builder per request type ---------------------------------------------------------------------------

Msg = dict[str, Any]


CARRIED_SHAPE = ('send them as [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}, ...]: '
                 "whole turns, a user message then its answer, oldest first")


def _carried(msg: Msg, rid: RequestId, limits: Limits) -> tuple[tuple[str, str], ...]:
    """session.create's `messages`: whole earlier turns (user, assistant, user, ...) to store unanswered."""
    given = msg.get("messages")
    if given is None:
        return ()
    if not isinstance(given, list):
        raise RequestError(p.BAD_REQUEST, f"'messages' must be an array; {CARRIED_SHAPE}", rid)
    if len(given) > p.MAX_CARRIED:
        raise RequestError(p.TOO_LARGE, f"'messages' holds {len(given)} messages; a session starts with at most "
                           f"{p.MAX_CARRIED} (carry the most recent turns)", rid)
    out: list[tuple[str, str]] = []
    for i, m in enumerate(given):
        role = "user" if i % 2 == 0 else "assistant"
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            raise RequestError(p.BAD_REQUEST, f"'messages[{i}]' must be an object with exactly 'role' and "
                               f"'content'; {CARRIED_SHAPE}", rid)
        if m["role"] != role:
            raise RequestError(p.BAD_REQUEST, f"'messages[{i}].role' must be {role!r}; {CARRIED_SHAPE}", rid)
        content = m["content"]
        if not isinstance(content, str) or not content.strip():
            raise RequestError(p.BAD_REQUEST, f"'messages[{i}].content' must be a non-empty string", rid)
        out.append((role, _fits(f"messages[{i}].content", content, rid, limits)))
    if len(out) % 2:
        raise RequestError(p.BAD_REQUEST, f"'messages' ends with a user message without its answer; {CARRIED_SHAPE}",
                           rid)
    return tuple(out)


def _session_create(msg: Msg, rid: RequestId, limits: Limits) -> Request:
    return SessionCreate(rid, _title(msg, rid) or p.DEFAULT_TITLE, _system(msg, rid, limits), _origin(msg, rid),
                         _model(msg, rid), _carried(msg, rid, limits))


def _session_update(msg: Msg, rid: RequestId, limits: Limits) -> Request:
    session = _session(msg, rid)
    title = _title(msg, rid)
    system = _system(msg, rid, limits) if "system" in msg else KEEP  # null clears it
    return SessionUpdate(rid, session, KEEP if title is None else title, system, _params(msg, rid, limits))


def _chat_attach(msg: Msg, rid: RequestId, limits: Limits) -> Request:
    session = _session(msg, rid)
    after_seq = _field(msg, rid, "after_seq", int, required=False, default=-1)
    if after_seq < -1:
        raise RequestError(p.BAD_REQUEST, "'after_seq' must be >= -1 (-1: nothing seen yet)", rid)
    return ChatAttach(rid, session, after_seq)


def _chat_regenerate(msg: Msg, rid: RequestId, limits: Limits) -> Request:
    session = _session(msg, rid)
    return ChatRegenerate(rid, session, _sampling(msg, rid, limits))


def _chat_send(msg: Msg, rid: RequestId, limits: Limits) -> Request:
    session = _session(msg, rid)
    s = _sampling(msg, rid, limits)
    return ChatSend(rid, session, _text(msg, rid, limits), s, _model(msg, rid))


def _chat_edit(msg: Msg, rid: RequestId, limits: Limits) -> Request:
    session = _session(msg, rid)
    s = _sampling(msg, rid, limits)
    text = _text(msg, rid, limits)
    index = _field(msg, rid, "message_index", int)
    if index < 0:
        raise RequestError(p.BAD_REQUEST, "'message_index' must be >= 0", rid)
    return ChatEdit(rid, session, index, text, s)


_BUILDERS: dict[str, Callable[[Msg, RequestId, Limits], Request]] = {
    p.PING: lambda msg, rid, limits: Ping(rid),
    p.STATUS: lambda msg, rid, limits: Status(rid),
    p.SESSION_LIST: lambda msg, rid, limits: SessionList(rid),
    p.SESSION_CREATE: _session_create,
    p.SESSION_GET: lambda msg, rid, limits: SessionGet(rid, _session(msg, rid)),
    p.SESSION_UPDATE: _session_update,
    p.SESSION_DELETE: lambda msg, rid, limits: SessionDelete(rid, _session(msg, rid)),
    p.CHAT_CANCEL: lambda msg, rid, limits: ChatCancel(rid, _session(msg, rid)),
    p.CHAT_ATTACH: _chat_attach,
    p.CHAT_SEND: _chat_send,
    p.CHAT_REGENERATE: _chat_regenerate,
    p.CHAT_EDIT: _chat_edit,
}


def parse_request(raw: str | bytes, limits: Limits) -> Request:
    """Turn one frame into a typed request, or raise RequestError."""
    msg = _decode(raw)
    rid = _request_id(msg.get("id"))
    kind = msg.get("type")
    if not isinstance(kind, str):
        raise RequestError(p.BAD_REQUEST, "missing field 'type'", rid)
    build = _BUILDERS.get(kind)
    if build is None:
        raise RequestError(p.UNKNOWN_TYPE, f"unknown request type {kind!r}; see docs/protocol.md", rid)
    return build(msg, rid, limits)
