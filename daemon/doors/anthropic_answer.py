"""One Anthropic Messages answer: a turn's events as Anthropic's JSON body or server-sent events.

The response's life is every door's (answering.py); the shapes are
anthropic_events.py's. A streamed answer begins once the engine has taken the
prompt (`AnswerReading`): by then the request was admitted, fits the context
and has its cache restored, so a refusal is still an HTTP error with its
status, and `message_start` carries the prompt's real input figures
(`input_tokens`, `cache_read_input_tokens`), as Anthropic's does. The
`ping`s of a long prompt's reading come after it (the engine reports progress
only on a prompt it has taken), and the SDKs want `message_start` first.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from anyio.streams.memory import MemoryObjectReceiveStream

from ..config import Config
from ..events import AnswerDelta, AnswerDone, AnswerError, AnswerQueued, AnswerStarted, TurnEvent
from ..turn import Turn
from ..turns import Turns
from .answering import TurnResponse
from .anthropic_events import MessageStream, sse, whole
from .anthropic_schema import error_body
from .httpdoor import api_error

Send = Callable[[dict[str, Any]], Any]


class MessagesResponse(TurnResponse[TurnEvent]):
    def __init__(self, turns: Turns, config: Config, turn: Turn, events: MemoryObjectReceiveStream[TurnEvent],
                 headers: dict[str, str], *, stream: bool):
        super().__init__(turns, config, turn, events, headers, stream=stream)
        self.message_id = f"msg_{secrets.token_hex(12)}"

    def _stop_sequence(self) -> str | None:
        stop = self.turn.stop
        return stop.found if stop is not None and stop.hit else None

    async def _error(self, send: Send, event: AnswerError) -> None:
        """An error before the answer began: a refusal (the turn core stored nothing of a session this
        request made, and took back what it added to a pinned one)."""
        e = api_error(event.code, event.message, model=self.config.model)
        await self.refuse(send, e, error_body(e))

    async def _whole(self, send: Send) -> None:
        async for event in self.events:
            if isinstance(event, AnswerDelta) and event.written is not None:
                event.written()  # nothing is sent before the end: the engine need not wait
            elif isinstance(event, AnswerDone):
                body = whole(self.message_id, self.config.model, event, self._stop_sequence())
                await self.send_body(send, 200, body)
                return
            elif isinstance(event, AnswerError):
                await self._error(send, event)
                return

    async def _stream(self, send: Send) -> None:
        stream = MessageStream(self.message_id, self.config.model)
        async for event in self.events:
            if isinstance(event, (AnswerStarted, AnswerQueued)):
                continue  # not yet taken by the engine: an error may still be an HTTP status
            if isinstance(event, AnswerError) and not self.started:
                await self._error(send, event)
                return
            try:
                await self._send_events(send, stream, event)
            finally:
                if isinstance(event, AnswerDelta) and event.written is not None:
                    event.written()  # the answer's first token is out (or never will be): the engine goes on
            if isinstance(event, (AnswerDone, AnswerError)):
                break
        if self.started:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _send_events(self, send: Send, stream: MessageStream, event: TurnEvent) -> None:
        """The server-sent events `event` makes, the response begun first if it has not been."""
        if not self.started:
            await self.begin_response(send, 200, "text/event-stream; charset=utf-8")
        if isinstance(event, AnswerError):
            e = api_error(event.code, event.message, model=self.config.model)
            out = stream.error(error_body(e))
        else:
            out = stream.feed(event, self._stop_sequence() if isinstance(event, AnswerDone) else None)
        await send({"type": "http.response.body", "body": b"".join(sse(e) for e in out), "more_body": True})

