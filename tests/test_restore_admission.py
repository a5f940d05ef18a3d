"""A cache read from disk never stops the engine, and running caches are admitted by their bytes.

Like test_engine.py, these drive a real Engine on the test thread (`load()`,
then `submit()`/`cancel()` and `step()`), with the built-in tiny model. The
I/O worker's reader is held at a gate (a read that waits on an Event), so
"the read is still under way" is a state the test controls.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import greedy_reference
from daemon.config import Config, load_config
from daemon.engine.jobs import Done, EngineEvent
from daemon.engine.running import Answer
from daemon.engine.thread import Engine
from daemon.events import AnswerDelta, AnswerQueued
from daemon.prompt import prompt_tokens
from protocol.shapes import Sampling

LONG = "Tell me everything about caches and how they page out to disk. " * 6


@pytest.fixture
def gate() -> Iterator[threading.Event]:
    g = threading.Event()
    yield g
    g.set()  # never leave the reader waiting


def config(tmp_path: Path, **fields: Any) -> Config:
    return load_config(None, data_dir=tmp_path, model="builtin:tiny", prefill_step_size=64, **fields)


def loaded(cfg: Config) -> Engine:
    e = Engine(cfg)
    e.load()
    return e


def first_turn(e: Engine, sid: str, text: str, events: list[EngineEvent], max_tokens: int) -> Answer:
    return turn(e, sid, [{"role": "user", "content": text}], [], 0, events, max_tokens)


def next_turn(e: Engine, sid: str, text: str, events: list[EngineEvent], end: Done, max_tokens: int) -> Answer:
    """The turn after `end`, whose ids append to exactly the ones that turn fed."""
    answer = "".join(x.text for x in events if isinstance(x, AnswerDelta))
    assert end.tokens is not None
    messages = [{"role": "user", "content": text}, {"role": "assistant", "content": answer},
                {"role": "user", "content": "And then?"}]
    return turn(e, sid, messages, end.tokens, 2, [], max_tokens)


def turn(e: Engine, sid: str, messages: list[dict[str, Any]], fed: list[int], fed_covers: int,
         events: list[EngineEvent], max_tokens: int) -> Answer:
    tokens, retokenized = prompt_tokens(e.tokenizer, messages, None, fed, fed_covers=fed_covers)
    return Answer(session_id=sid, tokens=tokens, retokenized=retokenized, fed_before=len(fed),
                   sampling=Sampling.of(max_tokens, 0.0, 1.0), emit=events.append)


def ended(events: list[EngineEvent]) -> Done | None:
    return next((x for x in events if isinstance(x, Done)), None)


def assert_exact(tmp_path: Path, end: Done) -> None:
    """The answer equals what a fresh full prefill of the same prompt continues with."""
    assert end.tokens is not None
    n = end.usage["prompt_tokens"]
    answer = end.tokens[n:]
    assert answer and answer == greedy_reference(tmp_path / "models" / "tiny", end.tokens[:n], len(answer))


def generated(e: Engine, sid: str) -> int:
    return e.statistics().answers[sid].generated


def test_a_restore_from_disk_never_stops_the_other_sessions(tmp_path: Path, gate: threading.Event) -> None:
    """While A's cache is read from disk, B gets a token at every step; A starts when the read reports."""
    a, b = "a" * 16, "b" * 16
    before = loaded(config(tmp_path))
    events: list[EngineEvent] = []
    before.submit(first_turn(before, a, LONG, events, max_tokens=8))
    while (first := ended(events)) is None:
        before.step()
    before.close()  # pages A's cache out to disk, as a stop does
    e = loaded(config(tmp_path))  # a fresh start: A's cache is only on disk (no prefetch here)
    assert e.caches is not None and e.caches.locations() == {a: "disk"}
    b_events: list[EngineEvent] = []
    e.submit(first_turn(e, b, "Hi.", b_events, max_tokens=400))
    while b not in e.statistics().answers or generated(e, b) < 2:
        e.step()
    e.caches.before_reads(gate.wait)  # the reader is busy: A's read waits behind this
    job = next_turn(e, a, LONG, events, first, max_tokens=8)
    a_events: list[EngineEvent] = []
    job.emit = a_events.append
    e.submit(job)
    for _ in range(12):
        was = generated(e, b)
        e.step()
        assert generated(e, b) == was + 1  # B decodes on
    assert a_events == [] and e.statistics().running == 2  # A is admitted, waiting for its read
    gate.set()
    while (end := ended(a_events)) is None:
        e.step()
    assert end.usage["restored_from"] == "disk" and end.usage["cached_tokens"] > 0
    e.cancel(b)
    e.step()
    e.caches.close()
    assert_exact(tmp_path, end)


