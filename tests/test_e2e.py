"""End to end, in process: a real daemon on port 0, the built-in models, a websocket client."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest

from conftest import client, greedy_reference, running_daemon
from daemon import device

pytestmark = pytest.mark.anyio

MODELS = ["builtin:tiny", "builtin:tiny-swa"]


@pytest.mark.parametrize("model", MODELS)
async def test_two_turns_stream_cache_and_transcript(tmp_path: Path, model: str) -> None:
    async with running_daemon(tmp_path, model=model) as d:
        async with client(d) as c:
            reply = await c.request("session.create", title="e2e", system="Be brief.")
            assert reply["type"] == "session"
            sid = reply["session"]["id"]
            turns = []
            # Turn one alone is longer than tiny-swa's 64-token window, so its
            # rotating caches have wrapped before turn two reuses them.
            for text in ["Hello, who are you? " * 4, "Tell me more about caches, please."]:
                deltas, done = await c.chat(sid, text, max_tokens=24, temperature=0)
                assert done["type"] == "chat.done", done
                assert [e["seq"] for e in deltas] == list(range(len(deltas)))
                assert deltas and all(e["session"] == sid for e in deltas)
                turns.append(("".join(e["text"] for e in deltas), done))
            listed = await c.request("session.list")
            assert [s["id"] for s in listed["sessions"]] == [sid]

    (text1, done1), (text2, done2) = turns
    u1, u2 = done1["usage"], done2["usage"]
    for u in (u1, u2):
        assert set(u) >= {"prompt_tokens", "completion_tokens", "cached_tokens", "ttft_ms", "decode_tps"}
        assert u["completion_tokens"] > 0 and u["ttft_ms"] > 0
    assert u1["cached_tokens"] == 0
    assert u1["prompt_tokens"] + u1["completion_tokens"] > 64
    # Turn two prefilled only its new message: everything fed in turn one was cached.
    assert u2["cached_tokens"] == u1["prompt_tokens"] + u1["completion_tokens"]
    assert u2["prompt_tokens"] > u2["cached_tokens"]

    db = sqlite3.connect(tmp_path / "kvd.sqlite")
    rows = db.execute("SELECT idx, role, content, status, finish_reason FROM messages "
                      "WHERE session_id = ? ORDER BY idx", [sid]).fetchall()
    assert [(r[0], r[1], r[3]) for r in rows] == [
        (0, "user", "complete"), (1, "assistant", "complete"),
        (2, "user", "complete"), (3, "assistant", "complete")]
    assert rows[1][2] == text1 and rows[3][2] == text2
    assert rows[3][4] == done2["finish_reason"]

    from common.tokenids import unpack_tokens
    (blob,) = db.execute("SELECT tokens FROM session_tokens WHERE session_id = ?", [sid]).fetchone()
    tokens = unpack_tokens(blob)
    assert len(tokens) == u2["prompt_tokens"] + u2["completion_tokens"]
    # Exact: the answer after reusing the cache equals a fresh full prefill's.
    short = model.split(":", 1)[1]
    reference = greedy_reference(tmp_path / "models" / short, tokens[: u2["prompt_tokens"]],
                                 u2["completion_tokens"])
    assert tokens[u2["prompt_tokens"]:] == reference


async def test_cancel_keeps_partial_answer_and_cache(tmp_path: Path) -> None:
    async with running_daemon(tmp_path) as d:
        async with client(d) as c:
            sid = (await c.request("session.create"))["session"]["id"]
            await c.send({"id": "long", "type": "chat.send", "session": sid, "text": "go on",
                          "max_tokens": 4000, "temperature": 0})
            assert (await c.recv())["type"] == "chat.start"
            first, second = await c.recv(), await c.recv()
            # Two deltas: a decode step has fed the first token (a cancel before that is
            # tests/test_engine.py's test_cancel_before_the_first_token_is_fed_keeps_it_in_the_history).
            assert first["type"] == second["type"] == "chat.delta"
            await c.send({"id": "stop", "type": "chat.cancel", "session": sid})
            streamed = first["text"] + second["text"]
            ok_seen = False
            while True:
                event = await c.recv()
                if event["type"] == "ok":
                    assert event["id"] == "stop"
                    ok_seen = True
                elif event["type"] == "chat.delta":
                    streamed += event["text"]
                else:
                    break
            assert event["type"] == "chat.done" and event["finish_reason"] == "cancelled"
            assert ok_seen
            generated = event["usage"]["completion_tokens"]
            assert 0 < generated < 4000
            got = await c.request("session.get", session=sid)
            answer = got["messages"][1]
            assert answer["status"] == "cancelled" and answer["content"] == streamed
            # The partial answer stays in the cache: the next turn reuses all of it.
            _, done = await c.chat(sid, "and now?", max_tokens=4, temperature=0)
            assert done["usage"]["cached_tokens"] == event["usage"]["prompt_tokens"] + generated


async def test_answer_survives_client_disconnect(tmp_path: Path) -> None:
    async with running_daemon(tmp_path) as d:
        async with client(d) as c:
            sid = (await c.request("session.create"))["session"]["id"]
            await c.send({"id": "x", "type": "chat.send", "session": sid, "text": "hi",
                          "max_tokens": 40, "temperature": 0})
            assert (await c.recv())["type"] == "chat.start"
        # The client is gone; the answer is generated and kept all the same.
        async with client(d) as c:
            while True:
                got = await c.request("session.get", session=sid)
                if got["messages"][1]["status"] != "streaming":
                    break
            answer = got["messages"][1]
            assert answer["status"] == "complete" and answer["content"]
            assert got["session"]["tokens"] > 0


async def test_busy_session_and_parallel_sessions(tmp_path: Path) -> None:
    async with running_daemon(tmp_path) as d:
        async with client(d) as c:
            a = (await c.request("session.create"))["session"]["id"]
            b = (await c.request("session.create"))["session"]["id"]
            await c.send({"id": "a1", "type": "chat.send", "session": a, "text": "one",
                          "max_tokens": 30, "temperature": 0})
            await c.send({"id": "a2", "type": "chat.send", "session": a, "text": "two"})
            await c.send({"id": "b1", "type": "chat.send", "session": b, "text": "three",
                          "max_tokens": 30, "temperature": 0})
            closing: dict[str, dict[str, Any]] = {}
            while len(closing) < 3:
                event = await c.recv()
                if event["type"] in ("chat.done", "error"):
                    closing[event["id"]] = event
            assert closing["a2"]["type"] == "error" and closing["a2"]["code"] == "busy"
            assert closing["a1"]["type"] == closing["b1"]["type"] == "chat.done"


async def test_prompt_beyond_context_is_refused_and_taken_back(tmp_path: Path) -> None:
    async with running_daemon(tmp_path) as d:
        async with client(d) as c:
            sid = (await c.request("session.create", system="z" * 30000))["session"]["id"]
            _, event = await c.chat(sid, "hi", max_tokens=8)
            assert event["type"] == "error" and event["code"] == "too_large"
            assert "context" in event["message"]
            got = await c.request("session.get", session=sid)
            assert got["messages"] == []
            # The daemon keeps serving.
            other = (await c.request("session.create"))["session"]["id"]
            _, done = await c.chat(other, "hi", max_tokens=3, temperature=0)
            assert done["type"] == "chat.done"


async def test_status_shows_each_answer_in_progress(tmp_path: Path) -> None:
    import io

    from rich.console import Console

    from daemon.service.status import render_status

    async with running_daemon(tmp_path) as d:
        async with client(d) as talker, client(d) as watcher:
            sid = (await talker.request("session.create"))["session"]["id"]
            await talker.send({"id": "t", "type": "chat.send", "session": sid, "text": "Go on and on.",
                               "max_tokens": 4000, "temperature": 0})
            while (await talker.recv())["type"] != "chat.delta":
                pass
            status = await watcher.request("status")
            await talker.send({"id": "c", "type": "chat.cancel", "session": sid})
    turn = status["answering"][sid]
    assert status["generating"] == 1 and turn["phase"] == "decode"
    assert turn["generated"] >= 1 and turn["fed"] == turn["prompt_tokens"] > 0
    console = Console(width=200, file=io.StringIO(), color_system=None)
    render_status(status, console)
    shown = console.file.getvalue()  # type: ignore[attr-defined]
    assert f"session {sid}: answering, {turn['generated']} token(s) so far after a " in shown
    assert f"\n{device.current().line('float32')}\n" in shown  # the device it runs on (daemon/device.py)
    running = status["tiers"]["running"]  # the answer's cache counts against the resident budget
    assert 0 < running["bytes"] <= running["budget"] == status["tiers"]["resident"]["budget"]
    assert "running and resident caches together stay within" in shown
    # At 60 columns (a terminal that narrow gets its own width): the tiers table fits, none of its rows broken
    # by the terminal (the lines of text are left for the terminal to wrap, so a path copies whole).
    from daemon.service.status import status_width

    assert status_width(Console(width=60, force_terminal=True)) == 60
    assert status_width(Console(width=60, file=io.StringIO())) == 100  # a pipe: room for the reader
    narrow = Console(width=60, file=io.StringIO(), color_system=None)
    render_status(status, narrow)
    lines = narrow.file.getvalue().splitlines()  # type: ignore[attr-defined]
    table = [line for line in lines if any(c in line for c in "│┃━")]
    assert len(table) >= 6 and all(len(line) <= 60 for line in table), table
    assert [line.split()[0] for line in table if line.split()[0] in ("running", "resident", "warm", "disk")] == [
        "running", "resident", "warm", "disk"], table  # the tiers' names whole, not `runn…`
    assert "…" not in "".join(table) and "hits" not in table[0], table  # columns left out, none cut
    assert "(hits, misses, page-ins and page-outs: in a terminal at least 78 columns wide, or kvd status --json)" \
        in " ".join(" ".join(lines).split())


async def test_each_turns_first_delta_is_handed_to_the_engine_as_sent(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The listener that writes a turn's first delta sets its job's `handed` (the engine waits for it
    after the first token, FIRST_HANDOFF_S at most: unset, every turn would pay that bound): the
    websocket's writer, the OpenAI stream's send, the OpenAI body that sends nothing before the end."""
    import openai

    from daemon.engine.running import Answer
    from daemon.engine.thread import Engine

    jobs: list[Answer] = []
    submit = Engine.submit

    def recorded(self: Engine, job: Answer) -> None:
        jobs.append(job)
        submit(self, job)

    monkeypatch.setattr(Engine, "submit", recorded)
    async with running_daemon(tmp_path) as d:
        async with client(d) as c:
            sid = (await c.request("session.create", title="handed"))["session"]["id"]
            for text in ["Hello, who are you?", "And then?"]:
                deltas, done = await c.chat(sid, text, max_tokens=8, temperature=0)
                assert done["type"] == "chat.done" and deltas
        async with openai.AsyncOpenAI(base_url=d.url.replace("ws://", "http://"), api_key=d.token,
                                      max_retries=0) as api:
            said: list[Any] = [{"role": "user", "content": "Hello, who are you?"}]
            whole = await api.chat.completions.create(model="kvd", max_tokens=8, messages=said)
            assert whole.choices[0].message.content
            stream = await api.chat.completions.create(model="kvd", max_tokens=8, stream=True, messages=said)
            assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert len(jobs) == 4 and all(j.handed is not None and j.handed.is_set() for j in jobs)
