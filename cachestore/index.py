"""The disk tier's index: which segment files exist, for which tokens.

Its own SQLite file (cachestore owns these rows and no others), used only
from the engine thread. A segment file is listed here only after it is
complete on disk (written, fsynced, renamed, directory fsynced), so a row
never points at a partial file; files without a row are leftovers of a
crash and are deleted on open.

The index is not the only record, though: each segment's header holds its
range, fingerprint and token ids. An index that is missing, empty or not a
database is therefore set aside (`lost` says how it was found) and rebuilt
from the files by the owner (manager.py), not taken as "no segments".
"""

from __future__ import annotations

import re
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from protocol.tokenids import pack_tokens, unpack_tokens

KEY_RE = re.compile(r"[0-9a-f]{1,64}")
SEGMENT_SUFFIX = ".safetensors"


@dataclass(frozen=True)
class SegmentRow:
    key: str
    start: int
    end: int
    path: Path
    nbytes: int
    checksum: str
    fingerprint: str
    tokens: tuple[int, ...]


def check_key(key: str) -> str:
    """Keys become directory names: only short lowercase hex ever touches a path."""
    if not isinstance(key, str) or not KEY_RE.fullmatch(key):
        raise ValueError(f"invalid cache key {key!r}")
    return key


_MIGRATIONS = [
    (
        "m001_segments",
        """
        CREATE TABLE segments (
            key TEXT NOT NULL,
            start INTEGER NOT NULL CHECK (start >= 0),
            "end" INTEGER NOT NULL CHECK ("end" > start),
            file TEXT NOT NULL,
            nbytes INTEGER NOT NULL,
            checksum TEXT NOT NULL,
            fingerprint TEXT NOT NULL,
            tokens BLOB NOT NULL,
            created_at REAL NOT NULL,
            PRIMARY KEY (key, start)
        );
        CREATE TABLE keys (
            key TEXT PRIMARY KEY,
            last_used REAL NOT NULL
        );
        """,
    ),
]


