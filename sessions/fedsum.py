"""The checksum of a session's fed token ids row.

The fed ids say which cache belongs to a session and which ids the next turn
appends to; the cache files are checksummed, so the ids that pick them are
too. One bit flipped in ``session_tokens`` (a bad sector, a torn page) would
otherwise restore a shorter prefix and prefill the rest from altered ids: a
silently different answer. The sum covers the session id (a row copied onto
another session fails), the ids blob and ``covers``; 8 bytes of BLAKE2b, as
a signed 64-bit integer so SQLite stores it as one. 10,000 ids (40 KB) take
about 30 µs.
"""

from __future__ import annotations

import hashlib

__all__ = ["fed_checksum"]


def fed_checksum(session_id: str, blob: bytes, covers: int) -> int:
    h = hashlib.blake2b(digest_size=8, person=b"kvd-fed-ids")
    h.update(session_id.encode("utf-8"))
    h.update(b"\0")
    h.update(covers.to_bytes(8, "little", signed=True))
    h.update(blob)
    return int.from_bytes(h.digest(), "little", signed=True)
