"""Fuzzed frames, as a table: each gets its precise error, the connection stays; floods are fair."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import anyio
import pytest

from conftest import client, running_daemon
from daemon.config import Config
from protocol.requests import RequestError, SessionCreate, parse_request

pytestmark = pytest.mark.anyio

SID = "0123456789abcdef"

# (raw frame, error code, the id the error echoes). Raw text, because the point
# is what JSON can say that Python's str or SQLite's UTF-8 cannot.
FUZZ: list[tuple[str, str, Any]] = [
    ('{"id": "\\ud800", "type": "ping"}', "bad_request", None),
    ('{"id": "x\\udfff", "type": "session.list"}', "bad_request", None),
    ('{"id": "a", "type": "session.create", "title": "\\ud800"}', "bad_request", "a"),
    ('{"id": "a", "type": "session.create", "system": "ok \\udc00 ok"}', "bad_request", "a"),
    ('{"id": "a", "type": "chat.send", "session": "%s", "text": "hi \\ud83d"}' % SID, "bad_request", "a"),
    ('{"id": "a", "type": "chat.send", "session": "%s", "text": "\\ude00 first"}' % SID, "bad_request", "a"),
    ('{"id": 7, "type": "session.update", "session": "%s", "params": {"\\ud800": 1}}' % SID, "bad_request", 7),
    ('{"id": "a", "\\ud800": 1, "type": "ping"}', "bad_request", "a"),
    ('{"id": "a", "type": "\\ud800"}', "bad_request", "a"),
    ("[" * 1000 + "]" * 1000, "bad_json", None),
    ("[" * 100_000, "bad_json", None),
    ('{"id": "a", "type": "ping", "x": ' + '{"y": ' * 5000 + "1" + "}" * 5000 + "}", "bad_json", None),
    # past common/jsondepth's 256 levels, which Python 3.11's parser reads and 3.12's reads deeper
    ('{"id": "a", "type": "ping", "x": ' + '{"y": ' * 300 + "1" + "}" * 300 + "}", "bad_json", None),
    ('{"id": ' + "9" * 5000 + ', "type": "ping"}', "bad_json", None),
    ('{"id": "a", "type": "chat.send", "session": "%s", "text": "hi", "temperature": NaN}' % SID,
     "bad_request", "a"),
    ('{"id": "a", "type": "chat.send", "session": "%s", "text": "hi", "top_p": Infinity}' % SID,
     "bad_request", "a"),
    ('{"id": true, "type": "ping"}', "bad_request", None),
    ('{"id": "a", "type": "ping"', "bad_json", None),
    ("null", "bad_json", None),
    ('"\\ud800"', "bad_json", None),
]


@pytest.mark.parametrize("raw, code, rid", FUZZ)
def test_parse_table(raw: str, code: str, rid: Any) -> None:
    with pytest.raises(RequestError) as info:
        parse_request(raw, Config().request_limits())
    event = info.value.event()
    assert (event["code"], event["id"]) == (code, rid)
    json.dumps(event).encode()  # the answer itself can always be sent
    event["message"].encode("utf-8")


def test_valid_non_bmp_text_is_fine() -> None:
    raw = '{"id": "a", "type": "session.create", "title": "\\ud83d\\ude00 ok"}'
    req = parse_request(raw, Config().request_limits())
    assert isinstance(req, SessionCreate) and req.title == "\U0001f600 ok"


async def test_fuzzed_frames_against_the_daemon(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    async with running_daemon(tmp_path, model="builtin:tiny") as d:
        async with client(d) as c:
            sid = (await c.request("session.create"))["session"]["id"]
            for raw, code, rid in FUZZ + FUZZ:  # twice: the second round must not log again
                await c.send(raw.replace(SID, sid))
                event = await c.recv()
                assert (event["type"], event["code"], event["id"]) == ("error", code, rid), (raw[:80], event)
                assert (await c.request("ping"))["type"] == "pong"
            # Nothing was stored by any of them; a real turn still works.
            assert (await c.request("session.get", session=sid))["messages"] == []
            assert (await c.request("session.list"))["sessions"][0]["title"] == "New chat"
            _, done = await c.chat(sid, "hi", max_tokens=3, temperature=0)
            assert done["type"] == "chat.done"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    deep = [r for r in caplog.records if "nested too deeply" in r.getMessage()]
    assert len(deep) == 1  # once per connection, however many such frames


async def test_a_flood_does_not_starve_another_client(tmp_path: Path) -> None:
    async with running_daemon(tmp_path, model="builtin:tiny") as d:
        async with client(d) as setup:
            for _ in range(200):
                await setup.request("session.create")
        async with client(d) as flooder, client(d) as other:
            n = 300
            for i in range(n):
                await flooder.send({"id": i, "type": "session.list"})
            assert (await flooder.recv())["id"] == 0  # the flood is being served
            assert (await other.request("ping"))["type"] == "pong"
            served = next(c for c in d.daemon.connection_statistics() if c.peer == _peer(flooder))
            # Without the yield the ping waits for all 300 (bench/fairness.py); now a handful at most.
            assert served.handled < n // 2, served
            for i in range(1, n):
                assert (await flooder.recv())["id"] == i


def _peer(c: Any) -> str:
    host, port = c.ws.local_address[:2]
    return f"{host}:{port}"


async def test_status_waiting_on_a_busy_engine_does_not_hold_up_cancel(tmp_path: Path) -> None:
    async with running_daemon(tmp_path, model="builtin:tiny") as d:
        async with client(d) as c:
            sid = (await c.request("session.create"))["session"]["id"]
            # An engine busy for the whole status wait: it never gets to the status query.
            d.daemon.engine.query_status = lambda reply: None  # type: ignore[method-assign]
            await c.send({"id": "s", "type": "status"})
            await c.send({"id": "c", "type": "chat.cancel", "session": sid})
            with anyio.fail_after(2):  # well inside the 5 s status wait
                assert (await c.recv())["id"] == "c"
            for i in range(4):
                await c.send({"id": f"s{i}", "type": "status"})
            busy = await c.recv()
            assert (busy["id"], busy["code"]) == ("s3", "busy")  # at most 4 slow ones at once


# The same hostile text as HTTP bodies, at each HTTP door: every one a 400 in OpenAI's shape, nothing stored.
BODIES: dict[str, list[str]] = {
    "chat/completions": [
        '{"messages": [{"role": "user", "content": "hi \\ud83d"}]}',
        '{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
        '{"messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}',
        '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + "9" * 5000 + "}",
        '{"messages": [{"\\ud800": "user", "content": "hi"}]}',
    ],
    "responses": [
        '{"input": "hi \\ud83d"}',
        '{"input": [{"role": "user", "content": [{"type": "input_text", "text": "\\ude00 first"}]}]}',
        '{"input": "hi", "instructions": "ok \\udc00 ok"}',
        '{"input": "hi", "metadata": {"\\ud800": "x"}}',
        '{"input": "hi", "temperature": NaN}',
        '{"input": "hi", "top_p": Infinity}',
        '{"input": "hi", "max_output_tokens": ' + "9" * 5000 + "}",
        '{"input": [{"type": "function_call_output", "call_id": "c", "output": ' + '{"y": ' * 5000 + "1" + "}" * 5000
        + "}]}",
    ],
}


@pytest.mark.parametrize("door", list(BODIES))
async def test_fuzzed_bodies_against_the_http_doors(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                    door: str) -> None:
    import httpx

    caplog.set_level(logging.INFO)
    async with running_daemon(tmp_path, model="builtin:tiny") as d:
        before = (d.store.list_sessions(), len(d.daemon.turns.active))
        async with httpx.AsyncClient(base_url=d.url.replace("ws://", "http://"),
                                     headers={"Authorization": f"Bearer {d.token}"}) as http:
            for raw in BODIES[door] + [raw for raw, _, _ in FUZZ]:  # the websocket's frames: not a request here
                r = await http.post(door, content=raw.encode("utf-8", "surrogatepass"), timeout=60,
                                    headers={"Content-Type": "application/json"})
                assert r.status_code == 400, (raw[:80], r.text[:200])
                error = r.json()["error"]
                assert set(error) == {"message", "type", "param", "code"} and error["message"], error
            assert (d.store.list_sessions(), len(d.daemon.turns.active)) == before
            ok = await http.post(door, json={"input": "hi", "max_output_tokens": 2} if door == "responses" else
                                 {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, timeout=60)
            assert ok.status_code == 200, ok.text[:200]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
