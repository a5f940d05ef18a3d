"""What every HTTP door shares: a body read within limits, its JSON decoded without stalling the loop,
the wait for the model, and the error body in OpenAI's shape.

The chat-completions door (openai_api.py) and the Responses door (responses.py)
differ only in how they read a request and write its events; these are the
steps before and around that, written once.
"""

from __future__ import annotations

import json
import json.scanner
import logging
from http import HTTPStatus
from typing import Any

import anyio
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

from ..config import Config
from ..engine.thread import Engine
from .loading import LoadingWatch
from .openai_schema import ApiError

log = logging.getLogger("kvd.api")

LOAD_WAIT = 120.0  # seconds a request waits for the model to finish loading before a 503
C_PARSE_BYTES = 64 << 10  # bodies up to this are parsed by the C parser (a stall of a millisecond or so)
# Bodies up to this are read on the event loop itself (~0.1 ms for a dozen messages): a worker
# thread's round trip costs more than that (~0.15 ms idle, milliseconds beside a busy engine).
INLINE_BYTES = 16 << 10
DRAIN_LIMIT = 64 << 20  # an oversize body is read (and dropped) up to this, so the client sees the 413


def api_origin(user_agent: str | None) -> str:
    """A session's origin for the list: "api (<the client's User-Agent>)", cut to a readable length."""
    agent = " ".join((user_agent or "").split())[:80]
    return f"api ({agent})" if agent else "api"


def error_response(e: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers={**(headers or {}), **e.headers})


def _cooperative_decoder() -> json.JSONDecoder:
    decoder = json.JSONDecoder()
    decoder.scan_once = json.scanner.py_make_scanner(decoder)  # type: ignore[attr-defined]
    return decoder


_COOPERATIVE = _cooperative_decoder()


def decode_json(body: bytes, what: str = "a chat request") -> Any:
    """The body's JSON value, or the 400 that says why not (on a worker thread past INLINE_BYTES).

    The C parser holds the GIL from start to end, and the event loop waits
    for it even from a worker (a 1 MiB body of small objects: tens of ms); so a
    large body goes through the standard library's Python scanner instead,
    slower but handing the GIL back every few milliseconds.
    """
    try:
        return json.loads(body) if len(body) <= C_PARSE_BYTES else _COOPERATIVE.decode(body.decode("utf-8"))
    except RecursionError:
        raise ApiError(HTTPStatus.BAD_REQUEST, "the request body is nested too deeply; "
                       f"{what} is at most a few levels deep") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"the request body is not valid JSON: {e}") from None


async def read_body(request: Request, config: Config) -> bytes | None:
    """The whole body, within limits.body_timeout; None if the client hung up mid-body."""
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


async def model_ready(engine: Engine, loading: LoadingWatch, model: str) -> None:
    """Wait (LOAD_WAIT at most) for the model to load; a 503 that says why when it did not."""
    if not engine.ready.is_set():
        with anyio.move_on_after(LOAD_WAIT):
            await loading.settled.wait()
    if not engine.ready.is_set():
        raise ApiError(HTTPStatus.SERVICE_UNAVAILABLE, f"kvd is still loading its model "
                       f"({model}) after {LOAD_WAIT:.0f} s; retry later", code="model_loading")
    if engine.load_error is not None:
        raise ApiError(HTTPStatus.SERVICE_UNAVAILABLE, f"the model failed to load: {engine.load_error}; "
                       "kvd's log has the details, fix the model setting and restart kvd",
                       code="model_not_loaded")
