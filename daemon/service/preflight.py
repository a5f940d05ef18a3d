"""Everything `kvd serve` checks before it listens, each failure one line that says what to do.

A daemon that prints "listening" and then cannot record a single answer is
worse than one that refuses to start, so the data directory is probed for
what kvd needs (ownership, privacy, room to write, a readable token and
database, a usable cache directory) before the port is opened. Each problem
is a StartError whose message is the whole story: what is wrong, which path,
and what the user can do.

Privacy: kvd's files hold private conversations. The process umask is set to
0077 first, so everything kvd or SQLite creates (the database and its -wal and
-shm, the cache index, segment files, model caches, every directory) is
owner-only whatever the user's umask; an existing data directory that others
can read is tightened, with a warning, as the token always was.
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import stat
import time
from pathlib import Path

from cachestore import cached_session_ids, check_usable, disk_ids
from common.diskfull import is_disk_full
from sessions import DamagedFedIds, Store
from sessions.commits import CommitNote, counted, note_path, put_back, read_note, write_note

log = logging.getLogger("kvd")

WHEN_WRONG = "docs/operations.md, 'When something is wrong'"


class StartError(Exception):
    """kvd cannot start; the message is one line for the user, the exit is non-zero."""


def _why(e: OSError) -> str:
    return e.strerror or str(e)


def prepare_data_dir(data_dir: Path) -> None:
    """Owner-only from here on: umask 0077, the directory made or tightened, then probed."""
    os.umask(0o077)
    try:
        data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = data_dir.stat()
    except OSError as e:
        raise StartError(f"cannot create the data directory {data_dir}: {_why(e)}; "
                         "pick another with --data-dir") from None
    if not stat.S_ISDIR(st.st_mode):
        raise StartError(f"the data directory {data_dir} is not a directory; pick another with --data-dir")
    if st.st_uid != os.getuid():
        raise StartError(f"the data directory {data_dir} belongs to uid {st.st_uid}, not to you "
                         f"(uid {os.getuid()}); kvd keeps private conversations there, so it must "
                         "be yours: chown it or pick another with --data-dir")
    if st.st_mode & 0o077:
        log.warning("the data directory %s was readable by others (mode %04o); "
                    "kvd made it and everything in it owner-only", data_dir, stat.S_IMODE(st.st_mode))
        tighten(data_dir)
    probe_writable(data_dir, "the data directory")


def tighten(root: Path) -> None:
    """Remove group and other permissions from `root` and everything under it (no symlinks followed)."""
    for path in [root, *root.rglob("*")]:
        try:
            st = path.lstat()
            if not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o077:
                path.chmod(stat.S_IMODE(st.st_mode) & 0o700)
        except OSError as e:
            raise StartError(f"cannot make {path} owner-only: {_why(e)}; fix its owner or "
                             "permissions (kvd must own its data directory)") from None


def probe_writable(directory: Path, what: str) -> None:
    """Write, fsync and remove a small file: a read-only or full disk fails here, not mid-answer."""
    probe = directory / f".kvd-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"\0" * 4096)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        probe.unlink(missing_ok=True)
        if is_disk_full(e):
            raise StartError(disk_full_line(directory)) from None
        if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise StartError(f"{what} {directory} is read-only ({_why(e)}); kvd must write its "
                             "transcripts and caches there: fix its permissions or pick another "
                             "with --data-dir") from None
        raise StartError(f"cannot write in {what} {directory}: {_why(e)}") from None
    probe.unlink(missing_ok=True)


def disk_full_line(directory: Path) -> str:
    cache = _du(directory / "cache") if (directory / "cache").is_dir() else 0
    hint = (f"; {cache / 2**20:.0f} MiB of that are KV caches in {directory / 'cache'}, which "
            "kvd rebuilds from the transcripts, so deleting that directory is safe" if cache else "")
    return (f"no space left on the disk holding {directory}: kvd could not record a single answer, "
            f"so it does not start. Free some space{hint}")


def _du(root: Path) -> int:
    total = 0
    for p in root.rglob("*"):
        try:
            if p.is_file():
                total += p.stat().st_size
        except OSError:
            pass
    return total


def check_readable(path: Path, what: str) -> None:
    """Open an existing file for reading and writing, as SQLite will; a refusal says which file."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return
    except OSError as e:
        raise StartError(f"cannot open {what} {path}: {_why(e)}; kvd must own everything in its "
                         f"data directory (chown -R $USER {path.parent})") from None
    os.close(fd)


def open_store(db_path: Path, backups: Path) -> Store:
    """The transcript store, checked with SQLite's quick_check; damage is a StartError."""
    for suffix, what in (("", "the transcript database"), ("-wal", "the transcript's write-ahead log"),
                         ("-shm", "the transcript's shared-memory file")):
        check_readable(db_path.with_name(db_path.name + suffix), what)
    restore = restore_hint(db_path, backups)
    try:
        store = Store(db_path)
    except sqlite3.DatabaseError as e:
        if is_disk_full(e):
            raise StartError(disk_full_line(db_path.parent)) from None
        raise StartError(f"{db_path} is not a kvd database or is damaged ({e}); {restore}") from None
    if damage := store.damage():
        store.close()
        found = " ".join(" ".join(damage).split())[:200]  # one line, whatever SQLite reports
        raise StartError(f"{db_path} is damaged (SQLite quick_check: {found}); {restore}")
    return store


