"""The transcript store: the source of truth for every conversation."""

from __future__ import annotations

import itertools
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from common.migrate import LEGACY_TABLE
from sessions import (
    Session,
    Store,
    UnknownMessage,
    UnknownSession,
    is_valid_session_id,
    new_session_id,
)
from sessions.migrations import MIGRATIONS

REPO = Path(__file__).resolve().parent.parent
MISSING = "0123456789abcdef"


def counter_clock() -> Callable[[], float]:
    """A clock that ticks once per call, so ordering never depends on timing."""
    ticks = itertools.count(1000)
    return lambda: float(next(ticks))


def raw_query(db_path: Path, sql: str, params: tuple[object, ...] = ()) -> list[tuple[Any, ...]]:
    """Read the file through a separate connection: what another process would see."""
    with closing(sqlite3.connect(db_path)) as raw:
        return raw.execute(sql, params).fetchall()


def get(store: Store, session_id: str) -> Session:
    session = store.get_session(session_id)
    assert session is not None
    return session


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "kvd.sqlite3"


@pytest.fixture
def store(db_path: Path) -> Iterator[Store]:
    with Store(db_path, clock=counter_clock()) as s:
        yield s


# Ids


def test_new_session_ids_are_valid_and_distinct() -> None:
    ids = {new_session_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(is_valid_session_id(i) for i in ids)


@pytest.mark.parametrize(
    "value",
    ["", "0123456789ABCDEF", "0123456789abcde", "0123456789abcdef0",
     "0123456789abcdef\n", "../../etc/passwd", "0123456789abcdeg", None, 12, b"0123456789abcdef"],
)  # fmt: skip
def test_invalid_session_ids(value: object) -> None:
    assert not is_valid_session_id(value)


# Sessions


def test_create_and_get_session(store: Store) -> None:
    created = store.create_session(title="New chat")
    assert is_valid_session_id(created["id"])
    assert created == {
        "id": created["id"],
        "title": "New chat",
        "system": None,
        "created_at": created["created_at"],
        "updated_at": created["created_at"],
        "message_count": 0,
        "last_message": None,
        "tokens": 0,
        "params": {},
        "origin": None,
        "model": None,
    }
    assert store.get_session(created["id"]) == created
    api = store.create_session(title="From a client", origin="api (curl/8.5)")
    assert store.get_session(api["id"]) == api and api["origin"] == "api (curl/8.5)"

    tiny = store.create_session(title="Tiny", model="builtin:tiny")
    assert get(store, tiny["id"])["model"] == "builtin:tiny"
    store.update_session(tiny["id"], model="builtin:tiny-swa")
    assert get(store, tiny["id"])["model"] == "builtin:tiny-swa"

    other = store.create_session(title="Plans", system="Be brief.")
    got = get(store, other["id"])
    assert (got["title"], got["system"]) == ("Plans", "Be brief.")


def test_get_missing_session_is_none(store: Store) -> None:
    assert store.get_session(MISSING) is None


def test_rename_and_set_system(store: Store) -> None:
    s = store.create_session(title="New chat")
    store.update_session(s["id"], title="Renamed")
    store.update_session(s["id"], system="You are terse.")
    got = get(store, s["id"])
    assert (got["title"], got["system"]) == ("Renamed", "You are terse.")
    # Renaming is not use: the listing order does not change.
    assert got["updated_at"] == s["updated_at"]
    store.update_session(s["id"], system=None)
    assert get(store, s["id"])["system"] is None


def test_update_session_changes_only_given_fields(store: Store) -> None:
    s = store.create_session(title="before", system="Be brief.")
    store.update_session(s["id"], params={"temperature": 0.2, "max_tokens": 64})
    got = get(store, s["id"])
    assert (got["title"], got["system"]) == ("before", "Be brief.")
    assert got["params"] == {"temperature": 0.2, "max_tokens": 64}
    store.update_session(s["id"], title="after", system=None)
    got = get(store, s["id"])
    assert (got["title"], got["system"], got["params"]) == ("after", None, {"temperature": 0.2, "max_tokens": 64})
    store.update_session(s["id"], params={})
    assert get(store, s["id"])["params"] == {}
    store.update_session(s["id"])  # nothing to change is not an error
    # Changing settings is not use: the listing order does not change.
    assert get(store, s["id"])["updated_at"] == s["updated_at"]
    with pytest.raises(UnknownSession):
        store.update_session(MISSING)
    with pytest.raises(UnknownSession):
        store.update_session(MISSING, title="x")


def test_list_sessions_most_recently_updated_first(store: Store) -> None:
    a, b, c = (store.create_session(title=t) for t in "abc")
    assert [s["title"] for s in store.list_sessions()] == ["c", "b", "a"]
    store.append_message(a["id"], "user", "hi")  # use, as a turn is
    assert [s["title"] for s in store.list_sessions()] == ["a", "c", "b"]
    store.append_message(b["id"], "user", "hi")
    assert [s["title"] for s in store.list_sessions()] == ["b", "a", "c"]
    assert [s["title"] for s in store.list_sessions(limit=2)] == ["b", "a"]
    assert store.list_sessions(limit=0) == []
    with pytest.raises(ValueError):
        store.list_sessions(limit=-1)
    assert c["id"] in {s["id"] for s in store.list_sessions()}


def test_list_sessions_ties_break_newest_first(db_path: Path) -> None:
    with Store(db_path, clock=lambda: 5.0) as store:
        ids = [store.create_session(title="New chat")["id"] for _ in range(3)]
        assert [s["id"] for s in store.list_sessions()] == ids[::-1]


def test_session_summary_fields(store: Store) -> None:
    s = store.create_session(title="New chat")
    store.append_message(s["id"], "user", "first")
    store.append_message(s["id"], "assistant", "é" * 500)
    store.set_tokens(s["id"], range(37))
    (listed,) = store.list_sessions()
    assert listed == store.get_session(s["id"])
    assert listed["message_count"] == 2
    assert listed["last_message"] == "é" * 200  # characters, not bytes
    assert listed["tokens"] == 37


def test_summary_fields_do_not_leak_between_sessions(store: Store) -> None:
    a = store.create_session(title="a")
    b = store.create_session(title="b")
    store.append_message(a["id"], "user", "only in a")
    store.set_tokens(a["id"], [1, 2, 3])
    by_title = {s["title"]: s for s in store.list_sessions()}
    assert (by_title["a"]["message_count"], by_title["a"]["tokens"]) == (1, 3)
    assert by_title["b"]["message_count"] == 0
    assert by_title["b"]["last_message"] is None
    assert by_title["b"]["tokens"] == 0
    assert b["id"] == by_title["b"]["id"]


def test_delete_session_cascades(store: Store, db_path: Path) -> None:
    s = store.create_session(title="New chat")
    keep = store.create_session(title="New chat")
    store.append_message(s["id"], "user", "hi")
    store.append_message(keep["id"], "user", "stay")
    store.set_tokens(s["id"], [1, 2, 3])
    assert store.delete_session(s["id"]) is True
    assert store.delete_session(s["id"]) is False
    assert store.get_session(s["id"]) is None
    assert raw_query(db_path, "SELECT count(*) FROM messages WHERE session_id = ?", (s["id"],)) == [(0,)]
    assert raw_query(db_path, "SELECT count(*) FROM session_tokens") == [(0,)]
    assert [m["content"] for m in store.messages(keep["id"])] == ["stay"]


# Messages


def test_append_and_read_messages(store: Store) -> None:
    s = store.create_session(title="New chat")
    assert store.append_message(s["id"], "user", "hello") == 0
    assert store.append_message(s["id"], "assistant", "", status="streaming") == 1
    messages = store.messages(s["id"])
    assert [(m["index"], m["role"], m["content"], m["status"]) for m in messages] == [
        (0, "user", "hello", "complete"),
        (1, "assistant", "", "streaming"),
    ]
    assert set(messages[0]) == {
        "index", "role", "content", "status", "finish_reason", "usage", "fed_end",
        "created_at", "updated_at", "tool_calls", "tool_call_id", "reasoning", "gen",
    }  # fmt: skip
    assert messages[0]["finish_reason"] is None and messages[0]["usage"] is None and messages[0]["reasoning"] is None
    assert messages[0]["tool_calls"] is None and messages[0]["tool_call_id"] is None


def test_tool_calls_and_tool_results_are_kept(store: Store) -> None:
    s = store.create_session(title="Tools")
    call = {"id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'}
    store.append_message(s["id"], "user", "Weather in Paris?")
    i = store.append_message(s["id"], "assistant", "", status="streaming")
    store.update_message(s["id"], i, content="", status="complete", tool_calls=[call])
    store.append_message(s["id"], "tool", "18 C, sunny", tool_call_id="call_1")
    got = store.messages(s["id"])
    assert [(m["role"], m["tool_calls"], m["tool_call_id"]) for m in got] == [
        ("user", None, None), ("assistant", [call], None), ("tool", None, "call_1")]
    with pytest.raises(ValueError, match="role must be one of user, assistant, tool"):
        store.append_message(s["id"], "robot", "beep")


def test_append_message_touches_session(store: Store) -> None:
    s = store.create_session(title="New chat")
    store.append_message(s["id"], "user", "hi")
    assert get(store, s["id"])["updated_at"] > s["updated_at"]


def test_messages_of_empty_session(store: Store) -> None:
    assert store.messages(store.create_session(title="New chat")["id"]) == []


def test_update_message_changes_only_given_fields(store: Store) -> None:
    s = store.create_session(title="New chat")
    store.append_message(s["id"], "user", "q")
    i = store.append_message(s["id"], "assistant", "", status="streaming")
    store.update_message(s["id"], i, content="Hel")
    store.update_message(s["id"], i, content="Hello")
    m = store.messages(s["id"])[i]
    assert (m["content"], m["status"], m["finish_reason"], m["usage"]) == (
        "Hello", "streaming", None, None,
    )  # fmt: skip
    assert m["updated_at"] > m["created_at"]

    usage = {"prompt_tokens": 40, "completion_tokens": 12, "ttft_ms": 35.2}
    store.update_message(s["id"], i, status="complete", finish_reason="stop", usage=usage)
    m = store.messages(s["id"])[i]
    assert (m["content"], m["status"], m["finish_reason"], m["usage"]) == (
        "Hello", "complete", "stop", usage,
    )  # fmt: skip
    # The other message is untouched.
    assert store.messages(s["id"])[0]["content"] == "q"


def test_update_missing_message(store: Store) -> None:
    s = store.create_session(title="New chat")
    with pytest.raises(UnknownMessage) as info:
        store.update_message(s["id"], 0, content="x")
    assert info.value.index == 0
    assert isinstance(info.value, KeyError)


def test_truncate_messages(store: Store) -> None:
    s = store.create_session(title="New chat")
    for i in range(5):
        store.append_message(s["id"], "user" if i % 2 == 0 else "assistant", f"m{i}")
    assert store.truncate_messages(s["id"], 3) == 2
    assert [m["content"] for m in store.messages(s["id"])] == ["m0", "m1", "m2"]
    # Indexes stay contiguous after a truncate.
    assert store.append_message(s["id"], "assistant", "again") == 3
    assert store.truncate_messages(s["id"], 10) == 0
    assert store.truncate_messages(s["id"], 0) == 4
    assert store.messages(s["id"]) == []
    assert store.append_message(s["id"], "user", "fresh") == 0
    with pytest.raises(ValueError):
        store.truncate_messages(s["id"], -1)


@pytest.mark.parametrize("role", ["system", "developer", "", "USER"])
def test_invalid_role_raises(store: Store, role: str) -> None:
    s = store.create_session(title="New chat")
    with pytest.raises(ValueError, match="role"):
        store.append_message(s["id"], role, "x")
    assert store.messages(s["id"]) == []


def test_invalid_status_raises(store: Store) -> None:
    s = store.create_session(title="New chat")
    with pytest.raises(ValueError, match="status"):
        store.append_message(s["id"], "user", "x", status="done")
    i = store.append_message(s["id"], "assistant", "", status="streaming")
    with pytest.raises(ValueError, match="status"):
        store.update_message(s["id"], i, status="finished")
    assert store.messages(s["id"])[i]["status"] == "streaming"


def test_recover_interrupted(store: Store) -> None:
    a = store.create_session(title="New chat")
    b = store.create_session(title="New chat")
    store.append_message(a["id"], "user", "q")
    store.append_message(a["id"], "assistant", "partial", status="streaming")
    store.append_message(b["id"], "assistant", "done")
    store.append_message(b["id"], "assistant", "stopped", status="cancelled")
    store.append_message(b["id"], "assistant", "half", status="streaming")
    assert store.recover_interrupted() == 2
    assert store.recover_interrupted() == 0
    statuses = [
        (m["content"], m["status"], m["finish_reason"])
        for sid in (a["id"], b["id"])
        for m in store.messages(sid)
    ]
    assert statuses == [
        ("q", "complete", None),
        ("partial", "error", "interrupted"),
        ("done", "complete", None),
        ("stopped", "cancelled", None),
        ("half", "error", "interrupted"),
    ]


# Token ids


def test_tokens_round_trip(store: Store) -> None:
    s = store.create_session(title="New chat")
    assert store.fed(s["id"])[0] == []
    ids = [0, 1, 151_643, 2**31, 2**32 - 1]
    store.set_tokens(s["id"], ids)
    assert store.fed(s["id"])[0] == ids
    big = [(i * 2_654_435_761) % 2**32 for i in range(10_000)]
    store.set_tokens(s["id"], big)
    assert store.fed(s["id"])[0] == big
    assert get(store, s["id"])["tokens"] == 10_000
    store.set_tokens(s["id"], [])
    assert store.fed(s["id"])[0] == []


def test_tokens_are_little_endian_uint32(store: Store, db_path: Path) -> None:
    s = store.create_session(title="New chat")
    store.set_tokens(s["id"], [1, 0x01020304])
    assert raw_query(db_path, "SELECT tokens FROM session_tokens") == [
        (b"\x01\x00\x00\x00\x04\x03\x02\x01",)
    ]


@pytest.mark.parametrize("bad", [[-1], [2**32], [1, 2, 2**40]])
def test_out_of_range_tokens_raise(store: Store, bad: list[int]) -> None:
    s = store.create_session(title="New chat")
    store.set_tokens(s["id"], [7])
    with pytest.raises(ValueError, match="out of range"):
        store.set_tokens(s["id"], bad)
    assert store.fed(s["id"])[0] == [7]


def test_non_integer_tokens_raise(store: Store) -> None:
    s = store.create_session(title="New chat")
    with pytest.raises(TypeError):
        store.set_tokens(s["id"], [1.5])  # type: ignore[list-item]


# Unknown sessions


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.messages(MISSING),
        lambda s: s.append_message(MISSING, "user", "x"),
        lambda s: s.update_message(MISSING, 0, content="x"),
        lambda s: s.truncate_messages(MISSING, 0),
        lambda s: s.fed(MISSING),
        lambda s: s.set_tokens(MISSING, [1]),
        lambda s: s.update_session(MISSING, params={}),
    ],
)
def test_unknown_session_raises(store: Store, call: Callable[[Store], object]) -> None:
    with pytest.raises(UnknownSession) as info:
        call(store)
    assert info.value.session_id == MISSING
    assert isinstance(info.value, KeyError)
    assert MISSING in str(info.value)
    assert store.list_sessions() == []


