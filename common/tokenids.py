"""Token ids <-> bytes: little-endian uint32, 4 bytes per id.

The one encoding of a list of token ids as a blob, wherever kvd stores one:
a session's fed ids (SQLite, sessions/), a segment's ids (the cache index,
and base64'd in the segment file's own header, cachestore/). Packed rather
than JSON: 10k ids are 40 KB, and packing or unpacking them is a single C
call. ``sessions`` and ``cachestore`` may import nothing but this leaf
package, so it lives here. Standard library only.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

__all__ = ["pack_tokens", "unpack_tokens"]

# 'I' is 4 bytes on every platform kvd runs on; pick 'L' if it ever is not.
_TYPECODE = next(code for code in "IL" if array(code).itemsize == 4)
_SWAP = sys.byteorder != "little"


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Pack token ids; ValueError for an id outside 0 <= t < 2**32, TypeError for a non-int."""
    try:
        packed = array(_TYPECODE, tokens)
    except OverflowError:
        bad = next(t for t in tokens if not 0 <= t < 2**32)
        raise ValueError(f"token id {bad!r} is out of range (0 <= id < 2**32)") from None
    if _SWAP:
        packed.byteswap()
    return packed.tobytes()


def unpack_tokens(blob: bytes) -> list[int]:
    """Inverse of `pack_tokens`; ValueError if ``blob`` is not a whole number of ids."""
    packed = array(_TYPECODE)
    packed.frombytes(blob)
    if _SWAP:
        packed.byteswap()
    return packed.tolist()
