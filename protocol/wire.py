"""The objects the daemon sends: built field by field from the stored rows.

The wire is a projection chosen on purpose, not the store's rows passed
through: a column the store adds for its own bookkeeping (a message's
`fed_end`, the turn boundary the fed-token rule keeps) stays off the wire
until docs/protocol.md names it. Rows come in as mappings so this package
needs nothing of `sessions`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# docs/protocol.md, "Session object" and "Message object", in that order.
SESSION_FIELDS = ("id", "title", "system", "created_at", "updated_at",
                  "message_count", "last_message", "tokens", "params", "origin", "model")
MESSAGE_FIELDS = ("index", "role", "content", "status", "finish_reason", "usage",
                  "created_at", "updated_at")


def session_object(session: Mapping[str, Any], cache: str) -> dict[str, Any]:
    """A session as the protocol shows it: the stored fields plus `cache`, the fastest tier holding it."""
    return {**{name: session[name] for name in SESSION_FIELDS}, "cache": cache}


def message_object(message: Mapping[str, Any]) -> dict[str, Any]:
    """A transcript message as the protocol shows it."""
    return {name: message[name] for name in MESSAGE_FIELDS}