# Opening, migrations, durability


def test_migrations_are_idempotent(db_path: Path) -> None:
    Store(db_path).close()
    with Store(db_path) as store:
        s = store.create_session(title="survives")
    with Store(db_path) as store:
        assert store.get_session(s["id"]) is not None
    names = [r[0] for r in raw_query(db_path, "SELECT name FROM _sqlite_migrations "
                                               "WHERE migration_set = 'kvd.sessions' ORDER BY id")]
    assert names == ["m001_initial", "m002_session_params", "m003_fed_blocks", "m004_drop_fed_blocks",
                     "m005_session_origin", "m006_tool_messages", "m007_fed_ids_checksum", "m008_session_model",
                     "m009_responses", "m010_response_items", "m011_commit_count", "m012_message_reasoning",
                     "m013_item_names"]


def test_a_database_from_before_session_params_is_migrated(db_path: Path) -> None:
    """A kvd.sqlite written by the first release gains the params column, rows intact.

    Its migrations were recorded by kvd's own runner (in _kvd_migrations); they
    move to sqlite-utils' table and only the later ones run.
    """
    from sqlite_utils import Database

    from sessions.migrations import m001_initial, migrate

    db = Database(db_path)
    db.execute(f"CREATE TABLE {LEGACY_TABLE} (name TEXT PRIMARY KEY, applied_at REAL NOT NULL)")
    m001_initial(db)
    db.execute(f"INSERT INTO {LEGACY_TABLE} VALUES ('m001_initial', 0)")
    db.execute("INSERT INTO sessions (id, title, system, created_at, updated_at) "
               "VALUES (?, 'old', NULL, 1, 1)", [MISSING])
    db.execute("INSERT INTO messages (session_id, idx, role, content, status, finish_reason, usage, fed_end, "
               "created_at, updated_at) VALUES (?, 0, 'user', 'kept', 'complete', NULL, NULL, 7, 1, 1)", [MISSING])
    db.conn.commit()
    assert migrate(db) == ["m002_session_params", "m003_fed_blocks", "m004_drop_fed_blocks", "m005_session_origin",
                           "m006_tool_messages", "m007_fed_ids_checksum", "m008_session_model",
                           "m009_responses", "m010_response_items", "m011_commit_count", "m012_message_reasoning",
                           "m013_item_names"]
    assert LEGACY_TABLE not in db.table_names() and MIGRATIONS.pending(db) == []
    assert migrate(db) == []
    db.close()
    with Store(db_path) as store:
        old = get(store, MISSING)
        assert (old["title"], old["params"], old["origin"]) == ("old", {}, None)
        store.update_session(MISSING, params={"top_p": 0.9})
        assert get(store, MISSING)["params"] == {"top_p": 0.9}
        (kept,) = store.messages(MISSING)  # the messages table was rebuilt (m006), its rows kept
        assert (kept["role"], kept["content"], kept["fed_end"], kept["tool_calls"]) == ("user", "kept", 7, None)
        assert kept["reasoning"] is None and kept["gen"] == 0  # m012, m013: named as before (msg_<session>000000)
        store.truncate_messages(MISSING, 1)
        store.append_message(MISSING, "assistant", "after a cut")
        assert [m["gen"] for m in store.messages(MISSING)] == [0, 1]  # named apart from what was cut (…000001g1)
        store.db.execute("PRAGMA foreign_keys = ON")
        store.delete_session(MISSING)  # the rebuilt table still cascades
        assert store.db.execute("SELECT count(*) FROM messages").fetchone()[0] == 0


