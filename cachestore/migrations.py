"""The cache index's schema migrations: numbered, append-only functions.

Registered with sqlite-utils' runner, `sqlite_utils.migrations.Migrations`,
and run by common/migrate.py, as the session store's are
(sessions/migrations.py): applied names are recorded in `_sqlite_migrations`
under the set "kvd.cache". Never edit or reorder a migration
that has shipped; append ``m00N_what_changed(db)``.
"""

from __future__ import annotations

from sqlite_utils import Database
from sqlite_utils.migrations import Migrations

from common.migrate import LEGACY_TABLE, run_migrations

MIGRATIONS = Migrations("kvd.cache")
migration = MIGRATIONS()


def known(db: Database) -> bool:
    """Whether `db` was ever migrated (an index created before, not a new or emptied file)."""
    return bool({MIGRATIONS.migrations_table, LEGACY_TABLE} & set(db.table_names()))


def migrate(db: Database) -> list[str]:
    """Apply the migrations `db` has not seen yet; return their names."""
    return run_migrations(db, MIGRATIONS)


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
    # Content-addressed blocks (store.py): stored once, listed by every
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


@migration
def m003_per_model(db: Database) -> None:
    # A session's cache is kept per model (issue 42): its private segments, its chain and its
    # place in the disk LRU are keyed by (session, fingerprint), so loading another model leaves
    # a cache valid for the model that wrote it. Existing rows take their own files' fingerprint
    # (a chain its blocks'); a session with no file left is forgotten.
    db.table("segments").transform(pk=("key", "fingerprint", "start"))
    db.table("chains").add_column("fingerprint", str)
    db.execute("UPDATE chains SET fingerprint = (SELECT b.fingerprint FROM blocks b WHERE b.block = chains.block)")
    db.execute("DELETE FROM chains WHERE fingerprint IS NULL")
    first = ["key", "fingerprint"]
    db.table("chains").transform(pk=("key", "fingerprint", "n"), not_null={"fingerprint"}, column_order=first)
    held = "SELECT key, fingerprint FROM segments UNION SELECT key, fingerprint FROM chains"
    db.table("keys").add_column("fingerprint", str)
    db.execute(f"UPDATE keys SET fingerprint = (SELECT h.fingerprint FROM ({held}) h WHERE h.key = keys.key)")
    db.execute("DELETE FROM keys WHERE fingerprint IS NULL")
    db.table("keys").transform(pk=tuple(first), not_null={"fingerprint"}, column_order=first)
    db.execute("INSERT OR IGNORE INTO keys (key, fingerprint, last_used) SELECT h.key, h.fingerprint, k.last_used "
               f"FROM ({held}) h JOIN keys k ON k.key = h.key")
    # The models that wrote caches, by fingerprint: what "kept for <model>" names.
    db.execute("CREATE TABLE models (fingerprint TEXT PRIMARY KEY, name TEXT NOT NULL)")
