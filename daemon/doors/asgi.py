"""Small helpers on ASGI scopes and uvicorn's protocols, shared by both front doors.

ASGI has no way to abort a connection: an app can only close it, and a close
waits for the client to read what is buffered, which a stalled client never
does. uvicorn hands the app its protocol's bound `send`; that protocol owns
the transport, and aborting it is what cutting a client off means. With any
other server the helper finds no transport and does nothing: the connection
is then closed normally once the app returns.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.types import Scope


def headers_of(scope: Scope) -> dict[str, str]:
    """A request's headers, names lower-cased; a repeated header keeps its first value."""
    out: dict[str, str] = {}
    for name, value in scope.get("headers", []):
        out.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
    return out


def abort_transport(send: Any) -> None:
    """Drop the connection behind an ASGI `send` at once, buffered data and all (through a wrapper that
    names the `send` it wraps as `__wrapped__`, as server.py's logging one does)."""
    send = getattr(send, "__wrapped__", send)
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    if isinstance(transport, asyncio.WriteTransport):
        transport.abort()
