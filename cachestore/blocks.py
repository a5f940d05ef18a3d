"""Content addresses of KV blocks: fixed runs of token ids keyed by everything before them.

Block k of a sequence holds the cache state of its ids ``[k*B, (k+1)*B)``.
The KV of those positions depends on every earlier id too, so a block's key
is a hash chain (as in vLLM's automatic prefix caching and SGLang's radix
cache): ``key_k = H(key_{k-1}, ids of block k)``, with ``key_{-1}`` derived from the
model fingerprint (model, config, dtype, kv_bits, cache layout). Equal keys
mean equal ids from position 0 for the same kind of cache, so a block one
session wrote serves every other whose ids pass through it. 128-bit BLAKE2b:
a collision is not a practical concern, and the ids are compared anyway
before a block is used.
"""

from __future__ import annotations

import hashlib
import re
from array import array
from collections.abc import Sequence

BLOCK_RE = re.compile(r"[0-9a-f]{32}")


def _ids(tokens: Sequence[int]) -> bytes:
    a = array("I", tokens)
    return a.tobytes()


def root_key(fingerprint: str) -> str:
    """The chain's root: a block key standing for "no ids yet, this kind of cache"."""
    return hashlib.blake2b(b"kvd-blocks\0" + fingerprint.encode(), digest_size=16).hexdigest()


def block_key(parent: str, tokens: Sequence[int]) -> str:
    """The key of the block holding `tokens` right after the block keyed `parent`."""
    return hashlib.blake2b(parent.encode() + b"\0" + _ids(tokens), digest_size=16).hexdigest()


def block_keys(tokens: Sequence[int], size: int, root: str) -> list[str]:
    """The key of every whole block of `tokens` (size ids each), the first chained to `root`."""
    keys: list[str] = []
    parent = root
    for start in range(0, len(tokens) - size + 1, size):
        parent = block_key(parent, tokens[start:start + size])
        keys.append(parent)
    return keys


def whole_blocks(n: int, size: int) -> int:
    """How many whole blocks a session of n ids keeps before its private tail.

    The one block/tail boundary: the tail always keeps at least one id, so a
    session's last id (whose logits the next turn needs) is never only in a
    block another session may drop or rewrite.
    """
    return (n - 1) // size if n > 0 else 0

