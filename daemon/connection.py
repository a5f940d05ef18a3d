"""One websocket client: a bounded outbox and a writer that never waits forever.

A client that stops reading fills the socket's buffers and then a send
waits indefinitely (keepalive pings wait behind the same full buffer), so
every send is bounded by `send_timeout`, after which the transport is aborted.
Publishers never block: an outbox that overflows also cuts the client off.
Either way the daemon, the engine and other clients carry on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from starlette.websockets import WebSocket, WebSocketDisconnect

from .protocol import encode

log = logging.getLogger("kvd.server")

OUTBOX_SIZE = 1024


class Connection:
    def __init__(self, ws: WebSocket, *, send_timeout: float, abort: Callable[[], None]):
        self.ws = ws
        self.send_timeout = send_timeout
        self._abort = abort
        self.closed = False
        self.closed_event = anyio.Event()  # set once this client is done with, for any reason
        send, receive = anyio.create_memory_object_stream[str](OUTBOX_SIZE)
        self._send: MemoryObjectSendStream[str] = send
        self._receive: MemoryObjectReceiveStream[str] = receive
        self.sent = 0
        self.dropped = 0

    @property
    def peer(self) -> str:
        addr = self.ws.client
        return f"{addr[0]}:{addr[1]}" if addr else "?"

    def publish(self, event: dict[str, Any]) -> None:
        """Queue an event for this client without ever blocking the caller."""
        if self.closed:
            self.dropped += 1
            return
        try:
            self._send.send_nowait(encode(event))
        except anyio.WouldBlock:
            log.warning("client %s is not reading (outbox full); disconnecting it", self.peer)
            self.abort()
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            self.dropped += 1

    async def writer(self) -> None:
        async with self._receive:
            async for frame in self._receive:
                with anyio.move_on_after(self.send_timeout) as scope:
                    try:
                        await self.ws.send_text(frame)
                    except (WebSocketDisconnect, OSError, RuntimeError):  # gone, or closed under us
                        break
                if scope.cancelled_caught:
                    log.warning("client %s did not read for %.1f s; disconnecting it",
                                self.peer, self.send_timeout)
                    self.abort()
                    break
                self.sent += 1

    def abort(self) -> None:
        self.close()
        self._abort()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.closed_event.set()
            self._send.close()

    def statistics(self) -> dict[str, Any]:
        return {"peer": self.peer, "sent": self.sent, "dropped": self.dropped,
                "queued": self._send.statistics().current_buffer_used}
