"""The OpenAI-compatible HTTP door: `POST /v1/chat/completions`, `POST /v1/completions` (completions.py),
`GET /v1/models`, and `GET /` (kvd runs:
the one request that needs no token, guards.py) (docs/openai.md).

A thin layer over the turn core, like the websocket door: it checks who is
asking (guards.py), validates the body (openai_schema.py), lets placement.py
place the conversation in a session, starts a turn (the turn core tokenizes
it and the engine checks that it fits, once), and hands the turn's events
to openai_answer.py, which makes them OpenAI's response or server-sent events.
"""

from __future__ import annotations

import functools
import logging
import time
from http import HTTPStatus
from pathlib import Path
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import BaseRoute, Route

from protocol.requests import RequestError
from sessions import Message, Store, chains, is_valid_session_id

from ..config import Config
from ..prompt import MessagePrompt
from ..turn import ChoiceStream, Turn
from .apiturns import ApiTurns, Ask, guarded
from .completions import CompletionsDoor
from .httpdoor import ApiError, RefusalResponse, api_error, read_request
from .jsonoutput import call_grammar, output_grammar
from .openai_answer import ChatResponse
from .openai_schema import OpenAIChatRequest, instructions, parse, stops
from .placement import Said, links
from .toolcalls import openai_calls
from .toolturns import check_tool_turns

log = logging.getLogger("kvd.api")

SEEDED = 8  # API conversations whose last request is rendered again after a start (`OpenAIDoor.seed`)


def error_response(e: ApiError, headers: dict[str, str] | None = None) -> RefusalResponse:
    """A refusal in OpenAI's shape (the chat and Responses doors')."""
    return RefusalResponse(e, e.body(), headers)


def _read(decoded: Any, surrogates: bool, config: Config) -> tuple[OpenAIChatRequest, str | None, list[Said]]:
    """The body as a validated request, its system prompt and its conversation (all three grow with
    the conversation: httpdoor.read_request runs this on a worker thread past INLINE_BYTES)."""
    req = parse(decoded, config, surrogates=surrogates)
    check_tool_turns(req.messages)
    convo = [Said(m.role, m.content if type(m.content) is str else m.text(),  # the common case first: 2x faster
                  tuple(c.stored() for c in m.tool_calls) if m.tool_calls else (), m.tool_call_id, m.thought())
             for m in req.messages if not m.instructs]
    return req, instructions(req), convo


def _messages(session_id: str, store: Store) -> list[Message]:
    return store.messages(session_id)


