"""chat.attach: a second connection picks up a running answer with no gap and no duplicate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conftest import Client, client, running_daemon

pytestmark = pytest.mark.anyio


async def read_until_done(c: Client, request_id: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    deltas = []
    while True:
        event = await c.recv()
        if event["type"] == "ok":
            continue  # chat.cancel's reply
        assert event["id"] == request_id, event
        if event["type"] == "chat.delta":
            deltas.append(event)
        else:
            assert event["type"] == "chat.done", event
            return deltas, event


async def test_attach_while_generating_continues_the_same_answer(tmp_path: Path) -> None:
    async with running_daemon(tmp_path) as d:
        async with client(d) as watcher:
            sid = (await watcher.request("session.create"))["session"]["id"]
            async with client(d) as first:
                await first.send({"id": "orig", "type": "chat.send", "session": sid, "text": "go on",
                                  "max_tokens": 4000, "temperature": 0})
                start = await first.recv()
                assert start["type"] == "chat.start"
                seen: list[dict[str, Any]] = []
                while len(seen) < 5:
                    event = await first.recv()
                    assert event["type"] == "chat.delta"
                    seen.append(event)
                # The first client drops without a goodbye; the answer runs on.
                (server_side,) = [c for c in d.daemon.websocket.connections
                                  if c.peer == "%s:%s" % first.ws.local_address[:2]]
                server_side.abort()

            # A second connection re-attaches after the last seq the first one saw.
            async with client(d) as second:
                await second.send({"id": "att", "type": "chat.attach", "session": sid,
                                   "after_seq": seen[-1]["seq"]})
                attached = await second.recv()
                assert attached == {"type": "chat.attached", "id": "att", "session": sid, "generating": True,
                                    "request": "orig", "message_index": start["message_index"]}
                more: list[dict[str, Any]] = []
                while len(more) < 5:
                    event = await second.recv()
                    assert event["type"] == "chat.delta" and event["id"] == "orig", event
                    more.append(event)
                # A third, with nothing seen, gets the whole answer replayed from seq 0.
                async with client(d) as third:
                    await third.send({"id": "all", "type": "chat.attach", "session": sid, "after_seq": -1})
                    assert (await third.recv())["generating"] is True
                    await second.send({"id": "stop", "type": "chat.cancel", "session": sid})
                    rest, done = await read_until_done(second, "orig")
                    replayed, done3 = await read_until_done(third, "orig")
                assert done["finish_reason"] == done3["finish_reason"] == "cancelled"

            got = await watcher.request("session.get", session=sid)

    answer = got["messages"][start["message_index"]]
    assert answer["status"] == "cancelled"
    union = seen + more + rest
    assert [e["seq"] for e in union] == list(range(len(union)))  # no gap, no duplicate
    assert "".join(e["text"] for e in union) == answer["content"]
    assert replayed == union  # exactly as first published: same id, session, seq and text
    assert all(e["session"] == sid for e in union)


async def test_attach_when_not_generating_returns_the_last_message(tmp_path: Path) -> None:
    async with running_daemon(tmp_path) as d:
        async with client(d) as c:
            sid = (await c.request("session.create"))["session"]["id"]
            empty = await c.request("chat.attach", session=sid, after_seq=-1)
            assert empty == {"type": "chat.attached", "id": empty["id"], "session": sid,
                             "generating": False, "message": None}
            deltas, done = await c.chat(sid, "hello", max_tokens=10, temperature=0)
            attached = await c.request("chat.attach", session=sid, after_seq=3)
            assert attached["generating"] is False
            message = attached["message"]
            assert message["index"] == done["message_index"] and message["role"] == "assistant"
            assert message["content"] == "".join(e["text"] for e in deltas)
            assert message["status"] == "complete"
            assert message["finish_reason"] == done["finish_reason"]
            assert message["usage"] == done["usage"]


@pytest.mark.parametrize("after_seq", [-2, "3", 1.5, True])
async def test_attach_refuses_a_bad_after_seq(tmp_path: Path, after_seq: Any) -> None:
    async with running_daemon(tmp_path) as d:
        async with client(d) as c:
            sid = (await c.request("session.create"))["session"]["id"]
            reply = await c.request("chat.attach", session=sid, after_seq=after_seq)
            assert (reply["type"], reply["code"]) == ("error", "bad_request")
