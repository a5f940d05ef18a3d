"""The transcript store: sessions, their messages and fed token ids, in SQLite.

The transcript is the source of truth for every conversation; KV caches are
an optimization rebuilt from it. The database runs in WAL mode with
``synchronous=FULL``: a commit survives the daemon being killed and also an
OS crash or power cut, so an answer the user saw finish is never lost.
Streamed chunks of an answer (update_message with no status) commit with
NORMAL, unsynced: nothing has acknowledged them, and the answer's final
commit fsyncs the WAL and them with it.

While kvd serves, one thread owns the store (writer.py): every call below
runs there, queued operations share one transaction and one fsync (group
commit), and the event loop never waits on SQLite. Outside the daemon
(preflight, tests, `kvd prune`) a Store is used directly: each public write
commits before it returns. bench/synchronous.py measured what the
synchronous levels cost per commit (the README has the table).
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from sqlite_utils import Database

from common.ids import new_session_id
from common.keep import KEEP, Keep
from common.tokenids import pack_tokens, unpack_tokens

from .branches import branch_map
from .errors import DamagedFedIds, UnknownMessage, UnknownSession
from .fedsum import fed_checksum
from .migrations import migrate
from .rows import Message, Session

ROLES: tuple[str, ...] = ("user", "assistant", "tool")  # "tool": a tool's result (the API's tool calling)
STATUSES: tuple[str, ...] = ("complete", "streaming", "cancelled", "error")

LAST_MESSAGE_CHARS = 200
BUSY_TIMEOUT_MS = 5000


# One query for the whole listing: the counts come from correlated subqueries
# on the (session_id, idx) primary key, not one query per session.
_SESSION_SELECT = f"""
SELECT s.id, s.title, s.system, s.created_at, s.updated_at,
    (SELECT count(*) FROM messages m WHERE m.session_id = s.id),
    (SELECT substr(m.content, 1, {LAST_MESSAGE_CHARS}) FROM messages m
        WHERE m.session_id = s.id ORDER BY m.idx DESC LIMIT 1),
    coalesce((SELECT length(t.tokens) / 4 FROM session_tokens t
        WHERE t.session_id = s.id), 0),
    s.params,
    s.origin,
    s.model
