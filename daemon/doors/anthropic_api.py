"""The Anthropic Messages door: `POST /v1/messages` and `POST /v1/messages/count_tokens` (docs/agents.md).

As thin as the chat door: it checks who is asking (guards.py: Anthropic's
clients send the token as `x-api-key`), reads the body into kvd's
conversation (anthropic_schema.py), and hands it to the HTTP doors' shared way
into the turn core (apiturns.py: admission, placement by the conversation's
hash chain, the turn). The turn's events go to anthropic_answer.py. Every
refusal is in Anthropic's error shape, whatever refused it. Messages is
stateless: each request carries the whole conversation and is placed as the
chat door's are, so its cache is found again, also after a restart.

`anthropic-version` and `anthropic-beta` headers are accepted and change
nothing. `max_tokens` is required, as Anthropic's, and is a ceiling (agents
ask for 32,000 meaning "as much as you like"): what the door rules (rules.py)
do with it, and with tools offered to a model that calls none, is every
HTTP door's.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from functools import partial
from http import HTTPStatus
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from protocol.requests import RequestError
from protocol.shapes import stops

from ..config import Config
from ..prompt import MessagePrompt
from .anthropic_answer import MessagesResponse
from .anthropic_schema import MessagesRequest, conversation, error_body, parse
from .apiturns import ApiTurns, Ask, guarded
from .httpdoor import ApiError, RefusalResponse, api_error, read_request
from .jsonoutput import call_grammar, output_grammar
from .placement import Said
from .titles import title_for

log = logging.getLogger("kvd.api")

PATH = "/v1/messages"


def is_anthropic(path: str) -> bool:
    """Whether a request's path is this door's (so that even its 401 or 404 is in Anthropic's shape)."""
    return path == PATH or path.startswith(PATH + "/")


def error_response(e: ApiError, headers: dict[str, str] | None = None) -> RefusalResponse:
    return RefusalResponse(e, error_body(e), headers)


def _read(decoded: Any, surrogates: bool, config: Config, *, count: bool = False) -> tuple[MessagesRequest, Ask]:
    """The body as a validated request and what it asks the turn core for (httpdoor.read_request runs this
    on a worker thread past INLINE_BYTES: its cost grows with the conversation)."""
    req = parse(decoded, config, count=count, surrogates=surrogates)
    ask = Ask(req.instructions(), conversation(req), req.offered_tools(), max_tokens=req.max_tokens,
              temperature=req.temperature, top_p=req.top_p, stop=stops(req.stop_sequences), model=req.model,
              door="messages", conversation=req.metadata.conversation() if req.metadata is not None else None,
              title=title_for([Said("user", text) for text in req.users_texts()]))
    return req, ask


class AnthropicDoor:
    def __init__(self, config: Config, api: ApiTurns, token: str):
        self.config = config
        self.api = api  # shared with the chat door: one admission queue for both
        routes: list[BaseRoute] = [Route(PATH, self.messages, methods=["POST"]),
                                   Route(f"{PATH}/count_tokens", self.count_tokens, methods=["POST"])]
        self.app = guarded(routes, config, token, error_response, f"{PATH} and {PATH}/count_tokens",
                           door="messages")

    async def _request(self, request: Request, *, count: bool = False) -> tuple[MessagesRequest, Ask] | None:
        """The request's body, read and validated (None: the client hung up mid-body)."""
        return await read_request(request, self.config, partial(_read, config=self.config, count=count))

    # --- POST /v1/messages ---

    async def messages(self, request: Request) -> Response:
        headers: dict[str, str] = {}
        try:
            read = await self._request(request)
            if read is None:
                return Response(status_code=HTTPStatus.BAD_REQUEST)  # nobody is left to read it
            req, ask = read
            with self.api.admission.slot():  # a place in the queue from here until the turn has started
                if (forced := req.forced()) is not None and ask.tools:  # one call, held by the grammar path
                    ask = replace(ask, grammar=await call_grammar(ask.tools, forced[0]), forced=True)
                else:
                    ask = replace(ask, grammar=await output_grammar(req.response_format()))  # a worker, in bounds
                turn, events = await self.api.start(request, ask, headers, rid_prefix="msg_")
        except ApiError as e:
            return error_response(e, headers)
        except RequestError as e:
            return error_response(api_error(e.code, e.message, model=self.config.model), headers)
        return MessagesResponse(self.api.turns, self.config, turn, events.receive, headers, stream=req.stream)

    # --- POST /v1/messages/count_tokens ---

    async def count_tokens(self, request: Request) -> Response:
        """The prompt's tokens as the turn core would feed them: rendered by the chat template, tools
        and all, in the tokenizer stage. Nothing is stored."""
        try:
            read = await self._request(request, count=True)
            if read is None:
                return Response(status_code=HTTPStatus.BAD_REQUEST)
            _, ask = read
            _, engine = await self.api.ready(ask.model)
            shown = ask.tools if self.api.tool_format(ask.tools, engine) else None  # as answered
            prompt = MessagePrompt(ask.convo, ask.system, shown)
            ids, _ = await engine.tokenize(prompt.ids)
        except ApiError as e:
            return error_response(e)
        return JSONResponse({"input_tokens": len(ids)})
