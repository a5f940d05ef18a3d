"""A follower rank (1..N-1): the same engine on its share of the model, driven by rank 0's word.

It has no port, no session store and no token: rank 0 runs the doors, the
sessions and the scheduler and sends each decision (lockstep.py); the
follower applies it to its own Engine, whose events go nowhere, so every
forward here pairs with rank 0's. Its share of every cache lives in its own
tiers under <data_dir>/rank-N/ with the budgets of config.toml (per rank).
It ignores SIGINT and SIGTERM: rank 0 decides when the group stops, and a
rank that dies ends it (lockstep.py).
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path

from ..config import Config
from .jobs import EngineEvent
from .lockstep import Lockstep, Op, decode_job
from .thread import Engine

log = logging.getLogger("kvd.follower")


def _nowhere(event: EngineEvent) -> None:
    """A follower's events: rank 0 tells the clients."""


def serve(config: Config, lockstep: Lockstep, model_dir: Path) -> int:
    """Load, then apply rank 0's decisions until it says stop (0), or end with one line."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    engine = Engine(config, model_dir, lockstep=lockstep)
    engine.open()  # this thread is the follower's engine thread
    if engine.load_error is not None:
        log.error("error: rank %d: the model failed to load: %s", config.rank, engine.load_error)
        return 1
    log.info("rank %d of %d following rank 0 (caches in %s)", config.rank, config.world_size, config.cache_dir)
    with lockstep.watched():  # rank 0 speaks at least every MAINTAIN_EVERY seconds, idle or not
        while True:
            m = lockstep.receive()
            if m.op == Op.STEP:
                engine.advance()
            elif m.op == Op.IDLE:
                engine.idle()
            elif m.op in (Op.JOB, Op.CANCEL, Op.FORGET):
                engine.apply(decode_job(m, _nowhere))
            elif m.op == Op.STOP:
                engine.close()
                log.info("rank %d stopped", config.rank)
                return 0
            else:
                lockstep.fatal(f"rank {config.rank} is out of step with rank 0 (got {m.op.name})")
