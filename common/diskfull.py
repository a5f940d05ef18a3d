"""Whether an error means the disk is full: one test for every layer that writes.

A write or fsync fails with ENOSPC (or EDQUOT over a quota); SQLite reports
SQLITE_FULL (the statement was rolled back, nothing half-written). Older
Pythons' sqlite3 errors carry no code, only the message.
"""

from __future__ import annotations

import errno
import sqlite3

_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def is_disk_full(e: BaseException) -> bool:
    """True for an OSError or sqlite3 error that says the disk (or the database's page limit) is full."""
    if isinstance(e, sqlite3.DatabaseError):
        code = getattr(e, "sqlite_errorcode", None)
        return code == sqlite3.SQLITE_FULL or (code is None and "disk is full" in str(e))
    return isinstance(e, OSError) and e.errno in _FULL_ERRNOS
