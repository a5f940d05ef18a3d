"""Running a SQLite file's migrations: sqlite-utils' runner, under the write lock, once per set.

Both of kvd's SQLite files (the session store, sessions/migrations.py, and the
cache index, cachestore/migrations.py) register their numbered migrations
with `sqlite_utils.migrations.Migrations` and run them through
:func:`run_migrations`, so there is one runner. What it adds to sqlite-utils':

- the usual start (nothing pending) is one read, no write lock;
- otherwise everything runs as one transaction under ``BEGIN IMMEDIATE``
  (each migration a savepoint in it, as sqlite-utils nests them), so another
  process migrating the same file at that moment waits, then finds nothing
  left to do, and a crash leaves no half-applied schema (a migration must
  therefore not change PRAGMAs);
- names kvd's own earlier runner recorded in ``_kvd_migrations`` move to
  sqlite-utils' table once, so existing files are not migrated twice.

Duck-typed on purpose (a `sqlite_utils.Database` and a `Migrations` set): the
stores may import this leaf package's helpers, and it stays standard-library
only.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LEGACY_TABLE", "run_migrations"]

#: Where kvd recorded applied migrations before it used sqlite-utils' runner.
LEGACY_TABLE = "_kvd_migrations"


def run_migrations(db: Any, migrations: Any) -> list[str]:
    """Apply the migrations of `migrations` that `db` has not seen yet; return their names."""
    if LEGACY_TABLE not in db.table_names() and not migrations.pending(db):
        return []
    db.execute("BEGIN IMMEDIATE")
    try:
        if LEGACY_TABLE in db.table_names():
            migrations.ensure_migrations_table(db)
            db.execute(f"INSERT OR IGNORE INTO {migrations.migrations_table} (migration_set, name, applied_at) "
                       f"SELECT ?, name, datetime(applied_at, 'unixepoch') FROM {LEGACY_TABLE}", [migrations.name])
            db.execute(f"DROP TABLE {LEGACY_TABLE}")
        pending = [m.name for m in migrations.pending(db)]
        migrations.apply(db)
    except BaseException:
        db.conn.rollback()
        raise
    db.conn.commit()
    return pending
