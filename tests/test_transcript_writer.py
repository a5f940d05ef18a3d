"""The transcript's writer (group commit, in order, failing alone) and the chains index placement reads."""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from sessions import Store, UnknownSession, is_disk_full
from sessions.chains import Chains, build, chain
from sessions.writer import Writer


@pytest.fixture
def store(tmp_path: Path) -> Any:
    with Store(tmp_path / "kvd.sqlite") as s:
        yield s


def test_queued_operations_commit_together_in_order(store: Store) -> None:
    sid = store.create_session(title="t")["id"]
    writer = Writer(store)
    writer.start()
    try:
        gate = threading.Event()
        blocked = writer.submit(lambda s: gate.wait(30))
        def append(i: int) -> Callable[[Store], int]:
            return lambda s: s.append_message(sid, "user", f"m{i}", index=i)

        appends = [writer.submit(append(i), durable=i == 9) for i in range(10)]
        read = writer.submit(lambda s: [m["content"] for m in s.messages(sid)])
        before = writer.batches
        gate.set()
        assert blocked.result(30) is True
        assert [f.result(30) for f in appends] == list(range(10))
        assert read.result(30) == [f"m{i}" for i in range(10)]  # a read sees every write queued before it
        assert writer.batches - before <= 1  # the eleven queued behind the gate: one transaction
    finally:
        writer.close()


def test_an_operation_that_fails_fails_alone(store: Store) -> None:
    sid = store.create_session(title="t")["id"]
    writer = Writer(store)
    writer.start()
    try:
        gate = threading.Event()
        writer.submit(lambda s: gate.wait(30))
        ok = writer.submit(lambda s: s.append_message(sid, "user", "kept"))
        bad = writer.submit(lambda s: s.append_message("0123456789abcdef", "user", "nowhere"))
        wrong_index = writer.submit(lambda s: s.append_message(sid, "user", "drifted", index=5))
        also = writer.submit(lambda s: s.append_message(sid, "assistant", "kept too"), durable=True)
        gate.set()
        assert ok.result(30) == 0 and also.result(30) == 1
        assert isinstance(bad.exception(30), UnknownSession)
        assert isinstance(wrong_index.exception(30), ValueError)
    finally:
        writer.close()
    assert [m["content"] for m in store.messages(sid)] == ["kept", "kept too"]


def test_a_full_disk_fails_the_operations_that_do_not_fit_and_keeps_the_others(store: Store) -> None:
    sid = store.create_session(title="t")["id"]
    (pages,) = store.db.execute("PRAGMA page_count").fetchone()
    store.db.execute(f"PRAGMA max_page_count = {pages}")
    writer = Writer(store)
    writer.start()
    try:
        gate = threading.Event()
        writer.submit(lambda s: gate.wait(30))
        small = writer.submit(lambda s: s.update_session(sid, title="u"))
        huge = writer.submit(lambda s: s.append_message(sid, "user", "x" * 100_000))
        gate.set()
        assert small.result(30) is None
        full = huge.exception(30)
        assert full is not None and is_disk_full(full)
    finally:
        writer.close()
    assert store.get_session(sid)["title"] == "u"  # type: ignore[index]
    assert store.messages(sid) == []


def test_before_it_starts_the_writer_runs_each_operation_at_once(store: Store) -> None:
    writer = Writer(store)
    future = writer.submit(lambda s: s.create_session(title="now")["title"])
    assert future.done() and future.result() == "now"


def said(*texts: str) -> list[dict[str, Any]]:
    return [{"index": i, "role": "user" if i % 2 == 0 else "assistant", "content": t, "tool_calls": None,
             "tool_call_id": None} for i, t in enumerate(texts)]


def test_the_longest_stored_prefix_of_a_request_is_found() -> None:
    chains = Chains()
    chains.put("a", "sys", said("hi", "hello"))
    chains.put("b", "sys", said("hi", "hello", "more", "sure"))
    chains.put("c", None, said("hi", "hello", "more", "sure"))  # another system prompt
    request = chain("sys", said("hi", "hello", "more", "sure", "again"))
    assert chains.longest(request) == ("b", 4)
    assert chains.longest(request, skip={"b"}) == ("a", 2)  # b is answering
    assert chains.longest(chain("sys", said("hi", "hello"))) is None  # nothing new: no continuation
    assert chains.longest(chain("sys", said("hi", "other", "x"))) is None
    assert chains.agree("b", chain("sys", said("hi", "hello", "edited"))) == 2
    assert chains.index_of("b", 2) == 2


def test_the_chain_follows_appends_changes_and_truncation() -> None:
    chains = Chains()
    chains.put("a", None, said("q1"))
    assert chains.message("a", 1, "assistant", "", None, None, "streaming")  # the placeholder: not said
    assert chains.longest(chain(None, said("q1", "a1", "q2"))) == ("a", 1)
    assert chains.message("a", 1, "assistant", "a1", None, None)  # the answer's end
    assert chains.longest(chain(None, said("q1", "a1", "q2"))) == ("a", 2)
    assert not chains.message("a", 0, "user", "q1 edited", None, None)  # an earlier message: put it whole
    chains.truncate("a", 1)
    assert chains.said_count("a") == 1
    assert chains.longest(chain(None, said("q1", "a1"))) == ("a", 1)
    chains.remove("a")
    assert chains.longest(chain(None, said("q1", "a1"))) is None


