"""One turn's HTTP response, whatever door's shape it is written in: the answer ends if the client goes.

The response starts only when a door's writer sends its first bytes, so an
error found at admission is a real HTTP error, not a broken stream. A client
that hangs up cancels its answer (what was generated stays in the session);
one that stops reading is cut off after `send_timeout`, its answer cancelled
too. Each door subclasses it with `write`, which encodes the turn's events
in its own shape through the bounded `send` it is given.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ..config import Config
from ..turns import Turn, Turns

log = logging.getLogger("kvd.api")

Sender = Callable[[dict[str, Any]], Any]


class TurnResponse(Response):
    """A turn's answer as an HTTP response, ending the turn if the client goes."""

    def __init__(self, turns: Turns, config: Config, turn: Turn, headers: dict[str, str]):
        self.turns, self.config = turns, config
        self.turn = turn
        self.extra_headers = headers
        self.started = False

    async def write(self, send: Sender) -> None:
        raise NotImplementedError

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        abort: Callable[[], None] = scope.get("kvd.abort", lambda: None)
        turns, turn = self.turns, self.turn
        answered = False  # the whole answer was sent: a disconnect after it is the client leaving, not hanging up
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                if answered or turn.finished.is_set():
                    return
                log.info("client of %s hung up; cancelling its answer", turn.session_id)
                turns.cancel(turn.session_id, turn)
                tg.cancel_scope.cancel()

            async def bounded(message: dict[str, Any]) -> None:
                with anyio.move_on_after(self.config.send_timeout) as timer:
                    await send(message)
                if timer.cancelled_caught:
                    log.warning("client of %s did not read for %.1f s; cutting it off",
                                turn.session_id, self.config.send_timeout)
                    turns.cancel(turn.session_id, turn)
                    abort()
                    tg.cancel_scope.cancel()

            tg.start_soon(watch)
            try:
                await self.write(bounded)
                answered = True
            except OSError:  # the client went away under a send
                turns.cancel(turn.session_id, turn)
            tg.cancel_scope.cancel()

    async def send_start(self, send: Sender, status: int, content_type: str) -> None:
        """The response's status and headers (the door's, and X-Kvd-Session)."""
        headers = [(b"content-type", content_type.encode())]
        headers += [(k.lower().encode(), v.encode()) for k, v in self.extra_headers.items()]
        if content_type.startswith("text/event-stream"):
            headers += [(b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        self.started = True

    async def send_json(self, send: Sender, status: int, body: dict[str, Any]) -> None:
        """The whole response: a JSON body."""
        data = json.dumps(body, ensure_ascii=False).encode()
        await self.send_start(send, status, "application/json")
        await send({"type": "http.response.body", "body": data})
