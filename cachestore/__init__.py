"""KV cache state across the tiers (resident, warm, disk): the front door the engine uses.

The engine makes a `SessionCaches` with `model_fingerprint(...)` and
`Budgets`, then only checks caches out (`Checkout`) and back in. Everything
else in the package (snapshot, segments, index, tiers, packing) is how that
is done, and stays behind this door.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .manager import Budgets, Checkout, SessionCaches
from .prefix import common_prefix_len
from .segments import fingerprint as _fingerprint
from .snapshot import layout as _layout

__all__ = ["Budgets", "Checkout", "SessionCaches", "common_prefix_len", "model_fingerprint"]


def model_fingerprint(*, model_id: str, config: dict[str, Any], dtype: str, kv_bits: int | None,
                      fresh_cache: Sequence[Any]) -> str:
    """What every cache this model writes is stamped with, and every cache it reads must match.

    `fresh_cache`: the model's own new, empty cache (the kind kvd feeds it), so
    a reader that has only the model computes the same layout as the writer.
    """
    return _fingerprint(model_id=model_id, config=config, dtype=dtype, kv_bits=kv_bits,
                        layout=_layout(fresh_cache))
