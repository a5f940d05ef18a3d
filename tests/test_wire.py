"""The wire projection: what a session and a message look like to a client, from real store rows."""

from __future__ import annotations

import protocol
from protocol import wire
from sessions import Store


def test_a_session_on_the_wire_is_the_documented_fields_plus_its_tier() -> None:
    with Store(":memory:") as store:
        session = store.create_session(title=protocol.DEFAULT_TITLE, system="Be brief.")
        shown = wire.session_object(session, protocol.NO_CACHE)
    assert list(shown) == ["id", "title", "system", "created_at", "updated_at", "message_count",
                           "last_message", "tokens", "params", "origin", "model", "cache"]
    assert shown["title"] == "New chat" and shown["system"] == "Be brief." and shown["cache"] == "none"


def test_a_message_on_the_wire_leaves_the_stores_bookkeeping_behind() -> None:
    with Store(":memory:") as store:
        sid = store.create_session(title="t")["id"]
        store.append_message(sid, "user", "hi")
        store.append_message(sid, "assistant", "hello")
        store.update_message(sid, 1, status="complete", finish_reason="stop", fed_end=12)
        stored = store.messages(sid)
    assert stored[1]["fed_end"] == 12  # the store keeps it for the fed-token rule
    shown = [wire.message_object(m) for m in stored]
    assert [list(m) for m in shown] == [["index", "role", "content", "status", "finish_reason", "usage",
                                         "created_at", "updated_at"]] * 2
    assert (shown[1]["content"], shown[1]["status"], shown[1]["finish_reason"]) == ("hello", "complete", "stop")
