"""What every HTTP door does with a request for an answer, written once: read its body within the
limits, decode its JSON off the event loop when it is large, wait for the model, place the
conversation (placement.py) and start its turn in the turn core.

A door (openai_api.py, anthropic_api.py) differs only in how it reads its
request into an `Ask` (kvd's terms: a system prompt, the conversation as the
transcript keeps it, the tools, the sampling) and how it writes the turn's
events. Refusals are `ApiError`s (openai_schema.py), which each door words
in its own error shape.
"""

from __future__ import annotations

import json
import json.scanner
import logging
import secrets
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from http import HTTPStatus
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from common import jsondepth
from protocol.requests import RequestError
from protocol.shapes import Sampling
from sessions import is_valid_session_id

from ..config import Config
from ..engine.registry import ModelRefused
from ..engine.thread import Engine
from ..prompt import Conversation, Prompt
from ..turn import CallSplit, EventStream, Turn
from ..turns import Turns
from .admission import Admission
from .asgi import headers_of
from .forcedcall import ForcedCall
from .guards import NO_ROUTE, check, token_needed
from .loading import LoadingWatch
from .openai_schema import ApiError, answers_to
from .placement import Diverged, Placement, Said, place
from .toolcalls import StreamSplit, ToolFormat

log = logging.getLogger("kvd.api")

SESSION_HEADER = "X-Kvd-Session"
REWIND_HEADER = "X-Kvd-Rewind"  # "true": a pinned request may rewind its session (docs/openai.md)
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


def guard_refusal(scope: Scope, config: Config, token: str) -> ApiError | None:
    """Who may ask (guards.py), as the refusal each door words in its own shape; logged."""
    headers = headers_of(scope)
    client = scope.get("client")
    refused = check(headers, config, token, token_needed=token_needed(
        str(scope.get("method", "")), str(scope.get("path", "")), headers, client[0] if client else None, config))
    if refused is None:
        return None
    log.warning("refused an HTTP request: %s", refused.message)
    status = HTTPStatus(refused.status)
    return ApiError(status, refused.message, code="invalid_api_key" if status == HTTPStatus.UNAUTHORIZED else None)


def guarded(routes: list[BaseRoute], config: Config, token: str, refuse: Callable[[ApiError], Response],
            endpoints: str) -> ASGIApp:
    """A door's routes behind the guards (guards.py), every refusal worded by the door (`refuse`), an
    unknown path or method too (saying what the door serves: `endpoints`)."""
    async def route_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        status = HTTPStatus(exc.status_code)
        if status == HTTPStatus.NOT_FOUND:
            request.scope[NO_ROUTE] = True  # (the log says "no such path": server.py)
            return refuse(ApiError(status, f"no such endpoint {request.url.path}; kvd serves {endpoints}"))
        return refuse(ApiError(status, f"{request.method} is not allowed on {request.url.path}"))

    router = Starlette(routes=routes, exception_handlers={HTTPException: route_error})

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if (refused := guard_refusal(scope, config, token)) is not None:
            await refuse(refused)(scope, receive, send)
            return
        await router(scope, receive, send)

    return app


@dataclass(frozen=True)
class Ask:
    """A request for an answer in kvd's terms, whichever door it came through."""

    system: str | None
    convo: Sequence[Said]
    tools: list[dict[str, Any]] | None = None  # as the chat template is shown them (function tools)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: Sequence[str] = ()
    seed: int | None = None
    grammar: str | None = None  # the answer held to a JSON schema (jsonoutput.py)
    # A model that cannot call tools answers without them, instead of the request being refused: coding
    # agents offer tools with every request, also when asked something a model without tools can answer.
    tools_optional: bool = False
    model: str | None = None  # the name the request gave (None: the default model)
    door: str = "api"  # which door asked, as the log's turn line says
    fit: bool = False  # max_tokens is a ceiling ("as much as fits"): lowered to the context's room, not refused
    call_ids: Callable[[int], str] | None = None  # the id of the answer's k-th tool call (None: the model's, or new)
    prompt: Prompt | None = None  # the prompt's ids made otherwise than by the chat template (rawprompt.py)
    context: int | None = None  # a context smaller than the model's the answer must fit (Ollama's num_ctx)
    logprobs: int | None = None  # each answer token's log-probability, and this many alternatives (None: none)
    knobs: Mapping[str, Any] = field(default_factory=dict)  # the sampling's knobs (protocol/shapes.py KNOBS)
    forced: bool = False  # the answer is one tool call, held to it by `grammar` (forcedcall.py)
    prompt_logprobs: bool = False  # the prompt's too (a text completion's echo)


def _vocabulary(tokenizer: Any) -> int:
    return len(tokenizer.get_vocab())


