"""The model's tokenizer stage: where a turn's every render and encode runs (daemon/prompt.py's functions).

One thread per loaded model ("kvd-tokenizer": `top -H`, py-spy and
bench/hostcost.py tell it apart), one call at a time, off the event loop (a
long conversation takes milliseconds) and off the engine thread (it would
stall every decoding stream). Its tokenizer is its own copy, made by the
engine before `ready`: a fast tokenizer used from two threads can fail
("Already borrowed").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any, TypeVar

import anyio

from common.threadname import name_thread

T = TypeVar("T")


class TokenizerStage:
    def __init__(self, model: str) -> None:
        self.model = model  # (what a call after the unload says is not loaded)
        self.tokenizer: Any = None  # the stage's own copy, once the engine has made it
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # its thread, made at its first call

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(tokenizer, *args)` on the stage's thread; not cancelled halfway (a worker thread's call
        ends before its caller does)."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvd-tokenizer",
                                                               initializer=name_thread, initargs=("kvd-tokenizer",))
        done = asyncio.wrap_future(self._pool.submit(self._call, fn, args))
        with anyio.CancelScope(shield=True):
            out = await done
        return out

    def _call(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        if (tokenizer := self.tokenizer) is None:  # the registry unloads no model a turn is on
            raise RuntimeError(f"{self.model} is not loaded")
        return fn(tokenizer, *args)

    def close(self) -> None:
        """Let the tokenizer and the thread go (the model was unloaded)."""
        self.tokenizer = None
        if self._pool is not None:
            self._pool.shutdown(wait=False)
