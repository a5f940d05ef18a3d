"""How many fsynced commits kvd made to its transcript, counted inside it and noted beside it.

A deleted or damaged kvd.sqlite-wal takes the commits made since the last
checkpoint with it, silently: SQLite opens what is left. kvd used to infer
such a loss from the KV caches (a cache fed more than its transcript says),
but a cache legitimately runs past its transcript: the part of a prompt read
before its turn was cancelled, an answer a regenerate or an edit cut from the
transcript before the next turn rewound its cache, a crash mid-answer. Those
false alarms turned backups off.

So the loss is counted instead. The writer (writer.py) adds one to
`commit_count.commits` in every batch it commits with an fsync, in the same
transaction, and once that commit is back writes the number to a small file
beside the database (`noted`, `<db>.commits`, no fsync of its own). The file
can only ever trail the database (a kill -9 or a power cut between the two
loses the note, never the commit), so a start that finds the note ahead of
the database knows it lost that many acknowledged commits, and nothing else
makes it so. The database's random id (`commit_count.database`) says which
database the note is about: a backup is written with an id of its own
(daemon/service/backup.py), so one put back, or a new database, is not read
as a loss. A loss found is kept in the note (`lost`, `found`) and said at
every start until a backup is restored or the note is removed.
"""

from __future__ import annotations

import os
import sqlite3
import struct
from dataclasses import dataclass, replace
from pathlib import Path

from .store import Store

_RECORD = struct.Struct("<16sqqd")  # the database's id, its commits, commits found lost, when (0: none)


@dataclass(frozen=True)
class CommitNote:
    database: bytes
    commits: int
    lost: int = 0  # commits a start found missing from the database (kept until a backup is put back)
    found: float = 0.0  # when it found them (time.time())


def note_path(db_path: Path) -> Path:
    return db_path.with_name(db_path.name + ".commits")


def counted(store: Store) -> CommitNote:
    """The database's id and its count of fsynced commits."""
    database, commits = store.db.execute("SELECT database, commits FROM commit_count").fetchone()
    return CommitNote(bytes(database), int(commits))


def count_one(store: Store) -> int:
    """One more fsynced commit (in the transaction that commits it); returns the count."""
    with store.db.atomic():  # RETURNING: its row is read inside the transaction
        (commits,) = store.db.execute("UPDATE commit_count SET commits = commits + 1 RETURNING commits").fetchone()
    return int(commits)


def put_back(store: Store) -> bool:
    """If the database is a backup put back (daemon/service/backup.py marks each), it takes an id of its own
    and counts its commits from here, as a database of its own; True if it was one."""
    with store.db.atomic():
        cursor = store.db.execute("UPDATE commit_count SET database = randomblob(16), backup = 0 WHERE backup = 1")
    return cursor.rowcount > 0


def mark_backup(conn: sqlite3.Connection) -> None:
    """On a backup's own connection, before it is renamed into place: it is a backup (see `put_back`)."""
    try:
        conn.execute("UPDATE commit_count SET backup = 1")
    except sqlite3.OperationalError:  # a database from before the count: nothing to mark
        return
    conn.commit()


def read_note(path: Path) -> CommitNote | None:
    """The note, or None when there is none or it cannot be read (then nothing is known)."""
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    if len(raw) != _RECORD.size:
        return None
    database, commits, lost, found = _RECORD.unpack(raw)
    return CommitNote(database, commits, lost, found)


def write_note(path: Path, note: CommitNote, *, sync: bool = False) -> None:
    """Write the note in place (one write of 40 bytes: it never tears); `sync` for a loss found."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.pwrite(fd, _RECORD.pack(note.database, note.commits, note.lost, note.found), 0)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


class Noter:
    """The writer's side: after each fsynced commit, the count in the note (never lowered: a loss a start
    found stays said until it is dealt with)."""

    def __init__(self, path: Path, store: Store) -> None:
        self.path = path
        now = counted(store)
        seen = read_note(path)
        self._note = seen if seen is not None and seen.database == now.database else now

    def committed(self, commits: int) -> None:
        if commits > self._note.commits:
            self._note = replace(self._note, commits=commits)
            try:
                write_note(self.path, self._note)
            except OSError:
                pass  # a note that trails the database only means a loss goes unnoticed
