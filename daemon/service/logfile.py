"""kvd's log: to stderr and to a rotated file under the data directory; `kvd logs` reads it.

A daemon left running (detached, or under systemd/launchd) has no terminal,
so the file is where its story is told. Rotation by size keeps it bounded:
at most (1 + LOG_BACKUPS) x LOG_MAX_BYTES on disk.

A file that cannot be written (a full disk, a read-only or vanished
directory) is said once on stderr, in one line, and its records are dropped
from the file (those it can still write are kept); stderr keeps every line. Left to
`logging`, each record printed a `--- Logging error ---` block with its
traceback: a full disk, whose writer logs as it fails, flooded stderr.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys
import time
from collections import deque
from pathlib import Path
from typing import TextIO

LOG_MAX_BYTES = 5 << 20
LOG_BACKUPS = 3
FORMAT = "kvd: %(message)s"
FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: A record's `extra` key that keeps it off stderr: the details (a traceback) the file keeps where the
#: terminal has the one line that says what happened and what to do (a model that fails at start).
FILE_ONLY = "kvd_file_only"


class _NotFileOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, FILE_ONLY, False)


def setup_logging(*, verbose: bool, log_file: Path | None, stderr: bool = True) -> None:
    """Log to stderr (as `kvd: ...`) and, with a path, to a rotated file with timestamps."""
    root = logging.getLogger()
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    for h in list(root.handlers):
        root.removeHandler(h)
    if stderr:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter(FORMAT))
        h.addFilter(_NotFileOnly())
        root.addHandler(h)
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fh = LogFile(log_file, maxBytes=LOG_MAX_BYTES, backupCount=LOG_BACKUPS, encoding="utf-8")
        fh.setFormatter(logging.Formatter(FILE_FORMAT))
        root.addHandler(fh)
        os.chmod(log_file, 0o600)


class LogFile(logging.handlers.RotatingFileHandler):
    """The rotated log file; a write that fails is one line on stderr, once (the module docstring)."""

    said = False  # the failure was said on stderr

    def handleError(self, record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, OSError):
            self._say(error)
        else:
            super().handleError(record)  # a record that cannot be formatted: logging's own report

    def flush(self) -> None:
        try:
            super().flush()
        except OSError as e:
            self._say(e)

    def close(self) -> None:
        try:
            super().close()
        except OSError as e:  # the last buffered lines could not be written
            self._say(e)

    def _say(self, error: OSError) -> None:
        if self.said:
            return
        self.said = True
        try:
            sys.stderr.write(f"kvd: the log file {self.baseFilename} is not being written ({error}); "
                             "kvd's lines go to stderr only\n")
            sys.stderr.flush()
        except (OSError, ValueError):  # no stderr either: nowhere left to say it
            pass


def tail(path: Path, lines: int) -> list[str]:
    """The last `lines` lines of the file (whole lines, newlines kept)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return list(deque(f, maxlen=lines)) if lines > 0 else []


def follow(path: Path, out: TextIO, *, lines: int, poll: float = 0.25) -> None:
    """Print the last `lines` lines, then lines as they are appended, across rotations, until interrupted.

    The tail and the follow read through one file object, so no line
    appended between them is lost. A rotation renames the file and starts a
    new one at the same path: seen as a different inode (or a shorter file),
    and then the new one is read from its start.
    """
    f = open(path, encoding="utf-8", errors="replace")
    try:
        out.writelines(deque(f, maxlen=max(lines, 0)))  # reads to the end: the follow starts there
        out.flush()
        ino = os.fstat(f.fileno()).st_ino
        while True:
            line = f.readline()
            if line:
                out.write(line)
                out.flush()
                continue
            time.sleep(poll)  # a terminal command polling a file, not a test waiting
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            if st.st_ino != ino or st.st_size < f.tell():
                f.close()
                f = open(path, encoding="utf-8", errors="replace")
                ino = os.fstat(f.fileno()).st_ino
    finally:
        f.close()