def test_a_turn_cancelled_while_its_cache_is_read_ends_at_once(tmp_path: Path, gate: threading.Event) -> None:
    a = "c" * 16
    before = loaded(config(tmp_path))
    events: list[EngineEvent] = []
    before.submit(first_turn(before, a, LONG, events, max_tokens=4))
    while (first := ended(events)) is None:
        before.step()
    before.close()
    e = loaded(config(tmp_path))
    assert e.caches is not None
    e.caches.before_reads(gate.wait)
    job = next_turn(e, a, LONG, events, first, max_tokens=4)
    again: list[EngineEvent] = []
    job.emit = again.append
    e.submit(job)
    e.step()
    e.cancel(a)
    e.step()
    end = ended(again)
    assert end is not None and end.finish_reason == "cancelled" and e.statistics().running == 0
    gate.set()
    e.caches.flush()
    e.step()  # the read's report arrives for nobody: dropped
    assert e.statistics().running == 0 and e.caches.statistics()["running"]["bytes"] == 0
    e.caches.close()


def test_sessions_whose_caches_exceed_the_budget_run_within_it_exactly(tmp_path: Path) -> None:
    """Eight sessions whose caches together are more than resident_bytes: at most what fits runs at
    once, the rest wait; memory (running plus idle resident) stays within the budget; each answer
    equals a fresh prefill's, in the first turn and in the next, restored from wherever it went."""
    sids = [f"{k:x}" * 16 for k in range(8)]
    texts = [f"Session {k} asks: " + LONG for k in range(8)]
    # What one turn's cache may reach, as the engine reckons it.
    probe = loaded(config(tmp_path / "probe"))
    probe.submit(first_turn(probe, sids[0], texts[0], [], max_tokens=24))
    probe.step()
    assert probe.caches is not None
    need = probe.caches.statistics()["running"]["bytes"]
    probe.cancel(sids[0])
    probe.step()
    probe.caches.close()
    assert need > 0
    budget = 3 * need + need // 2  # three such turns at once, not four
    e = loaded(config(tmp_path, resident_bytes=budget, warm_bytes=0))
    assert e.caches is not None
    caches = e.caches

    def run(jobs: list[Answer], events: list[list[EngineEvent]]) -> list[Done]:
        for j in jobs:
            e.submit(j)
        most = 0
        while any(ended(ev) is None for ev in events):
            e.step()
            s = caches.statistics()
            assert s["running"]["bytes"] <= budget
            assert s["running"]["bytes"] + s["resident"]["bytes"] <= budget
            most = max(most, e.statistics().running)
        assert most == 3
        assert any(isinstance(x, AnswerQueued) for ev in events for x in ev)
        return [d for ev in events if (d := ended(ev)) is not None]

    firsts: list[list[EngineEvent]] = [[] for _ in sids]
    done1 = run([first_turn(e, sid, text, ev, max_tokens=24) for sid, text, ev in zip(sids, texts, firsts)],
                firsts)
    seconds: list[list[EngineEvent]] = [[] for _ in sids]
    jobs = []
    for sid, text, ev, end, out in zip(sids, texts, firsts, done1, seconds):
        j = next_turn(e, sid, text, ev, end, max_tokens=24)
        j.emit = out.append
        jobs.append(j)
    done2 = run(jobs, seconds)
    caches.close()
    assert all(d.usage["cached_tokens"] > 0 for d in done2)  # every session continued its own cache
    assert {d.usage["restored_from"] for d in done2} <= {"resident", "warm", "disk"}
    for d in [*done1, *done2]:
        assert_exact(tmp_path, d)


def test_an_idle_running_engine_restores_a_cache_in_slices(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A started engine with nothing else to step makes a restore's buffers without waiting for a
    step that would never come: the turn ends though the idle wait is an hour long and a step's
    slice is one byte."""
    import cachestore.pagein
    import daemon.engine.thread

    monkeypatch.setattr(cachestore.pagein, "ALLOC_STEP", 1)  # one buffer per engine step
    monkeypatch.setattr(daemon.engine.thread, "MAINTAIN_EVERY", 3600.0)
    a = "d" * 16
    before = loaded(config(tmp_path))
    events: list[EngineEvent] = []
    before.submit(first_turn(before, a, LONG, events, max_tokens=8))
    while (first := ended(events)) is None:
        before.step()
    before.close()
    e = Engine(config(tmp_path, prefetch=False))
    e.start()
    assert e.ready.wait(120)
    finished = threading.Event()
    got: list[EngineEvent] = []

    def emit(event: EngineEvent) -> None:
        got.append(event)
        if isinstance(event, Done):
            finished.set()

    job = next_turn(e, a, LONG, events, first, max_tokens=8)
    job.emit = emit
    e.submit(job)
    assert finished.wait(120)
    e.stop()
    end = ended(got)
    assert end is not None and end.usage["restored_from"] == "disk"
    assert_exact(tmp_path, end)
