"""Session ids: 16 lowercase hex characters.

Ids end up in file names (cache segments), so the daemon checks every id a
client sends with `is_valid_session_id` before it touches a path. The same
format is the wire's (`protocol.SESSION_ID_RE`, which kvchat checks too);
sessions imports no other kvd package, so the rule is stated here for the
store and tests/test_arrows.py checks the two agree.
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
