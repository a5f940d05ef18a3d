"""/copy: an answer (or its last code block) onto the clipboard, through the terminal.

OSC 52 (``ESC ] 52 ; c ; <base64> BEL``) asks the terminal itself to set the
clipboard, so it works over ssh and inside tmux (with ``set-clipboard on``),
where no local clipboard tool could. A terminal cannot say whether it
obeyed, so the text is also written to a private file whose path is shown:
the fallback when the terminal ignores the sequence, or when there is no
terminal at all.
"""

from __future__ import annotations

import base64
import os
from pathlib import Path

from markdown_it import MarkdownIt
from rich.console import Console

from .sanitize import sanitize

_PARSER = MarkdownIt()
# Terminals cap what one OSC 52 may carry (xterm: 100,000 bytes of base64 by default).
MAX_OSC52_BYTES = 74_994  # 100,000 base64 characters


def osc52(text: str) -> str:
    return "\x1b]52;c;" + base64.b64encode(text.encode("utf-8")).decode("ascii") + "\x07"


def code_blocks(markdown: str) -> list[str]:
    """The contents of the answer's code blocks (fenced or indented), in order."""
    return [t.content.rstrip("\n") for t in _PARSER.parse(markdown) if t.type in ("fence", "code_block")]


def sanitize_for_copy(text: str) -> str:
    """The answer as the screen shows it: no escape sequences from the model reach the clipboard."""
    return sanitize(text)


def copy(console: Console, text: str, file: Path, *, what: str) -> str:
    """Send `text` to the clipboard (OSC 52) and keep it in `file`; the sentence saying what happened."""
    size = f"{len(text)} character{'' if len(text) == 1 else 's'}"
    saved = _save(file, text)
    fallback = f"it is also in {file}" if saved is None else f"(and could not write {file}: {saved})"
    if not console.is_terminal:
        if saved is not None:
            return f"no terminal to copy through, and could not write {file}: {saved}"
        return f"no terminal to copy through: {what} ({size}) is in {file}"
    if len(text.encode("utf-8")) > MAX_OSC52_BYTES:
        return f"{what} is too long for the terminal's clipboard ({size}); {fallback}"
    console.file.write(osc52(text))
    console.file.flush()
    return f"copied {what} ({size}) to the clipboard through the terminal (OSC 52); if it did not arrive, {fallback}"


def _save(file: Path, text: str) -> str | None:
    """Write `text` to `file` (mode 0600: it can be anything); None, or why not."""
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text if text.endswith("\n") else text + "\n")
    except OSError as exc:
        return exc.strerror or str(exc)
    return None
