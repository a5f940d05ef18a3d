"""kvchat's connection to kvd, made again when it drops.

Each attempt looks the daemon up afresh (daemon.json may name a new port
after a restart) and backs off from 0.2 s to 2 s between attempts, for up to
RECONNECT_FOR seconds. A refused token is not retried: waiting will not fix it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

from .client import Client
from .discover import locate
from .errors import ConnectionLost, GaveUp, NoDaemon, Unreachable

RECONNECT_FOR = 30.0
FIRST_DELAY = 0.2
MAX_DELAY = 2.0


class Link:
    """The current Client, and how to get a new one. Used on the network loop only."""

    def __init__(
        self,
        *,
        url: str | None = None,
        data_dir: Path | None = None,
        token_file: Path | None = None,
        reconnect_for: float = RECONNECT_FOR,
    ) -> None:
        self.url = url
        self.data_dir = data_dir
        self.token_file = token_file
        self.reconnect_for = reconnect_for
        self._client: Client | None = None
        self.known: str | None = None  # where kvd answered last: tried again while it is away

    @property
    def client(self) -> Client:
        assert self._client is not None, "Link.connect() first"
        return self._client

    async def connect(self) -> Client:
        """One attempt; KvchatError says what is wrong."""
        endpoint = locate(url=self.url, data_dir=self.data_dir, token_file=self.token_file, known=self.known)
        try:
            client = await Client.connect(endpoint.url, endpoint.token, token_path=endpoint.token_path)
        except NoDaemon as exc:
            if self.data_dir is None:
                raise
            raise NoDaemon(exc.url, self.data_dir) from exc
        self.known = client.url
        old, self._client = self._client, client
        if old is not None:
            await old.close()
        return client

    async def ensure(self, on_retry: Callable[[], None] | None = None) -> Client:
        """The client, connected again first if the connection has dropped since."""
        if self._client is None or self._client.lost:
            if on_retry is not None:
                on_retry()
            return await self.reconnect()
        return self._client

    async def reconnect(self) -> Client:
        """Retry with backoff until connected, or raise GaveUp after `reconnect_for` seconds."""
        give_up = time.monotonic() + self.reconnect_for
        delay = FIRST_DELAY
        while True:
            try:
                return await self.connect()
            except (NoDaemon, Unreachable, ConnectionLost) as exc:
                why = str(exc)
                url = getattr(exc, "url", self.url or "?")
            if time.monotonic() + delay > give_up:
                raise GaveUp(self.known or url, self.reconnect_for, _short(why), self.data_dir)
            await asyncio.sleep(delay)
            delay = min(delay * 2, MAX_DELAY)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()


def _short(why: str) -> str:
    return why.split(";")[0].split(". ")[0]