def test_tool_call_arguments_compare_as_json() -> None:
    def calls(arguments: str) -> list[dict[str, Any]]:
        return [{"index": 0, "role": "user", "content": "weather?", "tool_calls": None, "tool_call_id": None},
                {"index": 1, "role": "assistant", "content": "",
                 "tool_calls": [{"id": "call_1", "name": "get", "arguments": arguments}], "tool_call_id": None}]

    assert chain(None, calls('{"city": "Paris"}')) == chain(None, calls('{"city":"Paris"}'))
    assert chain(None, calls('{"city": "Paris"}')) != chain(None, calls('{"city": "Rome"}'))


def test_the_index_built_from_the_store_matches_one_kept_as_it_was_written(store: Store) -> None:
    a = store.create_session(title="a", system="sys")["id"]
    for text in ("hi", "hello", "more"):
        store.append_message(a, "user" if text != "hello" else "assistant", text)
    store.append_message(a, "assistant", "", status="cancelled")  # cut before any text: not said
    empty = store.create_session(title="empty")["id"]
    built = build(store.chain_rows())
    assert empty in built and built.said_count(empty) == 0
    assert built.longest(chain("sys", said("hi", "hello", "more", "next"))) == (a, 3)


def test_an_answer_that_ended_at_once_is_said_one_cut_before_any_text_is_not() -> None:
    """An API client gets an empty answer that ended (and sends it back); it never saw one it hung up on."""
    chains = Chains()
    chains.put("a", None, [{"index": 0, "role": "user", "content": "q"},
                           {"index": 1, "role": "assistant", "content": "", "status": "complete"}])
    chains.put("b", None, [{"index": 0, "role": "user", "content": "q"},
                           {"index": 1, "role": "assistant", "content": "", "status": "cancelled"}])
    assert chains.longest(chain(None, said("q", "", "next"))) == ("a", 2)
    assert chains.longest(chain(None, said("q", "next"))) == ("b", 1)


def test_a_cancelled_wait_neither_drops_the_write_nor_stops_the_writer(store: Store) -> None:
    """A task awaiting `run` that is cancelled (shutdown) cancels its future; the write still happens."""
    sid = store.create_session(title="t")["id"]
    writer = Writer(store)
    writer.start()
    try:
        gate = threading.Event()
        writer.submit(lambda s: gate.wait(30))
        abandoned = writer.submit(lambda s: s.append_message(sid, "user", "kept"), durable=True)
        assert abandoned.cancel()  # still queued behind the gate: nobody waits for it any more
        gate.set()
        after = writer.submit(lambda s: [m["content"] for m in s.messages(sid)])
        assert after.result(30) == ["kept"]  # the writer lived on, and the abandoned write was made
    finally:
        writer.close()


def test_each_fsynced_commit_is_counted_in_the_database_and_noted_beside_it(tmp_path: Path) -> None:
    from daemon.service.backup import back_up, backups
    from daemon.service.preflight import lost_commits, put_back_backup
    from sessions.commits import counted, note_path, read_note

    db = tmp_path / "kvd.sqlite"
    with Store(db) as store:
        assert lost_commits(store, db) is None  # no note yet: counting starts here
        sid = store.create_session(title="t")["id"]
        writer = Writer(store)
        for i in range(3):
            writer.submit(partial(Store.append_message, session_id=sid, role="user", content=f"m{i}"),
                          durable=i != 1)
        writer.submit(lambda s: s.append_message(sid, "user", "streamed"))  # not fsynced: not counted
        assert counted(store).commits == 2
        note = read_note(note_path(db))
        assert note is not None and note.commits == 2 and note.database == counted(store).database
        assert lost_commits(store, db) is None
        backup = back_up(db, tmp_path / "backups")
        writer.submit(lambda s: s.append_message(sid, "user", "after the backup"), durable=True)
    # The WAL lost since: here, the database put back as it was at the backup, by hand (not kvd's put-back).
    with Store(db) as store:
        store.db.execute("UPDATE commit_count SET commits = 2")
        loss = lost_commits(store, db)
        assert loss is not None and loss.lost == 1
        Writer(store).submit(lambda s: s.append_message(sid, "user", "later"), durable=True)
        loss = lost_commits(store, db)  # said again at the next start, though the count moved on
        assert loss is not None and loss.lost == 1 and read_note(note_path(db)) == loss
    # kvd's own backup put back: a database of its own, no loss.
    db.write_bytes(backups(tmp_path / "backups")[-1].read_bytes())
    assert backups(tmp_path / "backups") == [backup]
    with Store(db) as store:
        before = counted(store).database
        assert put_back_backup(store) and not put_back_backup(store)
        assert counted(store).database != before
        assert lost_commits(store, db) is None
