"""What the user typed, kept across runs in a readline history file (mode 0600).

kvchat adds lines itself (readline's automatic history is off): so answers to
questions such as "delete? [y/N]" stay out of it, and piped input is kept the
same way as typed input. Each line of a multi-line message is one entry, as
readline would keep it. The file can hold private text, hence 0600, set before
anything is written to it.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from types import ModuleType

HISTORY_FILE = "kvchat_history"
HISTORY_LENGTH = 1000


def _readline() -> ModuleType | None:
    try:
        import readline
    except ImportError:  # not every Python has it; kvchat works without history then
        return None
    return readline


class History:
    def __init__(self, path: Path | None, *, length: int = HISTORY_LENGTH) -> None:
        self.path = path
        self.length = length
        self._readline = _readline()
        self._last: str | None = None

    def load(self) -> None:
        """Start from the file's lines only (not whatever this process typed before)."""
        rl = self._readline
        if rl is None:
            return
        rl.clear_history()
        rl.set_auto_history(False)
        rl.set_history_length(self.length)
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError, OSError):
                rl.read_history_file(str(self.path))
        n = rl.get_current_history_length()
        self._last = rl.get_history_item(n) if n else None

    def add(self, line: str) -> None:
        if self._readline is None or not line.strip() or line == self._last:
            return
        self._readline.add_history(line)
        self._last = line

    def save(self) -> None:
        """Write the last `length` lines; a history that cannot be written is not worth a crash."""
        if self._readline is None or self.path is None:
            return
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600))
            os.chmod(self.path, 0o600)
            self._readline.write_history_file(str(self.path))
