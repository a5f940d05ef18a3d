"""What every HTTP door shares at its edge: the one error type its refusals are, and the one body reader.

- `ApiError` is a refusal, whichever door it comes through (chat
  completions, Responses, Anthropic Messages, any door to come): a status,
  a message that says what to send instead, the field it is about (`param`)
  and a code. Each door words it in its own shape (`ApiError.body` is
  OpenAI's; anthropic_schema.error_body Anthropic's) and sends it as a
  `RefusalResponse`, which tells the log why (server.py logs every 4xx and 5xx with
  the door, the client, the path, the code and this reason).
- `read_request` reads a body within the limits, decodes its JSON (on a
  worker thread past INLINE_BYTES: its cost grows with the body, and the
  large ones through a parser that hands the GIL back) and hands it to the
  door's own reading; a refused body's objects are freed where they were
  made, not on the event loop.
- `api_error` is the turn core's refusal (protocol's error codes) as an
  `ApiError`, for every door.
"""

from __future__ import annotations

import json
import json.scanner
import logging
import re
from collections.abc import Callable, Mapping
from http import HTTPStatus
from typing import Any, TypeVar

import anyio
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send

import protocol as p
from common import jsondepth

from ..config import Config

log = logging.getLogger("kvd.api")

C_PARSE_BYTES = 64 << 10  # bodies up to this are parsed by the C parser (a stall of a millisecond or so)
# Bodies up to this are read on the event loop itself (~0.1 ms for a dozen messages): a worker
# thread's round trip costs more than that (~0.15 ms idle, milliseconds beside a busy engine).
INLINE_BYTES = 16 << 10
DRAIN_LIMIT = 64 << 20  # an oversize body is read (and dropped) up to this, so the client sees the 413

#: Where a refusal leaves itself in its request's ASGI scope, for the log (server.py).
REFUSED = "kvd.refused"
#: Where a door names itself in a request's ASGI scope (apiturns.guarded), for the log.
DOOR = "kvd.door"
#: Set in a request's ASGI scope where a status of 400 or more is the answer asked for, not a refusal (a
#: health probe's 503 while the model loads): counted in /metrics, not logged.
ANSWERED = "kvd.answered"


class ApiError(Exception):
    """A request an HTTP door refuses: {"error": {message, type, param, code}} in OpenAI's shape (`body`)."""

    TYPES = {
        HTTPStatus.BAD_REQUEST: "invalid_request_error",
        HTTPStatus.UNAUTHORIZED: "authentication_error",
        HTTPStatus.FORBIDDEN: "permission_error",
        HTTPStatus.NOT_FOUND: "not_found_error",
        HTTPStatus.METHOD_NOT_ALLOWED: "invalid_request_error",
        HTTPStatus.CONFLICT: "conflict_error",
        HTTPStatus.REQUEST_TIMEOUT: "invalid_request_error",
        HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "invalid_request_error",
        HTTPStatus.TOO_MANY_REQUESTS: "requests",  # OpenAI's type for a request-rate limit
        HTTPStatus.SERVICE_UNAVAILABLE: "service_unavailable",
        HTTPStatus.INTERNAL_SERVER_ERROR: "server_error",
    }

    def __init__(self, status: HTTPStatus, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}  # sent with the body (a 429's Retry-After)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


class RefusalResponse(JSONResponse):
    """A refused request's response, the body in its door's shape; it leaves its `ApiError` in the
    request's scope, so the log says why."""

    def __init__(self, error: ApiError, body: Mapping[str, Any], headers: Mapping[str, str] | None = None):
        super().__init__(body, status_code=error.status, headers={**(headers or {}), **error.headers})
        self.error = error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[REFUSED] = self.error
        await super().__call__(scope, receive, send)


# The turn core's error codes, as HTTP statuses and OpenAI error codes.
_STATUS = {
    p.BAD_REQUEST: (HTTPStatus.BAD_REQUEST, None),
    p.TOO_LARGE: (HTTPStatus.BAD_REQUEST, "context_length_exceeded"),
    p.UNKNOWN_SESSION: (HTTPStatus.NOT_FOUND, "session_not_found"),
    p.UNKNOWN_MODEL: (HTTPStatus.NOT_FOUND, "model_not_found"),
    p.BUSY: (HTTPStatus.CONFLICT, "session_busy"),
}

#: A built-in model with a longer context than the default's, for the advice of a conversation too long.
LONGER_CONTEXT = "builtin:gemma3"


