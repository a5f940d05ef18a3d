"""Token ids <-> BLOB: little-endian uint32, 4 bytes per id.

A session's token ids are written once per turn and read on every resume, so
they are stored packed rather than as JSON: 10k ids are 40 KB, and packing or
unpacking them is a single C call.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

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
    """Inverse of `pack_tokens`."""
    packed = array(_TYPECODE)
    packed.frombytes(blob)
    if _SWAP:
        packed.byteswap()
    return packed.tolist()
