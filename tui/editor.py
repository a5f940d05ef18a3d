"""Compose a message in the user's editor: Ctrl-O at the prompt, or /editor.

$VISUAL, else $EDITOR, else vi, as git and crontab choose. The variable may
carry arguments (``code --wait``), so it runs through the shell with the file
as its last argument. The file is private (mode 0600, it can hold anything
the user types) and removed afterwards. While the editor runs the terminal
echoes and reads lines as usual: kvchat keeps echo off between prompts (see
lineinput.quiet_terminal), and an editor restores what it found.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator

from .errors import KvchatError

try:
    import termios
except ImportError:  # not a POSIX terminal
    termios = None  # type: ignore[assignment]

SUFFIX = ".md"  # answers and questions are Markdown: editors highlight it


def command() -> str:
    return os.environ.get("VISUAL") or os.environ.get("EDITOR") or "vi"


def edit(text: str) -> str:
    """What the user saved in the editor, started on `text` (trailing newlines dropped)."""
    fd, path = tempfile.mkstemp(prefix="kvchat-", suffix=SUFFIX)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text + ("\n" if text and not text.endswith("\n") else ""))
        editor = command()
        with _terminal_for_editor():
            try:
                result = subprocess.run(["sh", "-c", f'{editor} "$1"', "sh", path])
            except OSError as exc:
                raise KvchatError(f"cannot run the editor {editor!r}: {exc}; set $VISUAL or $EDITOR") from exc
        if result.returncode != 0:
            raise KvchatError(f"the editor {editor!r} exited with status {result.returncode}; nothing sent "
                              "(set $VISUAL or $EDITOR to change it)")
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().rstrip("\n")
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


@contextlib.contextmanager
def _terminal_for_editor() -> Iterator[None]:
    fd = sys.stdin.fileno() if sys.stdin is not None and sys.stdin.isatty() else -1
    if termios is None or fd < 0:
        yield
        return
    saved = termios.tcgetattr(fd)
    usual = list(saved)
    usual[3] |= termios.ECHO | termios.ICANON
    termios.tcsetattr(fd, termios.TCSANOW, usual)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, saved)
