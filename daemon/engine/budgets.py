"""An engine's cache store, opened at its load within the memory budgets every loaded model shares.

Engine thread only: called from `Engine.load` (thread.py), after the model is on the device. The budgets
are the daemon's memory decision-maker's (memory.py); the first engine makes them by its rule.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from common.sizes import human_bytes
from common.tiers import RESIDENT, WARM

from ..config import Config

if TYPE_CHECKING:
    from cachestore import Pool, SessionCaches

log = logging.getLogger("kvd.engine")


def shared_budgets(c: Config, pool: Pool | None, weights: int) -> Pool:
    """The resident and warm budgets every loaded model's caches share: `pool` as the daemon's memory
    decision-maker (memory.py) sized it before this load; None: this is the first engine, which makes
    them by the same rule beside its own `weights` (daemon/device.py's `cache_budgets`)."""
    from cachestore import Pool

    from ..device import current

    if pool is not None:
        return pool
    policy = current()
    resident, warm = policy.cache_budgets(c.resident_bytes, c.warm_bytes, weights=weights,
                                          limit=policy.models_memory(c.models_memory))
    configured = [(got, want) for got, want in ((resident, c.resident_bytes), (warm, c.warm_bytes))
                  if want is not None]
    if any(got != want for got, want in configured):
        log.warning("cache budgets cut to what %s has room for: resident %d bytes, warm %d bytes "
                    "(configured %s and %s)", policy.device.label(), resident, warm,
                    c.resident_bytes, c.warm_bytes)
    if len(configured) < 2:
        log.info("cache budgets (every loaded model's) from %s's memory: resident %s, warm %s",
                 policy.device.label(), human_bytes(resident), human_bytes(warm))
    return Pool({RESIDENT: resident, WARM: warm})


def open_caches(c: Config, loaded: Any, kv_bits: int | None, pool: Pool) -> SessionCaches:
    """This model's cache store: its caches' fingerprint (model, dtype, cache layout, rank), the budgets."""
    from cachestore import Budgets, SessionCaches, model_fingerprint

    from .quantized import make_cache

    return SessionCaches(
        c.cache_dir,
        model_fingerprint(model_id=c.model, config=loaded.config, dtype=loaded.dtype, kv_bits=kv_bits,
                          fresh_cache=make_cache(loaded.model, kv_bits), rank=c.rank,
                          world_size=c.world_size),
        Budgets(resident_bytes=pool.budgets[RESIDENT], warm_bytes=pool.budgets[WARM],
                disk_bytes=c.disk_bytes, resident_idle=c.resident_idle,
                warm_idle=c.warm_idle, max_segments=c.max_segments,
                resident_sessions=c.max_resident_sessions, warm_bits=c.warm_bits,
                block_tokens=c.block_tokens, checkpoints=c.checkpoints),
        model=c.model, pool=pool,
    )
