"""/compact: go on from a full session in a new one that carries what fits.

The new session starts with the old one's system prompt and the carried
turns as its own first messages (session.create's `messages`: stored, not
answered). Its first answer renders them as the old session rendered them,
so the prefix they share (the system prompt, and the turns when they are
the old session's first ones) is restored from the old session's cache, in
memory or on disk, instead of being read again.

The rule: the most recent whole turns (your message and its answer) whose
tokens add up to at most half the model's context window, leaving the other
half for the conversation to go on. A turn's tokens are the daemon's own
count, from each answer's usage: ``context_tokens`` after it minus after the
turn before (so template tokens are counted too). A turn without usage (an
answer that failed) ends the measurable stretch. The old session is kept.

One turn may be what the whole conversation is about: a long pasted
document or log that later questions refer to. When an earlier turn is
much larger than a typical one (ANCHOR_FACTOR times the median, at least
ANCHOR_MIN tokens), it is carried first, with the most recent turns that
fit beside it, in up to three quarters of the context; the small turns
before it come too when they are together at most 1/ANCHOR_FACTOR of its
size, so the new session begins exactly as the old one did and the large
turn is restored from the cache, not read again. When it does not fit even
so, /compact says so plainly instead of carrying small talk and dropping it
silently. Before creating anything it says what it will carry and what it
leaves out, and asks.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import protocol

from . import render
from .chatview import ChatView
from .errors import ServerError
from .listing import compacted_origin

TITLE_SUFFIX = " (compacted)"
MAX_TITLE = 200


ANCHOR_FACTOR = 4
ANCHOR_MIN = 200  # tokens: below this no turn is "what the conversation is about", however small the others


@dataclass(frozen=True)
class Exchange:
    question: str
    answer: str
    tokens: int
    number: int = 0  # which of your messages it was, from 1


@dataclass(frozen=True)
class CompactPlan:
    kept: list[Exchange]  # oldest first
    left_out: list[Exchange]
    budget: int  # tokens the carried turns may take
    anchor: Exchange | None = None  # the large turn carried first
    unfit: Exchange | None = None  # the large turn that could not be carried


def turns(messages: Sequence[Mapping[str, Any]]) -> list[Exchange]:
    """The transcript's whole turns, oldest first, each with its token count (the measurable ones).

    Turns a session was made with (an earlier /compact's: stored complete, never answered, so without
    usage) share the count of the first answer after them, in proportion to their characters.
    """
    out: list[Exchange] = []
    carried: list[Exchange] = []
    before = 0
    number = 0
    for user, answer in zip(messages, messages[1:]):
        if user.get("role") != "user" or answer.get("role") != "assistant":
            continue
        number += 1
        usage = answer.get("usage") or {}
        after = usage.get("context_tokens")
        turn = Exchange(str(user.get("content", "")), str(answer.get("content", "")), 0, number)
        if after is None and not answer.get("usage") and answer.get("status") == "complete":
            carried.append(turn)
            continue
        if not isinstance(after, int) or after <= before:
            out.clear()  # what came before cannot be measured from here on
            carried.clear()
            before = 0
            continue
        out += _shared(after - before, [*carried, turn])
        carried.clear()
        before = after
    return out


def _shared(tokens: int, stretch: Sequence[Exchange]) -> list[Exchange]:
    """`tokens` measured for the whole stretch, split among its turns by their characters (at least 1 each)."""
    chars = [len(t.question) + len(t.answer) + 1 for t in stretch]
    total = sum(chars)
    return [Exchange(t.question, t.answer, max(1, tokens * c // total), t.number) for t, c in zip(stretch, chars)]


def window(messages: Sequence[Mapping[str, Any]]) -> int | None:
    for m in reversed(messages):
        usage = m.get("usage") or {}
        if isinstance(usage.get("context_window"), int):
            return int(usage["context_window"])
    return None


def carried(all_turns: Sequence[Exchange], budget: int) -> list[Exchange]:
    """The last turns whose tokens fit in `budget`, oldest first."""
    kept: list[Exchange] = []
    total = 0
    for turn in reversed(all_turns):
        if total + turn.tokens > budget:
            break
        kept.insert(0, turn)
        total += turn.tokens
    return kept


def plan(all_turns: Sequence[Exchange], size: int) -> CompactPlan:
    """What a new session carries from `all_turns` in a model with a `size`-token context."""
    budget = size // 2
    tail = carried(all_turns, budget)
    earlier = list(all_turns[: len(all_turns) - len(tail)])
    if not earlier:
        return CompactPlan(tail, [], budget)
    anchor = max(earlier, key=lambda t: t.tokens)
    typical = sorted(t.tokens for t in all_turns)[len(all_turns) // 2]
    if anchor.tokens < max(ANCHOR_MIN, ANCHOR_FACTOR * typical):
        return CompactPlan(tail, earlier, budget)
    wide = size * 3 // 4
    if anchor.tokens > wide:
        return CompactPlan(tail, earlier, budget, unfit=anchor)
    at = all_turns.index(anchor)
    before = list(all_turns[:at])
    if sum(t.tokens for t in before) * ANCHOR_FACTOR > anchor.tokens:
        before = []  # too much to carry for the cache's sake
    head = [*before, anchor]
    room = wide - sum(t.tokens for t in head)
    kept = [*head, *carried(all_turns[at + 1:], room)] if room >= 0 else [anchor, *carried(all_turns[at + 1:],
                                                                                       wide - anchor.tokens)]
    return CompactPlan(kept, [t for t in all_turns if t not in kept], wide, anchor=anchor)


def _numbers(turns_: Sequence[Exchange]) -> str:
    """`turn 3`, `turns 2-4`, `turns 1, 3-5`."""
    spans: list[list[int]] = []
    for n in sorted(t.number for t in turns_):
        if spans and n == spans[-1][-1] + 1:
            spans[-1].append(n)
        else:
            spans.append([n])
    words = ", ".join(f"{s[0]}-{s[-1]}" if len(s) > 1 else f"{s[0]}" for s in spans)
    return f"turn{'s' if len(turns_) > 1 else ''} {words}"


def _quote(text: str) -> str:
    flat = " ".join(text.split())
    return repr(flat if len(flat) <= 40 else flat[:39] + "…")


def describe(p: CompactPlan, size: int, system: bool) -> list[str]:
    """What /compact will carry and leave out, said before it creates anything."""
    parts = ["the system prompt"] if system else []
    if p.anchor is not None:
        parts.append(f"{_numbers([p.anchor])} (your {p.anchor.tokens}-token message {_quote(p.anchor.question)} "
                     "and its answer: by far the largest turn, likely what the others are about)")
    before = [t for t in p.kept if p.anchor is not None and t.number < p.anchor.number]
    if before:
        parts.append(f"{_numbers(before)} before it ({sum(t.tokens for t in before)} tokens: the new session "
                     "begins as this one did, so its cache is reused, not read again)")
    rest = [t for t in p.kept if t is not p.anchor and t not in before]
    if rest:
        parts.append(f"the last {len(rest)} turn{'' if len(rest) == 1 else 's'} ({_numbers(rest)}, "
                     f"{sum(t.tokens for t in rest)} tokens)")
    lines = [f"/compact: the new session will carry {' and '.join(parts) if parts else 'nothing of this one'}"
             + (f"; it leaves out {_numbers(p.left_out)} ({sum(t.tokens for t in p.left_out)} tokens)"
                if p.left_out else "")]
    if p.unfit is not None:
        lines.append(f"it cannot carry {_numbers([p.unfit])}, your {p.unfit.tokens}-token message "
                     f"{_quote(p.unfit.question)}: carried turns may take at most {size * 3 // 4} tokens "
                     f"(three quarters of the {size}-token context); paste again the part of it you need")
    return lines


def carried_messages(kept: Sequence[Exchange]) -> list[dict[str, str]]:
    """The carried turns as session.create's `messages` (the most recent, as many as kvd takes)."""
    kept = kept[len(kept) - protocol.MAX_CARRIED // 2:] if len(kept) > protocol.MAX_CARRIED // 2 else kept
    return [m for turn in kept for m in ({"role": "user", "content": turn.question},
                                          {"role": "assistant", "content": turn.answer})]


def run(chat: ChatView) -> None:
    got = chat.request(protocol.SESSION_GET, session=chat.session_id)
    old, messages = got["session"], got.get("messages") or []
    title = str(old.get("title") or protocol.DEFAULT_TITLE)
    size = window(messages)
    measured = turns(messages)
    chosen = plan(measured, size) if size else CompactPlan([], measured, 0)
    kept = chosen.kept
    for line in describe(chosen, size or 0, bool(old.get("system"))):
        render.print_note(chat.console, line)
    try:
        answer = chat.input.ask("go on? [Y/n] ").strip().lower()
    except EOFError:
        answer = "n"
    if answer not in ("", "y", "yes"):
        render.print_note(chat.console, "not compacted; the session is as it was")
        return
    session, kept, chosen = _create(chat, old, title, chosen)
    if old.get("params"):
        chat.request(protocol.SESSION_UPDATE, session=session["id"], params=old["params"])
    made = chat.request(protocol.SESSION_GET, session=session["id"])
    chat.adopt(made["session"], messages=made.get("messages") or [])
    tokens = sum(t.tokens for t in kept)
    n = len(kept)
    if chosen.anchor is not None:
        limit = f"at most three quarters of the {size}-token context"
    else:
        limit = f"at most half the {size}-token context" if size else "the context size is not known yet"
    what = "the system prompt and " if old.get("system") else ""
    which = f"{n} turn{'' if n == 1 else 's'}" if chosen.anchor is not None else \
        f"the last {n} turn{'' if n == 1 else 's'}"
    render.print_note(chat.console, f"this new session carries {what}{which} ({tokens} tokens; {limit}) as its "
                      f"first messages; {title!r} is kept (/switch to it)")


def compacted_title(title: str) -> str:
    """"<title> (compacted)", once: a compacted session compacted again keeps its title."""
    return title if title.endswith(TITLE_SUFFIX) else title[: MAX_TITLE - len(TITLE_SUFFIX)] + TITLE_SUFFIX


_TOO_LONG = re.compile(r"'messages\[(\d+)\]\.content' is longer than")


def _create(chat: ChatView, old: Mapping[str, Any], title: str,
            chosen: CompactPlan) -> tuple[dict[str, Any], list[Exchange], CompactPlan]:
    """The new session, carrying `chosen.kept` (less any turn longer than kvd takes as one message)."""
    kept = chosen.kept
    while True:
        fields = {"title": compacted_title(title), "system": old.get("system"),
                  "messages": carried_messages(kept)}
        try:
            session = chat.request(protocol.SESSION_CREATE, origin=compacted_origin(str(old.get("id", ""))),
                                   **{k: v for k, v in fields.items() if v})["session"]
            return session, kept, chosen
        except ServerError as exc:
            too_long = _TOO_LONG.search(exc.message) if exc.code == protocol.TOO_LARGE else None
            if too_long is None:
                raise
            turn = kept[int(too_long[1]) // 2]  # an answer longer than a message may be (a large max_tokens)
            render.print_note(chat.console, f"{_numbers([turn])} is longer than kvd takes as one message; the new "
                              "session cannot carry it" + (": paste again the part of it you need"
                                                            if turn is chosen.anchor else ""))
            if turn is chosen.anchor:
                chosen = CompactPlan(chosen.kept, chosen.left_out, chosen.budget)
            kept = [t for t in kept if t is not turn]
