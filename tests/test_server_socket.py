"""The daemon's port turns Nagle's algorithm off on every connection it accepts.

A turn's first delta is a small frame written a few milliseconds after its
`chat.start`; with Nagle on, it waits for the client's delayed ACK of the
`chat.start` (40 ms on Linux) and every turn pays that.
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from daemon.server import listening_socket


class Accepted(asyncio.Protocol):
    def __init__(self, seen: asyncio.Future[int]) -> None:
        self.seen = seen

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        sock = transport.get_extra_info("socket")
        self.seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))


@pytest.mark.anyio
async def test_an_accepted_connection_has_nagle_off() -> None:
    sock = listening_socket("127.0.0.1", 0)  # socket.create_server's (protocol 0) fails this on Python 3.11
    loop = asyncio.get_running_loop()
    seen: asyncio.Future[int] = loop.create_future()
    server = await loop.create_server(lambda: Accepted(seen), sock=sock)
    try:
        with socket.create_connection(sock.getsockname()):
            nodelay = await asyncio.wait_for(seen, 10)
    finally:
        server.close()
        await server.wait_closed()
    assert nodelay


def test_the_port_is_taken_is_an_oserror_and_closes_the_socket() -> None:
    taken = listening_socket("127.0.0.1", 0)
    try:
        with pytest.raises(OSError):
            listening_socket("127.0.0.1", taken.getsockname()[1])
    finally:
        taken.close()
