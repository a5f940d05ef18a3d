"""What every HTTP door does with a request for an answer, written once: who may ask (guards.py), wait
for the model, apply the door rules (rules.py: what a door clamps and drops), place the conversation
(placement.py) and start its turn in the turn core.

A door (openai_api.py, responses.py, anthropic_api.py) differs only in how it
reads its request into an `Ask` (kvd's terms: a system prompt, the
conversation as the transcript keeps it, the tools, the sampling) and how it
writes the turn's events. Its body is read by httpdoor.read_request; refusals
are httpdoor's `ApiError`s, which each door words in its own error shape.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from http import HTTPStatus
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from common import origins
from protocol.requests import RequestError
from protocol.shapes import Sampling
from sessions import is_valid_session_id

from ..config import Config
from ..engine.registry import ModelRefused
from ..engine.thread import Engine
from ..prompt import MessagePrompt, Prompt
from ..turn import CallSplit, EventStream, Listener, Turn, TurnSpec
from ..turns import Turns
from .admission import Admission
from .asgi import headers_of
from .forcedcall import ForcedCall
from .guards import NO_ROUTE, check, token_needed
from .httpdoor import DOOR, ApiError
from .loading import LoadingWatch
from .openai_schema import answers_to
from .placement import Diverged, Placement, Said, branch, place
from .rules import OUTPUT_LIMIT_FITS, without_tools
from .titles import title_for
from .toolcalls import StreamSplit, ToolFormat

SESSION_HEADER = "X-Kvd-Session"
REWIND_HEADER = "X-Kvd-Rewind"  # "true": a pinned request may rewind its session (docs/openai.md)
LOAD_WAIT = 120.0  # seconds a request waits for the model to finish loading before a 503


def guard_refusal(scope: Scope, config: Config, token: str) -> ApiError | None:
    """Who may ask (guards.py), as the refusal each door words in its own shape (server.py logs it)."""
    headers = headers_of(scope)
    client = scope.get("client")
    refused = check(headers, config, token, token_needed=token_needed(
        str(scope.get("method", "")), str(scope.get("path", "")), headers, client[0] if client else None, config))
    if refused is None:
        return None
    status = HTTPStatus(refused.status)
    return ApiError(status, refused.message, code="invalid_api_key" if status == HTTPStatus.UNAUTHORIZED else None)


def guarded(routes: list[BaseRoute], config: Config, token: str, refuse: Callable[[ApiError], Response],
            endpoints: str, *, door: str) -> ASGIApp:
    """A door's routes behind the guards (guards.py), every refusal worded by the door (`refuse`), an
    unknown path or method too (saying what the door serves: `endpoints`). `door` names it in the log."""
    async def route_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        status = HTTPStatus(exc.status_code)
        if status == HTTPStatus.NOT_FOUND:
            request.scope[NO_ROUTE] = True  # (the log says "no such path": server.py)
            return refuse(ApiError(status, f"no such endpoint {request.url.path}; kvd serves {endpoints}"
                                   f"{_base_url_hint(request.url.path)}"))
        return refuse(ApiError(status, f"{request.method} is not allowed on {request.url.path}"))

    router = Starlette(routes=routes, exception_handlers={HTTPException: route_error})

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        scope[DOOR] = door
        if (refused := guard_refusal(scope, config, token)) is not None:
            await refuse(refused)(scope, receive, send)
            return
        await router(scope, receive, send)

    return app


#: Paths a client reaches when its base URL lacks kvd's /v1 (the AI SDK posts to `{baseURL}/messages`).
_UNDER_V1 = ("/messages", "/chat/completions", "/responses", "/models", "/completions")


def _base_url_hint(path: str) -> str:
    """What to fix when a client's base URL left out /v1: a 404 that says so."""
    if path.startswith(_UNDER_V1):
        return f"; did you mean /v1{path}? Set the client's base URL to kvd's address with /v1 at its end"
    return ""


