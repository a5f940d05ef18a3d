"""The client side of the kvd wire protocol over one websocket.

Requests are multiplexed on the connection: each gets an id and a queue, and
one reader task hands every incoming event to the queue of the request whose
id it echoes. That is what lets kvchat send ``chat.cancel`` while a
``chat.send`` is still streaming on the same socket.

Ids carry a random prefix ("3fa9c1-1", "3fa9c1-2", …): after ``chat.attach``
the answer's events keep the id of the request that started it, possibly on
another connection or in another kvchat, and that id must not collide with one
of ours. Events with no id (``loading``, ``ready``, a load failure) are about
the daemon, not a request; they update ``ready``/``loading``/``load_error``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import secrets
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

import protocol

from .errors import ConnectionLost, KvchatError, NoDaemon, ServerError, TokenMissing, TokenRefused, Unreachable

__all__ = ["Client", "ClientStatistics", "ServerError"]

# Replies to the client are not bounded by the daemon's own frame limit: one
# session.get carries a whole transcript, so allow far more than 1 MiB.
MAX_REPLY_BYTES = 64 * 2**20

_CLOSED = object()  # put in every pending queue when the connection ends


@dataclass
class ClientStatistics:
    pending: int
    """Requests waiting for a reply or still streaming."""
    dropped: int
    """Events for no pending request (e.g. the tail of an abandoned stream)."""


class Client:
    """One connection to kvd. Use ``await Client.connect(...)`` and ``close()``,
    or ``async with await Client.connect(...) as client``.

    The client owns its reader task: ``connect`` starts it, ``close`` cancels
    and awaits it.
    """

    def __init__(self, ws: ClientConnection, hello: dict[str, Any], url: str) -> None:
        self.hello = hello
        self.url = url
        self.ready = bool(hello.get("ready", True))
        self.loading: dict[str, Any] | None = hello.get("loading") if isinstance(hello.get("loading"), dict) else None
        self.load_error: str | None = None
        self._ws = ws
        prefix = secrets.token_hex(3)
        self._ids = (f"{prefix}-{n}" for n in itertools.count(1))
        # Unbounded on purpose: a stream is bounded by its max_tokens, and a
        # bounded queue would stall every other reply (chat.cancel's `ok`)
        # behind a consumer that is busy printing.
        self._pending: dict[Any, asyncio.Queue[Any]] = {}
        self._dropped = 0
        self._lost: ConnectionLost | None = None
        self._closing = False
        self._changed = asyncio.Event()  # set whenever a daemon event (loading, ready) arrives
        self._reader = asyncio.create_task(self._read(), name="kvchat-reader")

    # -- connecting ---------------------------------------------------------

    @classmethod
    async def connect(
        cls,
        url: str,
        token: str | None,
        *,
        token_path: Path | None = None,
        # Timeouts
        open_timeout: float = 10,
    ) -> Client:
        """Open the websocket, read ``hello``; failures become KvchatErrors."""
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        try:
            ws = await connect(
                url,
                additional_headers=headers,
                open_timeout=open_timeout,
                max_size=MAX_REPLY_BYTES,
                proxy=None,  # loopback daemon: never route through $HTTP_PROXY
            )
        except InvalidStatus as exc:
            raise _refused(url, exc.response.status_code, token, token_path) from exc
        except InvalidURI as exc:
            raise Unreachable(url, f"not a websocket URL ({exc}); it looks like {protocol.default_url()}") from exc
        except ConnectionRefusedError as exc:
            raise NoDaemon(url) from exc
        except (OSError, TimeoutError, InvalidHandshake) as exc:
            raise Unreachable(url, str(exc) or type(exc).__name__) from exc
        try:
            hello = await asyncio.wait_for(ws.recv(), open_timeout)
            hello = json.loads(hello)
        except (ConnectionClosed, TimeoutError, ValueError) as exc:
            await ws.close()
            raise Unreachable(url, f"no hello from the daemon ({exc or type(exc).__name__})") from exc
        if not isinstance(hello, dict) or hello.get("type") != protocol.HELLO:
            await ws.close()
            raise Unreachable(url, "the first event was not a hello; is this kvd?")
        if hello.get("protocol") != protocol.PROTOCOL_VERSION:
            await ws.close()
            raise Unreachable(
                url,
                f"it speaks protocol {hello.get('protocol')!r}, kvchat speaks "
                f"{protocol.PROTOCOL_VERSION}; run kvchat and kvd from the same install",
            )
        return cls(ws, hello, url)

    async def close(self) -> None:
        self._closing = True
        await self._ws.close()
        self._reader.cancel()
        try:
            await self._reader
        except asyncio.CancelledError:
            pass

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- requests -----------------------------------------------------------

    async def request(self, type_: str, /, **fields: Any) -> dict[str, Any]:
        """Send one request and return its reply; an ``error`` event raises ServerError."""
        request_id, queue = await self._send(type_, fields)
        try:
            return self._checked(await queue.get())
        finally:
            del self._pending[request_id]

    async def stream(self, type_: str, /, **fields: Any) -> AsyncGenerator[dict[str, Any], None]:
        """Send a request answered by a stream (``chat.send``); yield its events.

        Ends after ``chat.done``; an ``error`` event raises ServerError. Close
        the iterator (``contextlib.aclosing``) if you stop early, so later
        events for it are dropped instead of queued.
        """
        request_id, queue = await self._send(type_, fields)
        try:
            while True:
                event = self._checked(await queue.get())
                yield event
                if event.get("type") == protocol.CHAT_DONE:
                    return
        finally:
            del self._pending[request_id]

    async def attach(self, session: str, after_seq: int) -> AsyncGenerator[dict[str, Any], None]:
        """``chat.attach``: yield ``chat.attached``, then the answer's events if it is running.

        Ends after ``chat.attached`` when the session is not generating, else
        after the answer's ``chat.done``. The answer's events carry the id of
        the request that started it; the reader routes them here from the
        moment it reads ``chat.attached``, before any of them.
        """
        request_id, queue = await self._send(protocol.CHAT_ATTACH, {"session": session, "after_seq": after_seq})
        followed: Any = None
        try:
            while True:
                event = self._checked(await queue.get())
                if event.get("type") == protocol.CHAT_ATTACHED:
                    followed = event.get("request")
                yield event
                if event.get("type") == protocol.CHAT_ATTACHED and not event.get("generating"):
                    return
                if event.get("type") == protocol.CHAT_DONE:
                    return
        finally:
            del self._pending[request_id]
            if followed is not None and self._pending.get(followed) is queue:
                del self._pending[followed]

    async def wait_ready(self, progress: Callable[[dict[str, Any]], None] | None = None) -> None:
        """Until the daemon's model is loaded; ``progress`` gets each ``loading`` state."""
        while not self.ready:
            if self.load_error is not None:
                raise KvchatError(self.load_error)
            if self._lost is not None:
                raise self._lost
            if progress is not None and self.loading is not None:
                progress(self.loading)
            self._changed.clear()
            await self._changed.wait()

    @property
    def lost(self) -> bool:
        return self._lost is not None

    def statistics(self) -> ClientStatistics:
        return ClientStatistics(pending=len(self._pending), dropped=self._dropped)

    # -- the wire -----------------------------------------------------------

    async def _send(self, type_: str, fields: dict[str, Any]) -> tuple[str, asyncio.Queue[Any]]:
        if self._lost is not None:
            raise self._lost
        request_id = next(self._ids)
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._pending[request_id] = queue  # before sending: the reply can be quick
        try:
            await self._ws.send(protocol.encode({"type": type_, "id": request_id, **fields}))
        except ConnectionClosed as exc:
            del self._pending[request_id]
            raise self._connection_lost(exc) from exc
        return request_id, queue

    async def _read(self) -> None:
        try:
            async for frame in self._ws:
                try:
                    event = json.loads(frame)
                except ValueError:
                    self._dropped += 1
                    continue
                if not isinstance(event, dict):
                    self._dropped += 1
                    continue
                request_id = event.get("id")
                if request_id is None:
                    self._daemon_event(event)
                    continue
                queue = self._pending.get(request_id) if isinstance(request_id, (str, int)) else None
                if queue is None:
                    self._dropped += 1
                    continue
                if event.get("type") == protocol.CHAT_ATTACHED and event.get("generating"):
                    # The answer's own events follow at once, under its original id.
                    original = event.get("request")
                    if isinstance(original, (str, int)) and not isinstance(original, bool):
                        self._pending[original] = queue
                queue.put_nowait(event)
        except ConnectionClosed as exc:
            self._connection_lost(exc)
        finally:
            self._connection_lost(None)
            for queue in set(self._pending.values()):
                queue.put_nowait(_CLOSED)
            self._changed.set()

    def _daemon_event(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == protocol.LOADING:
            self.loading = event
        elif kind == protocol.READY:
            self.ready = True
            self.hello = {**self.hello, "ready": True}  # what the headers read: not "(loading)" any more
        elif kind == protocol.ERROR and not self.ready:
            self.load_error = str(event.get("message") or "the daemon's model failed to load")
        else:
            self._dropped += 1
            return
        self._changed.set()

    def _checked(self, event: Any) -> dict[str, Any]:
        if event is _CLOSED:
            raise self._lost or ConnectionLost(self.url)
        if event.get("type") == protocol.ERROR:
            raise ServerError(str(event.get("code")), str(event.get("message")))
        return event  # type: ignore[no-any-return]

    def _connection_lost(self, exc: ConnectionClosed | None) -> ConnectionLost:
        if self._lost is None:
            code, reason = self._ws.close_code, self._ws.close_reason
            if exc is not None and exc.rcvd is not None:
                code, reason = exc.rcvd.code, exc.rcvd.reason
            if self._closing:
                why = "kvchat closed it"
            elif code == 1001:
                why = "the daemon shut down"
            elif code is not None:
                why = f"closed with code {code}" + (f": {reason}" if reason else "")
            else:
                why = "the connection dropped"
            self._lost = ConnectionLost(self.url, why)
        return self._lost


def _refused(url: str, status: int, token: str | None, token_path: Path | None) -> Exception:
    if status == 401:
        if token is None and token_path is not None:
            return TokenMissing(token_path)
        return TokenRefused(token_path)
    if status == 403:
        return Unreachable(url, "the daemon refused the connection (HTTP 403)")
    if status == 404:
        return Unreachable(url, f"nothing there (HTTP 404); the path is {protocol.PATH}")
    if status == 503:
        return Unreachable(url, "the daemon is busy: it has as many connections as limits.max_connections "
                                "allows (HTTP 503); close another kvchat or raise the limit")
    return Unreachable(url, f"the daemon refused the connection (HTTP {status})")
