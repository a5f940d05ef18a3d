"""Writing a file that survives ``kill -9`` and a power cut: the one copy of the order.

Temp file beside the destination, written, fsynced, renamed over the
destination, then the directory fsynced. A crash at any point leaves the old
file or the new one at ``path`` (never half of one), plus at worst a hidden
``.<name>.<random>.tmp`` beside it. The rename is what makes it atomic; the
two fsyncs make it durable: without the first, a power cut can leave the new
name on empty blocks, without the second, the rename itself can be lost.

Every kvd package writes files this way (the daemon's token and
``daemon.json``, cache segment files, kvchat's exports), and ``cachestore``
and ``tui`` may import nothing but this leaf package, so it lives here.
Standard library only.
"""

from __future__ import annotations

import fcntl
import io
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["TEMP_SUFFIX", "fsync_dir", "fsync_file", "replace", "replacing", "temp_path", "write_atomic"]

#: Temp files end so, and start with a dot: easy to sweep, hidden from listings.
TEMP_SUFFIX = ".tmp"


def fsync_file(fd: int) -> None:
    """Flush a file's data to the disk itself."""
    # On macOS fsync() stops at the drive's cache; F_FULLFSYNC reaches the platter.
    full = getattr(fcntl, "F_FULLFSYNC", None)
    if full is not None:
        try:
            fcntl.fcntl(fd, full)
            return
        except OSError:
            pass
    os.fsync(fd)


def fsync_dir(directory: Path | str) -> None:
    """Make the names in ``directory`` (a rename, a new file) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_path(path: Path) -> Path:
    """A fresh hidden name beside ``path``: same directory, so the rename is atomic."""
    return path.with_name(f".{path.name}.{secrets.token_hex(4)}{TEMP_SUFFIX}")


def replace(tmp: Path, path: Path) -> None:
    """Make a finished temp file (written by someone else: SQLite, MLX) the file at ``path``."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        fsync_file(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


@contextmanager
def replacing(path: Path, *, mode: int = 0o666) -> Iterator[io.BufferedRandom]:
    """A new temp file to write ``path``'s contents to; it becomes ``path`` when the block ends.

    When the block ends cleanly the file is flushed, fsynced and renamed over
    ``path``, and the directory fsynced. If the block raises, the temp file
    is removed and ``path`` is untouched. ``mode`` is masked by the umask, as
    for any new file (``0o600``: owner-only whatever the umask). The file is
    opened for reading too, so a writer can read back what it wrote.
    """
    path = Path(path)
    tmp = temp_path(path)
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), mode)
    try:
        with os.fdopen(fd, "w+b") as f:
            yield f
            f.flush()
            fsync_file(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_atomic(path: Path, data: bytes | str, *, mode: int = 0o666) -> None:
    """Replace the file at ``path`` with ``data`` (str as UTF-8), atomically and durably."""
    with replacing(path, mode=mode) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
