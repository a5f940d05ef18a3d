"""Who made a session: the session's `origin`, and the kinds a list or a prune filters by.

kvchat says "kvchat" (a chat) or "kvchat one-shot"; the OpenAI door records
"api (<User-Agent>)"; another websocket client that does not say is
"websocket". Sessions from before origins were kept have none and count as
kvchat's (it was the only client then).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

KVCHAT = "kvchat"
ONE_SHOT = "kvchat one-shot"
WEBSOCKET = "websocket"
# What --from takes (kvd sessions prune, kvchat): the words kvchat's session list shows, and "any".
KINDS = ("kvchat", "one-shot", "api", "ws", "any")

S = TypeVar("S", bound=Mapping[str, Any])


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
