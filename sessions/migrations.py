"""Schema migrations: numbered, append-only functions (the simonw/llm pattern).

Never edit or reorder a migration that has shipped: a user's database records
it as applied and will not run it again. Change the schema by appending
``m00N_what_changed(db)``. Each migration runs in its own transaction together
with the row that records it, so a crash mid-migration leaves no half-applied
schema; it must therefore not change PRAGMAs (they are no-ops inside a
transaction).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from sqlite_utils import Database

MIGRATIONS_TABLE = "_kvd_migrations"

Migration = Callable[[Database], None]
MIGRATIONS: list[Migration] = []


def migration(fn: Migration) -> Migration:
    """Register `fn`; registration order is application order."""
    MIGRATIONS.append(fn)
    return fn


def migrate(db: Database) -> list[str]:
    """Apply the migrations `db` has not seen yet; return their names."""
    db.execute(
        f"CREATE TABLE IF NOT EXISTS {MIGRATIONS_TABLE} "
        "(name TEXT PRIMARY KEY, applied_at REAL NOT NULL)"
    )
    if not _pending(db):  # the usual case: one read, no write lock
        return []
    applied: list[str] = []
    for fn in MIGRATIONS:
        with _write_transaction(db):
            # Checked again under the write lock: another process may have
            # migrated since we looked.
            if fn.__name__ not in _applied(db):
                fn(db)
                db.execute(
                    f"INSERT INTO {MIGRATIONS_TABLE} (name, applied_at) VALUES (?, ?)",
                    [fn.__name__, time.time()],
                )
                applied.append(fn.__name__)
    return applied


def _applied(db: Database) -> set[str]:
    return {row[0] for row in db.execute(f"SELECT name FROM {MIGRATIONS_TABLE}")}


def _pending(db: Database) -> list[str]:
    done = _applied(db)
    return [fn.__name__ for fn in MIGRATIONS if fn.__name__ not in done]


@contextmanager
def _write_transaction(db: Database) -> Iterator[None]:
    """BEGIN IMMEDIATE: take the write lock before reading what to apply."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        db.rollback()
        raise
    db.commit()


@migration
def m001_initial(db: Database) -> None:
    db.execute(
        """
        CREATE TABLE sessions (
            id TEXT PRIMARY KEY,
            title TEXT NOT NULL,
            system TEXT,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL
        )
        """
    )
    # list_sessions: most recently updated first.
    db.execute("CREATE INDEX sessions_updated_at ON sessions (updated_at)")
    db.execute(
        """
        CREATE TABLE messages (
            session_id TEXT NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
            idx INTEGER NOT NULL CHECK (idx >= 0),
            role TEXT NOT NULL CHECK (role IN ('user', 'assistant')),
            content TEXT NOT NULL,
            status TEXT NOT NULL
                CHECK (status IN ('complete', 'streaming', 'cancelled', 'error')),
            finish_reason TEXT,
            usage TEXT,
            -- how many token ids the session had fed once this turn ended
            fed_end INTEGER CHECK (fed_end >= 0),
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL,
            PRIMARY KEY (session_id, idx)
        )
        """
    )
    # recover_interrupted on every start; partial, so it stays near-empty.
    db.execute(
        "CREATE INDEX messages_streaming ON messages (session_id) "
        "WHERE status = 'streaming'"
    )
    db.execute(
        """
        CREATE TABLE session_tokens (
            session_id TEXT PRIMARY KEY REFERENCES sessions (id) ON DELETE CASCADE,
            tokens BLOB NOT NULL,
            -- how many leading messages of the transcript these ids cover
            covers INTEGER NOT NULL DEFAULT 0 CHECK (covers >= 0),
            updated_at REAL NOT NULL
        )
        """
    )


@migration
def m002_session_params(db: Database) -> None:
    # Per-session generation defaults (temperature, top_p, max_tokens) as a
    # JSON object; NULL means none set, so the daemon's config applies.
    db.execute("ALTER TABLE sessions ADD COLUMN params TEXT")


@migration
def m003_fed_blocks(db: Database) -> None:
    # Issue 10's index on fed token ids, replaced by content-addressed cache
    # blocks (issue 14) and dropped by m004. A new database gets the empty
    # table for the one step in between; existing ones kept their rows then.
    db.execute(
        """
        CREATE TABLE fed_blocks (
            session_id TEXT NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
            n INTEGER NOT NULL CHECK (n >= 1),
            key INTEGER NOT NULL,
            PRIMARY KEY (session_id, n)
        )
        """
    )
    db.execute("CREATE INDEX fed_blocks_key ON fed_blocks (key, n)")


@migration
def m004_drop_fed_blocks(db: Database) -> None:
    # Which session a stateless request continues is found by its transcript
    # (Store.continuable); where its cache comes from, by cachestore's blocks.
    db.execute("DROP INDEX IF EXISTS fed_blocks_key")
    db.execute("DROP TABLE IF EXISTS fed_blocks")
