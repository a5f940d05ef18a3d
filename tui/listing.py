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
TITLE_CHARS = 50  # of a chat's first message, as its title
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


def compacted_origin(source: str) -> str:
    """The origin a /compact gives the session it makes: kvchat's, naming the session it went on from."""
    return f"{ORIGIN} (compacted from {source})"


def compacted_from(session: Mapping[str, Any]) -> str | None:
    """The id of the session a /compact started this one from: its origin names it (before the carried
    turns became messages, a header in its system prompt did)."""
    m = _COMPACTED_ORIGIN.fullmatch(str(session.get("origin") or "")) or _COMPACTED_FROM.search(
        str(session.get("system") or ""))
    return m[1] if m else None


def rows(sessions: Sequence[Mapping[str, Any]], *, everything: bool = False,
         one_shots: bool = False) -> list[dict[str, Any]]:
    """The rows of the sessions table, most recently used first: what its numbers count.

    An API conversation's branches (a retry, an edited message: each a session of its own, `branch_of`
    naming the conversation's first) are one row: its most recently used session, under the
    conversation's title, with `members` (every session of it, newest first). One-shots are left out
    unless `one_shots`. With `everything`, every session is a row of its own, one-shots included.
    """
    titles = {s.get("id"): s.get("title") for s in sessions}
    out: list[dict[str, Any]] = []
    groups: dict[Any, dict[str, Any]] = {}
    for s in sessions:
        if not (everything or one_shots) and origins.kind(s.get("origin")) == "one-shot":
            continue
        key = s.get("id") if everything else s.get("branch_of") or s.get("id")
        if key in groups:
            groups[key]["members"].append(s.get("id"))
            continue
        row = {**s, "title": titles.get(key) or s.get("title"), "members": [s.get("id")]}
        groups[key] = row
        out.append(row)
    return out


def hidden_one_shots(sessions: Sequence[Mapping[str, Any]]) -> int:
    return sum(origins.kind(s.get("origin")) == "one-shot" for s in sessions)


def _title_cell(s: Mapping[str, Any], numbers: Mapping[str, int], width: int = 200) -> Text:
    """The title, then what tells it from a look-alike: which listed session it was compacted from, how many
    branches of an API conversation the row stands for. In `width` cells: the title is cut, not those."""
    marks = Text()
    source = compacted_from(s)
    if source is not None:
        marks.append(f" ← #{numbers[source]}" if source in numbers else f" ← {source[:8]}", style="dim")
    branches = len(s.get("members") or ()) - 1
    whole = one_line(str(s.get("title") or protocol.DEFAULT_TITLE), width)
    if branches > 0:
        said = f" (+{branches} branch{'' if branches == 1 else 'es'})"
        # A narrow terminal: the title first (a short title with room for both keeps both whole).
        short = len(whole) + marks.cell_len + len(said) > width and width - marks.cell_len - len(said) < TITLE_MIN
        marks.append(f" (+{branches})" if short else said, style="dim")
    title = Text(one_line(str(s.get("title") or protocol.DEFAULT_TITLE), max(width - marks.cell_len, 8)))
    return title.append_text(marks)


# The table's columns after the number and the title, the first left out first when the terminal is
# narrow: the number a user is asked to type, and the title, are never left out, and no count is cut.
OPTIONAL = ("last message", "cache", "from", "last used", "msgs", "tokens")
TITLE_MIN = 20  # cells the title keeps before columns are left out


def sessions_table(sessions: Sequence[Mapping[str, Any]], *, width: int, current: str | None = None,
                   now: float | None = None) -> Table:
    """Numbered rows, most recently used first; the number is what /switch and /delete take.

    The title gets the terminal's width first (up to its whole length), the last message what is left:
    four sessions that start "What is the capital of" must read as four different ones. A narrow
    terminal leaves out whole columns (OPTIONAL's order) rather than squeezing any: a count cut to
    `5…` or a missing number is worse than no column.
    """
    now = time.time() if now is None else now
    shown = sessions[:SHOWN]
    numbers = {str(s.get("id")): n for n, s in enumerate(shown, 1)}
    cells: list[dict[str, Any]] = []
    for n, s in enumerate(shown, 1):
        updated, count = s.get("updated_at"), s.get("message_count")
        current_here = current is not None and current in (s.get("members") or [s.get("id")])
        cells.append({
            "#": f"{n}{'*' if current_here else ''}",
            "title": _title_cell(s, numbers),
            "last message": Text(one_line(s.get("last_message")) or "—", style="dim"),
            "msgs": str(count) if isinstance(count, int) else "?",
            "tokens": str(s.get("tokens", 0)),
            "cache": str(s.get("cache", protocol.NO_CACHE)),
            "from": origin_label(s.get("origin")),
            "last used": relative_time(float(updated), now) if isinstance(updated, (int, float)) else "?",
        })

    def widest(name: str) -> int:
        return max([len(name), *(Text(c[name]).cell_len if isinstance(c[name], str) else c[name].cell_len
                                 for c in cells)])

    columns = ["#", "title", "msgs", "tokens", "cache", "from", "last used"]  # the last message goes after the title
    with_last = True

    def room() -> int:  # cells left for the title (and the last message), 2 between each pair of columns
        fixed = [widest(c) for c in columns if c not in ("title",)]
        return width - sum(fixed) - 2 * (len(columns) - 1 + with_last)

    for name in OPTIONAL:  # drop columns, least needed first, until the title has its room
        if room() >= (NARROW if with_last else TITLE_MIN):
            break
        if name == "last message":
            with_last = False
        else:
            columns.remove(name)
    left = max(room(), 8)
    table = Table(box=None, padding=(0, 1), pad_edge=False, show_edge=False, header_style="bold")
    title_width = left
    if with_last:
        longest = widest("title")
        title_width = max(min(longest, left - LAST_MESSAGE_MIN), min(longest, left // 2), 8)
    for name in columns:
        if name == "title":
            table.add_column("title", no_wrap=True, overflow="ellipsis", width=title_width)
            if with_last:
                table.add_column("last message", no_wrap=True, overflow="ellipsis", width=max(left - title_width, 8))
        else:
            table.add_column(name, justify="right" if name in ("#", "msgs", "tokens") else "left", no_wrap=True,
                             width=widest(name))
    for s, c in zip(shown, cells):
        title = _title_cell(s, numbers, title_width)
        table.add_row(c["#"], title, *([c["last message"]] if with_last else []), *[c[name] for name in columns[2:]])
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
_COMPACTED_ORIGIN = re.compile(re.escape(ORIGIN) + r" \(compacted from (" + protocol.SESSION_ID_RE.pattern + r")\)")
_COMPACTED_FROM = re.compile(r"carried over from the session .*?, (" + protocol.SESSION_ID_RE.pattern + r")\)")


def _folded_title(session: Mapping[str, Any]) -> str:
    """A session's title as the table shows it, case-folded for matching what the user typed."""
    return one_line(str(session.get("title") or protocol.DEFAULT_TITLE), 200).casefold()
