"""The sessions table (at start and for /sessions), and finding a session by number or id."""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from rich.table import Table
from rich.text import Text

import protocol
from common import origins

from .sanitize import sanitize

# Who made a session (docs/protocol.md, the session object's `origin`): kvchat says which of its two it is.
ORIGIN = origins.KVCHAT
ONE_SHOT = origins.ONE_SHOT
ORIGINS = origins.KINDS
made_by = origins.made_by
S = TypeVar("S", bound=Mapping[str, Any])


def chats(sessions: Sequence[S]) -> list[S]:
    """The sessions someone typed in with kvchat (not its one-shots), in their order: what --last resumes."""
    return [s for s in sessions if origins.kind(s.get("origin")) == "kvchat"]

SHOWN = 30  # rows in the table; older sessions are reachable by id
PREVIEW_CHARS = 80
LAST_MESSAGE_MIN = 12  # cells the last message keeps when titles are long
NARROW = 30  # cells for title and last message below which the last message is left out
PICK_SHOWN = 10  # sessions a title prefix lists to pick from


def relative_time(then: float, now: float) -> str:
    seconds = max(now - then, 0)
    if seconds < 45:
        return "just now"
    if seconds < 90:
        return "1 min ago"
    if seconds < 3600:
        return f"{round(seconds / 60)} min ago"
    if seconds < 23.5 * 3600:
        return f"{round(seconds / 3600)} h ago"
    if seconds < 2 * 86400:
        return "yesterday"
    if seconds < 30 * 86400:
        return f"{int(seconds // 86400)} days ago"
    return time.strftime("%Y-%m-%d", time.localtime(then))


