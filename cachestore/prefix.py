"""The longest shared prefix of two token-id sequences: how much of a cache a prompt can reuse."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

#: Fewer ids in common with another session's cache are prefilled, not copied: a chat
#: template's head ("<|im_start|>user\n") is shared by every conversation, and a forward
#: over a few tokens costs about what copying them out of another cache (or reading a block) does.
MIN_SHARED = 16


#: Ids compared a slice at a time (a slice's comparison runs in C): a restore plans over a whole
#: conversation's ids, 256k of them for a large cache, on the engine thread.
_CHUNK = 512


def common_prefix_len(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    n = min(len(a), len(b))
    start = 0
    if type(a) is type(b) and isinstance(a, (list, tuple)):
        while start + _CHUNK <= n and a[start:start + _CHUNK] == b[start:start + _CHUNK]:
            start += _CHUNK
    for i in range(start, n):
        if a[i] != b[i]:
            return i
    return n
