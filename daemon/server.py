"""The daemon: one port, four front doors, one turn core.

uvicorn serves the port. Its websocket implementation is the websockets
package's own protocol (`ws="websockets-sansio"`), so kvchat's protocol on
`/v1` keeps the framing, size limit (1009 on an oversize frame) and keepalive
it had, and it parses HTTP requests with bodies, which the websockets server
cannot (it refuses a request body). On top: the websocket door
(websocket.py), the OpenAI-compatible HTTP door (openai_api.py, a Starlette
app), the Anthropic Messages door (anthropic_api.py, `/v1/messages...`) and the
Responses door (responses.py, `/v1/responses...`), all thin layers over the turn
core (turns.py).

The asyncio side never calls MLX: turns are handed to the engine thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import anyio
import uvicorn
from anyio.abc import TaskStatus
from starlette.types import Receive, Scope, Send

import protocol as p
from sessions import Store

from . import __version__
from .config import Config
from .doors.anthropic_api import AnthropicDoor, is_anthropic
from .doors.apiturns import ApiTurns
from .doors.asgi import abort_transport
from .doors.connection import ConnectionStatistics
from .doors.guards import NO_ROUTE, asked
from .doors.h11guard import guarded_h11
from .doors.httpdoor import ANSWERED, DOOR, REFUSED, ApiError
from .doors.loading import LoadingWatch
from .doors.metrics import Live, Metrics, door_of
from .doors.ollama_api import OllamaDoor, is_ollama
from .doors.openai_api import OpenAIDoor, error_response
from .doors.operations import OperationsDoor, is_operations
from .doors.responses import ResponsesDoor, is_responses
from .doors.websocket import WebSocketDoor
from .engine.thread import Engine
from .turns import Turns

log = logging.getLogger("kvd.server")

STATUS_TIMEOUT = 5.0  # a busy engine answers status between steps; past this, the last figures
GRACEFUL_SHUTDOWN = 10  # seconds uvicorn waits for open HTTP responses when kvd stops



class RefusalLog:
    """Every 4xx and 5xx an HTTP door or the websocket's handshake answers, logged with the door, who asked
    (the client's address and User-Agent), the path, the status and code, and the reason the door gave
    (its `RefusalResponse`, httpdoor.py): `kvd logs` says why a client failed. At most one line a second per kind
    (door, status, code, field): a client retrying in a loop says how many more it sent, not each."""

    INTERVAL = 1.0  # seconds between two lines of one kind

    def __init__(self, clock: Callable[[], float] = time.monotonic, metrics: Metrics | None = None) -> None:
        self._clock = clock
        self._last: dict[tuple[Any, ...], tuple[float, int]] = {}  # kind -> (when last logged, how many since)
        self.metrics = metrics  # every response's status counted by door (GET /metrics)

    def wrap(self, scope: Scope, send: Send) -> Send:
        """`send`, logging the response's status when it is 400 or more, and counting every one."""
        started = False
        door = door_of(str(scope.get("path", "")), websocket=scope.get("type") == "websocket")

        async def logged(message: MutableMapping[str, Any]) -> None:
            nonlocal started
            if not started and message["type"] in ("http.response.start", "websocket.http.response.start"):
                started = True
                if int(message.get("status", 200)) >= 400 and not scope.get(ANSWERED):
                    self.said(scope, int(message["status"]))
                if self.metrics is not None:
                    self.metrics.responded(door, int(message.get("status", 200)))
            elif not started and message["type"] == "websocket.accept":
                started = True
                if self.metrics is not None:
                    self.metrics.responded(door, 101)
            await send(message)

        logged.__wrapped__ = send  # type: ignore[attr-defined]  # abort_transport cuts the connection behind it
        return logged

    def said(self, scope: Scope, status: int) -> None:
        error: ApiError | None = scope.get(REFUSED)
        door = scope.get(DOOR) or ("websocket" if scope.get("type") == "websocket" else "http")
        code, param = (error.code, error.param) if error is not None else (None, None)
        kind = (door, status, code, param)
        now = self._clock()
        last, since = self._last.get(kind, (-math.inf, 0))
        if now - last < self.INTERVAL:
            self._last[kind] = (last, since + 1)
            return
        self._last[kind] = (now, 0)
        lead = ("no such path" if scope.get(NO_ROUTE) else "not found" if status == 404
                else "refused" if status < 500 else "failed")
        reason = error.message if error is not None else "(no reason given)"
        more = f" ({since} more like it not logged)" if since else ""
        log.warning("%s (%s door) %s: HTTP %d%s: %s%s", lead, door, asked(scope), status,
                    f" {code}" if code else "", reason, more)


def listening_socket(host: str, port: int) -> socket.socket:
    """The port's socket, made with protocol IPPROTO_TCP rather than `socket.create_server`'s 0.

    asyncio turns Nagle's algorithm off (TCP_NODELAY) on each accepted
    connection only when the socket says it is TCP by its protocol number
    (`asyncio.base_events._set_nodelay` checks `sock.proto`), and accepted
    sockets inherit the listener's. With protocol 0 a turn's first delta,
    written a few milliseconds after its `chat.start`, waited for the client's
    delayed ACK of that frame: 40 ms added to every turn (bench/overhead.py).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as create_server: a restart rebinds at once
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen()
    except BaseException:
        sock.close()
        raise
    return sock


class _Server(uvicorn.Server):
    """uvicorn's own `serve()`, minus its signal handlers (`kvd serve` owns SIGTERM and SIGINT), and
    an event for when it listens."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.listening = anyio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        self.listening.set()


class Daemon:
    def __init__(self, config: Config, store: Store, engine: Engine, token: str):
        self.config = config
        self.store = store
        self.engine = engine
        self.turns = Turns(config, store, engine)
        self.engines = self.turns.engines  # every loaded model's engine (engine/registry.py)
        self._loading = LoadingWatch(engine, config.model)
        self.websocket = WebSocketDoor(config, engine, self.turns, token, self._loading, self.status)
        api = ApiTurns(config, engine, self.turns, self._loading)
        self.api = OpenAIDoor(config, api, token)
        self.messages = AnthropicDoor(config, api, token)
        self.responses = ResponsesDoor(config, api, token)
        self.ollama = OllamaDoor(config, api, token)
        self.metrics = Metrics(self._live)
        self.turns.watchers.append(self.metrics)
        self.operations = OperationsDoor(config, self._loading, self.metrics, token, error_response)
        self.refusals = RefusalLog(metrics=self.metrics)
        self._stopping = anyio.Event()
        self._started = time.monotonic()
        self._sock: socket.socket | None = None
        self.url: str | None = None
        self.blas: str | None = None  # the start line's BLAS choice, for `kvd status`

    # --- lifecycle ---

    def bind(self) -> None:
        """Open the listening socket now (OSError if the port is taken), before anything else starts.

        `kvd serve` binds before the engine thread starts loading the model,
        so a port in use ends it with one line and no thread in the middle of
        MLX work (exiting under one aborts the process).
        """
        self._sock = listening_socket(self.config.host, self.config.port)

    async def run(self, *, task_status: TaskStatus[str] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until `shutdown()`; then cut every answer short, keep it, and return."""
        if self._sock is None:
            self.bind()
        sock = self._sock
        assert sock is not None
        logging.getLogger("uvicorn").setLevel(logging.WARNING)
        http = guarded_h11(header_timeout=self.config.header_timeout,
                           max_unauthenticated=self.config.max_unauthenticated)
        config = uvicorn.Config(
            self._app, interface="asgi3", ws="websockets-sansio", http=http, lifespan="off", log_config=None,
            proxy_headers=False,
            access_log=False, server_header=False, headers=[("server", f"kvd/{__version__}")],
            ws_max_size=self.config.max_message_bytes, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN,
            # Frames are small JSON (a delta of a few tokens): compressing each cost the event loop more
            # than sending it (py-spy, bench/hostcost.py), and the peer is on this machine by default.
            ws_per_message_deflate=False,
            # No limit_concurrency: past it uvicorn answers everyone, token or not, with a plain-text
            # 503. Connections are bounded where kvd knows who is asking: heads by the protocol
            # (h11guard.py), websockets by max_connections, API turns by max_queued (admission.py).
        )
        server = _Server(config)
        await self.turns.transcripts.start()  # the store's writer thread, and the index placement reads
        try:
            await self._serve(server, sock, task_status)
        finally:
            # Every turn has committed its answer by now: the writer commits what is queued and stops,
            # also when serving was cancelled (the store is closed after this returns).
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self.turns.transcripts.close)

    async def _serve(self, server: _Server, sock: socket.socket, task_status: TaskStatus[str]) -> None:
        async with anyio.create_task_group() as tg:
            self.turns.tg = self.engines.tg = tg
            self.engines.broadcast = self.websocket.broadcast
            loading = anyio.CancelScope()

            async def watch_loading() -> None:
                with loading:
                    await self._loading.run(self.websocket.broadcast)
                if self._loading.ready:
                    await self.api.seed()

            async def serve() -> None:
                try:
                    await server.serve([sock])
                finally:
                    server.listening.set()  # also when it never started: run() must not wait forever

            tg.start_soon(serve)
            await server.listening.wait()
            if not server.started:
                raise RuntimeError("the HTTP server did not start; its log lines say why")
            tg.start_soon(watch_loading)
            keep_alive = anyio.CancelScope()

            async def unload_idle() -> None:
                with keep_alive:
                    await self.engines.keep_alive()

            tg.start_soon(unload_idle)
            self.url = p.default_url(self.config.host, sock.getsockname()[1])
            task_status.started(self.url)
            await self._stopping.wait()
            if cut := len(self.turns.active):
                # Cut, not finished: a stop must not wait for max_tokens of every answer.
                # Each is kept as 'cancelled' with its text and its cache, so it resumes.
                log.info("shutting down: cutting %d answer(s) short (kept as 'cancelled'; "
                         "chat.regenerate or a new message resumes from the cache), "
                         "paging caches out", cut)
            else:
                log.info("shutting down: paging caches out")
            loading.cancel()
            keep_alive.cancel()
            for listener in server.servers:
                listener.close()  # no new clients: one could attach to an answer about to be cut
            await self.websocket.close_all()
            for engine in {self.engine, *self.engines.engines()}:  # every running turn ends, cancelled
                await anyio.to_thread.run_sync(engine.stop)
            server.should_exit = True
            # Leaving the task group waits for every turn to commit its answer and for uvicorn's
            # own shutdown (open HTTP responses get GRACEFUL_SHUTDOWN seconds).

    def shutdown(self) -> None:
        self._stopping.set()

    def connection_statistics(self) -> list[ConnectionStatistics]:
        return [c.statistics() for c in self.websocket.connections]

    async def _app(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Route by kind: websockets to kvchat's door, HTTP by path to the Messages, Responses or OpenAI door."""
        if scope["type"] == "websocket":
            await self.websocket(scope, receive, self.refusals.wrap(scope, send))
        elif scope["type"] == "http":
            scope["kvd.abort"] = lambda: abort_transport(send)
            path = scope["path"]
            door = (self.messages if is_anthropic(path) else self.responses if is_responses(path)
                    else self.ollama if is_ollama(path) else self.operations if is_operations(path) else self.api)
            await door.app(scope, receive, self.refusals.wrap(scope, send))

    def _live(self) -> Live:
        """What /metrics reads when scraped: each engine's published statistics, the loaded models, the API
        requests admitted but not started."""
        engines = {e.config.model: e.stats for e in self.engines.engines() if e.ready.is_set()}
        return Live(engines=engines, loaded=self.engines.loaded(), admitted=self.api.api.admission.pending)

    async def status(self) -> dict[str, Any]:
        """What `kvd status` shows: the default model's figures (its tiers, its turns), the connections,
        every loaded model (`models`, what `kvd ps` shows), each answering session with its model, and
        the budgets every model's caches share (`budgets`; the disk tier's `bytes` count every model's
        files too, `by_model` says whose), and what the memory decision-maker counts (`memory`)."""
        engine = self.turns.engine
        stats = await self._engine_status(engine)
        answering = {sid: {**turn, "model": self.engines.default} for sid, turn in stats.get("answering", {}).items()}
        for other in self.engines.engines():
            if other is not engine:
                answering.update({sid: {**turn, "model": other.config.model}
                                  for sid, turn in other.stats.get("answering", {}).items()})
        return {"server": f"kvd {__version__}", "model": self.config.model, "pid": os.getpid(),
                "uptime": time.monotonic() - self._started, "log_file": str(self.config.log_path),
                "data_dir": str(self.config.data_dir),
                "ready": engine.ready.is_set() and engine.load_error is None,
                "connections": len(self.websocket.connections),
                "generating": sum(e.stats.get("generating", 0) for e in self.engines.engines() if e is not engine)
                + stats.get("generating", 0),
                "waiting": stats.get("waiting", 0), "answering": answering,
                "tiers": stats.get("tiers", {}), "budgets": stats.get("budgets", {}),
                "prefetched": stats.get("prefetched", {}),
                "locations": stats.get("locations", {}),
                "warm_up_ms": stats.get("warm_up_ms"), "blas": self.blas, "device": stats.get("device"),
                "ranks": stats.get("ranks", {"world_size": 1}), "models": self.engines.loaded(),
                "memory": self.engines.memory.statistics(),
                # kvd's own threads by name, with their kernel ids (top -H, /proc/PID/task: bench/hostcost.py)
                "threads": _threads(),
                **({"profile": stats["profile"]} if "profile" in stats else {})}  # the step profiler's, when on

    async def _engine_status(self, engine: Engine) -> dict[str, Any]:
        """The engine's statistics, fresh where it answers within STATUS_TIMEOUT."""
        stats = engine.stats
        if engine.ready.is_set():
            # Through the engine's queue, so a turn that just finished is counted.
            loop = asyncio.get_running_loop()
            fresh: asyncio.Future[dict[str, Any]] = loop.create_future()

            def deliver(s: dict[str, Any]) -> None:  # engine thread
                loop.call_soon_threadsafe(_settle, s)

            def _settle(s: dict[str, Any]) -> None:
                if not fresh.done():
                    fresh.set_result(s)

            engine.query_status(deliver)
            with anyio.move_on_after(STATUS_TIMEOUT):
                stats = await fresh
        return stats


def _threads() -> dict[str, list[int]]:
    """The daemon's Python threads (kvd-engine, kvd-writer, kvd-io, ...; the event loop is the main thread,
    "kvd-loop"), each name's kernel thread ids."""
    out: dict[str, list[int]] = {}
    for t in threading.enumerate():
        if t.native_id is not None:
            out.setdefault(t.name, []).append(t.native_id)
    return out