def restore_hint(db_path: Path, backups: Path) -> str:
    """How to get the transcripts back: the newest backup holding at least what the database still has.

    A backup that holds less (fewer sessions or messages: the one taken at
    the first start holds none) would lose more than the damage did, so it
    is never suggested; then the advice is to keep the database.
    """
    from .backup import backups as all_backups
    from .backup import held as _holds

    found = all_backups(backups)
    if not found:
        return (f"there is no backup in {backups}; move {db_path.name} aside to start with no "
                f"sessions (see {WHEN_WRONG})")
    have = _holds(db_path)
    for candidate in reversed(found):
        held = _holds(candidate)
        if held is not None and (have is None or (held[0] >= have[0] and held[1] >= have[1])):
            which = ("the newest backup" if candidate == found[-1] else
                     "the newest backup that holds as much as it still does (newer ones hold less)")
            return (f"restore {which}: cp {candidate} {db_path} && rm -f {db_path}-wal {db_path}-shm "
                    f"(see {WHEN_WRONG})")
    assert have is not None
    return (f"every backup in {backups} holds less than {db_path.name} still does ({have[0]} session(s), "
            f"{have[1]} message(s)), so keep it: restoring one would lose more (see {WHEN_WRONG})")


def put_back_backup(store: Store) -> bool:
    """Whether the database is a backup put back (then its commits are counted from here: no loss)."""
    return put_back(store)


def lost_commits(store: Store, db_path: Path) -> CommitNote | None:
    """Acknowledged commits the database no longer holds (sessions/commits.py), found now or at an earlier start
    and not dealt with since; None when it lost none. Only this says a loss happened: a cache that holds more
    than its transcript (the prompt read before a cancel, what a regenerate cut, a crash mid-answer) is the
    cache's tail, kept as a prefix to reuse, and never an alarm. A new database, a backup put back (it has
    an id of its own) or a missing note start the count afresh."""
    path = note_path(db_path)
    now, seen = counted(store), read_note(path)
    if seen is None or seen.database != now.database:
        _note(path, now)
        return None
    if seen.commits > now.commits:
        seen = CommitNote(now.database, now.commits, seen.lost + seen.commits - now.commits, time.time())
        _note(path, seen)
    return seen if seen.lost else None


def _note(path: Path, note: CommitNote) -> None:
    try:
        write_note(path, note, sync=True)
    except OSError as e:
        raise StartError(f"cannot write {path}: {_why(e)}; kvd must own everything in its data directory "
                         f"(chown -R $USER {path.parent})") from None


def loss_line(loss: CommitNote, store: Store, db_path: Path, cache_dir: Path, backups: Path) -> str:
    """The one line that says a loss: how many commits, the sessions the caches name, what to do."""
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(loss.found))
    parts = [f"{db_path} no longer holds the last {loss.lost} commit(s) kvd made to it (found {when})"]
    if gone := sessions_without_transcript(store, cache_dir):
        parts.append(f"{len(gone)} session(s) have KV caches but no transcript in {db_path} ("
                     + ", ".join(gone[:10]) + (" ..." if len(gone) > 10 else "") + ")")
    if partial := partial_losses(store, cache_dir):
        parts.append(f"{len(partial)} session(s) in {db_path} end before what their KV caches were fed: "
                     + ", ".join(partial[:10]) + (" ..." if len(partial) > 10 else "")
                     + " (kvchat --all lists one-shots and API retries too)")
    return (f"TRANSCRIPTS LOST: {'; '.join(parts)}; was {db_path.name}-wal deleted or damaged? "
            f"{restore_hint(db_path, backups)}; or, to go on without them, rm {note_path(db_path)}")


def partial_losses(store: Store, cache_dir: Path) -> list[str]:
    """Sessions whose transcript ends before what their KV cache on disk was fed: once a loss is known
    (`lost_commits`), the sessions it cut short, whose caches still hold their last turns.

    Such a cache is only a clue, never the proof: a prompt read before its
    turn was cancelled, an answer a regenerate cut, a crash mid-answer leave
    one too, and each leaves the session ending in an answer that did not
    complete (or in a message not answered): such a session is not named.
    Call before recover_interrupted.
    """
    cached = disk_ids(cache_dir)
    if not cached:
        return []
    lost = []
    for sid in sorted(store.session_ids()):
        ids = cached.get(sid)
        if ids is None or _unfinished(store, sid):
            continue
        try:
            fed, _ = store.fed(sid)
        except DamagedFedIds:
            continue  # the turn core rebuilds them from the transcript, and says so
        if len(ids) > len(fed) and list(ids[:len(fed)]) == fed:
            lost.append(f"{sid} ({len(ids) - len(fed)} token(s) of its last turns)")
    return lost


def _unfinished(store: Store, session_id: str) -> bool:
    """Whether the session ends in something other than a complete answer (a cache tail's usual cause)."""
    last = store.db.execute("SELECT role, status FROM messages WHERE session_id = ? ORDER BY idx DESC LIMIT 1",
                            [session_id]).fetchone()
    return last is not None and tuple(last) != ("assistant", "complete")


def check_cache_dir(cache_dir: Path) -> None:
    """The cache directory is kvd's to write: a problem there is named as a cache problem."""
    try:
        segments = check_usable(cache_dir)
    except OSError as e:
        where = e.filename or cache_dir
        raise StartError(f"cannot use the KV cache directory {cache_dir} ({where}: {_why(e)}); "
                         "fix its permissions, or delete it: kvd rebuilds caches from the "
                         "transcripts") from None
    probe_writable(segments, "the KV cache directory")


def sessions_without_transcript(store: Store, cache_dir: Path) -> list[str]:
    """Session ids the cache holds files for but the transcript no longer knows: once a loss is known
    (`lost_commits`), the sessions it took whole.

    A segment directory is named after its session and is only ever written
    for a session the transcript has; so an id here and not in the database
    means the transcript lost it, or a crash fell between deleting a session
    and deleting its cache (not a loss: so this alone is no alarm).
    """
    cached = cached_session_ids(cache_dir)
    return sorted(cached - store.session_ids()) if cached else []