def api_error(code: str, message: str, *, model: str | None = None) -> ApiError:
    """The turn core's error as the HTTP doors' refusal. A conversation past the served `model`'s context
    also says which model to serve instead (agents' first requests are long: Claude Code's ~15-25k tokens)."""
    status, api_code = _STATUS.get(code, (HTTPStatus.INTERNAL_SERVER_ERROR, None))
    if code == p.TOO_LARGE and model is not None and model != LONGER_CONTEXT:
        message = (f"{message}; or serve a model with a longer context: `kvd serve --model {LONGER_CONTEXT}` "
                   "has 32k tokens (docs/models.md)")
    return ApiError(status, message, code=api_code)


# --- the body ---------------------------------------------------------------------------------------


def _cooperative_decoder() -> json.JSONDecoder:
    decoder = json.JSONDecoder()
    decoder.scan_once = json.scanner.py_make_scanner(decoder)  # type: ignore[attr-defined]
    return decoder


_COOPERATIVE = _cooperative_decoder()


def decode_json(body: bytes) -> Any:
    """The body's JSON (a worker thread for a large one: its cost grows with the body's size).

    The C parser holds the GIL from start to end, and the event loop waits
    for it even from a worker (a 1 MiB body of small objects: tens of ms); so
    a large body goes through the standard library's Python scanner instead,
    slower but handing the GIL back every few milliseconds.
    """
    try:
        value = json.loads(body) if len(body) <= C_PARSE_BYTES else _COOPERATIVE.decode(body.decode("utf-8"))
        return jsondepth.check_depth(value, body)
    except RecursionError:
        raise ApiError(HTTPStatus.BAD_REQUEST, "the request body is nested too deeply; a request "
                       "is at most a few levels deep") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"the request body is not valid JSON: {e}") from None


_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")  # an escaped one; one UTF-8 encoded (surrogatepass)


def may_hold_surrogates(body: bytes) -> bool:
    """Whether `body`, decoded by json.loads, can hold a surrogate: only through a \\uD800-\\uDFFF escape, or
    surrogate bytes json.loads lets through (it decodes with surrogatepass), or an encoding other than UTF-8.
    A regex over the bytes instead of a walk of every string (a long conversation: half a millisecond)."""
    return json.detect_encoding(body) != "utf-8" or _SURROGATE.search(body) is not None


async def read_body(request: Request, config: Config) -> bytes | None:
    """The whole body, within limits.body_timeout and limits.max_message_bytes; None if the client hung
    up mid-body."""
    limit = config.max_message_bytes
    body, size = bytearray(), 0
    try:
        with anyio.fail_after(config.body_timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size <= limit:
                    body += chunk
                elif size > DRAIN_LIMIT:
                    break
    except TimeoutError:
        raise ApiError(HTTPStatus.REQUEST_TIMEOUT, f"the request body did not arrive whole within "
                       f"{config.body_timeout:g} s (limits.body_timeout in config.toml); send "
                       "all the bytes its Content-Length announces", code="request_timeout") from None
    except ClientDisconnect:
        log.info("a client hung up before sending its whole request body")
        return None
    if size > limit:
        raise ApiError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                       f"the request body is {size} bytes, more than kvd accepts ({limit}; "
                       "limits.max_message_bytes in config.toml)", code="request_too_large")
    return bytes(body)


Read = TypeVar("Read")
#: A door's reading of a decoded body: (the JSON value, whether its strings may hold a lone surrogate) -> what
#: the door uses; ApiError when it refuses it. It runs where the body was decoded.
Reader = Callable[[Any, bool], Read]


async def read_request(request: Request, config: Config, reader: Reader[Read]) -> Read | None:
    """The request's body, decoded and read by the door's `reader` (on a worker thread past INLINE_BYTES);
    None when the client hung up mid-body (nobody is left to answer)."""
    body = await read_body(request, config)
    if body is None:
        return None
    if len(body) <= INLINE_BYTES:
        return read_bytes(body, reader)
    return await anyio.to_thread.run_sync(read_bytes, body, reader)


def read_bytes(body: bytes, reader: Reader[Read]) -> Read:
    """A whole body, decoded and read by `reader`, where this runs."""
    decoded = decode_json(body)
    try:
        return reader(decoded, may_hold_surrogates(body))
    except ApiError as e:
        refused = e
    # Refused: the body's objects (and the traceback's frames holding them) are freed here, not on the loop.
    del decoded
    raise refused.with_traceback(None)
