"""The websocket server: handshake checks, request dispatch, streaming answers.

The asyncio side never calls MLX. A chat turn is committed to the store, handed
to the engine thread as a GenerationJob, and its events come back through an
unbounded per-generation stream (the engine must never block) to a pump task
that commits the text as it streams and publishes it to the client.
Generations belong to the daemon's task group, not to a connection: a client
that goes away does not stop its answer from being generated and kept.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import os
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import anyio
from anyio.abc import TaskGroup, TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.http11 import Request, Response

from sessions import Keep, Message, Session, Store, is_disk_full

from . import __version__
from . import protocol as p
from .config import Config
from .connection import Connection
from .engine import Delta, Done, Engine, EngineEvent, Failed, GenerationJob, Queued, Started
from .loading import LoadingWatch
from .requests import (ChatAttach, ChatCancel, ChatEdit, ChatRegenerate, ChatSend, Ping, RequestError, SessionCreate,
                       SessionDelete, SessionGet, SessionList, SessionUpdate, Status, parse_request)
from .sampling import merge, resolve

log = logging.getLogger("kvd.server")

COMMIT_INTERVAL = 0.25  # seconds between commits of a streaming answer
DISK_FULL_MESSAGE = ("the disk holding kvd's data directory is full, so this was not saved; "
                     "free some space and send it again (nothing saved before is lost)")
STATUS_TIMEOUT = 5.0  # a busy engine answers status between steps; past this, the last figures


@dataclass
class Generation:
    request_id: Any
    session_id: str
    message_index: int
    first_new: int  # the first message this turn added (taken back if it can never fit)
    subscribers: set[Connection] = field(default_factory=set)
    text: str = ""
    seq: int = 0
    deltas: list[str] = field(default_factory=list)  # each published delta's text, by seq
    finished: anyio.Event = field(default_factory=anyio.Event)  # the answer is committed, whatever its end

    def publish(self, event: dict[str, Any]) -> None:
        event = {"id": self.request_id, "session": self.session_id, **event}
        for conn in list(self.subscribers):
            conn.publish(event)

    def attach(self, conn: Connection, after_seq: int) -> None:
        """Re-send the deltas `conn` has not seen, as first published, then subscribe it.

        One synchronous step on the event loop: no delta can be published
        between the replay and the subscription, so there is no gap and no
        duplicate.
        """
        for seq in range(after_seq + 1, len(self.deltas)):
            conn.publish({"type": p.CHAT_DELTA, "id": self.request_id, "session": self.session_id,
                          "seq": seq, "text": self.deltas[seq]})
        self.subscribers.add(conn)


class Daemon:
    def __init__(self, config: Config, store: Store, engine: Engine, token: str):
        self.config = config
        self.store = store
        self.engine = engine
        self._token = token
        self._generations: dict[str, Generation] = {}
        self._connections: set[Connection] = set()
        self._tg: TaskGroup | None = None
        self._stopping = anyio.Event()
        self._loading = LoadingWatch(engine, config.model)
        self.url: str | None = None
        self._started = time.monotonic()

    # --- lifecycle ---

    async def run(self, *, task_status: TaskStatus[str] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until `shutdown()`; then finish every answer and return."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            loading = anyio.CancelScope()

            async def watch_loading() -> None:
                with loading:
                    await self._loading.run(self._broadcast)

            tg.start_soon(watch_loading)
            server: Server
            async with serve(
                self._handle,
                self.config.host,
                self.config.port,
                process_request=self._check_handshake,
                max_size=self.config.max_message_bytes,
                max_queue=16,
                compression=None,
                server_header=f"kvd/{__version__}",
            ) as server:
                port = next(iter(server.sockets)).getsockname()[1]
                self.url = p.default_url(self.config.host, port)
                task_status.started(self.url)
                await self._stopping.wait()
                if cut := len(self._generations):
                    # Cut, not finished: a stop must not wait for max_tokens of every answer.
                    # Each is kept as 'cancelled' with its text and its cache, so it resumes.
                    log.info("shutting down: cutting %d answer(s) short (kept as 'cancelled'; "
                             "chat.regenerate or a new message resumes from the cache), "
                             "paging caches out", cut)
                else:
                    log.info("shutting down: paging caches out")
                loading.cancel()
                server.close(close_connections=True)
                await anyio.to_thread.run_sync(self.engine.stop)
                await server.wait_closed()
            # Leaving the task group waits for every pump to commit its answer.

    def shutdown(self) -> None:
        self._stopping.set()

    # --- handshake ---

    def _check_handshake(self, connection: ServerConnection, request: Request) -> Response | None:
        path = request.path.split("?", 1)[0]
        if path != p.PATH:
            return connection.respond(HTTPStatus.NOT_FOUND, f"kvd speaks on {p.PATH}\n")
        origin = request.headers.get("Origin")
        if origin is not None and origin not in self.config.allowed_origins:
            log.warning("refused a handshake from origin %s", origin)
            return connection.respond(HTTPStatus.FORBIDDEN, "browser origins are not allowed; see allowed_origins in config.toml\n")
        auth = request.headers.get("Authorization", "")
        expected = f"Bearer {self._token}"
        if not hmac.compare_digest(auth.encode(), expected.encode()):
            return connection.respond(HTTPStatus.UNAUTHORIZED, "missing or wrong token; it is in the token file of kvd's data directory\n")
        if len(self._connections) >= self.config.max_connections:
            log.warning("refused a connection: %d open (limits.max_connections)", len(self._connections))
            return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE,
                                      f"kvd has {len(self._connections)} connections open, its limit "
                                      "(limits.max_connections in config.toml); close one and retry\n")
        return None

    # --- connections ---

    async def _handle(self, ws: ServerConnection) -> None:
        conn = Connection(ws, send_timeout=self.config.send_timeout)
        self._connections.add(conn)
        try:
            conn.publish(self._hello())
            if (failed := self._loading.failure_event()) is not None:
                conn.publish(failed)
            await conn.serve(self._dispatch)
        finally:
            self._connections.discard(conn)
            for gen in self._generations.values():
                gen.subscribers.discard(conn)

    async def status(self) -> dict[str, Any]:
        """What `kvd status` shows: the model, the connections, every cache tier."""
        stats = self.engine.stats
        if self.engine.ready.is_set():
            # Through the engine's queue, so a turn that just finished is counted.
            loop = asyncio.get_running_loop()
            fresh: asyncio.Future[dict[str, Any]] = loop.create_future()

            def deliver(s: dict[str, Any]) -> None:  # engine thread
                loop.call_soon_threadsafe(_settle, s)

            def _settle(s: dict[str, Any]) -> None:
                if not fresh.done():
                    fresh.set_result(s)

            self.engine.query_status(deliver)
            with anyio.move_on_after(STATUS_TIMEOUT):
                stats = await fresh
        return {"server": f"kvd {__version__}", "model": self.config.model, "pid": os.getpid(),
                "uptime": time.monotonic() - self._started, "log_file": str(self.config.log_path),
                "data_dir": str(self.config.data_dir),
                "ready": self.engine.ready.is_set() and self.engine.load_error is None,
                "connections": len(self._connections), "generating": stats.get("generating", 0),
                "waiting": stats.get("waiting", 0),
                "tiers": stats.get("tiers", {}), "locations": stats.get("locations", {})}

    def connection_statistics(self) -> list[dict[str, Any]]:
        return [c.statistics() for c in self._connections]

    def _hello(self) -> dict[str, Any]:
        return {"type": p.HELLO, "protocol": p.PROTOCOL_VERSION, "server": f"kvd {__version__}",
                "model": self.config.model, **self._loading.hello_fields()}

    def _broadcast(self, event: dict[str, Any]) -> None:
        for conn in list(self._connections):
            conn.publish(event)

    async def _dispatch(self, conn: Connection, raw: str | bytes) -> None:
        rid = None
        try:
            req = parse_request(raw, self.config)
            rid = req.id
            if isinstance(req, Ping):
                conn.publish({"type": p.PONG, "id": rid})
            elif isinstance(req, Status):
                conn.start_slow(rid, lambda: self._reply_status(conn, rid))
            elif isinstance(req, SessionCreate):
                session = self.store.create_session(title=req.title, system=req.system)
                conn.publish({"type": p.SESSION, "id": rid, "session": self._session_object(session)})
            elif isinstance(req, SessionList):
                conn.publish({"type": p.SESSIONS, "id": rid,
                              "sessions": [self._session_object(s) for s in self.store.list_sessions()]})
            elif isinstance(req, SessionGet):
                session = self._session(req.session, rid)
                conn.publish({"type": p.SESSION, "id": rid, "session": self._session_object(session),
                              "messages": self.store.messages(req.session)})
            elif isinstance(req, SessionUpdate):
                self._session_update(conn, req)
            elif isinstance(req, SessionDelete):
                self._session_delete(conn, req)
            elif isinstance(req, ChatAttach):
                self._chat_attach(conn, req)
            elif isinstance(req, ChatSend):
                self._chat_send(conn, req)
            elif isinstance(req, ChatRegenerate):
                self._chat_regenerate(conn, req)
            elif isinstance(req, ChatEdit):
                self._chat_edit(conn, req)
            elif isinstance(req, ChatCancel):
                self._session(req.session, rid)
                self.engine.cancel(req.session)
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

    async def _reply_status(self, conn: Connection, rid: Any) -> None:
        conn.publish({"type": p.STATUS, "id": rid, **await self.status()})

    def _session(self, session_id: str, rid: Any) -> Session:
        session = self.store.get_session(session_id)
        if session is None:
            raise RequestError(p.UNKNOWN_SESSION,
                               f"no session {session_id!r}; list sessions with session.list", rid)
        return session

    # --- sessions ---

    def _session_object(self, session: Session) -> dict[str, Any]:
        """The protocol's session object: the stored one plus where its cache lives now."""
        if session["id"] in self._generations:
            cache = "resident"  # in the engine's batch
        else:
            cache = self.engine.stats.get("locations", {}).get(session["id"], "none")
        return {**session, "cache": cache}

    def _session_update(self, conn: Connection, req: SessionUpdate) -> None:
        session = self._session(req.session, req.id)
        params = req.params if isinstance(req.params, Keep) else merge(session["params"], req.params)
        new_system = not isinstance(req.system, Keep) and req.system != session["system"]
        if new_system:
            self._check_idle(req.session, req.id)  # the running turn would keep the old prompt's ids
        self.store.update_session(req.session, title=req.title, system=req.system, params=params)
        if new_system:
            # The fed ids begin with the old system prompt, so the next turn must not append
            # to them: it retokenizes, and the cache keeps what still matches (the template's head).
            fed, _ = self.store.fed(req.session)
            self.store.set_tokens(req.session, fed, covers=0)
            self.store.forget_fed_ends(req.session, session["message_count"])
        conn.publish({"type": p.SESSION, "id": req.id,
                      "session": self._session_object(self._session(req.session, req.id))})

    def _session_delete(self, conn: Connection, req: SessionDelete) -> None:
        self._check_idle(req.session, req.id)
        self.store.delete_session(req.session)
        self.engine.forget(req.session)  # queued behind any turn that is still keeping its cache
        conn.publish({"type": p.OK, "id": req.id})

    # --- chat ---

    def _chat_send(self, conn: Connection, req: ChatSend) -> None:
        self._check_idle(req.session, req.id)
        # The user's message is committed before anything is generated.
        first_new = self.store.append_message(req.session, "user", req.text)
        try:
            self._start_turn(conn, req.id, req.session, first_new, req.max_tokens, req.temperature, req.top_p)
        except Exception as e:
            if not is_disk_full(e):
                raise
            try:  # so that "not saved" stays true
                self.store.truncate_messages(req.session, first_new)
            except Exception:
                raise RequestError(p.DISK_FULL, "the disk holding kvd's data directory is full: your "
                                   "message was saved but no answer could be started; free some space "
                                   "and send chat.regenerate", req.id) from None
            raise

    def _chat_regenerate(self, conn: Connection, req: ChatRegenerate) -> None:
        self._check_idle(req.session, req.id)
        messages = self.store.messages(req.session)
        if not messages or messages[-1]["role"] != "assistant":
            raise RequestError(p.BAD_REQUEST, "the session's last message is not an answer; "
                               "there is nothing to regenerate", req.id)
        last = messages[-1]["index"]
        self._rewind_to(req.session, messages, last)
        self._start_turn(conn, req.id, req.session, last, req.max_tokens, req.temperature, req.top_p)

    def _chat_edit(self, conn: Connection, req: ChatEdit) -> None:
        self._check_idle(req.session, req.id)
        messages = self.store.messages(req.session)
        target = next((m for m in messages if m["index"] == req.message_index), None)
        if target is None or target["role"] != "user":
            raise RequestError(p.BAD_REQUEST, f"message {req.message_index} is not a user message "
                               "of this session; session.get lists them", req.id)
        self._rewind_to(req.session, messages, req.message_index)
        first_new = self.store.append_message(req.session, "user", req.text)
        self._start_turn(conn, req.id, req.session, first_new, req.max_tokens, req.temperature, req.top_p)

    def _chat_attach(self, conn: Connection, req: ChatAttach) -> None:
        self._session(req.session, req.id)
        gen = self._generations.get(req.session)
        if gen is None:
            messages = self.store.messages(req.session)
            conn.publish({"type": p.CHAT_ATTACHED, "id": req.id, "session": req.session,
                          "generating": False, "message": messages[-1] if messages else None})
            return
        conn.publish({"type": p.CHAT_ATTACHED, "id": req.id, "session": req.session, "generating": True,
                      "request": gen.request_id, "message_index": gen.message_index})
        gen.attach(conn, req.after_seq)

    def _check_idle(self, session_id: str, rid: Any) -> None:
        self._session(session_id, rid)
        if session_id in self._generations:
            raise RequestError(p.BUSY, "this session is already generating; "
                               "send chat.cancel or wait for chat.done", rid)

    def _rewind_to(self, session_id: str, messages: list[Message], index: int) -> None:
        """Drop messages from `index` on, and the fed token ids with them.

        The ids are cut at the end of the last earlier turn whose boundary is
        known, so the next turn appends to exactly what was fed; the engine
        then rewinds the session's cache to the longest prefix it still shares.
        """
        fed, _ = self.store.fed(session_id)
        keep, covers = 0, 0
        for m in messages:
            if m["index"] < index and m["fed_end"] is not None and m["fed_end"] <= len(fed):
                keep, covers = m["fed_end"], m["index"] + 1
        self.store.truncate_messages(session_id, index)
        self.store.set_tokens(session_id, fed[:keep], covers=covers)

    def _start_turn(self, conn: Connection, rid: Any, session_id: str, first_new: int,
                    max_tokens: int | None, temperature: float | None, top_p: float | None) -> None:
        """Generate an answer to the transcript as it stands (its last message is the user's)."""
        assert self._tg is not None
        session = self._session(session_id, rid)
        sampling = resolve(self.config, session["params"], max_tokens=max_tokens,
                           temperature=temperature, top_p=top_p)
        index = self.store.append_message(session_id, "assistant", "", status="streaming")
        earlier = [m for m in self.store.messages(session_id) if m["index"] < index and m["content"]]
        history = [{"role": m["role"], "content": m["content"]} for m in earlier]
        fed, covers = self.store.fed(session_id)
        gen = Generation(rid, session_id, index, first_new, {conn})
        self._generations[session_id] = gen
        send, receive = anyio.create_memory_object_stream[EngineEvent](math.inf)
        loop = asyncio.get_running_loop()

        def emit(event: EngineEvent) -> None:  # engine thread
            loop.call_soon_threadsafe(_deliver, event)

        def _deliver(event: EngineEvent) -> None:  # event loop
            try:
                send.send_nowait(event)
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                pass

        self._tg.start_soon(self._pump, gen, receive)
        gen.publish({"type": p.CHAT_START, "message_index": index})
        self.engine.submit(GenerationJob(
            session_id=session_id, messages=history, system=session["system"],
            fed_tokens=fed, fed_covers=sum(1 for m in earlier if m["index"] < covers),
            max_tokens=sampling.max_tokens, temperature=sampling.temperature, top_p=sampling.top_p, emit=emit,
        ))

    async def _pump(self, gen: Generation, events: MemoryObjectReceiveStream[EngineEvent]) -> None:
        """Commit and publish one answer's events until it is done.

        The first delta is committed at once, later ones at most every
        COMMIT_INTERVAL: a crash loses at most that much of an answer.
        """
        last_commit = -math.inf
        try:
            async with events:
                async for ev in events:
                    if isinstance(ev, Queued):
                        gen.publish({"type": p.CHAT_QUEUED, "position": ev.position})
                        continue
                    if isinstance(ev, Started):
                        if ev.retokenized:
                            self.store.forget_fed_ends(gen.session_id, gen.message_index)
                        continue
                    if isinstance(ev, Delta):
                        gen.text += ev.text
                        gen.deltas.append(ev.text)
                        gen.publish({"type": p.CHAT_DELTA, "seq": gen.seq, "text": ev.text})
                        gen.seq += 1
                        if time.monotonic() - last_commit >= COMMIT_INTERVAL:
                            self.store.update_message(gen.session_id, gen.message_index, content=gen.text)
                            last_commit = time.monotonic()
                    elif isinstance(ev, Done):
                        status = "cancelled" if ev.finish_reason == "cancelled" else "complete"
                        self.store.update_message(gen.session_id, gen.message_index, content=gen.text,
                                                  status=status, finish_reason=ev.finish_reason,
                                                  usage=ev.usage,
                                                  fed_end=len(ev.tokens) if ev.tokens else None)
                        if ev.tokens is not None:
                            self.store.set_tokens(gen.session_id, ev.tokens,
                                                  covers=gen.message_index + 1)
                        gen.publish({"type": p.CHAT_DONE, "message_index": gen.message_index,
                                     "finish_reason": ev.finish_reason, "usage": ev.usage})
                        return
                    elif isinstance(ev, Failed):
                        if ev.code == p.TOO_LARGE and not gen.text:
                            # Nothing was generated and the turn can never fit: take it back,
                            # so the session stays usable (the client still has the text).
                            self.store.truncate_messages(gen.session_id, gen.first_new)
                        else:
                            self.store.update_message(gen.session_id, gen.message_index,
                                                      content=gen.text, status="error",
                                                      finish_reason="error")
                        gen.publish({"type": p.ERROR, "code": ev.code, "message": ev.message})
                        return
        except Exception as e:
            self.engine.cancel(gen.session_id)  # nobody is left to keep what it generates
            if is_disk_full(e):
                log.warning("answer for session %s cut: the disk is full (%s)", gen.session_id, e)
                gen.publish({"type": p.ERROR, "code": p.DISK_FULL, "message": DISK_FULL_MESSAGE})
            else:
                log.exception("answer for session %s failed", gen.session_id)
                gen.publish({"type": p.ERROR, "code": p.INTERNAL,
                             "message": "kvd hit an internal error; it is logged"})
            try:
                self.store.update_message(gen.session_id, gen.message_index, content=gen.text,
                                          status="error", finish_reason="error")
            except Exception as again:  # the answer keeps what was committed before; recovered at start
                log.warning("could not mark the answer of %s as cut: %s", gen.session_id, again)
        finally:
            self._generations.pop(gen.session_id, None)
            gen.finished.set()
