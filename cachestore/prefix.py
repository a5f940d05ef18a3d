"""The longest shared prefix of two token-id sequences: how much of a cache a prompt can reuse."""

from __future__ import annotations

from collections.abc import Hashable, Sequence


def common_prefix_len(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
