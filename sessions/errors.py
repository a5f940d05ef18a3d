"""Errors the transcript store raises.

Both are ``KeyError`` subclasses, so ``except KeyError`` still works, and each
carries the id it could not find so the daemon can answer with
``unknown_session`` without parsing messages::

    KeyError
    ├── UnknownSession   no session with that id
    └── UnknownMessage   the session exists, that message index does not

A session's fed token ids that fail their checksum raise ``DamagedFedIds``
(not a ``KeyError``: the session exists); the daemon rebuilds them from the
transcript, which stays the source of truth.

Bad arguments (a role, status or token id out of range) are plain
``ValueError``: they are bugs in the caller, not states of the store.

A full disk stays SQLite's own ``sqlite3.OperationalError`` (the statement
was rolled back, nothing half-written); ``common.diskfull.is_disk_full`` tells it apart.
"""

from __future__ import annotations


class UnknownSession(KeyError):
    """No session with this id (never created, or deleted)."""

    def __init__(self, session_id: str) -> None:
        super().__init__(session_id)
        self.session_id = session_id

    def __str__(self) -> str:
        # KeyError's own __str__ is repr(arg); say what to do instead.
        return f"no session {self.session_id!r}; list sessions with session.list"


class UnknownMessage(KeyError):
    """The session exists but has no message at this index."""

    def __init__(self, session_id: str, index: int) -> None:
        super().__init__(session_id, index)
        self.session_id = session_id
        self.index = index

    def __str__(self) -> str:
        return f"session {self.session_id!r} has no message {self.index}"


class DamagedFedIds(Exception):
    """The session's stored fed token ids fail their checksum (sessions/fedsum.py)."""

    def __init__(self, session_id: str) -> None:
        super().__init__(session_id)
        self.session_id = session_id

    def __str__(self) -> str:
        return f"session {self.session_id}: its fed token ids fail their checksum"