def one_line(text: str | None, limit: int = PREVIEW_CHARS) -> str:
    flat = " ".join(sanitize(text or "").split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def origin_label(origin: object) -> str:
    """The list's short word for who made a session: kvchat, one-shot, api, ws (another websocket client)."""
    if not isinstance(origin, str) or not origin:
        return ""
    if origin == ONE_SHOT:
        return "one-shot"
    if origin.startswith("api"):
        return "api"
    return "ws" if origin == origins.WEBSOCKET else origin.split()[0][:8]


def compacted_from(session: Mapping[str, Any]) -> str | None:
    """The id of the session a /compact started this one from (its system prompt's header names it)."""
    m = _COMPACTED_FROM.search(str(session.get("system") or ""))
    return m[1] if m else None


def _title_cell(s: Mapping[str, Any], numbers: Mapping[str, int]) -> Text:
    """The whole title, then what tells it from a look-alike: which listed session it was compacted from."""
    title = Text(one_line(str(s.get("title") or protocol.DEFAULT_TITLE), 200))
    source = compacted_from(s)
    if source is not None:
        title.append(f" ← #{numbers[source]}" if source in numbers else f" ← {source[:8]}", style="dim")
    return title


def sessions_table(sessions: Sequence[Mapping[str, Any]], *, width: int, current: str | None = None,
                   now: float | None = None) -> Table:
    """Numbered rows, most recently used first; the number is what /switch and /delete take.

    The title gets the terminal's width first (up to its whole length), the last message what is left:
    four sessions that start "What is the capital of" must read as four different ones.
    """
    now = time.time() if now is None else now
    shown = sessions[:SHOWN]
    numbers = {str(s.get("id")): n for n, s in enumerate(shown, 1)}
    rows = []
    for n, s in enumerate(shown, 1):
        updated = s.get("updated_at")
        count = s.get("message_count")
        rows.append((
            f"{n}{'*' if s.get('id') == current else ''}",
            _title_cell(s, numbers),
            one_line(s.get("last_message")) or "—",
            str(count) if isinstance(count, int) else "?",
            str(s.get("tokens", 0)),
            str(s.get("cache", protocol.NO_CACHE)),
            origin_label(s.get("origin")),
            relative_time(float(updated), now) if isinstance(updated, (int, float)) else "?",
        ))
    table = Table(box=None, padding=(0, 1), pad_edge=False, show_edge=False, header_style="bold")

    def widest(i: int, header: str) -> int:
        return max([len(header), *(len(str(row[i])) for row in rows)])

    # Rich squeezes every no_wrap column alike; the numbers must not be, so widths are set here.
    fixed = [widest(0, "#"), widest(3, "msgs"), widest(4, "tokens"), widest(5, "cache"), widest(6, "from"),
             widest(7, "last used")]
    room = max(width - sum(fixed) - 2 * 7, 16)  # 2 cells between each of the 8 columns
    with_last = room >= NARROW  # a narrow terminal drops the last message: the title tells sessions apart
    if not with_last:
        room += 2
    title_width = max(min(widest(1, "title"), room - LAST_MESSAGE_MIN), min(widest(1, "title"), room // 2), 8)
    table.add_column("#", justify="right", no_wrap=True, width=fixed[0])
    table.add_column("title", no_wrap=True, overflow="ellipsis", width=title_width if with_last else room)
    if with_last:
        table.add_column("last message", no_wrap=True, overflow="ellipsis", width=max(room - title_width, 8))
    table.add_column("msgs", justify="right", no_wrap=True, width=fixed[1])
    table.add_column("tokens", justify="right", no_wrap=True, width=fixed[2])
    table.add_column("cache", no_wrap=True, width=fixed[3])
    table.add_column("from", no_wrap=True, width=fixed[4])
    table.add_column("last used", no_wrap=True, width=fixed[5])
    for number, title, last, count, tokens, cache, origin, used in rows:
        table.add_row(number, title, *([Text(last, style="dim")] if with_last else []), count, tokens, cache,
                      origin, used)
    return table


def find(sessions: Sequence[Mapping[str, Any]], key: str) -> Mapping[str, Any] | str:
    """The session `key` names (a number from the table, an id, an id's unique start, or a title's), or why not."""
    key = key.strip()
    if key.isdigit() and len(key) < 6:
        n = int(key)
        if 1 <= n <= min(len(sessions), SHOWN):
            return sessions[n - 1]
        return f"no session number {n}; /sessions lists them"
    if protocol.SESSION_ID_RE.fullmatch(key):
        for s in sessions:
            if s.get("id") == key:
                return s
        return {"id": key}  # not in the list; the daemon will say if it does not exist
    if len(key) >= 4 and all(c in "0123456789abcdef" for c in key):
        matches = [s for s in sessions if str(s.get("id", "")).startswith(key)]
        if len(matches) == 1:
            return matches[0]
        if matches:
            return f"{key!r} starts {len(matches)} session ids; give more of it"
    # The start of a title, as shown in the table (case and spacing ignored).
    wanted = " ".join(key.casefold().split())
    titled = [s for s in sessions if _folded_title(s).startswith(wanted)]
    exact = [s for s in titled if _folded_title(s) == wanted]
    if len(titled) == 1 or len(exact) == 1:
        return (exact or titled)[0]
    if titled:
        return ambiguous(key, sessions, titled)
    return f"{key!r} is not a session number, id or title; /sessions lists them"


def ambiguous(key: str, sessions: Sequence[Mapping[str, Any]], matches: Sequence[Mapping[str, Any]]) -> str:
    """Several titles start with `key`: list them, numbered as in the table, to pick one by its number."""
    numbers = {str(s.get("id")): n for n, s in enumerate(sessions[:SHOWN], 1)}
    lines = [f"{key!r} starts {len(matches)} titles; type the number of the one you mean:"]
    for s in matches[:PICK_SHOWN]:
        n = numbers.get(str(s.get("id")))
        used = s.get("updated_at")
        when = relative_time(float(used), time.time()) if isinstance(used, (int, float)) else "?"
        count = s.get("message_count")
        lines.append(f"  {n if n is not None else str(s.get('id'))[:8]:>3}  "
                     f"{one_line(str(s.get('title') or protocol.DEFAULT_TITLE), 100)}  "
                     f"({count if isinstance(count, int) else '?'} messages, {when})")
    if len(matches) > PICK_SHOWN:
        lines.append(f"  … and {len(matches) - PICK_SHOWN} more; give more of the title")
    return "\n".join(lines)


def find_many(sessions: Sequence[Mapping[str, Any]], keys: str) -> list[Mapping[str, Any]] | str:
    """The sessions `keys` names: numbers and ranges from the table (``2 5 7-9``, commas allowed),
    ids, or ``empty`` (the listed sessions with no messages); one title otherwise. Or why not."""
    words = keys.replace(",", " ").split()
    if words == ["empty"]:
        empty = [s for s in sessions[:SHOWN] if not s.get("last_message") and not s.get("tokens")]
        return empty or "no listed session is empty"
    if len(words) < 2 and not _RANGE.fullmatch(keys.strip()):
        found = find(sessions, keys)
        return found if isinstance(found, str) else [found]
    if not all(_RANGE.fullmatch(w) or w.isdigit() or protocol.SESSION_ID_RE.fullmatch(w) for w in words):
        found = find(sessions, keys)  # a title with spaces
        return found if isinstance(found, str) else [found]
    out: dict[str, Mapping[str, Any]] = {}
    for word in words:
        if m := _RANGE.fullmatch(word):
            first, last = int(m[1]), int(m[2])
            if first > last:
                return f"{word}: a range goes from the smaller number to the larger"
            if last - first >= SHOWN:
                return f"{word}: the table shows {SHOWN} sessions at most"
            keys_here = [str(n) for n in range(first, last + 1)]
        else:
            keys_here = [word]
        for key in keys_here:
            found = find(sessions, key)
            if isinstance(found, str):
                return found
            out[str(found.get("id"))] = found
    return list(out.values())


_RANGE = re.compile(r"(\d{1,5})-(\d{1,5})")
_COMPACTED_FROM = re.compile(r"carried over from the session .*?, (" + protocol.SESSION_ID_RE.pattern + r")\)")


def _folded_title(session: Mapping[str, Any]) -> str:
    """A session's title as the table shows it, case-folded for matching what the user typed."""
    return one_line(str(session.get("title") or protocol.DEFAULT_TITLE), 200).casefold()
