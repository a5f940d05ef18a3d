"""The followers' doorbell: a TCP byte from rank 0 that ends an idle wait without spinning.

MLX's ring backend waits for a collective by polling: a follower blocked in
`all_sum` while rank 0 has nothing to do burns a whole core (measured: 5.9 s
of CPU in a 6 s wait). So before rank 0 blocks on its inbox it sends SLEEP
through the lockstep; the followers then block in `recv` on this socket,
which costs nothing, until rank 0 rings (one byte each) just before its next
message. Only the wake-up goes this way; every decision still goes through
`all_sum`, in order with the model's own collectives.

Rank 0 listens on its ring address (from MLX_HOSTFILE) on a port the kernel
picks, tells the followers the port through the lockstep, and accepts
exactly one connection per follower, each naming its rank first; then it
stops listening. Without a hostfile (another backend) there is no doorbell
and the followers wait in `all_sum`, as mlx_lm.server's do.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time
from collections.abc import Callable
from pathlib import Path

ACCEPT_TIMEOUT = 30.0  # seconds rank 0 waits for every follower to connect


def ring_hosts() -> list[str] | None:
    """Each rank's host in the ring's hostfile (MLX_HOSTFILE: a list of ["ip:port", ...] per rank), in rank
    order; None without a readable one."""
    path = os.environ.get("MLX_HOSTFILE")
    if not path:
        return None
    try:
        return [str(h[0]).rsplit(":", 1)[0] for h in json.loads(Path(path).read_text())] or None
    except (OSError, ValueError, IndexError, KeyError, TypeError):
        return None


def rank0_address() -> str | None:
    """Rank 0's IP in the ring's hostfile, or None without one."""
    hosts = ring_hosts()
    return hosts[0] if hosts else None


class Doorbell:
    """Rank 0 rings, a follower waits; `share` is the lockstep's broadcast of one int from rank 0."""

    def __init__(self, rank: int, size: int, address: str, share: Callable[[int], int]):
        self.rank = rank
        self._peers: list[socket.socket] = []
        if rank == 0:
            listener = socket.create_server((address, 0))
            port = share(listener.getsockname()[1])
            deadline = time.monotonic() + ACCEPT_TIMEOUT
            seen: set[int] = set()
            with listener:
                while len(seen) < size - 1:
                    listener.settimeout(max(deadline - time.monotonic(), 0.01))
                    conn, _ = listener.accept()  # socket.timeout: a follower never came (start fails)
                    conn.settimeout(5.0)
                    who = struct.unpack("<i", _exactly(conn, 4))[0]
                    if 0 < who < size and who not in seen:
                        seen.add(who)
                        conn.settimeout(None)
                        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                        self._peers.append(conn)
                    else:
                        conn.close()
        else:
            port = share(0)
            conn = socket.create_connection((address, port), timeout=ACCEPT_TIMEOUT)
            conn.sendall(struct.pack("<i", rank))
            conn.settimeout(None)
            self._peers.append(conn)

    def ring(self) -> None:
        """Rank 0: wake every follower (it then waits in all_sum for the next message)."""
        for conn in self._peers:
            conn.sendall(b"\x01")

    def wait(self) -> bool:
        """A follower: block until rank 0 rings; False if rank 0 is gone."""
        return self._peers[0].recv(1) == b"\x01"


def _exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("a follower closed the doorbell before naming its rank")
        data += chunk
    return data
