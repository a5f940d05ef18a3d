"""`kvd serve`'s model at start: prepared before listening, and a load failure ends the daemon.

A model that cannot be loaded must stop kvd with one line and a non-zero
exit, not leave a listening daemon that answers every message with an error.
Two moments catch it: :func:`prepare` runs before kvd listens (a missing
path, a bad or unsupported file, a failed fetch: everything daemon/models/sources.py
can tell without loading weights), and :func:`load_failure` tells `kvd serve` (cli.py) to end the
daemon when the engine thread's load fails after all (weights that do not
match their config, say), once every waiting client has been told.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import anyio

from ..config import Config
from ..engine.thread import Engine

log = logging.getLogger("kvd")

POLL_INTERVAL = 0.2  # seconds between looks at engine.ready (a threading.Event)


def prepare(config: Config) -> Path | None:
    """The model's directory, fetched and converted if needed; None after printing why not."""
    from common.printable import printable

    from ..models.sources import ModelError, prepare_model, progress_bar

    try:
        with progress_bar() as progress:
            return prepare_model(config.model, config.models_dir, progress=progress)
    except ModelError as e:  # names from the command line and the stores: no control character reaches the terminal
        print(f"kvd: error: {printable(str(e))}", file=sys.stderr, flush=True)
        return None


async def load_failure(engine: Engine) -> str | None:
    """Wait until the engine has tried to load the model: None if it did, else why not (one line; the
    exception and its traceback go to the log file, not the terminal)."""
    from .logfile import FILE_ONLY

    while not engine.ready.is_set():
        await anyio.sleep(POLL_INTERVAL)
    if (error := engine.load_error) is None:
        return None
    log.error("loading %s failed", engine.config.model, exc_info=error, extra={FILE_ONLY: True})
    return str(error) or type(error).__name__
