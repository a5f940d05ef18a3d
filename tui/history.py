"""What the user typed, kept across runs in a history file (mode 0600).

One message is one entry, however many lines it has (Up brings a whole
paste back), written as a JSON string on a line of its own; a line that is
not JSON is read as it stands (the plain lines of readline's file, which
kvchat wrote before it edited with prompt_toolkit). Each message sent is
added, typed or piped (terminal.py lets prompt_toolkit read and add through
this class); answers to questions such as "delete? [y/N]" never are. The file can
hold private text, hence 0600, set before anything is written to it.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

HISTORY_FILE = "kvchat_history"
HISTORY_LENGTH = 1000


class History:
    def __init__(self, path: Path | None, *, length: int = HISTORY_LENGTH) -> None:
        self.path = path
        self.length = length
        self.entries: list[str] = []  # oldest first

    def read(self) -> None:
        """Start from the file's entries; a history that cannot be read is an empty one."""
        if self.path is None:
            return
        with contextlib.suppress(OSError, UnicodeDecodeError):
            self.entries = [_entry(line) for line in self.path.read_text(encoding="utf-8").splitlines()
                            if line.strip()][-self.length:]

    def add(self, message: str) -> None:
        """Keep a message sent (blank ones and repeats are not kept)."""
        if message.strip() and (not self.entries or self.entries[-1] != message):
            self.entries.append(message)

    def save(self) -> None:
        """Write the last `length` entries; a history that cannot be written is not worth a crash."""
        if self.path is None:
            return
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(e, ensure_ascii=False) + "\n" for e in self.entries[-self.length:])


def _entry(line: str) -> str:
    if line.startswith('"'):
        with contextlib.suppress(ValueError):
            decoded = json.loads(line)
            if isinstance(decoded, str):
                return decoded
    return line
