"""Schema migrations: numbered, append-only functions, run by sqlite-utils' own runner.

`sqlite_utils.migrations.Migrations` records each applied function's name in
`_sqlite_migrations` under the set "kvd.sessions"; common/migrate.py runs
them (for the cache index too) under the write lock, as one transaction, so
a crash mid-migration leaves no half-applied schema; a migration must
therefore not change PRAGMAs (they are no-ops inside a transaction). Never edit or reorder
a migration that has shipped: a user's database records it as applied and
will not run it again. Change the schema by appending
``m00N_what_changed(db)``.
"""

from __future__ import annotations

from sqlite_utils import Database
from sqlite_utils.migrations import Migrations

from common.migrate import run_migrations

from .fedsum import fed_checksum

MIGRATIONS = Migrations("kvd.sessions")
migration = MIGRATIONS()


def migrate(db: Database) -> list[str]:
    """Apply the migrations `db` has not seen yet; return their names."""
    return run_migrations(db, MIGRATIONS)


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


@migration
def m005_session_origin(db: Database) -> None:
    # Who made the session: "kvchat", "kvchat one-shot", "api (<User-Agent>)", "websocket" (a client
    # that did not say); NULL for sessions made before origins were kept.
    db.execute("ALTER TABLE sessions ADD COLUMN origin TEXT")


@migration
def m006_tool_messages(db: Database) -> None:
    # Tool calling over the API: an assistant message may carry the calls it made (tool_calls: a JSON
    # list of {"id", "name", "arguments"}), and a 'tool' message answers one (tool_call_id). SQLite
    # cannot change a CHECK constraint in place, so the table is rebuilt (once, in this transaction).
    db.execute(
        """
        CREATE TABLE messages_m006 (
            session_id TEXT NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
            idx INTEGER NOT NULL CHECK (idx >= 0),
            role TEXT NOT NULL CHECK (role IN ('user', 'assistant', 'tool')),
            content TEXT NOT NULL,
            status TEXT NOT NULL
                CHECK (status IN ('complete', 'streaming', 'cancelled', 'error')),
            finish_reason TEXT,
            usage TEXT,
            -- how many token ids the session had fed once this turn ended
            fed_end INTEGER CHECK (fed_end >= 0),
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL,
            tool_calls TEXT,
            tool_call_id TEXT,
            PRIMARY KEY (session_id, idx)
        )
        """
    )
    db.execute(
        "INSERT INTO messages_m006 (session_id, idx, role, content, status, finish_reason, usage, fed_end, "
        "created_at, updated_at) SELECT session_id, idx, role, content, status, finish_reason, usage, fed_end, "
        "created_at, updated_at FROM messages"
    )
    db.execute("DROP TABLE messages")
    db.execute("ALTER TABLE messages_m006 RENAME TO messages")
    db.execute(
        "CREATE INDEX messages_streaming ON messages (session_id) "
        "WHERE status = 'streaming'"
    )


@migration
def m007_fed_ids_checksum(db: Database) -> None:
    # The fed ids pick a session's cache and the ids its next turn appends to: a checksum over
    # (session id, covers, ids), verified where they are read (sessions/fedsum.py). Rows written
    # before it get their sum here; a row whose sum does not match is rebuilt from the transcript.
    db.execute("ALTER TABLE session_tokens ADD COLUMN checksum INTEGER")
    rows = db.execute("SELECT session_id, tokens, covers FROM session_tokens").fetchall()
    for session_id, tokens, covers in rows:
        db.execute("UPDATE session_tokens SET checksum = ? WHERE session_id = ?",
                   [fed_checksum(session_id, bytes(tokens), int(covers)), session_id])


