"""An asyncio event loop on a background thread, for the network.

The websocket must keep answering the daemon's pings while the user takes
their time at the prompt, and the prompt must stay on the main thread (see
lineinput.py). So the async client lives on this thread and the main thread
hands it coroutines and waits for their results.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """``with LoopThread() as net: net.run(coro)``; leaving stops the loop,
    cancelling whatever still runs on it, and joins the thread."""

    def __init__(self) -> None:
        self._started = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="kvchat-network", daemon=True)

    def __enter__(self) -> LoopThread:
        self._thread.start()
        self._started.wait()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.call_soon(self._stopping.set)
        self._thread.join(timeout=10)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for it; a KeyboardInterrupt while
        waiting cancels it."""
        future = self.submit(coro)
        try:
            return future.result()
        except KeyboardInterrupt:
            future.cancel()
            raise

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self._running_loop)

    def call_soon(self, callback: Callable[[], object]) -> None:
        """Thread-safe, and safe from a signal handler: it only queues the call."""
        self._running_loop.call_soon_threadsafe(callback)

    @property
    def _running_loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "LoopThread used outside its with block"
        return self._loop

    @property
    def _stopping(self) -> asyncio.Event:
        assert self._stop is not None
        return self._stop

    def _main(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._started.set()
        await self._stop.wait()
