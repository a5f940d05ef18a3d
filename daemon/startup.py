"""`kvd serve`'s model at start: prepared before listening, and a load failure ends the daemon.

A model that cannot be loaded must stop kvd with one line and a non-zero
exit, not leave a listening daemon that answers every message with an error.
Two moments catch it: :func:`prepare` runs before kvd listens (a missing
path, a bad or unsupported file, a failed fetch: everything daemon/models.py
can tell without loading weights), and :func:`until_stopped` ends the
daemon when the engine thread's load fails after all (weights that do not
match their config, say), once every waiting client has been told.
"""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path

import anyio

from .config import Config
from .engine import Engine

log = logging.getLogger("kvd")

POLL_INTERVAL = 0.2  # seconds between looks at engine.ready (a threading.Event)


def prepare(config: Config) -> Path | None:
    """The model's directory, fetched and converted if needed; None after printing why not."""
    from .models import ModelError, prepare_model, progress_bar

    try:
        with progress_bar() as progress:
            return prepare_model(config.model, config.models_dir, progress=progress)
    except ModelError as e:
        print(f"kvd: error: {e}", file=sys.stderr, flush=True)
        return None


async def until_stopped(engine: Engine) -> str | None:
    """Wait for SIGTERM/SIGINT (None) or for the model to fail to load (the line printed)."""
    failure: str | None = None
    async with anyio.create_task_group() as tg:

        async def signals() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as received:
                async for signum in received:
                    log.info("received %s", signal.Signals(signum).name)
                    break
            tg.cancel_scope.cancel()

        async def load_failure() -> None:
            nonlocal failure
            while not engine.ready.is_set():
                await anyio.sleep(POLL_INTERVAL)
            if engine.load_error is not None:
                failure = f"kvd: error: the model failed to load: {engine.load_error}"
                print(failure, file=sys.stderr, flush=True)
                tg.cancel_scope.cancel()

        tg.start_soon(signals)
        tg.start_soon(load_failure)
    return failure
