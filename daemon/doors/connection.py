"""One websocket client: a bounded outbox and a writer that never waits forever.

A client that stops reading fills the socket's buffers and then a send
waits indefinitely (keepalive pings wait behind the same full buffer), so
every send is bounded by `send_timeout`, after which the transport is aborted.
Publishers never block: an outbox that overflows also cuts the client off.
Either way the daemon, the engine and other clients carry on.

Fairness: `serve` hands the event loop back after every request, so a client
that sends 300 requests in one burst gets them answered one per loop turn,
interleaved with everyone else's, instead of holding the loop until its
burst is done. bench/fairness.py (200 sessions stored, a burst of 300
session.list, 2-core VM at load ~4.6): another client's ping answered in
10-15 ms, after 4 of the burst's requests; without the yield, 430-520 ms,
after all 300. A
request that may wait (status waits up to 5 s for a busy engine) runs beside
the client's later requests, so a chat.cancel sent after it is not held up;
at most MAX_SLOW such requests per client run at once, the rest are `busy`.

A connection listens to its client's turns (turn.py's Listener): each typed
event (events.py) becomes its protocol frame (`frame`). Each delta comes
with a `written` callback: the writer calls it right after sending that
frame (a frame that will never be sent, the client having gone, calls it at
once); the turn publishes its next delta, holding whatever the answer said
meanwhile, only then (turn.py, `Turn.show`). So the outbox holds at most one
delta of each turn, and a client that reads slowly gets fewer, bigger deltas;
the first delta's call is also the hand-off the engine waits for.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from starlette.types import Receive
from starlette.websockets import WebSocket, WebSocketDisconnect

import protocol as p
from protocol import encode
from protocol.requests import RequestError, RequestId

from .. import events as ev

if TYPE_CHECKING:
    from ..turn import Turn

log = logging.getLogger("kvd.server")

OUTBOX_SIZE = 1024
MAX_SLOW = 4

Written = Callable[[], None] | None  # called once the frame is sent (or never will be)


def frame(request_id: RequestId, session: str, event: ev.TurnEvent) -> dict[str, Any] | None:
    """A turn's event as its protocol frame (docs/protocol.md); None for what the protocol does not carry
    (an answer's tool calls: the websocket offers no tools)."""
    head = {"id": request_id, "session": session}
    if isinstance(event, ev.AnswerDelta):
        return {**head, "type": p.CHAT_DELTA, "seq": event.seq, "text": event.text}
    if isinstance(event, ev.AnswerStarted):
        return {**head, "type": p.CHAT_START, "message_index": event.message_index}
    if isinstance(event, ev.AnswerQueued):
        return {**head, "type": p.CHAT_QUEUED, "position": event.position}
    if isinstance(event, ev.AnswerProgress):
        return {**head, "type": p.CHAT_PROGRESS, "fed": event.fed, "total": event.total}
    if isinstance(event, ev.AnswerDone):
        return {**head, "type": p.CHAT_DONE, "message_index": event.message_index,
                "finish_reason": event.finish_reason, "usage": event.usage}
    if isinstance(event, ev.AnswerError):
        return {**head, "type": p.ERROR, "code": event.code, "message": event.message}
    return None


@dataclass(frozen=True)
class ConnectionStatistics:
    """One client's figures, in the style of anyio's `statistics()`."""

    peer: str
    handled: int  # requests dispatched
    dropped: int  # events published after the client had gone
    queued: int  # events waiting in the outbox


class Connection:
    def __init__(self, ws: WebSocket, *, send_timeout: float, abort: Callable[[], None]):
        self.ws = ws
        self.send_timeout = send_timeout
        self._abort = abort
        self.closed = False
        self.closed_event = anyio.Event()  # set once this client is done with, for any reason
        send, receive = anyio.create_memory_object_stream[tuple[str, Written]](OUTBOX_SIZE)
        self._send: MemoryObjectSendStream[tuple[str, Written]] = send
        self._receive: MemoryObjectReceiveStream[tuple[str, Written]] = receive
        self.dropped = 0
        self.handled = 0  # requests dispatched
        self._logged: set[str] = set()
        self._slow: TaskGroup | None = None
        self._slow_running = 0
        self._watchers: list[Callable[[dict[str, Any]], None]] = []

    @property
    def peer(self) -> str:
        addr = self.ws.client
        return f"{addr[0]}:{addr[1]}" if addr else "?"

    def hear(self, turn: Turn, event: ev.TurnEvent) -> None:
        """One of the client's turns said something (turn.py's Listener): its frame into the outbox."""
        if (out := frame(turn.request_id, turn.session_id, event)) is not None:
            self.publish(out, event.written if isinstance(event, ev.AnswerDelta) else None)

    def publish(self, event: dict[str, Any], written: Written = None) -> None:
        """Queue an event for this client without ever blocking the caller."""
        if self.closed:
            self.dropped += 1
            _call(written)
            return
        try:
            self._send.send_nowait((encode(event), written))
            for watch in self._watchers:
                watch(event)
        except anyio.WouldBlock:
            log.warning("client %s is not reading (outbox full); disconnecting it", self.peer)
            self.abort()
            _call(written)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            self.dropped += 1
            _call(written)

    async def serve(self, receive: Receive,
                    dispatch: Callable[[Connection, str | bytes], Awaitable[None]]) -> None:
        """Write this client's events and dispatch its requests, one per turn of the loop, until it goes."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.writer)
            try:
                async with anyio.create_task_group() as slow:
                    self._slow = slow
                    while True:
                        message = await receive()
                        if message["type"] != "websocket.receive":
                            break  # websocket.disconnect
                        raw = message.get("text")
                        await dispatch(self, raw if raw is not None else message.get("bytes") or b"")
                        self.handled += 1
                        await anyio.lowlevel.checkpoint()  # everyone else's turn
                    slow.cancel_scope.cancel()  # nobody is left to read their answers
            finally:
                self._slow = None
                self.close()

    def start_slow(self, request_id: RequestId, fn: Callable[[], Awaitable[None]]) -> None:
        """Run `fn` beside this client's later requests; `busy` past MAX_SLOW at once."""
        if self._slow is None or self._slow_running >= MAX_SLOW:
            raise RequestError(p.BUSY, f"{MAX_SLOW} slow requests (status) are still being answered "
                               "on this connection; wait for one", request_id)
        self._slow_running += 1

        async def run() -> None:
            try:
                await fn()
            finally:
                self._slow_running -= 1

        self._slow.start_soon(run)

    def refuse(self, error: RequestError) -> None:
        """Answer a bad request; its kind of abuse is logged once per connection at most."""
        if error.log_once is not None and error.log_once not in self._logged:
            self._logged.add(error.log_once)
            log.warning("client %s sent %s; answering %s (logged once per connection)",
                        self.peer, error.log_once, error.code)
        self.publish(error.event())

    async def writer(self) -> None:
        """Send the outbox's frames in order; one cancel scope for the writer's life, its deadline set for
        each send (a client that does not read within send_timeout is cut off)."""
        receive = self._receive
        with anyio.CancelScope() as timer:
            try:
                while True:
                    try:
                        frame, written = receive.receive_nowait()
                    except anyio.WouldBlock:
                        timer.deadline = math.inf  # nothing to send: no client is late
                        try:
                            frame, written = await receive.receive()
                        except (anyio.EndOfStream, anyio.ClosedResourceError):
                            break
                    except (anyio.EndOfStream, anyio.ClosedResourceError):
                        break
                    timer.deadline = anyio.current_time() + self.send_timeout
                    try:
                        await self.ws.send_text(frame)
                    except (WebSocketDisconnect, OSError, RuntimeError):  # gone, or closed under us
                        break
                    finally:
                        _call(written)  # the delta is out: the turn may publish its next one
            finally:
                self._unsent()
                receive.close()
        if timer.cancelled_caught:
            log.warning("client %s did not read for %.1f s; disconnecting it", self.peer, self.send_timeout)
            self.abort()

    def _unsent(self) -> None:
        """The frames left in the outbox when the writer stops will never be sent."""
        while True:
            try:
                _, written = self._receive.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                return
            _call(written)

    def abort(self) -> None:
        self.close()
        self._abort()

    def watch(self, observer: Callable[[dict[str, Any]], None]) -> None:
        """Call `observer` on the event loop with each event once it is queued for this client.

        For tests and tools that must act at an exact point of a stream (drop
        the connection after the 20th delta); it must not block.
        """
        self._watchers.append(observer)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.closed_event.set()
            self._send.close()

    def statistics(self) -> ConnectionStatistics:
        return ConnectionStatistics(peer=self.peer, handled=self.handled, dropped=self.dropped,
                                    queued=self._send.statistics().current_buffer_used)


def _call(written: Written) -> None:
    if written is not None:
        written()
