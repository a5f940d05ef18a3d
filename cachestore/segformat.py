"""The segment file format: what a segment file holds and how it is named.

One :class:`~cachestore.snapshot.Snapshot` per safetensors file. A segment
holds the arrays of a snapshot under positional names (``L3.0``, ``L3.c1.0``
for a ``CacheList`` child) and, in the string-only safetensors metadata, the
format version, the fingerprint, the token range, the range's token ids and
the layer layout (kinds and meta ints) as JSON. Nothing in a file ever names
a class: kinds map to classes through a fixed table (cachestore/kinds.py).

:mod:`cachestore.segwrite` writes a durable file; :mod:`cachestore.segread`
checks an untrusted one. Checksum: crc32 (the reasons and numbers are in
segread's docstring); ``sha256:<hex>`` checksums are accepted on read too.
"""

from __future__ import annotations

import base64
import hashlib
import json
import zlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from protocol.tokenids import pack_tokens, unpack_tokens

__all__ = [
    "CHUNK",
    "END",
    "FINGERPRINT",
    "FORMAT",
    "FORMAT_VERSION",
    "HASHERS",
    "LAYOUT",
    "START",
    "TOKENS",
    "decode_tokens",
    "digest",
    "encode_tokens",
    "fingerprint",
]

FORMAT_VERSION = 1

# Metadata keys. Never renamed: a reader of any version must find the
# fingerprint and the version where every earlier writer put them.
FORMAT = "kvd.format"
FINGERPRINT = "kvd.fingerprint"
START = "kvd.start"
END = "kvd.end"
LAYOUT = "kvd.layout"
TOKENS = "kvd.tokens"  # base64 of the range's token ids, uint32 little-endian (since 2026-11)

CHUNK = 4 << 20  # read + checksum in cache-sized chunks: 2.5x faster than one big read


def fingerprint(
    *, model_id: str, config: dict[str, Any], dtype: str, kv_bits: int | None, layout: list[str]
) -> str:
    """A stable short hash of everything that makes a cache loadable by a model.

    Canonical JSON (sorted keys), so dict order and reloading the config do
    not change it; 64 bits, plenty to tell models apart (it is not a defence).
    """
    payload = {
        "v": 1,
        "model_id": model_id,
        "config": config,
        "dtype": dtype,
        "kv_bits": kv_bits,
        "layout": list(layout),
    }
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def encode_tokens(tokens: Sequence[int]) -> str:
    """The ``kvd.tokens`` metadata value for these token ids: the one blob codec, base64'd."""
    return base64.b64encode(pack_tokens(tokens)).decode()


def decode_tokens(value: str) -> list[int]:
    """Inverse of :func:`encode_tokens`; ValueError if it is not one."""
    return unpack_tokens(base64.b64decode(value, validate=True))


class Readable(Protocol):
    """A binary file open for reading: a raw ``FileIO`` or a buffered one."""

    def readinto(self, buffer: memoryview, /) -> int | None: ...


#: Checksums other than crc32 that a reader accepts (``sha256:<hex>``).
HASHERS: dict[str, Callable[[], Any]] = {"sha256": hashlib.sha256}


def digest(f: Readable, algo: str) -> tuple[int, str]:
    """(size, hex digest) of a whole file, read in chunks that stay in cache."""
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    size = 0
    if algo == "crc32":
        crc = 0
        while n := f.readinto(view):
            crc = zlib.crc32(view[:n], crc)
            size += n
        return size, f"{crc:08x}"
    h = HASHERS[algo]()
    while n := f.readinto(view):
        h.update(view[:n])
        size += n
    return size, h.hexdigest()
