"""A session as a Markdown file: /export.

Answers are Markdown already and stay as they are; the file is written next to
itself, fsynced and renamed into place (protocol.durable), so an export that
fails leaves no half file.
Control characters are dropped: the file should be safe to `cat`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import protocol
from common import durable

from .render import calls_text
from .sanitize import sanitize

SLUG_CHARS = 40


def slug(title: str) -> str:
    words = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")
    return words[:SLUG_CHARS].rstrip("-") or "chat"


def default_path(session: Mapping[str, Any]) -> Path:
    """``./<title-slug>-<first 8 of the id>.md``: exporting again updates the same file."""
    return Path(f"{slug(str(session.get('title') or ''))}-{str(session.get('id', ''))[:8]}.md")


def to_markdown(session: Mapping[str, Any], messages: Sequence[Mapping[str, Any]], *, now: float | None = None) -> str:
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(time.time() if now is None else now))
    out = [f"# {sanitize(str(session.get('title') or protocol.DEFAULT_TITLE))}", "",
           f"kvd session `{sanitize(str(session.get('id', '')))}`, exported {when}", ""]
    system = session.get("system")
    if system:
        out += ["**System prompt:**", ""]
        out += [f"> {line}" if line else ">" for line in sanitize(str(system)).split("\n")]
        out.append("")
    for message in messages:
        who = {"user": "You", "tool": "Tool result"}.get(str(message.get("role")), "kvd")
        status = message.get("status", "complete")
        out += [f"## {who}" + ("" if status == "complete" else f" ({sanitize(str(status))})"), ""]
        content = sanitize(str(message.get("content", ""))).strip("\n")
        calls = calls_text(message.get("tool_calls"))
        if content or not calls:
            out += [content, ""]
        if calls:
            out += [*(f"- {line}" for line in calls), ""]
    return "\n".join(out).rstrip("\n") + "\n"


def write_atomic(path: Path, text: str) -> None:
    """Write the export as an ordinary new file would be (the umask decides its mode)."""
    durable.write_atomic(path.expanduser(), text)