class OpenAIDoor:
    def __init__(self, config: Config, api: ApiTurns, token: str):
        self.config = config
        self.engine = api.engine
        self.turns = api.turns
        self.api = api  # shared with the Anthropic door: one admission queue for both
        self._created = int(time.time())
        self.completions = CompletionsDoor(config, api)
        routes: list[BaseRoute] = [
            Route("/", self.root, methods=["GET"]),  # and HEAD; no token needed (guards.public)
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            self.completions.route,
            Route("/v1/kvd/sessions/{session_id}", self.transcript, methods=["GET"])]
        self.app = guarded(routes, config, token, error_response,
                           "/v1/chat/completions, /v1/completions, /v1/responses, /v1/messages and /v1/models",
                           door="chat")

    # --- GET / ---

    async def root(self, request: Request) -> Response:
        """That kvd runs, for a client's probe (llama-server and Ollama answer theirs); nothing else."""
        return PlainTextResponse("kvd is running\n")

    # --- GET /v1/models ---

    async def _model_objects(self) -> list[dict[str, Any]]:
        """Every model kvd can serve, the default first, with its context length in the fields clients read:
        `context_length` (OpenRouter's, which litellm and many clients read), `max_model_len` (vLLM's),
        `max_context_length` / `loaded_context_length` and `state` (LM Studio's)."""
        engines = self.turns.engines
        loaded = {m["model"]: m for m in engines.loaded()}
        contexts = await anyio.to_thread.run_sync(_contexts, self.config.models_dir)
        out = []
        for name in await engines.servable():
            here = loaded.get(name)
            context = (here or {}).get("context_length") or contexts.get(name)
            out.append({"id": name, "object": "model", "created": self._created, "owned_by": "kvd",
                        "context_length": context, "max_model_len": context, "max_context_length": context,
                        "loaded_context_length": context if here is not None else None,
                        "state": "loaded" if here is not None else "not-loaded",
                        # kvd's own: a loaded model's cache layers by kind and its checkpoints' bytes (docs/caches.md)
                        **({"kvd": {"cache": here["cache"]}} if here is not None and here.get("cache") else {})})
        return out

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": await self._model_objects()})

    async def model(self, request: Request) -> Response:
        asked = request.path_params["model_id"]
        try:
            name = await self.api.model(asked)
        except ApiError as e:
            return error_response(e)
        found = [m for m in await self._model_objects() if m["id"] == name]
        return JSONResponse(found[0] if found else {"id": name, "object": "model", "owned_by": "kvd"})

    # --- GET /v1/kvd/sessions/{id}: a session's transcript, read-only ---

    async def transcript(self, request: Request) -> Response:
        """What a pinned client must send to continue a session: its system prompt and messages, in order."""
        session_id = request.path_params["session_id"]
        session = (await self.turns.transcripts.read(lambda store: store.get_session(session_id))
                   if is_valid_session_id(session_id) else None)
        if session is None:
            return error_response(ApiError(HTTPStatus.NOT_FOUND, f"no session {session_id!r}",
                                           code="session_not_found"))
        stored = await self.turns.transcripts.read(lambda store: store.messages(session_id))
        said = [m for m in stored if chains.said(m["content"], m["tool_calls"], m["status"])]  # as placement compares
        messages: list[dict[str, Any]] = (
            [{"role": "system", "content": session["system"]}] if session["system"] is not None else [])
        for m in said:
            message: dict[str, Any] = {"role": m["role"], "content": m["content"]}
            if m["tool_calls"]:
                message["tool_calls"] = openai_calls(m["tool_calls"])
            if m["tool_call_id"] is not None:
                message["tool_call_id"] = m["tool_call_id"]
            if m.get("reasoning"):
                message["reasoning_content"] = m.get("reasoning")
            messages.append(message)
        return JSONResponse({"object": "kvd.session", "id": session_id, "title": session["title"],
                             "created": session["created_at"], "updated": session["updated_at"],
                             "messages": messages})

    # --- POST /v1/chat/completions ---

    async def chat(self, request: Request) -> Response:
        headers: dict[str, str] = {}
        try:
            read = await read_request(request, self.config, functools.partial(_read, config=self.config))
            if read is None:
                return Response(status_code=HTTPStatus.BAD_REQUEST)  # nobody is left to read it
            req, system, convo = read
            with self.api.admission.slot():  # a place in the queue from here until the turn has started
                turn, events = await self._start(request, req, system, convo, headers)
        except ApiError as e:
            return error_response(e, headers)
        except RequestError as e:
            return error_response(api_error(e.code, e.message), headers)
        return ChatResponse(self.turns, self.config, turn, events.receive, req, headers)

    async def _start(self, request: Request, req: OpenAIChatRequest, system: str | None, convo: list[Said],
                     headers: dict[str, str]) -> tuple[Turn, ChoiceStream]:
        """Place the request and start its turn (ApiError/RequestError when it cannot be)."""
        tools, forced = req.offered_tools(), req.forced()
        grammar: str | None
        if forced is not None and tools:
            grammar = await call_grammar(tools, forced[0])
        else:
            grammar = await output_grammar(req.response_format)  # on a worker, within bounds
        ask = Ask(system, convo, tools, max_tokens=req.max_completion_tokens or req.max_tokens,
                  temperature=req.temperature, top_p=req.top_p, stop=stops(req), seed=req.seed, grammar=grammar,
                  model=req.model, door="chat", conversation=req.prompt_cache_key, knobs=req.knobs(),
                  logprobs=(req.top_logprobs or 0) if req.logprobs else None, forced=forced is not None,
                  n=req.n or 1)
        events = ChoiceStream()
        return await self.api.begin(request, ask, events, headers, rid_prefix="chatcmpl-"), events

    async def seed(self, count: int = SEEDED) -> int:
        """After a start: render the last request of the most recently used API conversations once, in
        the tokenizer stage, so that each one's next request renders only its new messages.

        `daemon/renders.py` remembers only the requests this process rendered, so the first request
        of each conversation after a restart rendered and tokenized it whole: 6-9 ms for the default
        model at 2k tokens on a 2-core CPU, more than the turn's own forward on a GPU. The seed is
        the very render that last request had (its stored messages up to its answer, its system
        prompt, no tools), so the ids stay exactly a whole render's: a next request that differs
        (other messages, tools) does not match it and renders whole, as before. Conversations with
        tool calls are left out (their arguments are remembered as the client wrote them, which the
        transcript does not keep). Returns how many were seeded.
        """
        try:
            return await self._seed(count)
        except Exception as e:  # an optimisation: whatever keeps it from running, requests render whole
            log.warning("could not render the recent API conversations ahead after the start (%s); their "
                        "next requests render them whole", e)
            return 0

    async def _seed(self, count: int) -> int:
        sessions = await self.turns.transcripts.read(lambda store: store.list_sessions(limit=4 * count))
        seeded = 0
        for session in sessions:
            if seeded >= count:
                break
            if not (session["origin"] or "").startswith("api"):
                continue
            stored = await self.turns.transcripts.read(functools.partial(_messages, session["id"]))
            said = [m for m in stored if chains.said(m["content"], m["tool_calls"], m["status"])]
            if len(said) < 2 or said[-1]["role"] != "assistant" or any(
                    m["tool_calls"] or m["tool_call_id"] is not None or m["role"] == "tool" for m in said):
                continue
            asked = [Said(m["role"], m["content"], reasoning=m.get("reasoning")) for m in said[:-1]]
            system = session["system"]
            prompt = MessagePrompt(asked, system, None, chain=links(system, asked), renders=self.turns.renders)
            try:
                await self.turns.engine.tokenize(prompt.ids)  # the default model's (seeded at start)
            except Exception:  # a template that refuses it: its next request renders whole
                log.debug("seeding the render of session %s failed", session["id"], exc_info=True)
                continue
            seeded += 1
        if seeded:
            log.info("rendered the last request of %d API conversation(s) ahead of their next", seeded)
        return seeded


def _contexts(models_dir: Path) -> dict[str, int | None]:
    """Each listed model's context length as its files say, loaded or not (a worker thread)."""
    from ..models.catalog import entries

    return {e.name: e.context for e in entries(models_dir)}
