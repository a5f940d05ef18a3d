"""Rolling backups of the transcript: `VACUUM INTO` at clean shutdown, once a day, and after new messages.

The transcript is the one thing kvd cannot rebuild, and a deleted or damaged
kvd.sqlite-wal takes its last commits with it. `VACUUM INTO` writes a
consistent, compact copy through a connection of its own, so it can run on a
worker thread while the daemon keeps writing (WAL: a reader blocks nobody).
Written to a temp name, then renamed: a crash never leaves a half backup
under a backup's name. One backup per UTC day (a new one replaces the day's
earlier one), the newest BACKUPS_KEPT days kept: many restarts in one day
cannot push out yesterday's copy. While kvd runs it also backs up once the
transcript holds AFTER_MESSAGES more messages than the newest backup, so a
daemon that is only ever killed (never stopped cleanly) still has recent
backups.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from pathlib import Path

from common import durable
from sessions.commits import mark_backup

log = logging.getLogger("kvd")

BACKUPS_KEPT = 3
BACKUP_EVERY = 24 * 3600.0
AFTER_MESSAGES = 40  # about 20 turns
PREFIX = "kvd-"
SUFFIX = ".sqlite"


def backups(directory: Path) -> list[Path]:
    """Backups, oldest first (names sort by time)."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.name.startswith(PREFIX) and p.name.endswith(SUFFIX))


def newest_backup(directory: Path) -> Path | None:
    found = backups(directory)
    return found[-1] if found else None


def back_up(db_path: Path, directory: Path, *, now: float | None = None) -> Path:
    """Write one backup of the database at `db_path`, drop the oldest beyond BACKUPS_KEPT; return its path."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))
    path = directory / f"{PREFIX}{stamp}{SUFFIX}"
    tmp = directory / f".{path.name}.tmp"
    tmp.unlink(missing_ok=True)
    db = sqlite3.connect(db_path)
    try:
        db.execute("PRAGMA busy_timeout = 5000")
        db.execute("VACUUM INTO ?", [str(tmp)])
        _mark(tmp)
        durable.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        db.close()
    day = path.name[: len(PREFIX) + 8]
    for old in backups(directory):
        if old != path and old.name.startswith(day):
            old.unlink(missing_ok=True)
    for old in backups(directory)[:-BACKUPS_KEPT]:
        old.unlink(missing_ok=True)
    return path


def _mark(copy: Path) -> None:
    """The copy says it is a backup: put back and served, it counts its commits afresh (sessions/commits.py),
    never read as the live database's loss."""
    conn = sqlite3.connect(copy)
    try:
        conn.execute("PRAGMA journal_mode = DELETE")  # the change in the file itself, no -wal beside it
        mark_backup(conn)
    finally:
        conn.close()


def due(directory: Path, *, now: float | None = None) -> bool:
    """Whether a day has passed since the newest backup (or there is none)."""
    newest = newest_backup(directory)
    if newest is None:
        return True
    return (time.time() if now is None else now) - newest.stat().st_mtime >= BACKUP_EVERY


def held(path: Path) -> tuple[int, int] | None:
    """(sessions, messages) in a transcript database, read only; None if it cannot be read."""
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            return (int(db.execute("SELECT COUNT(*) FROM sessions").fetchone()[0]),
                    int(db.execute("SELECT COUNT(*) FROM messages").fetchone()[0]))
        finally:
            db.close()
    except sqlite3.Error:
        return None


def wanted(messages: int, directory: Path, *, now: float | None = None) -> str | None:
    """Why a backup is due now ("daily", "after N new messages"), or None.

    `messages`: how many the transcript holds now, compared with the newest backup's.
    """
    if due(directory, now=now):
        return "daily"
    newest = newest_backup(directory)
    before = held(newest) if newest is not None else None
    if before is None or messages - before[1] >= AFTER_MESSAGES:
        return f"after {messages - (before[1] if before else 0)} new messages"
    return None
