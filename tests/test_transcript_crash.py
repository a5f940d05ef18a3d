"""What a crash at each point of a turn's transcript writes leaves behind (docs/caches.md's table).

A turn's rows are written behind it by the store's writer (sessions/writer.py):
its new messages and the answer's placeholder in one operation, queued when
the turn starts; the answer's end in one more, which `chat.done` waits for.
A real `kvd serve` dies like kill -9 just before or just after each commit,
and a restart shows what was kept: never half a turn's messages, and never
less than a turn that was acknowledged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from websockets.exceptions import ConnectionClosed

from daemonproc import DaemonProcess

QUESTION = "Is this kept?"


def crash_during_a_turn(data: Path, point: str) -> tuple[str, list[dict[str, Any]]]:
    """A session, then one turn during which kvd dies at `point`; the events the client saw."""
    d = DaemonProcess(data, crash_at=point)
    seen: list[dict[str, Any]] = []
    with d.client() as c:
        sid = c.request("session.create")["session"]["id"]
        rid = c.send(type="chat.send", session=sid, text=QUESTION, max_tokens=8, temperature=0)
        with pytest.raises(ConnectionClosed):
            while True:
                event = c.recv()
                if event.get("id") == rid:
                    seen.append(event)
    assert d.proc.wait(timeout=60) == -9
    return sid, seen


def after_restart(data: Path, sid: str) -> list[dict[str, Any]]:
    d = DaemonProcess(data)
    try:
        with d.client() as c:
            messages: list[dict[str, Any]] = c.request("session.get", session=sid)["messages"]
            _, done = c.chat(sid, "And now?", max_tokens=2, temperature=0)  # the session goes on
            assert done["type"] == "chat.done", done
    finally:
        d.terminate()
    return messages


def test_a_crash_before_the_turns_first_commit_leaves_nothing_of_it(tmp_path: Path) -> None:
    sid, seen = crash_during_a_turn(tmp_path, "transcript:before-commit:messages")
    assert not any(e["type"] == "chat.done" for e in seen)  # the turn may have begun; nothing was acknowledged
    assert after_restart(tmp_path, sid) == []


def test_a_crash_after_the_turns_first_commit_leaves_the_question_and_a_cut_answer(tmp_path: Path) -> None:
    sid, seen = crash_during_a_turn(tmp_path, "transcript:after-commit:messages")
    assert not any(e["type"] == "chat.done" for e in seen)
    question, answer = after_restart(tmp_path, sid)
    assert (question["role"], question["content"], question["status"]) == ("user", QUESTION, "complete")
    assert (answer["role"], answer["status"], answer["finish_reason"]) == ("assistant", "error", "interrupted")


def test_a_crash_before_the_answers_commit_leaves_it_cut(tmp_path: Path) -> None:
    sid, seen = crash_during_a_turn(tmp_path, "transcript:before-commit:answer")
    assert not any(e["type"] == "chat.done" for e in seen)  # never acknowledged
    question, answer = after_restart(tmp_path, sid)
    assert question["content"] == QUESTION
    assert (answer["status"], answer["finish_reason"]) == ("error", "interrupted")
    streamed = "".join(e["text"] for e in seen if e["type"] == "chat.delta")
    assert streamed.startswith(answer["content"])  # what was committed of it, at most what streamed


def test_a_crash_after_the_answers_commit_keeps_it_whole(tmp_path: Path) -> None:
    sid, seen = crash_during_a_turn(tmp_path, "transcript:after-commit:answer")
    assert not any(e["type"] == "chat.done" for e in seen)  # kvd died before it could say so
    question, answer = after_restart(tmp_path, sid)
    assert question["content"] == QUESTION
    assert answer["status"] == "complete"
    # Every delta was published before the commit; the last ones may not have reached the client.
    assert answer["content"].startswith("".join(e["text"] for e in seen if e["type"] == "chat.delta"))
