"""Many sessions at once: one decode batch, a queue past max_generations, a stalled client.

Every answer generated beside others must equal the same request run alone
(greedy): batching, interleaved prefill and cancellation change timing only.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from websockets.frames import Frame, Opcode

from conftest import Client, RunningDaemon, client, raw_client, running_daemon

pytestmark = pytest.mark.anyio

PROMPTS = [f"Tell me a story about caches, number {i}." for i in range(8)]
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 48}


class Answer:
    def __init__(self) -> None:
        self.text = ""
        self.done: dict[str, Any] = {}
        self.first = self.last = 0.0
        self.queued: list[int] = []


async def ask(c: Client, session: str, text: str, answer: Answer, *, rid: str = "q",
              on_delta: Any = None, **fields: Any) -> Answer:
    await c.send({"id": rid, "type": "chat.send", "session": session, "text": text, **fields})
    while True:
        event = await c.recv()
        if event.get("id") != rid:
            continue
        if event["type"] == "chat.queued":
            answer.queued.append(event["position"])
        elif event["type"] == "chat.delta":
            answer.first = answer.first or time.monotonic()
            answer.last = time.monotonic()
            answer.text += event["text"]
            if on_delta is not None:
                await on_delta(answer)
        elif event["type"] in ("chat.done", "error"):
            answer.done = event
            return answer


async def alone(d: RunningDaemon, text: str) -> str:
    async with client(d) as c:
        sid = (await c.request("session.create"))["session"]["id"]
        return (await ask(c, sid, text, Answer(), **GREEDY)).text


async def stall(d: RunningDaemon, text: str) -> str:
    """A client that starts an answer, then floods requests and reads nothing until cut off."""
    async with client(d) as c:
        sid: str = (await c.request("session.create"))["session"]["id"]
        # A session whose session.get reply is ~30 kB: a few hundred of them fill any socket buffer.
        big = (await c.request("session.create", system="z" * 30000))["session"]["id"]
    reader, writer = await raw_client(d.url, d.token)
    assert b'"hello"' in await reader.read(4096)
    local = "%s:%s" % writer.get_extra_info("sockname")[:2]
    (conn,) = [c for c in d.daemon.websocket.connections if c.peer == local]

    def frame(request: dict[str, Any]) -> bytes:
        return Frame(Opcode.TEXT, json.dumps(request).encode()).serialize(mask=True, extensions=[])

    writer.write(frame({"id": "s", "type": "chat.send", "session": sid, "text": text, **GREEDY}))
    with anyio.move_on_after(10):
        try:
            while not conn.closed:
                writer.write(frame({"id": 1, "type": "session.get", "session": big}))
                await writer.drain()
        except (ConnectionResetError, BrokenPipeError):
            pass
    with anyio.fail_after(30):
        await conn.closed_event.wait()
    writer.close()
    return sid


async def test_eight_clients_at_once_each_equal_to_alone(tmp_path: Path) -> None:
    answers = [Answer() for _ in PROMPTS]
    stalled: list[str] = []
    async with running_daemon(tmp_path, send_timeout=0.2) as d:
        # Every client connects and makes its session first, then all ask at once: on a loaded
        # machine a client still connecting could otherwise find the first answers already done.
        connected: list[int] = []
        everyone = anyio.Event()

        async def one(i: int) -> None:
            async with client(d) as c:
                sid = (await c.request("session.create"))["session"]["id"]
                connected.append(i)
                if len(connected) == len(PROMPTS):
                    everyone.set()
                await everyone.wait()
                await ask(c, sid, PROMPTS[i], answers[i], **GREEDY)

        async def stalling() -> None:
            stalled.append(await stall(d, "A story for nobody reading."))

        async with anyio.create_task_group() as tg:
            tg.start_soon(stalling)
            for i in range(len(PROMPTS)):
                tg.start_soon(one, i)
        assert all(a.done["type"] == "chat.done" for a in answers), [a.done for a in answers]
        # The answers were generated side by side: some two streams overlapped in time (none do when
        # the engine serves one at a time). Pairs, not "before the first to end": a short answer can
        # end before a late one has begun while the others still overlap.
        streamed = [a for a in answers if a.first]
        assert any(a.first < b.last and b.first < a.last for a, b in itertools.combinations(streamed, 2))
        # The stalled client was cut off, but its answer runs on into the transcript.
        (sid,) = stalled
        gen = d.daemon.turns.active.get(sid)
        if gen is not None:
            with anyio.fail_after(60):
                await gen.finished.wait()
        kept = d.store.messages(sid)[-1]
        assert kept["status"] == "complete"
        for prompt, a in zip(PROMPTS, answers):
            assert a.text == await alone(d, prompt), prompt
        assert kept["content"] == await alone(d, "A story for nobody reading.")


async def test_cancelling_one_leaves_the_others_unchanged(tmp_path: Path) -> None:
    answers = [Answer() for _ in range(3)]
    async with running_daemon(tmp_path) as d:
        async with client(d) as c:
            sids = [(await c.request("session.create"))["session"]["id"] for _ in answers]

            cancelled: list[str] = []

            async def cancel_once_streaming(a: Answer) -> None:
                if not cancelled:
                    cancelled.append(a.text)
                    await c.send({"id": "x", "type": "chat.cancel", "session": sids[1]})

            async with client(d) as c0, client(d) as c2:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(lambda: ask(c0, sids[0], PROMPTS[0], answers[0], **GREEDY))
                    tg.start_soon(lambda: ask(c, sids[1], PROMPTS[1], answers[1], rid="q1",
                                              on_delta=cancel_once_streaming, **GREEDY))
                    tg.start_soon(lambda: ask(c2, sids[2], PROMPTS[2], answers[2], **GREEDY))
        assert answers[1].done["finish_reason"] == "cancelled"
        assert d.store.messages(sids[1])[-1]["content"] == answers[1].text
        for i in (0, 2):
            assert answers[i].done["finish_reason"] != "cancelled"
            assert answers[i].text == await alone(d, PROMPTS[i])


async def test_past_max_generations_requests_wait_and_learn_their_place(tmp_path: Path) -> None:
    async with running_daemon(tmp_path, max_generations=2) as d:
        async with client(d) as c:
            sids = [(await c.request("session.create"))["session"]["id"] for _ in range(4)]
            for i, sid in enumerate(sids):
                await c.send({"id": f"q{i}", "type": "chat.send", "session": sid,
                              "text": PROMPTS[i], **GREEDY})
            answers = {f"q{i}": Answer() for i in range(4)}
            order: list[str] = []  # by first delta
            while not all(a.done for a in answers.values()):
                event = await c.recv()
                a = answers[event["id"]]
                if event["type"] == "chat.queued":
                    a.queued.append(event["position"])
                elif event["type"] == "chat.delta":
                    if not a.text:
                        order.append(event["id"])
                    a.text += event["text"]
                elif event["type"] == "chat.done":
                    a.done = event
            status = await c.request("status")
        assert answers["q0"].queued == [] and answers["q1"].queued == []
        assert answers["q2"].queued == [1]
        assert answers["q3"].queued == [2, 1]  # it moved up when q2 started
        assert order[2:] == ["q2", "q3"]  # first come, first served
        assert status["generating"] == 0 and status["waiting"] == 0
        for i in range(4):
            assert answers[f"q{i}"].text == await alone(d, PROMPTS[i])


async def test_connections_past_the_limit_are_refused_with_503(tmp_path: Path) -> None:
    from websockets.exceptions import InvalidStatus

    async with running_daemon(tmp_path, max_connections=2) as d:
        async with client(d), client(d):
            with pytest.raises(InvalidStatus) as info:
                async with d.connect():
                    pass
            assert info.value.response.status_code == 503
            assert b"max_connections" in info.value.response.body
            # kvchat says what is wrong and what to do.
            from tui.client import Client as Kvchat
            from tui.errors import Unreachable

            with pytest.raises(Unreachable, match="max_connections"):
                await Kvchat.connect(d.url, d.token)
        async with client(d) as c:  # a slot is free again
            assert (await c.request("ping"))["type"] == "pong"
