"""The websocket front door: kvchat's protocol (docs/protocol.md) on `/v1`.

A thin layer: it checks the handshake, keeps one bounded outbox per client
(connection.py), turns each frame into a typed request (protocol/requests.py) and
calls the turn core (turns.py), which owns the sessions' store. Answers are turns,
owned by the daemon, so a client that goes away does not stop one. The client's
`Connection` listens to its turns: their typed events (events.py) become protocol
frames there (`frame`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import partial
from http import HTTPStatus
from typing import Any

import anyio
from starlette.responses import PlainTextResponse
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketDisconnect

import protocol as p
from protocol import wire
from protocol.requests import (
    ChatAttach,
    ChatCancel,
    ChatEdit,
    ChatRegenerate,
    ChatSend,
    Ping,
    RequestError,
    SessionCreate,
    SessionDelete,
    SessionGet,
    SessionList,
    SessionUpdate,
    Status,
    parse_request,
)
from protocol.shapes import merge, resolve
from sessions import KEEP, Keep, Message, Session, Store, is_disk_full

from .. import __version__
from ..config import Config
from ..engine.thread import Engine
from ..turns import DISK_FULL_MESSAGE, Turns
from .asgi import abort_transport, headers_of
from .connection import Connection
from .guards import NO_ROUTE, check
from .httpdoor import REFUSED, ApiError
from .loading import LoadingWatch

log = logging.getLogger("kvd.server")


class WebSocketDoor:
    def __init__(self, config: Config, engine: Engine, turns: Turns, token: str,
                 loading: LoadingWatch, status: Callable[[], Awaitable[dict[str, Any]]]):
        self.config = config
        self.limits = config.request_limits()
        self.engine = engine
        self.turns = turns
        self._token = token
        self._loading = loading
        self._status = status
        self.connections: set[Connection] = set()

    async def close_all(self) -> None:
        """Close every connection with 1001 (going away): kvchat then says the daemon shut down."""
        for conn in list(self.connections):
            conn.close()
            with anyio.move_on_after(1.0):
                try:
                    await conn.ws.close(1001)
                except (RuntimeError, OSError, WebSocketDisconnect):
                    pass  # already closed, or the client is gone

    def broadcast(self, event: dict[str, Any]) -> None:
        for conn in list(self.connections):
            conn.publish(event)

    # --- handshake and connection ---

    def _refusal(self, ws: WebSocket) -> PlainTextResponse | None:
        """Why the handshake is refused, if it is; left in the scope for the log (server.py)."""
        if ws.url.path != p.PATH:
            ws.scope[NO_ROUTE] = True
            return _refused(ws, HTTPStatus.NOT_FOUND, f"kvd speaks on {p.PATH}")
        refused = check(headers_of(ws.scope), self.config, self._token)
        if refused is not None:
            return _refused(ws, refused.status, refused.message)
        if len(self.connections) >= self.config.max_connections:
            return _refused(ws, HTTPStatus.SERVICE_UNAVAILABLE, f"kvd has {len(self.connections)} connections "
                            "open, its limit (limits.max_connections in config.toml); close one and retry")
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ws = WebSocket(scope, receive, send)
        if (refusal := self._refusal(ws)) is not None:
            await ws.send_denial_response(refusal)
            return
        await ws.accept(headers=[(b"server", f"kvd/{__version__}".encode())])
        conn = Connection(ws, send_timeout=self.config.send_timeout, abort=lambda: abort_transport(send))
        log.info("connection open from %s", conn.peer)
        self.connections.add(conn)
        try:
            conn.publish(self._hello())
            if (failed := self._loading.failure_event()) is not None:
                conn.publish(failed)
            await conn.serve(receive, self._dispatch)
        finally:
            self.connections.discard(conn)
            for turn in self.turns.active.values():
                turn.subscribers.discard(conn)

    def _hello(self) -> dict[str, Any]:
        return {"type": p.HELLO, "protocol": p.PROTOCOL_VERSION, "server": f"kvd {__version__}",
                "model": self.config.model, **self._loading.hello_fields(),
                "defaults": resolve({}, {}, self.config.sampling(),
                                    max_tokens_limit=self.config.max_tokens_limit).model_dump()}

    # --- requests ---

    async def _dispatch(self, conn: Connection, raw: str | bytes) -> None:  # noqa: C901 - 19: one short branch
        # per request type under the one try that turns every failure into that request's error event
        rid = None
        try:
            req = parse_request(raw, self.limits)
            rid = req.id
            if isinstance(req, Ping):
                conn.publish({"type": p.PONG, "id": rid})
            elif isinstance(req, Status):
                conn.start_slow(rid, lambda: self._reply_status(conn, rid))
            elif isinstance(req, SessionCreate):
                model = await self.turns.engines.resolve(req.model, rid) if req.model is not None else None
                session = await self.turns.transcripts.create_session(title=req.title, system=req.system,
                                                                      origin=req.origin, model=model,
                                                                      messages=req.messages)
                conn.publish({"type": p.SESSION, "id": rid, "session": self._session_object(session)})
            elif isinstance(req, SessionList):
                sessions = await self.turns.transcripts.read(lambda store: store.list_sessions(branches=True))
                conn.publish({"type": p.SESSIONS, "id": rid,
                              "sessions": [{**self._session_object(s), "branch_of": s.get("branch_of")}
                                           for s in sessions]})
            elif isinstance(req, SessionGet):
                found = await self.turns.transcripts.read(partial(_session_and_messages, req.session))
                if found is None:
                    raise RequestError(p.UNKNOWN_SESSION, f"no session {req.session!r}; list sessions with "
                                       "session.list", rid)
                session, messages = found
                conn.publish({"type": p.SESSION, "id": rid, "session": self._session_object(session),
                              "messages": [wire.message_object(m) for m in messages]})
            elif isinstance(req, SessionUpdate):
                await self._session_update(conn, req)
            elif isinstance(req, SessionDelete):
                await self.turns.delete_session(req.session, req.id)
                conn.publish({"type": p.OK, "id": req.id})
            elif isinstance(req, ChatAttach):
                await self._chat_attach(conn, req)
            elif isinstance(req, ChatSend):
                model = await self.turns.engines.resolve(req.model, rid) if req.model is not None else None
                await self.turns.send(conn, req.id, req.session, req.text,
                                      req.sampling, model=model)
            elif isinstance(req, ChatRegenerate):
                await self.turns.regenerate(conn, req.id, req.session, req.sampling)
            elif isinstance(req, ChatEdit):
                await self.turns.edit(conn, req.id, req.session, req.message_index,
                                      req.text, req.sampling)
            elif isinstance(req, ChatCancel):
                if req.session not in self.turns.active:
                    await self.turns.session(req.session, rid)
                self.turns.cancel(req.session)
                conn.publish({"type": p.OK, "id": rid})
        except RequestError as e:
            if e.request_id is None:
                e.request_id = rid
            conn.refuse(e)
        except Exception as e:
            if is_disk_full(e):
                log.warning("request refused, the disk is full: %s", e)
                conn.refuse(RequestError(p.DISK_FULL, DISK_FULL_MESSAGE, rid))
                return
            log.exception("request failed: %.200r", raw)
            conn.publish(RequestError(p.INTERNAL, "kvd hit an internal error; it is logged", rid).event())

    def _session_object(self, session: Session) -> dict[str, Any]:
        """The protocol's session object: the stored one, its model (the default's name where it has none)
        and the fastest tier holding its cache for that model now: its engine's word where it is loaded,
        else disk where a loaded model's cache store says disk keeps one for it (`kept_for`)."""
        model = session["model"] or self.turns.engines.default
        engine = self.turns.engines.get(model)
        if session["id"] in self.turns.active:
            tier = p.TIERS[0]  # resident: in the engine's batch
        elif engine is None:
            kept = {m for e in self.turns.engines.engines() for m in e.stats.get("kept_for", {}).get(session["id"], ())}
            tier = p.TIERS[-1] if model in kept else p.NO_CACHE
        else:
            tier = engine.stats.get("locations", {}).get(session["id"], p.NO_CACHE)
        return wire.session_object({**session, "model": model}, tier)

    async def _session_update(self, conn: Connection, req: SessionUpdate) -> None:
        session = await self.turns.session(req.session, req.id)
        params = KEEP if isinstance(req.params, Keep) else merge(session["params"], req.params)
        system = req.system  # one Keep (common/keep.py) on the wire and in the store
        new_system = system is not KEEP and system != session["system"]
        if new_system:
            self.turns.check_idle(req.session, req.id)  # the running turn would keep the old prompt's ids
        fields = {k: v for k, v in (("title", req.title), ("system", system), ("params", params))
                  if not isinstance(v, Keep)}
        await self.turns.transcripts.update_session(req.session, fields=fields, new_system=new_system)
        conn.publish({"type": p.SESSION, "id": req.id,
                      "session": self._session_object(await self.turns.session(req.session, req.id))})

    async def _reply_status(self, conn: Connection, rid: Any) -> None:
        conn.publish({"type": p.STATUS, "id": rid, **await self._status()})

    async def _chat_attach(self, conn: Connection, req: ChatAttach) -> None:
        if req.session not in self.turns.active:
            await self.turns.session(req.session, req.id)
        turn = self.turns.active.get(req.session)
        if turn is None:
            messages = await self.turns.transcripts.read(lambda store: store.messages(req.session))
            conn.publish({"type": p.CHAT_ATTACHED, "id": req.id, "session": req.session,
                          "generating": False, "message": wire.message_object(messages[-1]) if messages else None})
            return
        conn.publish({"type": p.CHAT_ATTACHED, "id": req.id, "session": req.session, "generating": True,
                      "request": turn.request_id, "message_index": turn.message_index})
        turn.attach(conn, req.after_seq)


def _session_and_messages(session_id: str, store: Store) -> tuple[Session, list[Message]] | None:
    """session.get's reply in one trip to the transcript's writer."""
    session = store.get_session(session_id)
    return None if session is None else (session, store.messages(session_id))



def _refused(ws: WebSocket, status: HTTPStatus, message: str) -> PlainTextResponse:
    ws.scope[REFUSED] = ApiError(status, message)
    return PlainTextResponse(message + "\n", status)
