"""The Responses API door: `POST /v1/responses`, stateful and durable (docs/agents.md).

A response is one answer of a session: `previous_response_id` names the
point of a stored conversation it continues (its session and the answer's
message, sessions/responses.py). The request's conversation is that point's
messages followed by its own input, and it is placed exactly as the chat
door places a stateless request (placement.py): continuing the latest
response extends its session; continuing an older one, or with other
instructions (they are not carried over, as OpenAI), makes a new session
holding the conversation, so nothing that followed is erased, and the cache
comes from the blocks the two share. `store: false` keeps no response a
later request could name; a client that re-sends its whole input each time
(Codex does) is placed by its hash chain like any chat client, and finds its
cache the same way.

Everything after placement is the turn core's (turns.py); this door reads a
Responses body (responses_schema.py) and writes its events
(responses_events.py). A stored response's row is queued with its turn's
writes and the turn acknowledges its answer only once that row is committed
too: a response whose `response.completed` (or body) was sent survives
kill -9.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from functools import partial
from http import HTTPStatus
from typing import Any, NamedTuple

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from protocol.requests import RequestError
from sessions import Message
from sessions.chains import said
from sessions.responses import StoredResponse, delete_response, get_response, put_response

from ..config import Config
from ..events import AnswerDelta, AnswerDone, AnswerError, TurnEvent
from ..prompt import MessagePrompt
from ..turn import Turn
from .answering import TurnResponse
from .apiturns import ApiTurns, Ask, guarded
from .httpdoor import ApiError, api_error, read_request
from .jsonoutput import call_grammar, output_grammar
from .openai_answer import token_logprobs
from .openai_api import error_response
from .openai_schema import ResponseFormat
from .placement import INLINE_MESSAGES, Said
from .responses_events import RESPONSE_PREFIX, Encoder, ResponseShape
from .responses_schema import InputItem, ResponsesInput, ResponsesRequest, calls_of, conversation, parse
from .responses_stored import input_items, referenced, stored_object

log = logging.getLogger("kvd.api")

PATH = "/v1/responses"
Sender = Callable[[dict[str, Any]], Any]


class Read(NamedTuple):
    """A request as the door uses it, made where the body was read (a worker thread past INLINE_BYTES: each
    grows with the body, a JSON schema with it)."""

    req: ResponsesRequest
    fmt: ResponseFormat | None  # text.format as jsonoutput.py takes it
    asked: dict[str, Any]  # what it asked for, as its response object shows it


def _read(decoded: Any, surrogates: bool, config: Config) -> Read:
    req = parse(decoded, config, surrogates=surrogates)
    return Read(req, req.response_format(), asked(req))


def asked(req: ResponsesRequest) -> dict[str, Any]:
    """What the request asked for, as its response object shows it (and the stored row keeps)."""
    return {"instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p,
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "tool_choice": req.tool_choice if isinstance(req.tool_choice, str) or req.tool_choice is None
            else req.tool_choice.model_dump(exclude_none=True),
            "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
            "text": req.text_shown(),
            "metadata": req.metadata or {}, "previous_response_id": req.previous_response_id, "store": req.store,
            "model": req.model}


def system_of(req: ResponsesRequest, new: ResponsesInput) -> str | None:
    """The request's system prompt: its instructions, then its input's leading system and developer messages."""
    parts = [*([req.instructions] if req.instructions is not None else []), *new.lead]
    return "\n\n".join(parts) if parts else None


def is_responses(path: str) -> bool:
    """Whether a request's path is this door's."""
    return path == PATH or path.startswith(PATH + "/")


class ResponsesDoor:
    def __init__(self, config: Config, api: ApiTurns, token: str):
        self.config = config
        self.turns = api.turns
        self.api = api  # shared with the other HTTP doors: one admission queue for all
        self.points = api.turns.transcripts.points  # id -> (session, answer index), lately used ones
        routes: list[BaseRoute] = [
            Route(PATH, self.create, methods=["POST"]),
            Route(f"{PATH}/input_tokens", self.input_tokens, methods=["POST"]),
            Route(f"{PATH}/{{response_id}}", self.get, methods=["GET"]),
            Route(f"{PATH}/{{response_id}}", self.delete, methods=["DELETE"]),
            Route(f"{PATH}/{{response_id}}/input_items", self.items, methods=["GET"])]
        self.app = guarded(routes, config, token, error_response, f"{PATH} (and its ids' GET, DELETE, "
                           "input_items), /v1/responses/input_tokens, /v1/chat/completions and /v1/models",
                           door="responses")

    # --- POST /v1/responses ---

    async def create(self, request: Request) -> Response:
        headers: dict[str, str] = {}
        try:
            if (read := await self._request(request)) is None:
                return Response(status_code=HTTPStatus.BAD_REQUEST)  # nobody is left to read it
            with self.api.admission.slot():  # a place in the queue from here until the turn has started
                return await self._start(request, read, headers)
        except (ApiError, RequestError) as e:
            return _refusal(e, headers)

    async def _request(self, request: Request) -> Read | None:
        return await read_request(request, self.config, partial(_read, config=self.config))

    async def _conversation(self, req: ResponsesRequest) -> tuple[str | None, list[Said]]:
        """The request's system prompt and whole conversation: the previous response's point, then its input."""
        history = await self._history(req.previous_response_id) if req.previous_response_id else []
        items = await self._resolved(req.input)
        if isinstance(items, list) and len(items) > INLINE_MESSAGES:
            new = await anyio.to_thread.run_sync(conversation, items, calls_of(history))
        else:
            new = conversation(items, calls_of(history))
        return system_of(req, new), [*history, *new.messages]

    async def _resolved(self, items: str | list[InputItem]) -> str | list[InputItem]:
        """The input with each `item_reference` replaced by the item it names: one kvd issued for a response
        of this data directory (its message, a function call, a function call output); 400 for any other id."""
        if isinstance(items, str) or not any(item.type == "item_reference" for item in items):
            return items
        ids = {item.id for item in items if item.type == "item_reference" and item.id}
        found = await self.turns.transcripts.read(partial(referenced, ids=ids))
        out = []
        for i, item in enumerate(items):
            if item.type != "item_reference":
                out.append(item)
            elif item.id is None:
                raise ApiError(HTTPStatus.BAD_REQUEST, f"input[{i}] is an item_reference without an id",
                               param=f"input[{i}].id")
            elif (named := found.get(item.id)) is None:
                raise ApiError(HTTPStatus.BAD_REQUEST, f"input[{i}] refers to the item {item.id!r:.80}, which kvd "
                               "did not issue for a stored response of this data directory (or its response was "
                               "deleted); send the item itself", param=f"input[{i}].id", code="item_not_found")
            else:
                out.append(InputItem.model_construct(**named))
        return out

    async def _start(self, request: Request, read: Read, headers: dict[str, str]) -> Response:
        req = read.req
        system, convo = await self._conversation(req)
        # No max_output_tokens: as OpenAI's, up to what the model may write (limits.max_tokens_limit, within the
        # context), not the chat default: Codex names none, and reports an answer cut at 512 as an error.
        tools, forced = [t.for_template() for t in req.functions()] or None, req.forced()
        grammar = await call_grammar(tools, forced[0]) if forced is not None and tools else await _grammar(read.fmt)
        ask = Ask(system, convo, tools, max_tokens=req.max_output_tokens or self.config.max_tokens_limit,
                  temperature=req.temperature, top_p=req.top_p, grammar=grammar,
                  model=req.model, door="responses", conversation=req.prompt_cache_key, forced=forced is not None,
                  logprobs=req.top_logprobs)
        turn, events = await self.api.start(request, ask, headers, rid_prefix=RESPONSE_PREFIX)
        rid = str(turn.request_id)
        request_shape = read.asked
        if req.store:
            row = StoredResponse(rid, turn.session_id, turn.message_index, turn.first_new,
                                 req.previous_response_id, time.time(), request_shape)
            # Committed with the turn's own rows, before it acknowledges its answer (the turn core's).
            self.turns.write_with(turn, partial(put_response, response=row), label="response")
            assert turn.held is not None
            self.turns.transcripts.responded(turn.held, turn.message_index)  # a rewrite keeps its answer
            self.points.remember(rid, turn.session_id, turn.message_index)
        shape = ResponseShape(rid, int(time.time()), self.config.model, request_shape, {"session": turn.session_id})
        return ResponsesResponse(self, turn, events.receive, Encoder(shape), headers, stream=req.stream,
                               stored=req.store)

    async def _point(self, response_id: str) -> tuple[str, int]:
        """The session and answer index a stored response names (a 404 when none)."""
        if (point := self.points.get(response_id)) is not None:
            return point
        row = await self.turns.transcripts.read(lambda s: get_response(s, response_id))
        if row is None:
            raise _not_found(response_id, "previous_response_id")
        self.points.remember(response_id, row.session_id, row.answer_idx)
        return row.session_id, row.answer_idx

    async def _history(self, response_id: str) -> list[Said]:
        """The conversation up to and with the response's answer, as the session holds it."""
        session_id, index = await self._point(response_id)
        try:
            held = await self.turns.hold(session_id)
        except RequestError:
            raise _not_found(response_id, "previous_response_id") from None
        if index >= len(held.messages) or held.messages[index]["role"] != "assistant":
            # Not its answer: a rewrite branches responses away first (sessions/responses.py), so only a
            # response whose own turn was refused gets here, before the door forgets it.
            raise _not_found(response_id, "previous_response_id")
        if held.messages[index]["status"] == "streaming":
            raise ApiError(HTTPStatus.CONFLICT, f"the response {response_id} is still being generated; wait for it "
                           "to complete, then continue it", param="previous_response_id", code="response_in_progress")
        kept = held.messages[:index + 1]
        if len(kept) <= INLINE_MESSAGES:
            return _said(kept)
        return await anyio.to_thread.run_sync(_said, kept)  # a long conversation: off the loop

    async def forget(self, response_id: str) -> bool:
        self.points.drop(response_id)
        point = await self.turns.transcripts.write(lambda s: delete_response(s, response_id))
        if point is not None:
            self.turns.transcripts.unresponded(*point)
        return point is not None

    # --- GET, DELETE /v1/responses/{id}, GET .../input_items ---

    async def get(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        answering = frozenset(self.turns.active)  # a 'streaming' answer of another session was cut
        found = await self.turns.transcripts.read(lambda s: stored_object(s, response_id, self.config.model,
                                                                          answering))
        if found is None:
            return error_response(_not_found(response_id))
        return JSONResponse(found)

    async def delete(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if not await self.forget(response_id):
            return error_response(_not_found(response_id))
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def items(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        q = request.query_params
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            return error_response(ApiError(HTTPStatus.BAD_REQUEST, "order is \"asc\" or \"desc\"", param="order"))
        limit_text = q.get("limit", "20")
        if not limit_text.isdigit() or not 1 <= int(limit_text) <= 100:
            return error_response(ApiError(HTTPStatus.BAD_REQUEST, "limit is a whole number from 1 to 100",
                                           param="limit"))
        after = q.get("after")
        found = await self.turns.transcripts.read(
            lambda s: input_items(s, response_id, order=order, limit=int(limit_text), after=after))
        if found is None:
            return error_response(_not_found(response_id))
        return JSONResponse(found)

    # --- POST /v1/responses/input_tokens ---

    async def input_tokens(self, request: Request) -> Response:
        """How many tokens the request's input comes to, rendered as its turn would be; nothing is stored."""
        try:
            read = await self._request(request)
            if read is None:
                return Response(status_code=HTTPStatus.BAD_REQUEST)
            req = read.req
            _, engine = await self.api.ready(req.model)
            system, convo = await self._conversation(req)
            tools = [t.for_template() for t in req.functions()] or None
            shown = tools if self.api.tool_format(tools, engine) is not None else None
            ids, _ = await engine.tokenize(MessagePrompt(convo, system, shown).ids)
        except (ApiError, RequestError) as e:
            return _refusal(e, {})
        return JSONResponse({"object": "response.input_tokens", "input_tokens": len(ids)})


def _said(messages: list[Message]) -> list[Said]:
    """A session's messages as placement compares them (those a client could have been shown)."""
    return [Said(m["role"], m["content"], tuple(m["tool_calls"] or ()), m["tool_call_id"], m.get("reasoning"))
            for m in messages if said(m["content"], m["tool_calls"], m["status"])]


async def _grammar(fmt: ResponseFormat | None) -> str | None:
    """text.format's grammar (jsonoutput.py, on a worker, within bounds); its errors name text.format."""
    try:
        return await output_grammar(fmt)
    except ApiError as e:
        if e.param is not None:
            e.param = e.param.replace("response_format.json_schema", "text.format").replace("response_format",
                                                                                             "text.format")
            e.message = e.message.replace("response_format", "text.format")
        raise


def _refusal(e: ApiError | RequestError, headers: dict[str, str]) -> Response:
    """A request refused before its turn began, in OpenAI's error shape (the turn core's refusals too)."""
    return error_response(e if isinstance(e, ApiError) else api_error(e.code, e.message), headers)


def _not_found(response_id: str, param: str | None = None) -> ApiError:
    return ApiError(HTTPStatus.NOT_FOUND, f"no response {response_id!r:.80} (never stored, stored with store: "
                    "false, or deleted)", param=param, code="previous_response_not_found" if param else "not_found")


class ResponsesResponse(TurnResponse[TurnEvent]):
    """One response: its body, or its stream of typed events (`event:` and `data:` lines)."""

    def __init__(self, door: ResponsesDoor, turn: Turn, events: MemoryObjectReceiveStream[TurnEvent],
                 encoder: Encoder, headers: dict[str, str], *, stream: bool, stored: bool):
        super().__init__(door.turns, door.config, turn, events, headers, stream=stream)
        self.door, self.encoder = door, encoder
        self.stored = stored  # a refusal forgets the response row it queued

    async def _whole(self, send: Sender) -> None:
        await self._answer(send)

    async def _stream(self, send: Sender) -> None:
        await self._answer(send)

    async def _answer(self, send: Sender) -> None:
        """The turn's events, encoded (`_write`) until the response is whole."""
        async for event in self.events:
            if isinstance(event, AnswerError) and not self.started:
                await self._refused(send, event)
                return
            try:
                if await self._write(send, event):
                    return
            finally:
                if isinstance(event, AnswerDelta) and event.written is not None:
                    event.written()  # the first token is out (or a body is sent only at the end)

    async def _write(self, send: Sender, event: TurnEvent) -> bool:
        """Encode one event; True once the response is whole."""
        if isinstance(event, AnswerDone) and event.logprobs is not None and self.turn.engine is not None:
            self.encoder.logprobs = await token_logprobs(self.turn.engine, event.logprobs, len(event.content))
        out = self.encoder.encode(event)
        last = isinstance(event, (AnswerDone, AnswerError))
        if not self.stream:
            if last:
                await self.send_body(send, 200, out[-1]["response"])
            return last
        if out and not self.started:
            await self.begin_response(send, 200, "text/event-stream; charset=utf-8")
        for e in out:
            await send({"type": "http.response.body", "more_body": True,
                        "body": f"event: {e['type']}\ndata: {_json(e)}\n\n".encode()})
        if last and self.started:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        return last

    async def _refused(self, send: Sender, event: AnswerError) -> None:
        """An error before the answer began: a refusal, which leaves nothing behind (the turn core stored
        nothing of a session this request made and took back what it added to another; the response row
        the client was never told of goes too)."""
        await self.turn.finished.wait()  # the turn's writes are done: the row is in, or never was
        if self.stored:
            await self.door.forget(self.turn.request_id)
        e = api_error(event.code, event.message, model=self.config.model)
        await self.refuse(send, e, e.body())


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
