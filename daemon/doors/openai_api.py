"""The OpenAI-compatible HTTP door: `POST /v1/chat/completions`, `GET /v1/models` (docs/openai.md).

A thin layer over the turn core, like the websocket door: it checks who is
asking (guards.py), validates the body (openai_schema.py), tokenizes the
conversation, lets stateless.py place it in a session, starts a turn and
translates the turn's events into OpenAI's response or server-sent events.

A client that hangs up cancels its answer (what was generated stays in the
session); one that stops reading is cut off after `send_timeout`, and its
answer is cancelled too. A response starts only when the first token (or an
error) is known, so an error found at admission (a conversation too long for
the model) is a real HTTP error, not a broken stream.
"""

from __future__ import annotations

import json
import json.scanner
import logging
import math
import secrets
import time
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

import protocol as p
from protocol.requests import RequestError
from sessions import Store, is_valid_session_id

from ..config import Config
from ..engine.running import fit_advice
from ..engine.thread import Engine
from ..prompt import Tokens, conversation_ids
from ..turns import Turn, Turns
from .admission import admit
from .asgi import headers_of
from .guards import check
from .loading import LoadingWatch
from .openai_schema import ApiError, ChatRequest, instructions, parse, served_names, stops
from .placement import Diverged, Said, place
from .toolcalls import StreamSplit, ToolFormat, openai_calls, split

log = logging.getLogger("kvd.api")

SESSION_HEADER = "X-Kvd-Session"
REWIND_HEADER = "X-Kvd-Rewind"  # "true": a pinned request may rewind its session (docs/openai.md)
LOAD_WAIT = 120.0  # seconds a request waits for the model to finish loading before a 503
C_PARSE_BYTES = 64 << 10  # bodies up to this are parsed by the C parser (a stall of a millisecond or so)
DRAIN_LIMIT = 64 << 20  # an oversize body is read (and dropped) up to this, so the client sees the 413

# The turn core's error codes, as HTTP statuses and OpenAI error codes.
_STATUS = {
    p.BAD_REQUEST: (HTTPStatus.BAD_REQUEST, None),
    p.TOO_LARGE: (HTTPStatus.BAD_REQUEST, "context_length_exceeded"),
    p.UNKNOWN_SESSION: (HTTPStatus.NOT_FOUND, "session_not_found"),
    p.BUSY: (HTTPStatus.CONFLICT, "session_busy"),
}


def api_origin(user_agent: str | None) -> str:
    """A session's origin for the list: "api (<the client's User-Agent>)", cut to a readable length."""
    agent = " ".join((user_agent or "").split())[:80]
    return f"api ({agent})" if agent else "api"


def api_error(code: str, message: str) -> ApiError:
    status, api_code = _STATUS.get(code, (HTTPStatus.INTERNAL_SERVER_ERROR, None))
    return ApiError(status, message, code=api_code)


def error_response(e: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers={**(headers or {}), **e.headers})


def _decode(body: bytes, config: Config) -> ChatRequest:
    """The body as a validated request (a worker thread: its cost grows with the body's size).

    The C parser holds the GIL from start to end, and the event loop waits
    for it even from here (a 1 MiB body of small objects: tens of ms); so a
    large body goes through the standard library's Python scanner instead,
    slower but handing the GIL back every few milliseconds. Its objects are
    freed here too, not on the loop, when the request is refused.
    """
    try:
        decoded = json.loads(body) if len(body) <= C_PARSE_BYTES else _COOPERATIVE.decode(body.decode("utf-8"))
    except RecursionError:
        raise ApiError(HTTPStatus.BAD_REQUEST, "the request body is nested too deeply; a chat request "
                       "is at most a few levels deep") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"the request body is not valid JSON: {e}") from None
    try:
        return parse(decoded, config)
    except ApiError as e:
        refused = e
    del decoded
    raise refused.with_traceback(None)


def _cooperative_decoder() -> json.JSONDecoder:
    decoder = json.JSONDecoder()
    decoder.scan_once = json.scanner.py_make_scanner(decoder)  # type: ignore[attr-defined]
    return decoder


