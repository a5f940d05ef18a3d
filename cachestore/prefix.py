"""Reusing a session's cache for its next prompt: the longest shared prefix.

Works on any list of mlx-lm per-layer caches through their common contract
(`is_trimmable`/`trim`), so KV, rotating and quantized caches take one path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def rewind_for(cache: list[Any], cached_tokens: Sequence[int], tokens: Sequence[int]) -> int:
    """Rewind `cache` in place to the prefix it shares with `tokens`.

    At least one token of `tokens` is always left to feed (generation needs a
    last input). Returns how many tokens of `tokens` the cache now holds; 0
    means nothing is reusable and the caller should start from a fresh cache
    (e.g. a sliding-window cache that has wrapped cannot be rewound).
    """
    if not tokens:
        raise ValueError("cannot rewind for an empty prompt")
    keep = min(common_prefix_len(cached_tokens, tokens), len(tokens) - 1)
    drop = len(cached_tokens) - keep
    if keep == 0:
        return 0
    if drop > 0:
        if not can_trim_prompt_cache(cache):
            return 0
        trim_prompt_cache(cache, drop)
    return keep
