"""uvicorn's HTTP/1.1 protocol, with a deadline and a cap on connections that have not said who they are.

uvicorn closes an idle keep-alive connection, but a connection that sends
part of a request head and then nothing is held forever, and its only cap
(`limit_concurrency`) answers everyone, token or not, with a plain-text
503 once enough such connections are open. Neither can live in an ASGI
layer: the app first sees a request once its head is whole. So this is the
protocol class uvicorn is given (`http=`), a subclass of its own:

- A request head (request line and headers, bounded in size by h11) must
  arrive whole within `header_timeout` seconds of its first byte, or of the
  connection's opening; otherwise the connection is closed.
- At most `max_unauthenticated` connections may be waiting for a whole head
  (nobody can know whose they are before it). One more closes the oldest of
  them, never the newcomer: a client with the token sends its head at once
  and is served, however many half-open connections an attacker keeps.

Once a head is whole the door decides (401 without the token; its body has
`limits.body_timeout`, in openai_api.py); a websocket upgrade has the
websockets library's own handshake and keepalive limits.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("kvd.server")


def guarded_h11(*, header_timeout: float, max_unauthenticated: int) -> type[H11Protocol]:  # noqa: C901 - a class
    # factory: the count is its class's methods together (each small), which share the server's register
    """A protocol class for one server: its own register of connections awaiting a head."""
    waiting: OrderedDict[GuardedH11, None] = OrderedDict()  # oldest first
    evicted = [0]

    class GuardedH11(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._await_head()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.transport.is_closing() or self.transport.get_protocol() is not self:
                self._head_done()  # closed, or upgraded to a websocket
            elif self.conn.their_state is h11.IDLE:
                self._await_head()  # (still, or again after a keep-alive response) part of a head
            else:
                self._head_done()

        def connection_lost(self, exc: Exception | None) -> None:
            self._head_done()
            super().connection_lost(exc)

        def _await_head(self) -> None:
            if self._deadline is None:
                self._deadline = self.loop.call_later(header_timeout, self._too_slow)
            if self not in waiting:
                waiting[self] = None
                while len(waiting) > max_unauthenticated:
                    oldest, _ = waiting.popitem(last=False)
                    evicted[0] += 1
                    if evicted[0] == 1 or evicted[0] % 1000 == 0:
                        log.warning("%d connection(s) closed for holding a slot without sending a whole "
                                    "request (more than %d at once; limits.max_unauthenticated)",
                                    evicted[0], max_unauthenticated)
                    oldest._close()

        def _head_done(self) -> None:
            waiting.pop(self, None)
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _too_slow(self) -> None:
            self._deadline = None
            if self.conn.their_state is h11.IDLE:
                self._close()

        def _close(self) -> None:
            self._head_done()
            if not self.transport.is_closing():
                self.transport.close()

        def __hash__(self) -> int:
            return id(self)

        def __eq__(self, other: Any) -> bool:
            return self is other

    return GuardedH11