class SegmentIndex:
    def __init__(self, root: Path):
        self.root = root
        self.files = root / "segments"
        self.files.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = root / "index.sqlite"
        # How the index was found, when it could not be used as it was: None (fine),
        # "missing", "empty", or "damaged (<why>), set aside as <name>".
        self.lost: str | None = None
        try:
            self.db = self._open()
        except sqlite3.DatabaseError as e:
            aside = self.path.with_name(f"index.sqlite.damaged-{int(time.time())}")
            self.path.replace(aside)
            for suffix in ("-wal", "-shm"):
                self.path.with_name(self.path.name + suffix).unlink(missing_ok=True)
            self.lost = f"damaged ({e}), set aside as {aside.name}"
            self.db = self._open()

    def _open(self) -> sqlite3.Connection:
        existed = self.path.exists()
        db = sqlite3.connect(self.path, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            known = db.execute("SELECT 1 FROM sqlite_master WHERE name = '_kvd_migrations'").fetchone()
            if known is None and self.lost is None:
                self.lost = "empty" if existed else "missing"
            db.execute("CREATE TABLE IF NOT EXISTS _kvd_migrations (name TEXT PRIMARY KEY, applied_at REAL)")
        except BaseException:
            db.close()
            raise
        self.db = db
        self._migrate()
        return db

    def _migrate(self) -> None:
        done = {r[0] for r in self.db.execute("SELECT name FROM _kvd_migrations")}
        for name, sql in _MIGRATIONS:
            if name not in done:
                self.db.execute("BEGIN IMMEDIATE")
                for stmt in filter(str.strip, sql.split(";")):
                    self.db.execute(stmt)
                self.db.execute("INSERT INTO _kvd_migrations VALUES (?, ?)", [name, time.time()])
                self.db.execute("COMMIT")

    def close(self) -> None:
        self.db.close()

    def dir_for(self, key: str) -> Path:
        return self.files / check_key(key)

    def path_for(self, key: str, start: int, end: int) -> Path:
        return self.dir_for(key) / f"{start:010d}-{end:010d}{SEGMENT_SUFFIX}"

    # --- reads ---

    def chain(self, key: str) -> list[SegmentRow]:
        rows = self.db.execute(
            'SELECT key, start, "end", file, nbytes, checksum, fingerprint, tokens FROM segments '
            "WHERE key = ? ORDER BY start", [check_key(key)]).fetchall()
        return [SegmentRow(r[0], r[1], r[2], self.files / r[3], r[4], r[5], r[6], tuple(unpack_tokens(r[7])))
                for r in rows]

    def keys_by_use(self) -> list[tuple[str, int]]:
        """(key, bytes on disk), least recently used first."""
        return [(r[0], r[1]) for r in self.db.execute(
            "SELECT k.key, COALESCE(SUM(s.nbytes), 0) FROM keys k LEFT JOIN segments s ON s.key = k.key "
            "GROUP BY k.key ORDER BY k.last_used, k.key")]

    def keys(self) -> set[str]:
        """Every key with at least one segment."""
        return {r[0] for r in self.db.execute("SELECT DISTINCT key FROM segments")}

    def total_bytes(self) -> int:
        return int(self.db.execute("SELECT COALESCE(SUM(nbytes), 0) FROM segments").fetchone()[0])

    def count(self) -> tuple[int, int]:
        """(keys with segments, segments)."""
        row = self.db.execute("SELECT COUNT(DISTINCT key), COUNT(*) FROM segments").fetchone()
        return int(row[0]), int(row[1])

    # --- writes ---

    def add(self, key: str, start: int, end: int, path: Path, nbytes: int, checksum: str,
            fingerprint: str, tokens: Sequence[int], now: float) -> None:
        """List a complete file. Called only after the file is durable."""
        if len(tokens) != end - start:
            raise ValueError("a segment's token ids must cover exactly [start, end)")
        rel = path.relative_to(self.files).as_posix()
        self.db.execute("BEGIN IMMEDIATE")
        try:
            self.db.execute(
                'INSERT OR REPLACE INTO segments (key, start, "end", file, nbytes, checksum, fingerprint, '
                "tokens, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [check_key(key), start, end, rel, nbytes, checksum, fingerprint, pack_tokens(tokens), now])
            self.db.execute("INSERT INTO keys (key, last_used) VALUES (?, ?) "
                            "ON CONFLICT (key) DO UPDATE SET last_used = excluded.last_used", [key, now])
            self.db.execute("COMMIT")
        except BaseException:
            if self.db.in_transaction:  # a failed COMMIT (a full disk) has rolled back already
                self.db.execute("ROLLBACK")
            raise

    def touch(self, key: str, now: float) -> None:
        self.db.execute("UPDATE keys SET last_used = ? WHERE key = ?", [now, check_key(key)])

    def drop_from(self, key: str, start: int) -> int:
        """Unlist and delete every segment of `key` starting at or after `start`; returns bytes freed."""
        rows = [r for r in self.chain(key) if r.start >= start]
        self.db.execute("BEGIN IMMEDIATE")
        self.db.execute("DELETE FROM segments WHERE key = ? AND start >= ?", [key, start])
        if start == 0:
            self.db.execute("DELETE FROM keys WHERE key = ?", [key])
        self.db.execute("COMMIT")
        for r in rows:  # unlisted first, then deleted: a crash in between leaves only orphans
            r.path.unlink(missing_ok=True)
        if start == 0:
            try:
                self.dir_for(key).rmdir()
            except OSError:
                pass
        return sum(r.nbytes for r in rows)

    def evict(self, key: str) -> int:
        """Free a full disk of `key`'s files: deleted first, unlisted after if the disk allows.

        The reverse of drop_from's order, because unlisting needs room in the
        index's WAL that only the deletion frees. A row left pointing at a
        deleted file is harmless: reading it finds the file missing and drops
        the row, and the next sweep removes it.
        """
        rows = self.chain(key)
        for r in rows:
            r.path.unlink(missing_ok=True)
        try:
            self.drop_from(key, 0)
        except sqlite3.OperationalError as e:
            if getattr(e, "sqlite_errorcode", None) != sqlite3.SQLITE_FULL:
                raise
            if self.db.in_transaction:
                self.db.execute("ROLLBACK")
        return sum(r.nbytes for r in rows)

    def sweep(self) -> int:
        """Delete files no row lists (a crash before indexing) and rows whose file is gone."""
        listed = {Path(r[0]) for r in self.db.execute("SELECT file FROM segments")}
        removed = 0
        for path in sorted(self.files.rglob("*")):
            if path.is_file() and path.relative_to(self.files) not in listed:
                path.unlink(missing_ok=True)
                removed += 1
        for (rel,) in self.db.execute("SELECT file FROM segments").fetchall():
            if not (self.files / rel).is_file():
                self.db.execute("DELETE FROM segments WHERE file = ?", [rel])
                removed += 1
        for d in sorted(self.files.iterdir()):
            if d.is_dir() and not any(d.iterdir()):
                d.rmdir()
        return removed