def test_file_database_pragmas(store: Store) -> None:
    def pragma(name: str) -> object:
        return store.db.execute(f"PRAGMA {name}").fetchone()[0]

    assert pragma("journal_mode") == "wal"
    assert pragma("synchronous") == 2  # FULL (bench/synchronous.py measured its cost)
    assert pragma("foreign_keys") == 1
    assert pragma("busy_timeout") == 5000


def test_memory_database() -> None:
    with Store(":memory:") as store:
        s = store.create_session(title="New chat")
        store.append_message(s["id"], "user", "hi")
        assert store.list_sessions()[0]["message_count"] == 1


_CRASH_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    from sessions import Store

    store = Store(sys.argv[1])
    session_id = sys.argv[2]
    store.append_message(session_id, "user", "written before the crash")
    i = store.append_message(session_id, "assistant", "", status="streaming")
    store.update_message(session_id, i, content="half an ans")
    store.set_tokens(session_id, [1, 2, 3])
    os.kill(os.getpid(), signal.SIGKILL)  # no close(), no atexit, no checkpoint
    """
)


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_commits_survive_a_killed_process(db_path: Path) -> None:
    with Store(db_path) as store:
        session_id = store.create_session(title="New chat")["id"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.run(
        [sys.executable, "-c", _CRASH_CHILD, str(db_path), session_id],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert child.returncode == -signal.SIGKILL, child.stderr

    with Store(db_path) as store:
        messages = store.messages(session_id)
        assert [(m["content"], m["status"]) for m in messages] == [
            ("written before the crash", "complete"),
            ("half an ans", "streaming"),
        ]
        assert store.fed(session_id)[0] == [1, 2, 3]
        assert store.recover_interrupted() == 1
        assert store.messages(session_id)[1]["finish_reason"] == "interrupted"


def test_update_message_is_one_statement_and_one_commit(store: Store) -> None:
    """It runs for every streamed chunk: no reads, no second write, no fsync (synchronous NORMAL)."""
    s = store.create_session(title="New chat")
    i = store.append_message(s["id"], "assistant", "", status="streaming")
    statements: list[str] = []
    store.db.conn.set_trace_callback(statements.append)
    try:
        store.update_message(s["id"], i, content="Hel", usage={"completion_tokens": 1})
    finally:
        store.db.conn.set_trace_callback(None)
    assert [" ".join(sql.split()[:2]) for sql in statements] == [
        "PRAGMA synchronous", "BEGIN", "UPDATE messages", "COMMIT", "PRAGMA synchronous"]
    assert statements[0].endswith("NORMAL") and statements[-1].endswith("FULL")


def test_fed_end_marks_turn_boundaries_until_forgotten(tmp_path: Path) -> None:
    store = Store(tmp_path / "kvd.sqlite")
    sid = store.create_session(title="New chat")["id"]
    for i in range(4):
        store.append_message(sid, "user" if i % 2 == 0 else "assistant", f"m{i}")
    store.update_message(sid, 1, fed_end=40)
    store.update_message(sid, 3, fed_end=90)
    assert [m["fed_end"] for m in store.messages(sid)] == [None, 40, None, 90]
    store.forget_fed_ends(sid, before_index=3)
    assert [m["fed_end"] for m in store.messages(sid)] == [None, None, None, 90]
    store.set_tokens(sid, list(range(90)), covers=4)
    assert store.fed(sid) == (list(range(90)), 4)


def test_other_models_fed_ids_are_put_aside_and_checked(store: Store) -> None:
    from sessions import stash

    sid = store.create_session(title="two models")["id"]
    store.set_tokens(sid, [1, 2, 3], covers=2, model="builtin:tiny")
    assert stash.fed_model(store, sid) == "builtin:tiny" and store.fed(sid) == ([1, 2, 3], 2)
    stash.stash(store, sid, "builtin:tiny", [1, 2, 3], 2)
    stash.stash(store, sid, "builtin:gemma3", [7, 8], 2)
    assert stash.stashed(store, sid) == {"builtin:tiny": ([1, 2, 3], 2), "builtin:gemma3": ([7, 8], 2)}
    stash.unstash(store, sid, "builtin:tiny")
    store.db.execute("UPDATE session_stash SET covers = 1 WHERE model = 'builtin:gemma3'")  # no longer its sum
    assert stash.stashed(store, sid) == {}  # a damaged row is dropped, not used
    assert store.db.execute("SELECT COUNT(*) FROM session_stash").fetchone()[0] == 0
    stash.stash(store, sid, "builtin:gemma3", [7, 8], 2)
    stash.drop_stash(store, sid)
    assert stash.stashed(store, sid) == {}
    stash.stash(store, sid, "builtin:gemma3", [7, 8], 2)
    assert store.delete_session(sid) and store.db.execute("SELECT COUNT(*) FROM session_stash").fetchone()[0] == 0


def test_the_sessions_a_client_named_one_conversation_are_one_conversation(store: Store) -> None:
    """Claude Code's title request and its conversation are two sessions its metadata names as one run; a
    retry of that conversation is a branch of it, and so of the run: every one lists under the run's first."""
    origin = "api (claude-cli/2.1.197; conversation c0ffee)"
    title = store.create_session(title="t", system="Write a title.", origin=origin)["id"]
    main = store.create_session(title="t", system="You are Claude Code.", origin=origin)["id"]
    store.append_message(main, "user", "Say hello.")
    retry = store.create_session(title="t", system="You are Claude Code.", origin="api (claude-cli/2.1.197)")["id"]
    store.append_message(retry, "user", "Say hello.")  # the same first request, in another session: a branch
    other = store.create_session(title="t", origin="api (claude-cli/2.1.197; conversation beef)")["id"]
    listed = {s["id"]: s.get("branch_of") for s in store.list_sessions(branches=True)}
    assert listed == {title: None, main: title, retry: title, other: None}
