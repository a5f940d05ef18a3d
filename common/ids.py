"""Session ids: 16 lowercase hex characters, minted by the store and checked at every door.

Ids end up in file names (cache segments), so the daemon checks every id a
client sends with :func:`is_valid_session_id` before it touches a path; the
wire (docs/protocol.md) and kvchat use the same pattern.
"""

from __future__ import annotations

import re
import secrets

SESSION_ID_RE = re.compile(r"[0-9a-f]{16}")


def new_session_id() -> str:
    """A fresh random id: 64 bits from `secrets`, so ids are unguessable and never collide in practice."""
    return secrets.token_hex(8)


def is_valid_session_id(s: object) -> bool:
    """True for a str of exactly 16 lowercase hex characters.

    `fullmatch`, not `match` with `$`: `$` also matches before a trailing newline.
    """
    return isinstance(s, str) and SESSION_ID_RE.fullmatch(s) is not None
