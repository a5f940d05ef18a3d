"""The cache index's schema migrations: numbered, append-only functions.

The same mechanism as the session store's (sessions/migrations.py, the
simonw/llm pattern, on sqlite-utils): a function per schema change, a
`_kvd_migrations` table of applied names, each migration in its own
`BEGIN IMMEDIATE` transaction with the row that records it. cachestore may
not import sessions, so the dozen lines of runner live here too; the
shape, the table and the rules are the same. Never edit or reorder a
migration that has shipped; append ``m00N_what_changed(db)``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from sqlite_utils import Database

MIGRATIONS_TABLE = "_kvd_migrations"

Migration = Callable[[Database], None]
MIGRATIONS: list[Migration] = []


def migration(fn: Migration) -> Migration:
    """Register `fn`; registration order is application order."""
    MIGRATIONS.append(fn)
    return fn


def known(db: Database) -> bool:
    """Whether `db` was ever migrated (an index created before, not a new or emptied file)."""
    return db.execute("SELECT 1 FROM sqlite_master WHERE name = ?", [MIGRATIONS_TABLE]).fetchone() is not None


def migrate(db: Database) -> list[str]:
    """Apply the migrations `db` has not seen yet; return their names."""
    db.execute(f"CREATE TABLE IF NOT EXISTS {MIGRATIONS_TABLE} (name TEXT PRIMARY KEY, applied_at REAL)")
    applied: list[str] = []
    for fn in MIGRATIONS:
        db.execute("BEGIN IMMEDIATE")
        try:
            done = {row[0] for row in db.execute(f"SELECT name FROM {MIGRATIONS_TABLE}")}
            if fn.__name__ not in done:
                fn(db)
                db.execute(f"INSERT INTO {MIGRATIONS_TABLE} (name, applied_at) VALUES (?, ?)",
                           [fn.__name__, time.time()])
                applied.append(fn.__name__)
        except BaseException:
            db.conn.rollback()
            raise
        db.conn.commit()
    return applied


@migration
def m001_segments(db: Database) -> None:
    # A session's private segment files, [start, end) each (the name kept from
    # the first index, whose runner recorded it the same way).
    db.execute(
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
        )
        """
    )
    db.execute("CREATE TABLE keys (key TEXT PRIMARY KEY, last_used REAL NOT NULL)")


@migration
def m002_blocks(db: Database) -> None:
    # Content-addressed blocks (manager.py): stored once, listed by every
    # session whose chain passes through them.
    db.execute(
        """
        CREATE TABLE blocks (
            block TEXT PRIMARY KEY,
            parent TEXT NOT NULL,
            start INTEGER NOT NULL CHECK (start >= 0),
            "end" INTEGER NOT NULL CHECK ("end" > start),
            file TEXT NOT NULL,
            nbytes INTEGER NOT NULL,
            checksum TEXT NOT NULL,
            fingerprint TEXT NOT NULL,
            tokens BLOB NOT NULL,
            last_used REAL NOT NULL
        )
        """
    )
    db.execute(
        """
        CREATE TABLE chains (
            key TEXT NOT NULL,
            n INTEGER NOT NULL CHECK (n >= 0),  -- the block covering [n * B, (n + 1) * B)
            block TEXT NOT NULL REFERENCES blocks (block),
            PRIMARY KEY (key, n)
        )
        """
    )
    db.execute("CREATE INDEX chains_block ON chains (block)")
    db.execute("CREATE INDEX blocks_parent ON blocks (parent)")
