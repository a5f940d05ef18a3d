"""Sizes as people read them (one format for the start line, `kvd status` and kvchat), and the cache's block size."""

from __future__ import annotations

# Token ids per content-addressed cache block unless configured ([cache] block_tokens): the one
# default, read by config.py's [cache] and cachestore's Budgets.
BLOCK_TOKENS = 128

# Checkpoints a session keeps in memory unless configured ([cache] checkpoints), for a model whose
# cache cannot be cut back (recurrent or sliding-window layers): its last two turns' prompt and
# answer ends (cachestore/checkpoints.py).
CHECKPOINTS = 4


def human_bytes(n: int) -> str:
    """`512 B`, `22.5 MiB`: powers of 1024, as the tiers' budgets are set."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable: GiB ends the loop")