_COOPERATIVE = _cooperative_decoder()


class _Events:
    """A turn's events for one HTTP response. Unbounded, but a turn publishes at most
    max_tokens deltas plus a handful of others, and max_tokens is bounded by config."""

    def __init__(self) -> None:
        self._send, self.receive = anyio.create_memory_object_stream[dict[str, Any]](math.inf)

    def publish(self, event: dict[str, Any]) -> None:
        try:
            self._send.send_nowait(event)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass


class OpenAIDoor:
    def __init__(self, config: Config, store: Store, engine: Engine, turns: Turns, token: str,
                 loading: LoadingWatch):
        self.config = config
        self.loading = loading
        self.store = store
        self.engine = engine
        self.turns = turns
        self._token = token
        self._created = int(time.time())
        self._router = Starlette(
            routes=[Route("/v1/models", self.models, methods=["GET"]),
                    Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
                    Route("/v1/chat/completions", self.chat, methods=["POST"]),
                    Route("/v1/kvd/sessions/{session_id}", self.transcript, methods=["GET"])],
            exception_handlers={HTTPException: self._http_error},
        )

    async def app(self, scope: Scope, receive: Receive, send: Send) -> None:
        refused = check(headers_of(scope), self.config, self._token)
        if refused is not None:
            log.warning("refused an HTTP request: %s", refused.message)
            status = HTTPStatus(refused.status)
            await error_response(ApiError(status, refused.message,
                                          code="invalid_api_key" if status == 401 else None))(scope, receive, send)
            return
        await self._router(scope, receive, send)

    async def _http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        status = HTTPStatus(exc.status_code)
        if status == HTTPStatus.NOT_FOUND:
            message = f"no such endpoint {request.url.path}; kvd serves /v1/chat/completions and /v1/models"
        else:
            message = f"{request.method} is not allowed on {request.url.path}"
        return error_response(ApiError(status, message))

    # --- GET /v1/models ---

    def _model_object(self) -> dict[str, Any]:
        return {"id": self.config.model, "object": "model", "created": self._created, "owned_by": "kvd"}

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_object()]})

    async def model(self, request: Request) -> Response:
        asked = request.path_params["model_id"]
        if asked not in served_names(self.config.model):
            return error_response(ApiError(HTTPStatus.NOT_FOUND, f"kvd serves the model {self.config.model!r}, "
                                           f"not {asked!r}", code="model_not_found"))
        return JSONResponse(self._model_object())

    # --- GET /v1/kvd/sessions/{id}: a session's transcript, read-only ---

    async def transcript(self, request: Request) -> Response:
        """What a pinned client must send to continue a session: its system prompt and messages, in order."""
        session_id = request.path_params["session_id"]
        session = self.store.get_session(session_id) if is_valid_session_id(session_id) else None
        if session is None:
            return error_response(ApiError(HTTPStatus.NOT_FOUND, f"no session {session_id!r}",
                                           code="session_not_found"))
        said = [m for m in self.store.messages(session_id) if m["content"] or m["tool_calls"]]
        messages: list[dict[str, Any]] = (
            [{"role": "system", "content": session["system"]}] if session["system"] is not None else [])
        for m in said:
            message: dict[str, Any] = {"role": m["role"], "content": m["content"]}
            if m["tool_calls"]:
                message["tool_calls"] = openai_calls(m["tool_calls"])
            if m["tool_call_id"] is not None:
                message["tool_call_id"] = m["tool_call_id"]
            messages.append(message)
        return JSONResponse({"object": "kvd.session", "id": session_id, "title": session["title"],
                             "created": session["created_at"], "updated": session["updated_at"],
                             "messages": messages})

    # --- POST /v1/chat/completions ---

    async def chat(self, request: Request) -> Response:
        headers: dict[str, str] = {}
        try:
            body = await self._body(request)
            if body is None:
                return Response(status_code=HTTPStatus.BAD_REQUEST)  # nobody is left to read it
            req = await anyio.to_thread.run_sync(_decode, body, self.config)
            admit(self.config, self.turns)  # before the work below: a burst past the queue costs little
            if not self.engine.ready.is_set():
                with anyio.move_on_after(LOAD_WAIT):
                    await self.loading.settled.wait()
            self._check_ready()
            pinned = request.headers.get(SESSION_HEADER)
            if pinned is not None and not is_valid_session_id(pinned):
                raise ApiError(HTTPStatus.BAD_REQUEST, f"{SESSION_HEADER} must be a session id "
                               "(16 lowercase hex characters)", param=SESSION_HEADER)
            system = instructions(req)
            convo = [Said(m.role, m.text(), tuple(c.stored() for c in m.tool_calls or ()), m.tool_call_id)
                     for m in req.messages if not m.instructs]
            tools = req.offered_tools()
            tool_format = ToolFormat.of(self.engine.tokenizer, tools)
            if tools and tool_format is None:
                raise ApiError(HTTPStatus.BAD_REQUEST, f"the model {self.config.model}'s chat template has no "
                               "tool calling (mlx-lm finds no tool-call format in it); leave tools out, or "
                               "serve a model that calls tools (docs/openai.md lists them)", param="tools")
            ids = await self.turns.tokenizing.run(conversation_ids, [s.for_template() for s in convo],
                                                  system, tools)
            self._check_fits(ids, req.max_completion_tokens or req.max_tokens)
            admit(self.config, self.turns)  # again: the engine's queue may have grown while tokenizing
            rewind = request.headers.get(REWIND_HEADER, "").strip().lower() == "true"
            try:
                placement = place(self.store, self.turns, system, convo, pinned, rewind=rewind,
                                  origin=api_origin(request.headers.get("user-agent")))
            except Diverged as e:
                raise ApiError(HTTPStatus.CONFLICT, str(e), param=f"messages[{e.index}]",
                               code="session_diverged") from None
            headers[SESSION_HEADER] = placement.session_id
            events = _Events()
            rid = f"chatcmpl-{secrets.token_hex(12)}"
            turn = self.turns.start(
                events, rid, placement.session_id, placement.first_new,
                max_tokens=req.max_completion_tokens or req.max_tokens, temperature=req.temperature,
                top_p=req.top_p, prompt=Tokens(ids), stop=stops(req), seed=req.seed,
                door=f"api, {placement.kind} session", history=len(convo) > 1,
            )
        except ApiError as e:
            return error_response(e, headers)
        except RequestError as e:
            return error_response(api_error(e.code, e.message), headers)
        return _Answer(self, turn, events.receive, req, headers, created=placement.kind == "new",
                       tool_format=tool_format)

    async def _body(self, request: Request) -> bytes | None:
        """The whole body, within limits.body_timeout; None if the client hung up mid-body."""
        limit = self.config.max_message_bytes
        body, size = bytearray(), 0
        try:
            with anyio.fail_after(self.config.body_timeout):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size <= limit:
                        body += chunk
                    elif size > DRAIN_LIMIT:
                        break
        except TimeoutError:
            raise ApiError(HTTPStatus.REQUEST_TIMEOUT, f"the request body did not arrive whole within "
                           f"{self.config.body_timeout:g} s (limits.body_timeout in config.toml); send "
                           "all the bytes its Content-Length announces", code="request_timeout") from None
        except ClientDisconnect:
            log.info("a client hung up before sending its whole request body")
            return None
        if size > limit:
            raise ApiError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                           f"the request body is {size} bytes, more than kvd accepts ({limit}; "
                           "limits.max_message_bytes in config.toml)", code="request_too_large")
        return bytes(body)

    def _check_fits(self, ids: list[int], max_tokens: int | None) -> None:
        """Refuse, before anything is stored, a conversation that cannot fit even a one-token answer
        (or the answer the request asks room for); the engine checks again with the session's settings."""
        context = self.engine.max_context
        if context and len(ids) + (max_tokens or 1) > context:
            raise ApiError(HTTPStatus.BAD_REQUEST, f"the conversation ({len(ids)} tokens) plus max_tokens "
                           f"({max_tokens or 1}) exceeds the model's context of {context} tokens; "
                           + fit_advice(len(ids), context), code="context_length_exceeded")

    def _check_ready(self) -> None:
        if not self.engine.ready.is_set():
            raise ApiError(HTTPStatus.SERVICE_UNAVAILABLE, f"kvd is still loading its model "
                           f"({self.config.model}) after {LOAD_WAIT:.0f} s; retry later", code="model_loading")
        if self.engine.load_error is not None:
            raise ApiError(HTTPStatus.SERVICE_UNAVAILABLE, f"the model failed to load: {self.engine.load_error}; "
                           "kvd's log has the details, fix the model setting and restart kvd",
                           code="model_not_loaded")



