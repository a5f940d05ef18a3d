"""The longest shared prefix of two token-id sequences: how much of a cache a prompt can reuse."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

#: Fewer ids in common with another session's cache are prefilled, not copied: a chat
#: template's head ("<|im_start|>user\n") is shared by every conversation, and a forward
#: over a few tokens costs about what copying them out of another cache (or reading a block) does.
MIN_SHARED = 16


def common_prefix_len(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
