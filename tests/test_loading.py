"""While the model loads: hello says so, `loading` events follow, then `ready` (or the load's error)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import Client, client, running_daemon

pytestmark = pytest.mark.anyio


async def test_loading_then_ready(tmp_path: Path) -> None:
    # The engine is not started: the daemon serves while "its model loads" for as long as the test likes.
    async with running_daemon(tmp_path, start_engine=False) as d:
        async with d.connect() as ws:
            c = Client(ws)
            hello = await c.recv()
            assert hello["type"] == "hello" and hello["ready"] is False
            assert hello["loading"]["stage"] == "loading builtin:tiny"
            assert hello["loading"]["elapsed_s"] >= 0
            loading = await c.recv()  # pushed about once a second
            assert loading["type"] == "loading" and loading["stage"] == "loading builtin:tiny"
            assert loading["elapsed_s"] >= hello["loading"]["elapsed_s"]

            # Requests keep working meanwhile; a chat turn waits for the model.
            sid = (await c.request("session.create"))["session"]["id"]
            await c.send({"id": "early", "type": "chat.send", "session": sid, "text": "hi",
                          "max_tokens": 3, "temperature": 0})
            d.daemon.engine.start()
            kinds = []
            while "ready" not in kinds or "chat.done" not in kinds:
                kinds.append((await c.recv())["type"])
            # `ready` ends the loading events; the waiting turn's events may come before or after it.
            assert kinds.count("ready") == 1 and "loading" not in kinds[kinds.index("ready"):]
            turn = [k for k in kinds if k not in ("loading", "ready")]
            assert turn[0] == "chat.start" and turn[-1] == "chat.done" and "chat.delta" in turn

            # Once ready, a newcomer's hello says so and nothing else about loading follows.
            async with client(d) as late:
                assert (await late.request("ping"))["type"] == "pong"
            async with d.connect() as ws2:
                hello = json.loads(await ws2.recv())
                assert hello["ready"] is True and "loading" not in hello


async def test_a_model_that_fails_to_load_is_reported_to_every_client(tmp_path: Path) -> None:
    async with running_daemon(tmp_path, model="/nonexistent/model", start_engine=False) as d:
        async with d.connect() as ws:
            c = Client(ws)
            assert (await c.recv())["ready"] is False
            d.daemon.engine.start()
            while (event := await c.recv())["type"] == "loading":
                pass
            assert event["type"] == "error" and event["id"] is None and event["code"] == "internal"
            assert event["message"].startswith("the model failed to load: ")
            assert "restart kvd" in event["message"]
        # A client that comes later hears it right after hello.
        async with d.connect() as ws:
            c = Client(ws)
            hello = await c.recv()
            assert hello["ready"] is False and "loading" not in hello
            assert (await c.recv())["code"] == "internal"
            sid = (await c.request("session.create"))["session"]["id"]
            _, event = await c.chat(sid, "hi", max_tokens=3)
            assert event["type"] == "error" and "failed to load" in event["message"]
