"""The handshake guards and bad input: every bad request is an error event, nothing is lost."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.frames import Frame, Opcode

from conftest import client, raw_client, running_daemon

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    "headers, path, status",
    [
        ({}, "/v1", 401),
        ({"Authorization": "Bearer wrong"}, "/v1", 401),
        ({"Authorization": "Basic abc"}, "/v1", 401),
        ({"Authorization": "Bearer {token}", "Origin": "http://evil.example"}, "/v1", 403),
        ({"Authorization": "Bearer {token}"}, "/v2", 404),
    ],
)
async def test_handshake_refused(tmp_path: Path, headers: dict[str, str], path: str, status: int) -> None:
    async with running_daemon(tmp_path) as d:
        headers = {k: v.format(token=d.token) for k, v in headers.items()}
        url = d.url.replace("/v1", path)
        with pytest.raises(InvalidStatus) as info:
            async with connect(url, additional_headers=headers, origin=None):
                pass
        assert info.value.response.status_code == status
        # The daemon keeps serving the rightful client.
        async with client(d) as c:
            assert (await c.request("ping"))["type"] == "pong"


async def test_token_file_is_private(tmp_path: Path) -> None:
    async with running_daemon(tmp_path) as d:
        mode = (tmp_path / "token").stat().st_mode & 0o777
        assert mode == 0o600
        assert d.token and d.token in (tmp_path / "token").read_text()


async def test_configured_origin_is_allowed(tmp_path: Path) -> None:
    async with running_daemon(tmp_path, allowed_origins=["http://localhost:3000"]) as d:
        async with connect(d.url, additional_headers={"Authorization": f"Bearer {d.token}"},
                           origin="http://localhost:3000") as ws:  # type: ignore[arg-type]
            assert json.loads(await ws.recv())["type"] == "hello"


BAD: list[tuple[Any, str]] = [
    ("not json", "bad_json"),
    ("[1, 2]", "bad_json"),
    (b"\x00binary", "bad_json"),
    ({"id": "a"}, "bad_request"),
    ({"id": [1], "type": "ping"}, "bad_request"),
    ({"id": "x" * 65, "type": "ping"}, "bad_request"),
    ({"id": "a", "type": "nope"}, "unknown_type"),
    ({"id": "a", "type": "session.get"}, "bad_request"),
    ({"id": "a", "type": "session.get", "session": "../../etc/passwd"}, "bad_request"),
    ({"id": "a", "type": "session.get", "session": "0123456789abcdef\n"}, "bad_request"),
    ({"id": "a", "type": "session.get", "session": "0123456789abcdef"}, "unknown_session"),
    ({"id": "a", "type": "chat.send", "session": "0123456789abcdef", "text": "hi"}, "unknown_session"),
    ({"id": "a", "type": "chat.cancel", "session": "0123456789abcdef"}, "unknown_session"),
    ({"id": "a", "type": "session.create", "title": ""}, "bad_request"),
    ({"id": "a", "type": "session.create", "title": 5}, "bad_request"),
    ({"id": "a", "type": "session.create", "title": "t" * 201}, "bad_request"),
    ({"id": "a", "type": "chat.send", "session": "{sid}"}, "bad_request"),
    ({"id": "a", "type": "chat.send", "session": "{sid}", "text": "   "}, "bad_request"),
    ({"id": "a", "type": "chat.send", "session": "{sid}", "text": "x" * 32001}, "too_large"),
    ({"id": "a", "type": "chat.send", "session": "{sid}", "text": "hi", "max_tokens": -1}, "bad_request"),
    ({"id": "a", "type": "chat.send", "session": "{sid}", "text": "hi", "max_tokens": 0}, "bad_request"),
    ({"id": "a", "type": "chat.send", "session": "{sid}", "text": "hi", "max_tokens": 10**9}, "bad_request"),
    ({"id": "a", "type": "chat.send", "session": "{sid}", "text": "hi", "max_tokens": "5"}, "bad_request"),
    ({"id": "a", "type": "chat.send", "session": "{sid}", "text": "hi", "max_tokens": True}, "bad_request"),
    ({"id": "a", "type": "chat.send", "session": "{sid}", "text": "hi", "temperature": 5}, "bad_request"),
    ({"id": "a", "type": "chat.send", "session": "{sid}", "text": "hi", "temperature": -1}, "bad_request"),
    ({"id": "a", "type": "chat.send", "session": "{sid}", "text": "hi", "top_p": 0}, "bad_request"),
    ({"id": "a", "type": "chat.send", "session": "{sid}", "text": 12}, "bad_request"),
    ({"id": "a", "type": "session.delete"}, "bad_request"),
    ({"id": "a", "type": "session.delete", "session": "../../x"}, "bad_request"),
    ({"id": "a", "type": "session.update", "session": "{sid}", "params": {"max_tokens": 10**9}}, "bad_request"),
    ({"id": "a", "type": "chat.attach", "session": "{sid}", "after_seq": -5}, "bad_request"),
    ({"id": "a", "type": "chat.attach", "session": "0123456789abcdef"}, "unknown_session"),
]


async def test_bad_input_is_an_error_event_and_loses_nothing(tmp_path: Path) -> None:
    async with running_daemon(tmp_path) as d:
        async with client(d) as c:
            sid = (await c.request("session.create"))["session"]["id"]
            for frame, code in BAD:
                if isinstance(frame, dict):
                    frame = json.loads(json.dumps(frame).replace("{sid}", sid))
                await c.send(frame)
                event = await c.recv()
                assert event["type"] == "error", (frame, event)
                assert event["code"] == code, (frame, event)
                assert event["message"]
                if isinstance(frame, dict) and isinstance(frame.get("id"), str) and len(frame["id"]) <= 64:
                    assert event["id"] == frame["id"]
                # The connection stays usable after each.
                assert (await c.request("ping"))["type"] == "pong"
            # Nothing was written by any of them; a real turn still works.
            got = await c.request("session.get", session=sid)
            assert got["messages"] == []
            _, done = await c.chat(sid, "hi", max_tokens=3, temperature=0)
            assert done["type"] == "chat.done"


async def test_oversize_frame_closes_only_that_connection(tmp_path: Path) -> None:
    async with running_daemon(tmp_path, max_message_bytes=4096) as d:
        async with client(d) as c:
            await c.send({"id": "big", "type": "ping", "pad": "x" * 8000})
            with pytest.raises(ConnectionClosed) as info:
                await c.recv()
            assert info.value.rcvd is not None and info.value.rcvd.code == 1009
        async with client(d) as c2:
            assert (await c2.request("ping"))["type"] == "pong"


async def test_client_that_stops_reading_is_cut_off(tmp_path: Path) -> None:
    """A stalled reader is disconnected after send_timeout; others are unaffected."""
    async with running_daemon(tmp_path, send_timeout=0.2) as d:
        async with client(d) as good:
            sid = (await good.request("session.create", system="z" * 30000))["session"]["id"]
            reader, writer = await raw_client(d.url, d.token)
            # Once hello arrives the daemon has registered this connection.
            assert b'"hello"' in await reader.read(4096)
            local = "%s:%s" % writer.get_extra_info("sockname")[:2]
            (stalled,) = [c for c in d.daemon.websocket.connections if c.peer == local]
            request = json.dumps({"id": 1, "type": "session.get", "session": sid}).encode()
            frame = Frame(Opcode.TEXT, request).serialize(mask=True, extensions=[])
            # ~18 MB of replies, far beyond any socket buffer, and this client reads none.
            with anyio.move_on_after(10):
                try:
                    for _ in range(600):
                        writer.write(frame)
                        await writer.drain()
                except (ConnectionResetError, BrokenPipeError):
                    pass  # already cut off
            # Not reading, the client is cut off once a send waits past send_timeout...
            with anyio.fail_after(30):
                await stalled.closed_event.wait()
            # ...while everyone else is served as before.
            other = (await good.request("session.create"))["session"]["id"]
            _, done = await good.chat(other, "still here?", max_tokens=5, temperature=0)
            assert done["type"] == "chat.done", done
            # Reading now, the stalled client finds its connection cut, not a live stream.
            with anyio.fail_after(30):
                try:
                    while await reader.read(1 << 16):
                        pass
                except ConnectionResetError:
                    pass
            writer.close()


async def test_the_log_names_who_was_refused_and_what_they_asked_for(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A refused token was logged without the path or the client; a 404 not at all (Claude Code's requests to
    /v1/messages went unseen). The official openai client, a wrong key, a path kvd lacks, a wrong websocket path,
    and a path kvd serves naming a response it does not have (logged once as "no such path")."""
    import logging
    import re

    import openai

    caplog.set_level(logging.WARNING, logger="kvd.server")
    async with running_daemon(tmp_path) as d:
        base = d.url.replace("ws://", "http://", 1)
        wrong = openai.AsyncOpenAI(base_url=base, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await wrong.chat.completions.create(model="kvd", messages=[{"role": "user", "content": "hi"}])
        right = openai.AsyncOpenAI(base_url=base, api_key=d.token, max_retries=0)
        with pytest.raises(openai.NotFoundError):
            await right.post("/assistants", cast_to=object, body={"model": "kvd"})
        with pytest.raises(InvalidStatus):
            async with connect(d.url.replace("/v1", "/v2"), additional_headers={"Authorization": f"Bearer {d.token}"}):
                pass
        with pytest.raises(openai.NotFoundError):  # a path kvd serves, naming what it does not have
            await right.responses.retrieve("resp_nope")
        await wrong.close()
        await right.close()
    said = [r.getMessage() for r in caplog.records if r.name == "kvd.server"]
    agent = r"\(User-Agent 'AsyncOpenAI/Python [^']+'\)"
    assert any(re.fullmatch(rf"refused \(chat door\) POST /v1/chat/completions from 127\.0\.0\.1:\d+ {agent}: HTTP 401 "
                            r"invalid_api_key: missing or wrong token; .+", line) for line in said), said
    assert any(re.fullmatch(rf"no such path \(chat door\) POST /v1/assistants from 127\.0\.0\.1:\d+ {agent}: HTTP 404: "
                            r"no such endpoint /v1/assistants; .+", line) for line in said), said
    assert any(re.fullmatch(r"no such path \(websocket door\) websocket /v2 from 127\.0\.0\.1:\d+ \(User-Agent "
                            r"'[^']+'\): HTTP 404: kvd speaks on /v1", line) for line in said), said
    # Not "no such path": an operator would look for a client pointed at the wrong endpoint.
    assert any(re.fullmatch(rf"not found \(responses door\) GET /v1/responses/resp_nope from 127\.0\.0\.1:\d+ {agent}: "
                            r"HTTP 404 not_found: no response 'resp_nope' .+", line) for line in said), said
    assert len(said) == 4, said  # each once