@migration
def m008_session_model(db: Database) -> None:
    # sessions.model: the model a client chose for the session, as kvd names it (an alias resolved);
    # NULL: whichever model the daemon starts with (`--model`), as every session made before.
    # session_tokens.model: the model whose tokens the fed ids are (NULL: from before; taken as the
    # serving model's). session_stash: other models' fed ids of the session, put aside when it moved
    # to another model, so a switch back appends to exactly what that model fed (its cache matches).
    db.execute("ALTER TABLE sessions ADD COLUMN model TEXT")
    db.execute("ALTER TABLE session_tokens ADD COLUMN model TEXT")
    db.execute(
        """
        CREATE TABLE session_stash (
            session_id TEXT NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
            model TEXT NOT NULL,
            tokens BLOB NOT NULL,
            covers INTEGER NOT NULL CHECK (covers >= 0),
            checksum INTEGER NOT NULL,
            PRIMARY KEY (session_id, model)
        )
        """
    )


@migration
def m009_responses(db: Database) -> None:
    # The Responses API's stored responses (daemon/doors/responses.py): each names the point of a
    # session it answered, its assistant message `answer_idx`, and keeps what the request asked for
    # (instructions, tools, metadata...: `request`, JSON) so GET /v1/responses/{id} can show it. The
    # answer itself (text, calls, status, usage) stays in `messages`, written by the turn core.
    # A deleted session takes its responses with it.
    db.execute(
        """
        CREATE TABLE responses (
            id TEXT PRIMARY KEY,
            session_id TEXT NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
            answer_idx INTEGER NOT NULL CHECK (answer_idx >= 0),
            first_input INTEGER NOT NULL CHECK (first_input >= 0),
            previous_response_id TEXT,
            created_at REAL NOT NULL,
            request TEXT NOT NULL
        )
        """
    )
    db.execute("CREATE INDEX responses_session ON responses (session_id)")


@migration
def m010_response_items(db: Database) -> None:
    # responses.items_session: the session whose id names the response's input items (`msg_<session><idx>`)
    # when its conversation was branched away from a session rewritten in place (sessions/responses.py's
    # branch_away): the items keep the ids they were listed under. NULL: the response's own session.
    db.execute("ALTER TABLE responses ADD COLUMN items_session TEXT")


@migration
def m011_commit_count(db: Database) -> None:
    # How many fsynced commits the writer made (sessions/commits.py): a start that finds fewer than the
    # note beside the database says lost them (a deleted or damaged WAL). `database` names this database
    # (a backup is marked `backup`, and takes a new id when it is put back and served).
    db.execute(
        """
        CREATE TABLE commit_count (
            id INTEGER PRIMARY KEY CHECK (id = 1),
            database BLOB NOT NULL,
            commits INTEGER NOT NULL CHECK (commits >= 0),
            backup INTEGER NOT NULL DEFAULT 0
        )
        """
    )
    db.execute("INSERT INTO commit_count (id, database, commits) VALUES (1, randomblob(16), 0)")


@migration
def m012_message_reasoning(db: Database) -> None:
    # messages.reasoning: an assistant message's reasoning as a client sent it back apart from its content
    # (OpenAI-style `reasoning_content`, Anthropic's `thinking` blocks, Responses' `reasoning` items), which
    # chat templates render (Qwen3's in <think>). NULL: none.
    db.execute("ALTER TABLE messages ADD COLUMN reasoning TEXT")


@migration
def m013_item_names(db: Database) -> None:
    # The Responses API names a message's input items after its session and index (msg_<session><idx>); a
    # session cut back reuses those indices. `sessions.gen` counts the cuts, and each message keeps the one
    # it was written under (`messages.gen`): a message written after a cut at or below its index is named
    # apart (msg_<session><idx>g<gen>), so an item id kvd issued always names the item it was issued for.
    db.execute("ALTER TABLE sessions ADD COLUMN gen INTEGER NOT NULL DEFAULT 0")
    db.execute("ALTER TABLE messages ADD COLUMN gen INTEGER NOT NULL DEFAULT 0")
    # An item_reference to such an id whose message was branched away is found through the responses that
    # keep its name (responses.items_session, m010; sessions/responses.py's `holding`): without a scan.
    db.execute("CREATE INDEX responses_items ON responses (items_session) WHERE items_session IS NOT NULL")