class ApiTurns:
    """The HTTP doors' way into the turn core: readiness, admission, placement, the turn's start."""

    def __init__(self, config: Config, engine: Engine, turns: Turns, loading: LoadingWatch):
        self.config, self.engine, self.turns, self.loading = config, engine, turns, loading
        self.admission = Admission(config, turns)
        self._vocabulary: dict[str, int] = {}  # each model's vocabulary size, once asked

    async def model(self, name: str | None) -> str:
        """The model a request's `model` names: one kvd can serve (the registry's names, [models] aliases),
        else the default for a name in [api] model_aliases ("*": every name, as an agent asks for its
        vendor's models); ApiError 404 for any other name."""
        try:
            return await self.turns.engines.resolve(name)
        except RequestError as e:
            if name is not None and answers_to(name, self.config):
                return self.turns.engines.default
            raise ApiError(HTTPStatus.NOT_FOUND, f"{e.message}; or list {name!r} in model_aliases under [api] "
                           "for the default model to answer it", param="model", code="model_not_found") from None

    async def ready(self, name: str | None) -> tuple[str, Engine]:
        """The model a request names and its engine, loaded (waiting up to LOAD_WAIT); ApiError 404 for a
        name kvd cannot serve, 503 when the model cannot be loaded or is still loading."""
        model = await self.model(name)
        if model == self.turns.engines.default and not self.engine.ready.is_set():
            with anyio.move_on_after(LOAD_WAIT):
                await self.loading.settled.wait()
        try:
            with anyio.move_on_after(LOAD_WAIT):
                engine = await self.turns.engines.engine(model)
                self._check_ready(engine, model)
                return model, engine
        except ModelRefused as e:
            raise ApiError(HTTPStatus.SERVICE_UNAVAILABLE, str(e), code="model_not_loaded") from None
        raise ApiError(HTTPStatus.SERVICE_UNAVAILABLE, f"kvd is still loading the model {model} after "
                       f"{LOAD_WAIT:.0f} s; retry later", code="model_loading")

    @staticmethod
    def _check_ready(engine: Engine, model: str) -> None:
        if not engine.ready.is_set():
            raise ApiError(HTTPStatus.SERVICE_UNAVAILABLE, f"kvd is still loading its model "
                           f"({model}) after {LOAD_WAIT:.0f} s; retry later", code="model_loading")
        if engine.load_error is not None:
            raise ApiError(HTTPStatus.SERVICE_UNAVAILABLE, f"the model failed to load: {engine.load_error}; "
                           "kvd's log has the details, fix the model setting and restart kvd",
                           code="model_not_loaded")

    async def check_ids(self, ids: Sequence[int], engine: Engine, model: str, *, param: str) -> None:
        """ApiError (400) for a token id outside the model's vocabulary (its size asked once per model)."""
        if not ids:
            return
        if model not in self._vocabulary:
            self._vocabulary[model] = await engine.tokenize(_vocabulary)
        if (top := max(ids)) >= self._vocabulary[model] or min(ids) < 0:
            raise ApiError(HTTPStatus.BAD_REQUEST, f"{param} holds token id {top if top >= 0 else min(ids)}, outside "
                           f"{model}'s vocabulary of {self._vocabulary[model]}", param=param)

    @staticmethod
    def tool_format(tools: list[dict[str, Any]] | None, engine: Engine, model: str, *,
                    refuse: bool = True) -> ToolFormat | None:
        """How the model writes a call of `tools`; ApiError when tools are offered to a model that has none
        (unless not `refuse`: then the answer is asked for without them)."""
        tool_format = ToolFormat.of(engine.tokenizer, tools)
        if tools and tool_format is None and refuse:
            raise ApiError(HTTPStatus.BAD_REQUEST, f"the model {model}'s chat template has no "
                           "tool calling (mlx-lm finds no tool-call format in it); leave tools out, or "
                           "serve a model that calls tools (docs/openai.md lists them)", param="tools")
        return tool_format

    async def start(self, request: Request, ask: Ask, headers: dict[str, str], *, rid_prefix: str,
                    placed: Callable[[str], Awaitable[Placement]] | None = None) -> tuple[Turn, EventStream]:
        """Place the request and start its turn (ApiError/RequestError when it cannot be); `headers` gets
        the session's id. The caller holds an admission slot (`self.admission.slot()`). `placed(model)`:
        the door's own placement (a text completion's session: completions.py), not the conversation's."""
        model, engine = await self.ready(ask.model)
        if bias := ask.knobs.get("logit_bias"):
            await self.check_ids([token for token, _ in bias], engine, model, param="logit_bias")
        pinned = request.headers.get(SESSION_HEADER)
        if pinned is not None and not is_valid_session_id(pinned):
            raise ApiError(HTTPStatus.BAD_REQUEST, f"{SESSION_HEADER} must be a session id "
                           "(16 lowercase hex characters)", param=SESSION_HEADER)
        tool_format = self.tool_format(ask.tools, engine, model, refuse=not (ask.tools_optional or ask.forced))
        if ask.tools and tool_format is None:
            log.info("the model %s calls no tools: answering a request that offered %d without %s", model,
                     len(ask.tools), "showing them (the call is forced)" if ask.forced else "them")
            ask = replace(ask, tools=None)
        calls: CallSplit | None = (ForcedCall(ask.call_ids) if ask.forced else
                                   StreamSplit(tool_format, ask.call_ids) if tool_format is not None else None)
        rewind = request.headers.get(REWIND_HEADER, "").strip().lower() == "true"
        try:
            placement = await (placed(model) if placed is not None else place(
                self.turns, ask.system, ask.convo, pinned, rewind=rewind,
                origin=api_origin(request.headers.get("user-agent"))))
        except Diverged as e:
            raise ApiError(HTTPStatus.CONFLICT, str(e), param=f"messages[{e.index}]",
                           code="session_diverged") from None
        headers[SESSION_HEADER] = placement.session_id
        events = EventStream()
        turn = self.turns.start(
            events, f"{rid_prefix}{secrets.token_hex(12)}", placement.session_id, placement.first_new,
            sampling=Sampling.model_construct(max_tokens=ask.max_tokens, temperature=ask.temperature, top_p=ask.top_p,
                                              **ask.knobs),
            stop=ask.stop, seed=ask.seed,
            prompt=ask.prompt or Conversation(ask.convo, ask.system, ask.tools or None, chain=placement.chain,
                                              renders=self.turns.renders_for(model)),
            door=f"{ask.door}, {placement.kind} session", history=len(ask.convo) > 1, grammar=ask.grammar,
            tools=calls, model=model, fit=ask.fit,
            context=ask.context, raw=bool(getattr(ask.prompt, "raw", False)), logprobs=ask.logprobs,
            prompt_logprobs=ask.prompt_logprobs,
        )
        return turn, events
