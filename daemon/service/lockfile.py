"""One daemon per data directory: an exclusive lock held for the daemon's life.

`flock` on `<data_dir>/kvd.lock`, not a pid file: the kernel drops the lock
when the process dies in any way (kill -9 included), so a stale file never
keeps a new daemon out, and two daemons can never both hold it. The file's
content (the holder's pid) is only for messages; the lock is the truth.
`flock` rather than `fcntl` record locks, because closing *any* descriptor
of the file drops a record lock, and SQLite or a status check could do that.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_FILE = "kvd.lock"


class AlreadyRunning(Exception):
    """Another process holds the data directory's lock."""

    def __init__(self, pid: int | None):
        super().__init__(f"kvd is already running (pid {pid if pid is not None else '?'})")
        self.pid = pid


class DataDirLock:
    """The exclusive lock on a data directory; `release()` (or process exit) frees it."""

    def __init__(self, data_dir: Path):
        self.path = data_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise AlreadyRunning with the holder's pid; never waits."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise AlreadyRunning(holder_pid(self.path.parent)) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None


def is_locked(data_dir: Path) -> bool:
    """Whether some process holds the data directory's lock right now."""
    try:
        fd = os.open(data_dir / LOCK_FILE, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also drops the shared lock, if it was taken
    return False


def holder_pid(data_dir: Path) -> int | None:
    """The pid the lock's holder wrote, if readable."""
    try:
        return int((data_dir / LOCK_FILE).read_text().strip())
    except (OSError, ValueError):
        return None