def usage_of(u: dict[str, Any]) -> dict[str, Any]:
    prompt, completion = int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": int(u.get("cached_tokens") or 0)}}


def finish_reason_of(reason: str) -> str:
    # OpenAI's stop and length; an answer cut short (kvd stopping, chat.cancel from kvchat on the same
    # session) says "cancelled", so a client never takes a cut answer for a finished one.
    return reason if reason in ("length", "cancelled") else "stop"


class _Answer(Response):
    """One turn's answer as a JSON body or an event stream, ending the turn if the client goes."""

    def __init__(self, door: OpenAIDoor, turn: Turn, events: MemoryObjectReceiveStream[dict[str, Any]],
                 req: ChatRequest, headers: dict[str, str], *, created: bool, tool_format: ToolFormat | None = None):
        self.created_session = created  # this request made the session: a refusal takes it back
        self.tool_format = tool_format  # the request offered tools the model can call
        self.door = door
        self.turn = turn
        self.events = events
        self.req = req
        self.extra_headers = headers
        self.created = int(time.time())
        self.started = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        abort: Callable[[], None] = scope.get("kvd.abort", lambda: None)
        turns, turn = self.door.turns, self.turn
        answered = False  # the whole answer was sent: a disconnect after it is the client leaving, not hanging up
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                if answered or turn.finished.is_set():
                    return
                log.info("client of %s hung up; cancelling its answer", turn.session_id)
                turns.cancel(turn.session_id, turn)
                tg.cancel_scope.cancel()

            async def bounded(message: dict[str, Any]) -> None:
                with anyio.move_on_after(self.door.config.send_timeout) as timer:
                    await send(message)
                if timer.cancelled_caught:
                    log.warning("client of %s did not read for %.1f s; cutting it off",
                                turn.session_id, self.door.config.send_timeout)
                    turns.cancel(turn.session_id, turn)
                    abort()
                    tg.cancel_scope.cancel()

            tg.start_soon(watch)
            try:
                async with self.events:
                    if self.req.stream:
                        await self._stream(bounded)
                    else:
                        await self._whole(bounded)
                answered = True
            except OSError:  # the client went away under a send
                turns.cancel(turn.session_id, turn)
            tg.cancel_scope.cancel()

    def _kvd(self, done: dict[str, Any]) -> dict[str, Any]:
        u = done.get("usage") or {}
        return {"session": self.turn.session_id, "restored_from": u.get("restored_from"),
                "shared_tokens": u.get("shared_tokens"), "ttft_ms": u.get("ttft_ms"),
                "prefill_tokens": u.get("prefill_tokens"), "drafted_tokens": u.get("drafted_tokens"),
                "accepted_tokens": u.get("accepted_tokens")}

    async def _start(self, send: Callable[[dict[str, Any]], Any], status: int, content_type: str) -> None:
        headers = [(b"content-type", content_type.encode())]
        headers += [(k.lower().encode(), v.encode()) for k, v in self.extra_headers.items()]
        if content_type.startswith("text/event-stream"):
            headers += [(b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        self.started = True

    async def _body(self, send: Callable[[dict[str, Any]], Any], status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body, ensure_ascii=False).encode()
        await self._start(send, status, "application/json")
        await send({"type": "http.response.body", "body": data})

    async def _error(self, send: Callable[[dict[str, Any]], Any], event: dict[str, Any]) -> None:
        """An error before the answer began: a refusal, which leaves nothing behind."""
        if self.created_session and not self.turn.text:
            await self.turn.finished.wait()  # its answer is committed (as an error) first
            self.door.store.delete_session(self.turn.session_id)
            self.door.engine.forget(self.turn.session_id)
        e = api_error(event["code"], event["message"])
        await self._body(send, e.status, e.body())

    def _called(self, event: dict[str, Any], content: str, calls: list[dict[str, str]]) -> str:
        """Keep an answer that called tools as its content and calls; its finish_reason."""
        reason = finish_reason_of(event["finish_reason"])
        if not calls:
            return reason
        self.door.store.update_message(self.turn.session_id, event["message_index"], content=content,
                                       tool_calls=calls, status="cancelled" if reason == "cancelled" else "complete")
        return "tool_calls" if reason == "stop" else reason

    async def _whole(self, send: Callable[[dict[str, Any]], Any]) -> None:
        text = ""
        async for event in self.events:
            if event["type"] == p.CHAT_DELTA:
                text += event["text"]
            elif event["type"] == p.CHAT_DONE:
                content, calls = split(self.tool_format, text) if self.tool_format else (text, [])
                reason = self._called(event, content, calls)
                message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
                if calls:
                    message["tool_calls"] = openai_calls(calls)
                await self._body(send, 200, {
                    "id": self.turn.request_id, "object": "chat.completion", "created": self.created,
                    "model": self.door.config.model,
                    "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": reason}],
                    "usage": usage_of(event["usage"]), "kvd": self._kvd(event)})
                return
            elif event["type"] == p.ERROR:
                await self._error(send, event)
                return

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.turn.request_id, "object": "chat.completion.chunk", "created": self.created,
            "model": self.door.config.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        if self._usage_wanted():
            chunk["usage"] = None
        return chunk

    def _usage_wanted(self) -> bool:
        return bool(self.req.stream_options and self.req.stream_options.include_usage)

    async def _stream(self, send: Callable[[dict[str, Any]], Any]) -> None:
        async def sse(data: dict[str, Any] | str) -> None:
            payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
            await send({"type": "http.response.body", "body": f"data: {payload}\n\n".encode(), "more_body": True})

        async def begin() -> None:
            if not self.started:
                await self._start(send, 200, "text/event-stream; charset=utf-8")
                await sse(self._chunk({"role": "assistant", "content": ""}))

        splitter = StreamSplit(self.tool_format) if self.tool_format else None
        async for event in self.events:
            kind = event["type"]
            if kind == p.CHAT_DELTA:
                await begin()
                text = splitter.feed(event["text"]) if splitter else event["text"]
                if text:
                    await sse(self._chunk({"content": text}))
            elif kind == p.CHAT_DONE:
                await begin()
                rest, calls = splitter.finish() if splitter else ("", [])
                if rest:
                    await sse(self._chunk({"content": rest}))
                if calls:
                    await sse(self._chunk({"tool_calls": openai_calls(calls, streaming=True)}))
                content = self.turn.text
                if calls and self.tool_format:
                    content = split(self.tool_format, self.turn.text)[0]
                await sse(self._chunk({}, self._called(event, content, calls)))
                if self._usage_wanted():
                    await sse({"id": self.turn.request_id, "object": "chat.completion.chunk",
                               "created": self.created, "model": self.door.config.model, "choices": [],
                               "usage": usage_of(event["usage"]), "kvd": self._kvd(event)})
                break
            elif kind == p.ERROR:
                if not self.started:
                    await self._error(send, event)
                    return
                await sse(api_error(event["code"], event["message"]).body())
                break
        if self.started:
            await sse("[DONE]")
            await send({"type": "http.response.body", "body": b"", "more_body": False})
