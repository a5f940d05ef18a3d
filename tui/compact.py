"""/compact: go on from a full session in a new one that carries what fits.

kvd has no request that writes messages without answering them, so the new
session carries the old one's turns in its system prompt: the old system
prompt, then "earlier in this conversation" with the last turns verbatim.

The rule: the most recent whole turns (your message and its answer) whose
tokens add up to at most half the model's context window, leaving the other
half for the conversation to go on. A turn's tokens are the daemon's own
count, from each answer's usage: ``context_tokens`` after it minus after the
turn before (so template tokens are counted too). A turn without usage (an
answer that failed) ends the carried stretch. The old session is kept.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import protocol

from . import render
from .chatview import ChatView
from .errors import ServerError
from .listing import ORIGIN

TITLE_SUFFIX = " (compacted)"
MAX_TITLE = 200
HEADER = "Earlier in this conversation (carried over from the session {title!r}, {id}):"  # listing.py reads the id


@dataclass(frozen=True)
class Turn:
    question: str
    answer: str
    tokens: int


def turns(messages: Sequence[Mapping[str, Any]]) -> list[Turn]:
    """The transcript's whole turns, oldest first, each with its token count (the measurable ones)."""
    out: list[Turn] = []
    before = 0
    for user, answer in zip(messages, messages[1:]):
        if user.get("role") != "user" or answer.get("role") != "assistant":
            continue
        usage = answer.get("usage") or {}
        after = usage.get("context_tokens")
        if not isinstance(after, int) or after <= before:
            out.clear()  # what came before cannot be measured from here on
            before = 0
            continue
        out.append(Turn(str(user.get("content", "")), str(answer.get("content", "")), after - before))
        before = after
    return out


def window(messages: Sequence[Mapping[str, Any]]) -> int | None:
    for m in reversed(messages):
        usage = m.get("usage") or {}
        if isinstance(usage.get("context_window"), int):
            return int(usage["context_window"])
    return None


def carried(all_turns: Sequence[Turn], budget: int) -> list[Turn]:
    """The last turns whose tokens fit in `budget`, oldest first."""
    kept: list[Turn] = []
    total = 0
    for turn in reversed(all_turns):
        if total + turn.tokens > budget:
            break
        kept.insert(0, turn)
        total += turn.tokens
    return kept


def system_prompt(system: str | None, title: str, kept: Sequence[Turn], source: str = "") -> str | None:
    parts = [system] if system else []
    if kept:
        lines = [HEADER.format(title=title, id=source)]
        for turn in kept:
            lines += ["", f"User: {turn.question}", "", f"Assistant: {turn.answer}"]
        parts.append("\n".join(lines))
    return "\n\n".join(parts) or None


def run(chat: ChatView) -> None:
    got = chat.request(protocol.SESSION_GET, session=chat.session_id)
    old, messages = got["session"], got.get("messages") or []
    title = str(old.get("title") or protocol.DEFAULT_TITLE)
    size = window(messages)
    measured = turns(messages)
    kept = carried(measured, size // 2) if size else []
    while True:
        try:
            fields = {"title": (title[: MAX_TITLE - len(TITLE_SUFFIX)] + TITLE_SUFFIX),
                      "system": system_prompt(old.get("system"), title, kept, str(old.get("id", "")))}
            session = chat.request(protocol.SESSION_CREATE, origin=ORIGIN,
                                   **{k: v for k, v in fields.items() if v})["session"]
            break
        except ServerError as exc:
            if exc.code != protocol.TOO_LARGE or not kept:
                raise
            kept = kept[1:]  # the system prompt has its own character limit: carry one turn less
    if old.get("params"):
        session = chat.request(protocol.SESSION_UPDATE, session=session["id"], params=old["params"])["session"]
    chat.adopt(session)
    tokens = sum(t.tokens for t in kept)
    n = len(kept)
    limit = f"at most half the {size}-token context" if size else "the context size is not known yet"
    what = "the system prompt and " if old.get("system") else ""
    render.print_note(chat.console, f"this new session carries {what}the last {n} "
                      f"turn{'' if n == 1 else 's'} ({tokens} tokens; {limit}) in its system prompt; "
                      f"{title!r} is kept (/switch to it)")
