"""Telling clients that the model is still loading, and when it is ready.

The engine loads the model on its own thread and then sets `engine.ready`
(with `engine.load_error` set if loading failed). The event loop cannot await
a threading.Event without tying up a thread, so a task polls it, only until
the model is ready. Clients learn the state from `hello` and then from pushed
`loading` events, ended by exactly one `ready` or `error`.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

import anyio

import protocol as p

from ..engine.thread import Engine

POLL_INTERVAL = 0.2  # seconds between looks at engine.ready
ANNOUNCE_INTERVAL = 1.0  # seconds between `loading` events


class LoadingWatch:
    """The model's loading state as clients see it.

    `ready` turns true only when `run` has announced it, not when the engine
    sets its event: so a client whose hello said "not ready" is always sent the
    `ready` (or `error`) that ends its wait, and one whose hello said "ready"
    is never sent a stray one.
    """

    def __init__(self, engine: Engine, model: str) -> None:
        self.engine = engine
        self.model = model
        self.since = time.monotonic()
        self.ready = False
        self.failure: str | None = None
        self.settled = anyio.Event()  # set once `ready` or `failure` is known

    def progress(self) -> dict[str, Any]:
        return {"stage": f"loading {self.model}", "elapsed_s": round(time.monotonic() - self.since, 1)}

    def hello_fields(self) -> dict[str, Any]:
        if self.ready:
            return {"ready": True}
        if self.failure is not None:
            return {"ready": False}
        return {"ready": False, "loading": self.progress()}

    def failure_event(self) -> dict[str, Any] | None:
        """The error every client gets once loading has failed (also sent after hello)."""
        if self.failure is None:
            return None
        return {"type": p.ERROR, "id": None, "code": p.INTERNAL,
                "message": f"the model failed to load: {self.failure}; kvd's log has the details, "
                           "fix the model setting and restart kvd"}

    async def run(self, broadcast: Callable[[dict[str, Any]], None]) -> None:
        """Push `loading` about once a second until the engine is ready, then `ready` or `error`."""
        announced = -ANNOUNCE_INTERVAL
        while not self.engine.ready.is_set():
            now = time.monotonic()
            if now - announced >= ANNOUNCE_INTERVAL:
                broadcast({"type": p.LOADING, **self.progress()})
                announced = now
            await anyio.sleep(POLL_INTERVAL)
        if self.engine.load_error is not None:
            self.failure = str(self.engine.load_error) or type(self.engine.load_error).__name__
            event = self.failure_event()
            assert event is not None
            broadcast(event)
        else:
            # Everything loaded so far (the model, the libraries: ~100k objects) lives as long as kvd:
            # out of the collector's sight, a full collection that a large request's allocations
            # trigger scans that request's objects only, not 150-230 ms of these, holding the GIL.
            gc.freeze()
            self.ready = True
            broadcast({"type": p.READY})
        self.settled.set()
