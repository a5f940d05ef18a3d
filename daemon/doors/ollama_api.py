"""Ollama's API on kvd's port: `/api/chat`, `/api/generate`, the model endpoints and `/api/version`
(docs/ollama.md).

As thin as the other HTTP doors: who may ask is guards.py's (an Ollama client
on this machine may come without the token: guards.token_needed), the body is
read and validated (ollama_schema.py), and the request goes the way every HTTP
door's goes into the turn core (apiturns.py: admission, placement by the
conversation's hash chain, the turn), so an /api/chat conversation is cached
and found again, after a restart too, as an OpenAI client's is. The turn's
events become NDJSON lines or one object (ollama_answer.py); the model
endpoints are ollama_models.py's. Every refusal is `{"error": "..."}` with its
HTTP status, which Ollama's clients raise as a ResponseError.

A chat with no messages, or a generate with no prompt, loads the model (done_reason
"load"); with `keep_alive: 0` it unloads it ("unload"; the default model stays).
`keep_alive` otherwise sets how long the model stays loaded once idle.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from protocol.requests import RequestError
from protocol.shapes import MAX_PENALTY_WINDOW

from .. import __version__
from ..config import Config
from . import ollama_models
from .apiturns import ApiTurns, Ask, guarded
from .httpdoor import ApiError, RefusalResponse, api_error, read_request
from .jsonoutput import output_grammar
from .ollama_answer import OllamaResponse, created_at
from .ollama_schema import (
    NUM_PREDICT_ALL,
    GenerateRequest,
    ModelRequest,
    OllamaChatRequest,
    Options,
    call_id,
    conversation,
    error_body,
    parse_chat,
    parse_generate,
    response_format,
    stops,
)
from .openai_schema import validated
from .placement import Said
from .rawprompt import RawPrompt, fim_markers
from .toolturns import stray_result

log = logging.getLogger("kvd.api")

PREFIX = "/api/"
#: The Ollama API version kvd answers /api/version with: the API as Ollama 0.12 defines it, which clients
#: compare against to turn features on (tools, structured outputs); kvd's own version is beside it.
OLLAMA_VERSION = "0.12.0"
NOT_SERVED = {
    "/api/embed": "embeddings: kvd serves chat models, which make no embeddings; use an embedding server",
    "/api/embeddings": "embeddings: kvd serves chat models, which make no embeddings; use an embedding server",
    "/api/create": "creating models: kvd runs the models `kvd models` lists; pull one, or point --model at a "
                   "GGUF file or an mlx-lm folder",
    "/api/copy": "copying models: name a model by any name [models] aliases in config.toml gives it",
    "/api/push": "pushing models: kvd has no registry to push to",
}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}

Req = TypeVar("Req")


def is_ollama(path: str) -> bool:
    """Whether a request's path is this door's (so that even its 401 or 404 is in Ollama's shape)."""
    return path.startswith(PREFIX)


def error_response(e: ApiError, headers: dict[str, str] | None = None) -> RefusalResponse:
    return RefusalResponse(e, error_body(e), headers)


def keep_alive_seconds(value: float | int | str | None) -> float | None:
    """Ollama's keep_alive as seconds: a number of seconds or a Go duration ("5m", "1h30m"); a negative one
    keeps the model loaded (inf). None: not given. ApiError for anything else."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        try:
            seconds = sign * float(body)  # "300", "-1"
        except ValueError:
            parts = _DURATION.findall(body)
            if not parts or "".join(n + u for n, u in parts) != body:
                raise ApiError(HTTPStatus.BAD_REQUEST, f"keep_alive {value!r} is not a duration; send seconds "
                               "(300), a duration (\"5m\", \"1h\"), 0 to unload, or -1 to keep loaded") from None
            seconds = sign * sum(float(n) * _UNITS[u] for n, u in parts)
    return float("inf") if seconds < 0 else seconds


def _sampling(options: Options | None, config: Config) -> dict[str, Any]:
    """What Ask takes of `options`: max_tokens (num_predict: -1 and -2 and more than kvd's limit are "as
    much as fits"), temperature, top_p, seed (a negative one: random), the num_ctx context, and the knobs
    (top_k, min_p, repeat_penalty, the presence and frequency penalties over repeat_last_n tokens)."""
    o = options or Options()
    limit = config.max_tokens_limit
    predict = o.num_predict
    if predict == 0:
        raise ApiError(HTTPStatus.BAD_REQUEST, "options.num_predict is 0: ask for at least one token, or -1 for as "
                       "many as fit")
    fit = predict is None or predict in NUM_PREDICT_ALL or predict > limit
    knobs: dict[str, Any] = {k: v for k, v in (("top_k", o.top_k), ("min_p", o.min_p),
                                                ("repetition_penalty", o.repeat_penalty),
                                                ("presence_penalty", o.presence_penalty),
                                                ("frequency_penalty", o.frequency_penalty)) if v not in (None, 0)}
    if o.repeat_last_n == 0:  # Ollama's "penalize nothing"
        knobs = {k: v for k, v in knobs.items() if k not in ("repetition_penalty", "presence_penalty",
                                                            "frequency_penalty")}
    elif o.repeat_last_n is not None:  # -1: the whole context, as far as kvd looks back
        knobs["penalty_window"] = MAX_PENALTY_WINDOW if o.repeat_last_n < 0 else min(o.repeat_last_n,
                                                                                    MAX_PENALTY_WINDOW)
    return {"max_tokens": limit if fit else predict, "temperature": o.temperature, "top_p": o.top_p,
            "seed": o.seed if o.seed is not None and o.seed >= 0 else None, "context": o.num_ctx, "knobs": knobs}


class Lines(Response):
    """A response of NDJSON lines that `produce` emits (a pull's progress); an ApiError before the first line
    is an HTTP error, after it an error line."""

    def __init__(self, produce: Callable[[Callable[[dict[str, Any]], Awaitable[None]]], Awaitable[None]]):
        self.produce = produce

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def emit(obj: dict[str, Any]) -> None:
            nonlocal started
            if not started:
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-type", b"application/x-ndjson")]})
                started = True
            await send({"type": "http.response.body", "body": json.dumps(obj).encode() + b"\n", "more_body": True})

        try:
            await self.produce(emit)
        except ApiError as e:
            if not started:
                await error_response(e)(scope, receive, send)
                return
            await emit(error_body(e))
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class OllamaDoor:
    def __init__(self, config: Config, api: ApiTurns, token: str):
        self.config = config
        self.api = api  # shared with the other HTTP doors: one admission queue for all
        self.turns = api.turns
        routes: list[BaseRoute] = [
            Route("/api/chat", self.chat, methods=["POST"]),
            Route("/api/generate", self.generate, methods=["POST"]),
            Route("/api/tags", self.tags, methods=["GET"]),
            Route("/api/show", self.show, methods=["POST"]),
            Route("/api/ps", self.ps, methods=["GET"]),
            Route("/api/pull", self.pull, methods=["POST"]),
            Route("/api/delete", self.delete, methods=["DELETE"]),
            Route("/api/version", self.version, methods=["GET"]),
            *(Route(path, self.not_served, methods=["POST", "GET"]) for path in NOT_SERVED)]
        self.app = guarded(routes, config, token, error_response,
                           "/api/chat, /api/generate, /api/tags, /api/show, /api/ps, /api/pull, /api/delete and "
                           "/api/version", door="ollama")

    async def _body(self, request: Request, parse: Callable[..., Req]) -> Req | None:
        return await read_request(request, self.config,
                                  lambda decoded, surrogates: parse(decoded, self.config, surrogates=surrogates))

    async def _model(self, name: str) -> str:
        """The model a request names; Ollama's clients add ":latest" to a name without a tag."""
        try:
            return await self.api.model(name)
        except ApiError:
            if name.endswith(":latest"):
                return await self.api.model(name.removesuffix(":latest"))
            raise

    # --- POST /api/chat and /api/generate ---

    async def chat(self, request: Request) -> Response:
        started = time.perf_counter_ns()
        headers: dict[str, str] = {}
        try:
            req = await self._body(request, parse_chat)
            if req is None:
                return Response(status_code=HTTPStatus.BAD_REQUEST)  # nobody is left to read it
            system, convo = conversation(req.messages)
            if not convo:
                return await self._load_only(req.model, req.keep_alive, chat=True)
            _check_results(convo)
            tools = [t.model_dump(exclude_none=True) for t in req.tools or ()] or None
            return await self._answer(request, req, Ask(system, convo, tools, door="ollama chat",
                                                        call_ids=lambda k: call_id(len(convo), k)),
                                      headers, started, chat=True)
        except ApiError as e:
            return error_response(e, headers)
        except RequestError as e:
            return error_response(api_error(e.code, e.message, model=self.config.model), headers)

    async def generate(self, request: Request) -> Response:
        started = time.perf_counter_ns()
        headers: dict[str, str] = {}
        try:
            req = await self._body(request, parse_generate)
            if req is None:
                return Response(status_code=HTTPStatus.BAD_REQUEST)
            if not req.prompt and not req.suffix:
                return await self._load_only(req.model, req.keep_alive, chat=False)
            convo = [Said("user", req.prompt or "")]
            prompt = None
            if req.suffix is not None:
                prompt = RawPrompt(req.prompt or "", suffix=req.suffix, markers=await self._fim(req.model))
            elif req.raw:
                prompt = RawPrompt(req.prompt or "")
            ask = Ask(req.system, convo, door="ollama generate", prompt=prompt)
            return await self._answer(request, req, ask, headers, started, chat=False)
        except ApiError as e:
            return error_response(e, headers)
        except RequestError as e:
            return error_response(api_error(e.code, e.message, model=self.config.model), headers)

    async def _fim(self, name: str) -> tuple[str, str, str]:
        """The model's fill-in-the-middle markers; ApiError where it has none."""
        model, engine = await self.api.ready(await self._model(name))
        markers = await engine.tokenize(fim_markers)
        if markers is None:
            raise ApiError(HTTPStatus.BAD_REQUEST, f"suffix: {model}'s tokenizer has no fill-in-the-middle tokens "
                           "(<fim_prefix> and the like), so it cannot fill in between a prompt and a suffix; leave "
                           "suffix out, or serve a code model that has them")
        return markers

    async def _answer(self, request: Request, req: OllamaChatRequest | GenerateRequest, ask: Ask,
                      headers: dict[str, str], started: int, *, chat: bool) -> Response:
        sampling = _sampling(req.options, self.config)
        model = await self._model(req.model)
        keep = keep_alive_seconds(req.keep_alive)
        with self.api.admission.slot():  # a place in the queue from here until the turn has started
            t0 = time.perf_counter_ns()
            model, engine = await self.api.ready(model)
            load_ns = time.perf_counter_ns() - t0
            context = sampling.pop("context")
            extra: dict[str, Any] = {}
            if context is not None and engine.max_context and context > engine.max_context:
                extra["num_ctx"] = engine.max_context  # capped: the model's own context
                log.info("num_ctx %d is more than %s's context; capped to %d", context, model, engine.max_context)
                context = engine.max_context
            grammar = await output_grammar(response_format(req.format))  # a worker, within bounds
            ask = Ask(ask.system, ask.convo, ask.tools, stop=stops(req.options), grammar=grammar, model=model,
                      door=ask.door, call_ids=ask.call_ids, prompt=ask.prompt,
                      context=context, logprobs=(req.top_logprobs or 0) if req.logprobs else None, **sampling)
            turn, events = await self.api.start(request, ask, headers, rid_prefix="ollama-")
        if keep is not None:
            self.turns.engines.keep(model, keep)
        return OllamaResponse(self.turns, self.config, turn, events.receive, headers, stream=req.stream, chat=chat,
                            model=req.model, started_ns=started, load_ns=load_ns, extra=extra)

    async def _load_only(self, name: str, keep_alive: float | int | str | None, *, chat: bool) -> Response:
        """No messages (no prompt): load the model, or with keep_alive 0 unload it (Ollama's convention)."""
        keep = keep_alive_seconds(keep_alive)
        model = await self._model(name)
        reason = "load"
        if keep == 0 and model != self.turns.engines.default:
            reason = "unload" if await self.turns.engines.unload(model) or self.turns.engines.get(model) is None \
                else "load"
        else:
            await self.api.ready(model)
            if keep is not None:
                self.turns.engines.keep(model, keep)
        body: dict[str, Any] = {"model": name, "created_at": created_at(), "done": True, "done_reason": reason}
        body.update({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})
        return JSONResponse(body)

    # --- the model endpoints ---

    async def tags(self, request: Request) -> Response:
        return JSONResponse(await ollama_models.tags(self.config.models_dir, self.turns.engines.default))

    async def ps(self, request: Request) -> Response:
        return JSONResponse(ollama_models.ps(self.turns.engines))

    async def _named(self, request: Request) -> ModelRequest | None:
        return await self._body(request, lambda body, config, surrogates: validated(ModelRequest, body, config)
                                if isinstance(body, dict) else _not_object())

    async def show(self, request: Request) -> Response:
        try:
            req = await self._named(request)
            if req is None:
                return Response(status_code=HTTPStatus.BAD_REQUEST)
            model = await self._model(req.named())
            return JSONResponse(await ollama_models.show(self.config.models_dir, self.turns.engines, model,
                                                         capabilities))
        except ApiError as e:
            return error_response(e)

    async def pull(self, request: Request) -> Response:
        try:
            req = await self._named(request)
            if req is None:
                return Response(status_code=HTTPStatus.BAD_REQUEST)
            name = req.named()
            try:
                model = await self._model(name)
            except ApiError:
                model = name  # not here yet: a repo id, a GGUF's path
            if req.stream:
                return Lines(lambda emit: ollama_models.pull(self.config.models_dir, model, emit))

            async def quiet(line: dict[str, Any]) -> None:
                pass

            await ollama_models.pull(self.config.models_dir, model, quiet)
            return JSONResponse({"status": "success"})
        except ApiError as e:
            return error_response(e)

    async def delete(self, request: Request) -> Response:
        try:
            req = await self._named(request)
            if req is None:
                return Response(status_code=HTTPStatus.BAD_REQUEST)
            try:
                model = await self._model(req.named())
            except ApiError:
                raise ApiError(HTTPStatus.NOT_FOUND, f"model {req.named()!r} not found") from None
            await ollama_models.delete(self.config.models_dir, self.turns.engines, model)
            return Response(status_code=HTTPStatus.OK)
        except ApiError as e:
            return error_response(e)

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": OLLAMA_VERSION, "kvd": __version__})

    async def not_served(self, request: Request) -> Response:
        return error_response(ApiError(HTTPStatus.NOT_IMPLEMENTED, f"kvd does not serve {request.url.path}: "
                                       + NOT_SERVED[request.url.path]))


def _not_object() -> Any:
    raise ApiError(HTTPStatus.BAD_REQUEST, "the request body must be a JSON object")


def _check_results(convo: list[Said]) -> None:
    """A tool message must answer a call of the assistant message before its run (as every door checks)."""
    stray = stray_result(convo)
    if stray is not None:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"messages: a tool message (the {stray.index + 1}th after the system "
                       "prompt) answers no call of the assistant message before it; send it after the assistant "
                       "message whose tool_calls it answers")


def capabilities(tokenizer: Any) -> list[str]:
    """What the loaded model can do, as /api/show says it (tokenizer stage)."""
    caps = ["completion"]
    if getattr(tokenizer, "has_tool_calling", False):
        caps.append("tools")
    if fim_markers(tokenizer) is not None:
        caps.append("insert")
    return caps
