"""KV cache state across the tiers (resident, warm, disk): the front door the engine uses.

The engine makes a `SessionCaches` with `model_fingerprint(...)`, `Budgets`
and the daemon's `Pool` (the memory budgets every loaded model's store
shares), then calls ten of its methods (store.py's class docstring): it is
admitted, checks caches out (`Checkout`, or a `Pending` read) and back in,
and tells the store what happened (told.py: `ARRIVED`, `Took`, `Stepped`, ...).
Everything else in the package (the budget protocol, the I/O worker's manners,
snapshot, segments, index, tiers, packing) is how that is done, and stays
behind this door.

Importing the package stays light (no MLX): the names that need MLX load on
first use, on the engine thread. Importing MLX on the main thread of a `kvd
serve` that then fails to listen made it abort at exit ("terminate called
without an active exception") instead of exiting with its one-line error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .layout import cached_session_ids, check_usable, disk_ids
from .pool import Pool
from .prefix import common_prefix_len
from .told import ARRIVED, IDLE, READS_REPORTED, STOPPING, WOKEN, Abandoned, Stepped, Took

if TYPE_CHECKING:
    from .snapshot import rewind
    from .store import Budgets, Checkout, SessionCaches
    from .terms import Pending

__all__ = ["ARRIVED", "IDLE", "READS_REPORTED", "STOPPING", "WOKEN", "Abandoned", "Budgets", "Checkout", "Pending",
           "Pool", "SessionCaches", "Stepped", "Took", "cached_session_ids", "check_usable", "common_prefix_len",
           "disk_ids", "model_fingerprint", "rewind"]


def __getattr__(name: str) -> Any:
    """The names that need MLX, loaded on first use (the engine thread's)."""
    if name in ("Budgets", "Checkout", "SessionCaches"):
        from .store import Budgets, Checkout, SessionCaches

        return {"Budgets": Budgets, "Checkout": Checkout, "SessionCaches": SessionCaches}[name]
    if name == "Pending":
        from .terms import Pending

        return Pending
    if name == "rewind":
        from .snapshot import rewind

        return rewind
    raise AttributeError(f"module 'cachestore' has no attribute {name!r}")


def model_fingerprint(*, model_id: str, config: dict[str, Any], dtype: str, kv_bits: int | None,
                      fresh_cache: Sequence[Any], rank: int = 0, world_size: int = 1) -> str:
    """What every cache this model writes is stamped with, and every cache it reads must match.

    `fresh_cache`: the model's own new, empty cache (the kind kvd feeds it), so
    a reader that has only the model computes the same layout as the writer.
    `rank` of `world_size`: a sharded model's caches hold one rank's heads, so a
    share is never restored into another rank or another split (one rank's
    fingerprint is unchanged: its caches stay valid).
    """
    from .segments import fingerprint
    from .snapshot import layout

    if world_size > 1:
        config = {**config, "kvd_shard": {"rank": rank, "world_size": world_size}}
    return fingerprint(model_id=model_id, config=config, dtype=dtype, kv_bits=kv_bits, layout=layout(fresh_cache))
