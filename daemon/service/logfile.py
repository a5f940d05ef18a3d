"""kvd's log: to stderr and to a rotated file under the data directory; `kvd logs` reads it.

A daemon left running (detached, or under systemd/launchd) has no terminal,
so the file is where its story is told. Rotation by size keeps it bounded:
at most (1 + LOG_BACKUPS) x LOG_MAX_BYTES on disk.
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


def setup_logging(*, verbose: bool, log_file: Path | None, stderr: bool = True) -> None:
    """Log to stderr (as `kvd: ...`) and, with a path, to a rotated file with timestamps."""
    root = logging.getLogger()
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    for h in list(root.handlers):
        root.removeHandler(h)
    if stderr:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter(FORMAT))
        root.addHandler(h)
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fh = logging.handlers.RotatingFileHandler(log_file, maxBytes=LOG_MAX_BYTES,
                                                  backupCount=LOG_BACKUPS, encoding="utf-8")
        fh.setFormatter(logging.Formatter(FILE_FORMAT))
        root.addHandler(fh)
        os.chmod(log_file, 0o600)


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
