"""OpenAI's text completions: `POST /v1/completions` (docs/openai.md).

A prompt (text, or token ids as given) is fed as it is, not through the chat
template (rawprompt.py); a `suffix` makes it a fill-in-the-middle where the
model's tokenizer has the markers. A completion has no conversation to place,
so it needs no session of its own: its prefix is reused by content. The
turn core still runs it in a session (its answer is committed, its cache
kept as every turn's), one of a few kept for text completions per daemon
(`SessionPool`): an idle one is rewound to nothing and takes the completion, so
their number stays at most the turns running at once. The cache store's
checkout restores the longest prefix of the prompt's ids that anything holds:
that session's last completion, another session's cache in memory, the
content-addressed blocks on disk (a repeated long prompt, after a restart
too); the usage says how many tokens came from it (`cached_tokens`).

A pool session that a chat request continued since (placement found its
prompt and answer as the start of a conversation) is left to that
conversation and never rewound.
"""

from __future__ import annotations

import logging
import time
from http import HTTPStatus
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from protocol.requests import RequestError
from sessions import Session

from ..config import Config
from ..turn import ChoiceStream
from ..turns import Turns
from .apiturns import ApiTurns, Ask
from .completions_answer import CompletionResponse
from .completions_schema import CompletionRequest, parse, stops
from .httpdoor import ApiError, RefusalResponse, api_error, read_request
from .placement import Placement, Said
from .rawprompt import RawPrompt, fim_markers

log = logging.getLogger("kvd.api")

PATH = "/v1/completions"
ORIGIN = "api (text completions)"
TITLE = "text completions"
POOL_LOOKUP = 64  # sessions looked at after a start for the pool's earlier ones


def error_response(e: ApiError, headers: dict[str, str] | None = None) -> RefusalResponse:
    return RefusalResponse(e, e.body(), headers)


class SessionPool:
    """The sessions text completions run in: an idle one is reused (rewound), else a new one is made."""

    def __init__(self, turns: Turns):
        self.turns = turns
        self.sessions: list[str] = []
        self.placing: set[str] = set()  # taken by a request whose turn has not started yet (`release`)
        self._found = False

    async def _find(self) -> None:
        """Once per start: the pool's sessions of an earlier run (their caches serve prefixes still)."""
        if self._found:
            return
        self._found = True
        listed: list[Session] = await self.turns.transcripts.read(
            lambda store: store.list_sessions(limit=POOL_LOOKUP))
        self.sessions += [s["id"] for s in listed if s["origin"] == ORIGIN and s["id"] not in self.sessions]

    async def place(self, said: Said) -> Placement:
        """A session for the completion, its prompt as its one user message (the answer comes next)."""
        await self._find()
        message = [said.for_template()]
        for sid in list(self.sessions):
            if sid in self.turns.active or sid in self.placing:
                continue
            self.placing.add(sid)  # before the wait below: no other request takes it meanwhile
            held = await self.turns.transcripts.hold(sid)
            if held is None or len(held.messages) > 2 or sid in self.turns.active:  # gone, or a conversation now
                self.placing.discard(sid)
                if sid in self.sessions:
                    self.sessions.remove(sid)
                continue
            session_id, first_new = self.turns.apply(sid, system=None, messages=message, rewind_from=0,
                                                     new_system=held.system is not None, title=TITLE, origin=ORIGIN)
            return Placement(session_id, first_new, "continued")
        session_id, first_new = self.turns.apply(None, system=None, messages=message, title=TITLE, origin=ORIGIN)
        self.sessions.append(session_id)
        self.placing.add(session_id)
        return Placement(session_id, first_new, "new")

    def release(self, session_id: str | None) -> None:
        """The request that took `session_id` has started its turn (the turn core holds it now) or failed."""
        if session_id is not None:
            self.placing.discard(session_id)


class CompletionsDoor:
    """Its route is the OpenAI door's (openai_api.py adds it); this holds what it needs."""

    def __init__(self, config: Config, api: ApiTurns):
        self.config, self.api, self.turns = config, api, api.turns
        self.pool = SessionPool(api.turns)
        self.route = Route(PATH, self.complete, methods=["POST"])

    async def _request(self, request: Request) -> CompletionRequest | None:
        return await read_request(request, self.config,
                                  lambda decoded, surrogates: parse(decoded, self.config, surrogates=surrogates))

    async def complete(self, request: Request) -> Response:
        headers: dict[str, str] = {}
        try:
            req = await self._request(request)
            if req is None:
                return Response(status_code=HTTPStatus.BAD_REQUEST)  # nobody is left to read it
            with self.api.admission.slot():  # a place in the queue from here until the turn has started
                model, engine = await self.api.ready(req.model)
                prompt, text = await self._prompt(req, model, engine)
                ask = Ask(None, [Said("user", text)], max_tokens=req.max_tokens, temperature=req.temperature,
                          top_p=req.top_p, stop=stops(req), seed=req.seed, model=model, door="completions",
                          prompt=prompt, logprobs=req.logprobs, prompt_logprobs=req.echo and req.logprobs is not None,
                          knobs=req.knobs(), n=req.n or 1)
                taken: list[str] = []  # the pool's sessions this request placed its choices in

                async def placed(_: str) -> Placement:
                    placement = await self.pool.place(ask.convo[0])
                    taken.append(placement.session_id)
                    return placement

                events = ChoiceStream()
                try:
                    turn = await self.api.begin(request, ask, events, headers, rid_prefix="cmpl-", placed=placed)
                finally:
                    for session_id in taken:
                        self.pool.release(session_id)
        except ApiError as e:
            return error_response(e, headers)
        except RequestError as e:
            return error_response(api_error(e.code, e.message, model=self.config.model), headers)
        return CompletionResponse(self.turns, self.config, turn, events.receive, req, headers,
                                echo=text if req.echo else None, created=int(time.time()))

    async def _prompt(self, req: CompletionRequest, model: str, engine: Any) -> tuple[RawPrompt, str]:
        """The prompt's ids as the tokenizer stage will make them, and its text (the transcript's user message,
        what `echo` repeats); ApiError for ids outside the vocabulary or a suffix the model cannot take."""
        given = req.one_prompt()
        if isinstance(given, list):
            await self.api.check_ids(given, engine, model, param="prompt")
            text = await engine.tokenize(lambda tokenizer: tokenizer.decode(given))
            return RawPrompt(ids_given=tuple(given)), text
        if req.suffix is None:
            return RawPrompt(given), given
        markers = await engine.tokenize(fim_markers)
        if markers is None:
            raise ApiError(HTTPStatus.BAD_REQUEST, f"suffix: {model}'s tokenizer has no fill-in-the-middle tokens "
                           "(<fim_prefix> and the like), so it cannot fill in between a prompt and a suffix; leave "
                           "suffix out, or serve a code model that has them", param="suffix")
        return RawPrompt(given, suffix=req.suffix, markers=markers), given