FROM sessions s
"""
_SESSION_KEYS = (
    "id", "title", "system", "created_at", "updated_at",
    "message_count", "last_message", "tokens", "params", "origin", "model",
)  # fmt: skip
_MESSAGE_KEYS = (
    "index", "role", "content", "status", "finish_reason", "usage",
    "fed_end", "created_at", "updated_at", "tool_calls", "tool_call_id", "reasoning", "gen",
)  # fmt: skip


class Store:
    """Sessions and transcripts in one SQLite file (or ``":memory:"``)."""

    # Durability (module docstring): every commit fsynced but streamed chunks.
    synchronous = "FULL"
    streamed_synchronous = "NORMAL"

    def __init__(
        self, path: str | Path, *, clock: Callable[[], float] = time.time
    ) -> None:
        """Open (creating if needed) and migrate the database at `path`.

        `clock` supplies every timestamp; tests pass a counter so ordering by
        `updated_at` never depends on the wall clock's resolution.
        """
        self._clock = clock
        # No sqlite-utils plugins: the store's connection must not depend on
        # what else happens to be installed.
        # One connection, usable from the writer thread (writer.py) that owns it while kvd serves.
        memory = str(path) == ":memory:"
        conn = sqlite3.connect(":memory:" if memory else str(path), check_same_thread=False)
        self.db = Database(conn, execute_plugins=False)
        self.db.memory = memory
        self.db.execute("PRAGMA foreign_keys = ON")  # needed for ON DELETE CASCADE
        self.db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        if not self.db.memory:
            self.db.enable_wal()
        self.db.execute(f"PRAGMA synchronous = {self.synchronous}")
        self.path = None if memory else Path(path)
        if migrate(self.db) and not memory:
            # A new schema (a new database's commit count among it) in the main file, not only in the WAL.
            self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # Sessions

    def create_session(
        self, *, title: str, system: str | None = None, origin: str | None = None,
        session_id: str | None = None, model: str | None = None,
        messages: Sequence[tuple[str, str]] = (),
    ) -> Session:
        """A new session. The daemon chooses the title (the wire's default is protocol.DEFAULT_TITLE),
        and may choose its id (new_session_id()) before the row is written, as the turn core does.
        `messages` (role, content): earlier turns it starts with, written with it (all or nothing)."""
        now = self._clock()
        session_id = session_id or new_session_id()
        with self.db.atomic():
            self.db.execute(
                "INSERT INTO sessions (id, title, system, created_at, updated_at, origin, model) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                [session_id, title, system, now, now, origin, model],
            )
            for role, _ in messages:
                _check_role(role)
            self.db.conn.executemany(
                "INSERT INTO messages (session_id, idx, role, content, status, created_at, updated_at) "
                "VALUES (?, ?, ?, ?, 'complete', ?, ?)",
                [(session_id, i, role, content, now, now) for i, (role, content) in enumerate(messages)])
        if messages:
            made = self.get_session(session_id)
            assert made is not None
            return made
        return Session(
            id=session_id, title=title, system=system, created_at=now,
            updated_at=now, message_count=0, last_message=None, tokens=0,
            params={}, origin=origin, model=model,
        )  # fmt: skip

    def get_session(self, session_id: str) -> Session | None:
        row = self.db.execute(
            _SESSION_SELECT + "WHERE s.id = ?", [session_id]
        ).fetchone()
        return _session_dict(row) if row else None

    def list_sessions(self, *, limit: int | None = None, branches: bool = False) -> list[Session]:
        """Most recently updated first (ties: most recently created first); with `branches`, each
        session says which API conversation it is a branch of (`branch_of`, see `_branches`)."""
        if limit is not None and limit < 0:
            raise ValueError(f"limit must be >= 0, not {limit}")
        rows = self.db.execute(
            _SESSION_SELECT + "ORDER BY s.updated_at DESC, s.rowid DESC LIMIT ?",
            [-1 if limit is None else limit],
        )
        sessions = [_session_dict(row) for row in rows]
        if branches:
            found = branch_map(self.db)
            for session in sessions:
                session["branch_of"] = found.get(session["id"])
        return sessions

    def update_session(
        self,
        session_id: str,
        *,
        title: str | Keep = KEEP,
        system: str | None | Keep = KEEP,
        params: Mapping[str, Any] | Keep = KEEP,
        model: str | None | Keep = KEEP,
    ) -> None:
        """Change the given fields in one statement; this is not use (`updated_at`, so the list order, stays).

        `params` replaces the session's generation defaults as a whole (an
        empty mapping clears them); merging a partial change is the caller's.
        """
        stored = json.dumps(dict(params)) if not isinstance(params, Keep) and params else None
        given = {"title": title, "system": system, "params": params if isinstance(params, Keep) else stored,
                 "model": model}
        changed = {column: value for column, value in given.items() if not isinstance(value, Keep)}
        if changed:
            self._update_session(session_id, ", ".join(f"{column} = ?" for column in changed), list(changed.values()))
        else:
            self._require_session(session_id)

    def delete_session(self, session_id: str) -> bool:
        """Delete the session, its messages and tokens; False if it did not exist."""
        cursor = self.db.execute("DELETE FROM sessions WHERE id = ?", [session_id])
        return cursor.rowcount > 0

    # Messages

    def messages(self, session_id: str, *, first: int = 0, end: int | None = None) -> list[Message]:
        """The session's messages in order (those with first <= index < end, when given)."""
        rows = self.db.execute(
            "SELECT idx, role, content, status, finish_reason, usage, fed_end, "
            "created_at, updated_at, tool_calls, tool_call_id, reasoning, gen FROM messages WHERE session_id = ? "
            "AND idx >= ? AND idx < ? ORDER BY idx",
            [session_id, first, (1 << 62) if end is None else end],
        ).fetchall()
        if not rows and first == 0 and end is None:
            self._require_session(session_id)
        return [_message_dict(row) for row in rows]

    def append_message(
        self, session_id: str, role: str, content: str, *, status: str = "complete",
        tool_calls: Sequence[Mapping[str, str]] | None = None, tool_call_id: str | None = None,
        index: int | None = None, reasoning: str | None = None,
    ) -> int:
        """Append a message and touch the session; return its index (0, 1, ...).

        `tool_calls` (an assistant's) and `tool_call_id` (a tool message's) come from the API's tool calling;
        `reasoning`, an assistant's reasoning as a client sent it back.
        `index`, when given, is the index the caller holds in memory for it (the turn core): a
        transcript that disagrees fails here rather than drifting apart.
        """
        _check_role(role)
        _check_status(status)
        now = self._clock()
        with self.db.atomic():
            self._update_session(session_id, "updated_at = ?", [now])
            (next_index,) = self.db.execute(
                "SELECT coalesce(max(idx) + 1, 0) FROM messages WHERE session_id = ?",
                [session_id],
            ).fetchone()
            if index is not None and index != next_index:
                raise ValueError(f"session {session_id}'s next message is {next_index}, not {index}")
            index = next_index
            self.db.execute(
                "INSERT INTO messages (session_id, idx, role, content, status, "
                "created_at, updated_at, tool_calls, tool_call_id, reasoning, gen) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, (SELECT gen FROM sessions WHERE id = ?))",
                [session_id, index, role, content, status, now, now,
                 json.dumps([dict(c) for c in tool_calls]) if tool_calls else None, tool_call_id, reasoning,
                 session_id],
            )
        return int(index)

    def update_message(
        self,
        session_id: str,
        index: int,
        *,
        content: str | None = None,
        status: str | None = None,
        finish_reason: str | None = None,
        usage: dict[str, Any] | None = None,
        fed_end: int | None = None,
        tool_calls: Sequence[Mapping[str, str]] | None = None,
        append: str | None = None,
    ) -> None:
        """Change only the given fields (None means "leave as is"); `append`: text added to the content
        (a streaming answer's commit: what came since the last one, never the whole answer again).

        Called for every streamed chunk, so it is one UPDATE and one commit;
        it does not touch the session (append_message already did).
        """
        sets = ["updated_at = ?"]
        params: list[Any] = [self._clock()]
        if content is not None:
            sets.append("content = ?")
            params.append(content)
        elif append is not None:
            sets.append("content = content || ?")
            params.append(append)
        if status is not None:
            _check_status(status)
            sets.append("status = ?")
            params.append(status)
        if finish_reason is not None:
            sets.append("finish_reason = ?")
            params.append(finish_reason)
        if usage is not None:
            sets.append("usage = ?")
            params.append(json.dumps(usage))
        if fed_end is not None:
            sets.append("fed_end = ?")
            params.append(fed_end)
        if tool_calls is not None:
            sets.append("tool_calls = ?")
            params.append(json.dumps([dict(c) for c in tool_calls]) if tool_calls else None)
        sql = f"UPDATE messages SET {', '.join(sets)} WHERE session_id = ? AND idx = ?"
        if status is None and not self.db.conn.in_transaction:
            # A streamed chunk is not acknowledged yet: no fsync for it. The
            # answer's final commit fsyncs the WAL, and with it these frames.
            self.db.execute(f"PRAGMA synchronous = {self.streamed_synchronous}")
            try:
                cursor = self.db.execute(sql, [*params, session_id, index])
            finally:
                self.db.execute(f"PRAGMA synchronous = {self.synchronous}")
        else:
            cursor = self.db.execute(sql, [*params, session_id, index])
        if cursor.rowcount == 0:
            self._require_session(session_id)
            raise UnknownMessage(session_id, index)

    def forget_fed_ends(self, session_id: str, before_index: int) -> None:
        """The session's token ids were rebuilt: earlier turn boundaries no longer apply."""
        self.db.execute(
            "UPDATE messages SET fed_end = NULL WHERE session_id = ? AND idx < ? AND fed_end IS NOT NULL",
            [session_id, before_index],
        )

    def truncate_messages(self, session_id: str, from_index: int) -> int:
        """Delete messages with index >= `from_index` (regenerate, edit); return how many.

        The session's token ids are left alone: what was fed is still a valid
        cache prefix, and the daemon decides how much of it to keep. The messages
        written from now on count one more cut (`gen`): they are named apart from
        the ones they replace (daemon/doors/responses_stored.py).
        """
        if from_index < 0:
            raise ValueError(f"from_index must be >= 0, not {from_index}")
        with self.db.atomic():
            self._update_session(session_id, "updated_at = ?, gen = gen + 1", [self._clock()])
            cursor = self.db.execute(
                "DELETE FROM messages WHERE session_id = ? AND idx >= ?",
                [session_id, from_index],
            )
        return cursor.rowcount

    def recover_interrupted(self) -> int:
        """On start: answers left 'streaming' by a crash become 'error'/'interrupted'."""
        cursor = self.db.execute(
            "UPDATE messages SET status = 'error', finish_reason = 'interrupted', "
            "updated_at = ? WHERE status = 'streaming'",
            [self._clock()],
        )
        return cursor.rowcount

    # Token ids

    def fed(self, session_id: str) -> tuple[list[int], int]:
        """The session's fed token ids and how many leading messages they cover.

        Raises :class:`DamagedFedIds` when the row fails its checksum: the
        caller rebuilds the ids from the transcript (:meth:`drop_fed`).
        """
        row = self.db.execute(
            "SELECT tokens, covers, checksum FROM session_tokens WHERE session_id = ?", [session_id]
        ).fetchone()
        if row is None:
            self._require_session(session_id)
            return [], 0
        blob, covers = bytes(row[0]), int(row[1])
        if row[2] != fed_checksum(session_id, blob, covers) or len(blob) % 4:
            raise DamagedFedIds(session_id)
        return unpack_tokens(blob), covers

    def drop_fed(self, session_id: str) -> None:
        """Forget the session's fed ids (they cover nothing): its next turn renders the transcript afresh."""
        self.set_tokens(session_id, [], covers=0)
        self.forget_fed_ends(session_id, 1 << 62)

    def set_tokens(self, session_id: str, tokens: Sequence[int], *, covers: int = 0, model: str | None = None) -> None:
        """Replace the session's token ids (`model`'s tokens); each must satisfy 0 <= t < 2**32.

        `covers` says how many leading messages of the transcript the ids
        stand for, so a later turn knows whether it may append to them.
        """
        blob = pack_tokens(tokens)
        if covers < 0:
            raise ValueError("covers must be >= 0")
        self._require_session(session_id)
        with self.db.atomic():
            self.db.execute(
                "INSERT INTO session_tokens (session_id, tokens, covers, updated_at, checksum, model) "
                "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (session_id) DO UPDATE SET tokens = excluded.tokens, "
                "covers = excluded.covers, updated_at = excluded.updated_at, checksum = excluded.checksum, "
                "model = excluded.model",
                [session_id, blob, covers, self._clock(), fed_checksum(session_id, blob, covers), model],
            )

    def chain_rows(self) -> Iterator[tuple[str, str | None, int, str, str, Any, str | None, str, str | None]]:
        """Every session's messages, least recently used session first, for sessions.chains.build
        (a session without messages: one row with index -1)."""
        yield from self.db.execute(
            "SELECT s.id, s.system, coalesce(m.idx, -1), m.role, m.content, m.tool_calls, m.tool_call_id, m.status, "
            "m.reasoning "
            "FROM sessions s LEFT JOIN messages m ON m.session_id = s.id "
            "ORDER BY s.updated_at, s.rowid, m.idx")

    # Internals

    def session_ids(self) -> set[str]:
        """Every session's id (a start compares them with what the cache holds)."""
        return {row[0] for row in self.db.execute("SELECT id FROM sessions")}

    def message_count(self) -> int:
        """Messages in every session (backups are taken after enough new ones)."""
        return int(self.db.execute("SELECT COUNT(*) FROM messages").fetchone()[0])

    def damage(self) -> list[str]:
        """What SQLite's quick_check finds wrong with the database; empty when it is sound."""
        try:
            result = [str(r[0]) for r in self.db.execute("PRAGMA quick_check").fetchall()]
        except sqlite3.DatabaseError as e:
            return [str(e)]
        return [] if result == ["ok"] else result

    def _require_session(self, session_id: str) -> None:
        row = self.db.execute(
            "SELECT 1 FROM sessions WHERE id = ?", [session_id]
        ).fetchone()
        if row is None:
            raise UnknownSession(session_id)

    def _update_session(self, session_id: str, assignment: str, params: list[Any]) -> None:
        cursor = self.db.execute(
            f"UPDATE sessions SET {assignment} WHERE id = ?", [*params, session_id]
        )
        if cursor.rowcount == 0:
            raise UnknownSession(session_id)


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}; not {role!r}")


def _check_status(status: str) -> None:
    if status not in STATUSES:
        raise ValueError(f"status must be one of {', '.join(STATUSES)}; not {status!r}")


def _session_dict(row: tuple[Any, ...]) -> Session:
    session = dict(zip(_SESSION_KEYS, row))
    session["params"] = json.loads(session["params"]) if session["params"] else {}
    return cast(Session, session)


def _message_dict(row: tuple[Any, ...]) -> Message:
    message = dict(zip(_MESSAGE_KEYS, row))
    if message["usage"] is not None:
        message["usage"] = json.loads(message["usage"])
    if message["tool_calls"] is not None:
        message["tool_calls"] = json.loads(message["tool_calls"])
    return cast(Message, message)
