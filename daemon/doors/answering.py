"""The response of every HTTP door's answer: a turn's events as a JSON body or server-sent events.

The response starts only when the first token (or an error) is known, so an
error found at admission is a real HTTP error, not a broken stream. A client
that hangs up cancels its answer (what was generated stays in the session);
one that stops reading is cut off after `send_timeout`, its answer cancelled
too. Each door (openai_answer.py, anthropic_answer.py) writes the body and
the events in its own shape.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ..config import Config
from ..events import AnswerDelta, TurnEvent
from ..turn import Chosen, Turn
from ..turns import Turns
from .httpdoor import REFUSED, ApiError

log = logging.getLogger("kvd.api")


E = TypeVar("E", bound=TurnEvent | Chosen)  # what the response reads: its turn's events, or its choices' (n > 1)


class TurnResponse(Response, Generic[E]):
    """One turn's answer as a JSON body or an event stream, ending the turn if the client goes. A door
    writes `_whole` and `_stream` in its own shape; the rest is the same for every door. The turn's other
    choices (`Turn.choices`, a request's n > 1) end with it: a client that goes cancels them all."""

    def __init__(self, turns: Turns, config: Config, turn: Turn,
                 events: MemoryObjectReceiveStream[E], headers: dict[str, str], *, stream: bool):
        self.turns, self.config = turns, config
        self.turn = turn
        self.events = events
        self.stream = stream  # server-sent events, not one JSON body
        self.extra_headers = headers
        self.started = False
        self.scope: Scope = {}  # the request's, once answering (a refusal leaves itself there for the log)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.scope = scope
        abort: Callable[[], None] = scope.get("kvd.abort", lambda: None)
        turns, turn = self.turns, self.turn
        answered = False  # the whole answer was sent: a disconnect after it is the client leaving, not hanging up
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                if answered or all(t.finished.is_set() for t in (turn, *turn.choices)):
                    return
                log.info("client of %s hung up; cancelling its answer", turn.session_id)
                self._cancel()
                tg.cancel_scope.cancel()

            timer = anyio.CancelScope()  # one for the response's life: its deadline is set for each send

            async def bounded(message: dict[str, Any]) -> None:
                timer.deadline = anyio.current_time() + self.config.send_timeout
                await send(message)
                timer.deadline = math.inf

            tg.start_soon(watch)
            try:
                with timer:
                    try:
                        if self.stream:
                            await self._stream(bounded)
                        else:
                            await self._whole(bounded)
                        answered = True
                    finally:
                        self._unread()
                        for other in turn.choices:  # (a choice that failed ended the response: the rest go)
                            turns.cancel(other.session_id, other)
                if timer.cancelled_caught:
                    log.warning("client of %s did not read for %.1f s; cutting it off",
                                turn.session_id, self.config.send_timeout)
                    self._cancel()
                    abort()
            except OSError:  # the client went away under a send
                self._cancel()
            tg.cancel_scope.cancel()

    def _cancel(self) -> None:
        """The client is gone: its answer stops, and every other choice of its request with it."""
        for t in (self.turn, *self.turn.choices):
            self.turns.cancel(t.session_id, t)

    def _unread(self) -> None:
        """The events the response will never read: a delta among them is written for no one (its
        turn may publish the next one to its other listeners), then the stream is closed."""
        while True:
            try:
                item = self.events.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                break
            event = item.event if isinstance(item, Chosen) else item
            if isinstance(event, AnswerDelta) and event.written is not None:
                event.written()
        self.events.close()

    async def begin_response(self, send: Callable[[dict[str, Any]], Any], status: int, content_type: str) -> None:
        headers = [(b"content-type", content_type.encode())]
        headers += [(k.lower().encode(), v.encode()) for k, v in self.extra_headers.items()]
        if content_type.startswith("text/event-stream"):
            headers += [(b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        self.started = True

    async def send_body(self, send: Callable[[dict[str, Any]], Any], status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body, ensure_ascii=False).encode()
        await self.begin_response(send, status, "application/json")
        await send({"type": "http.response.body", "body": data})


    async def refuse(self, send: Callable[[dict[str, Any]], Any], error: ApiError, body: dict[str, Any]) -> None:
        """A refusal before the answer began (the turn core's: a conversation too long, a template that
        refuses it), with its HTTP status and the door's `body`; the log says why (server.py)."""
        self.scope[REFUSED] = error
        await self.send_body(send, error.status, body)

    async def _whole(self, send: Callable[[dict[str, Any]], Any]) -> None:
        raise NotImplementedError

    async def _stream(self, send: Callable[[dict[str, Any]], Any]) -> None:
        raise NotImplementedError
