"""kill -9 at random moments of a real `kvd serve`, against an oracle of acknowledged turns.

Bounded: a few rounds, seeded (the seed is in the test id, so a failure
replays). A moment is "after the k-th event the client saw" with k random, so
kills land during prefill, mid-stream, right after a chat.done (while the
cache is paged out behind it) and between turns, without any sleeping.
The oracle: every turn acknowledged by chat.done is in the transcript after
the restart, complete, with exactly the text that streamed; nothing else
claims to be complete; and the daemon keeps answering in every session.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from daemonproc import DaemonProcess

ROUNDS = 4


@pytest.mark.parametrize("seed", [11, 29])
def test_kill_9_at_random_moments_keeps_every_acknowledged_turn(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    acknowledged: dict[str, list[tuple[str, str]]] = {}  # session -> [(user text, answer)]
    sessions: list[str] = []
    turn = 0
    for _ in range(ROUNDS):
        d = DaemonProcess(tmp_path)
        with d.client() as c:
            # The oracle holds across the previous kill.
            for sid in sessions:
                messages = c.request("session.get", session=sid)["messages"]
                # Each acknowledged turn, in order: its question, then its answer, complete and exact.
                # (A turn that finished unseen before the kill may be complete too: never acknowledged.)
                pairs = [(m["content"], n["content"]) for m, n in zip(messages, messages[1:])
                         if m["role"] == "user" and n["role"] == "assistant" and n["status"] == "complete"]
                it = iter(pairs)
                assert all(turn_ in it for turn_ in acknowledged[sid]), (acknowledged[sid], pairs)
            if len(sessions) < 3:
                sid = c.request("session.create")["session"]["id"]
                sessions.append(sid)
                acknowledged[sid] = []
            kill_after = rng.randint(1, 60)
            seen = 0
            while seen < kill_after:
                sid = rng.choice(sessions)
                turn += 1
                text = f"Turn {turn}: " + "words " * rng.randint(1, 80)
                rid = c.send(type="chat.send", session=sid, text=text, max_tokens=rng.randint(1, 24),
                             temperature=0)
                answer = ""
                while seen < kill_after:
                    event = c.recv()
                    if event.get("id") != rid:
                        continue
                    seen += 1
                    if event["type"] == "chat.delta":
                        answer += event["text"]
                    elif event["type"] == "chat.done":
                        acknowledged[sid].append((text, answer))
                        break
                    elif event["type"] == "error":
                        raise AssertionError(event)
            d.kill()
    d = DaemonProcess(tmp_path)
    try:
        with d.client() as c:
            for sid in sessions:
                _, done = c.chat(sid, "Still there?", max_tokens=3, temperature=0)
                assert done["type"] == "chat.done", done
    finally:
        assert d.terminate() == 0
    assert sum(map(len, acknowledged.values())) > 0
