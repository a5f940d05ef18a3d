"""Session ids: 16 lowercase hex characters.

Ids end up in file names (cache segments), so the daemon checks every id a
client sends with `is_valid_session_id` before it touches a path. The pattern
is the protocol's, so client and daemon can never disagree on it.
"""

from __future__ import annotations

import secrets

from daemon.protocol import SESSION_ID_RE


def new_session_id() -> str:
    """A fresh random id: 64 bits from `secrets`, so ids are unguessable and never collide in practice."""
    return secrets.token_hex(8)


def is_valid_session_id(s: object) -> bool:
    """True for a str of exactly 16 lowercase hex characters.

    `fullmatch`, not `match`: `$` also matches before a trailing newline.
    """
    return isinstance(s, str) and SESSION_ID_RE.fullmatch(s) is not None