@dataclass(frozen=True)
class Ask:
    """A request for an answer in kvd's terms, whichever door it came through."""

    system: str | None
    convo: Sequence[Said]
    tools: list[dict[str, Any]] | None = None  # as the chat template is shown them (function tools)
    # The most the answer may be (None: the door's default): a ceiling, lowered to what fits (rules.py).
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: Sequence[str] = ()
    seed: int | None = None
    grammar: str | None = None  # the answer held to a JSON schema (jsonoutput.py)
    model: str | None = None  # the name the request gave (None: the default model)
    door: str = "chat"  # which door asked, as the log's turn line says
    # The client's own name for its conversation, where its request says one (Claude Code's metadata, a
    # prompt_cache_key): its sessions are one row of the list.
    conversation: str | None = None
    title: str | None = None  # a new session's title (None: titles.title_for of the conversation)
    call_ids: Callable[[int], str] | None = None  # the id of the answer's k-th tool call (None: the model's, or new)
    prompt: Prompt | None = None  # the prompt's ids made otherwise than by the chat template (rawprompt.py)
    context: int | None = None  # a context smaller than the model's the answer must fit (Ollama's num_ctx)
    logprobs: int | None = None  # each answer token's log-probability, and this many alternatives (None: none)
    prompt_logprobs: bool = False  # the prompt's too (a text completion's echo)
    knobs: Mapping[str, Any] = field(default_factory=dict)  # the sampling's knobs (protocol/shapes.py KNOBS)
    forced: bool = False  # the answer is one tool call, held to it by `grammar` (forcedcall.py)
    # Answers to draw (OpenAI's `n`): the others ride on the first's prompt, each in a session of its own, choice
    # i drawing with seed + i (a request with `seed` + i and n = 1 answers choice i alone).
    n: int = 1


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
    def tool_format(tools: list[dict[str, Any]] | None, engine: Engine) -> ToolFormat | None:
        """How the model writes a call of `tools` (None: no tools, or a model that calls none)."""
        return ToolFormat.of(engine.tokenizer, tools)

    async def start(self, request: Request, ask: Ask, headers: dict[str, str], *, rid_prefix: str) -> tuple[
            Turn, EventStream]:
        """Place the request and start its turn, its events heard by an EventStream (`begin`)."""
        events = EventStream()
        return await self.begin(request, ask, events, headers, rid_prefix=rid_prefix), events

    async def begin(self, request: Request, ask: Ask, listener: Listener, headers: dict[str, str], *,
                    rid_prefix: str, placed: Callable[[str], Awaitable[Placement]] | None = None) -> Turn:
        """Place the request and start its turn, heard by `listener` (ApiError/RequestError when it cannot be);
        `headers` gets the session's id. The caller holds an admission slot (`self.admission.slot()`).
        `placed(model)`: the door's own placement (a text completion's session: completions.py), not the
        conversation's; asked once for each of `ask.n` choices. The turn (choice 0) lists the other choices'."""
        model, engine = await self.ready(ask.model)
        if bias := ask.knobs.get("logit_bias"):
            await self.check_ids([token for token, _ in bias], engine, model, param="logit_bias")
        pinned = request.headers.get(SESSION_HEADER)
        if pinned is not None and not is_valid_session_id(pinned):
            raise ApiError(HTTPStatus.BAD_REQUEST, f"{SESSION_HEADER} must be a session id "
                           "(16 lowercase hex characters)", param=SESSION_HEADER)
        tool_format = self.tool_format(ask.tools, engine)
        if ask.tools and tool_format is None:
            without_tools(model, ask.door, len(ask.tools))  # a forced call is still made: the grammar holds it
            ask = replace(ask, tools=None)

        def calls() -> CallSplit | None:  # one for each choice: it follows that answer's text
            return (ForcedCall(ask.call_ids) if ask.forced else
                    StreamSplit(tool_format, ask.call_ids) if tool_format is not None else None)

        rewind = request.headers.get(REWIND_HEADER, "").strip().lower() == "true"
        title, origin = ask.title or title_for(ask.convo), origins.api(request.headers.get("user-agent"),
                                                                       ask.conversation)
        try:
            placement = await (placed(model) if placed is not None else place(
                self.turns, ask.system, ask.convo, pinned, rewind=rewind, title=title, origin=origin))
        except Diverged as e:
            raise ApiError(HTTPStatus.CONFLICT, str(e), param=f"messages[{e.index}]",
                           code="session_diverged") from None
        headers[SESSION_HEADER] = placement.session_id
        others = [await (placed(model) if placed is not None else branch(
            self.turns, ask.system, ask.convo, chain=placement.chain, title=title, origin=origin))
            for _ in range(ask.n - 1)]
        rid = f"{rid_prefix}{secrets.token_hex(12)}"
        prompt = ask.prompt or MessagePrompt(ask.convo, ask.system, ask.tools or None, chain=placement.chain,
                                             renders=self.turns.renders_for(model))

        def spec(i: int, placed: Placement) -> TurnSpec:
            return TurnSpec(
                rid, placed.session_id, placed.first_new,
                sampling=Sampling.model_construct(max_tokens=ask.max_tokens, temperature=ask.temperature,
                                                  top_p=ask.top_p, **ask.knobs),
                prompt=prompt, stop=ask.stop, seed=ask.seed + i if ask.seed is not None else None,
                door=f"{ask.door}, {f'choice {i}, ' if i else ''}{placed.kind} session", history=len(ask.convo) > 1,
                grammar=ask.grammar, tools=calls(), model=model, fit=OUTPUT_LIMIT_FITS, context=ask.context,
                raw=bool(getattr(ask.prompt, "raw", False)), logprobs=ask.logprobs,
                prompt_logprobs=ask.prompt_logprobs)

        return self.turns.start(listener, spec(0, placement), [spec(i, p) for i, p in enumerate(others, start=1)])
