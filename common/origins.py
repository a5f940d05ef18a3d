"""Who made a session: the session's `origin`, and the kinds a list or a prune filters by.

kvchat says "kvchat" (a chat) or "kvchat one-shot"; the HTTP doors record
"api (<User-Agent>)", with "; conversation <key>" when the request names the
client's own conversation (Claude Code's metadata, a `prompt_cache_key`):
the sessions of one are one row of the list; another websocket client that
does not say is "websocket". Sessions from before origins were kept have none and count as
kvchat's (it was the only client then).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

KVCHAT = "kvchat"
ONE_SHOT = "kvchat one-shot"
WEBSOCKET = "websocket"
# What --from takes (kvd sessions prune, kvchat): the words kvchat's session list shows, and "any".
KINDS = ("kvchat", "one-shot", "api", "ws", "any")

S = TypeVar("S", bound=Mapping[str, Any])

ORIGIN_CHARS = 80  # of a User-Agent, and of a conversation's key, in an origin
_KEYED = re.compile(r"api \((?:.*; )?conversation (\S+)\)")


def api(user_agent: str | None, conversation: str | None = None) -> str:
    """An API session's origin: "api (<the client's User-Agent>)", cut to a readable length, and
    "; conversation <key>" when its request names the client's own conversation."""
    agent = " ".join((user_agent or "").split())[:ORIGIN_CHARS]
    key = "".join(c for c in conversation or "" if c.isprintable() and not c.isspace())[:ORIGIN_CHARS]
    said = "; ".join(part for part in (agent, f"conversation {key}" if key else "") if part)
    return f"api ({said})" if said else "api"


def conversation_of(origin: object) -> str | None:
    """The client's name for the conversation an API session belongs to, where its origin records one."""
    m = _KEYED.fullmatch(str(origin or ""))
    return m[1] if m else None


def kind(origin: object) -> str:
    """kvchat, one-shot, api or ws."""
    if origin == ONE_SHOT:
        return "one-shot"
    if origin is None or str(origin).startswith(KVCHAT):
        return "kvchat"
    return "api" if str(origin).startswith("api") else "ws"


def matches(origin: object, which: str) -> bool:
    """Whether a session made by `origin` is one `--from which` picks: "kvchat" takes its one-shots too."""
    made = kind(origin)
    return which in ("any", made) or (which == "kvchat" and made == "one-shot")


def made_by(sessions: Sequence[S], which: str) -> list[S]:
    """The sessions of one kind ("any": all of them), in their order."""
    return [s for s in sessions if matches(s.get("origin"), which)]
