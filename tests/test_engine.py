"""The engine's scheduling, step by step: prefill chunks, the first token, cancel, interleaving.

These tests drive one Engine on the test thread (no engine thread is started:
`load()`, then `submit()`/`cancel()` and `step()`), so every step is deterministic. The model is the real built-in one.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from conftest import greedy_reference
from daemon import device
from daemon.config import load_config
from daemon.engine.jobs import Done, EngineEvent
from daemon.engine.running import Answer
from daemon.engine.scheduler import MIN_CHUNK
from daemon.engine.thread import Engine
from daemon.events import AnswerDelta, AnswerProgress
from daemon.prompt import prompt_tokens
from protocol.shapes import Sampling

LONG = "Tell me everything about caches and how they page out to disk. " * 6
STEP = 16


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    e = Engine(load_config(None, data_dir=tmp_path, model="builtin:tiny", prefill_step_size=STEP))
    e.load()
    yield e
    assert e.caches is not None
    e.caches.close()


def job(engine: Engine, session: str, text: str, events: list[EngineEvent], **fields: Any) -> Answer:
    """A first turn's job, its ids made as the turn core's tokenizer stage makes them."""
    fields.setdefault("max_tokens", 32)
    return submitted(engine, session, [{"role": "user", "content": text}], [], 0, events, **fields)


def submitted(engine: Engine, session: str, messages: list[dict[str, Any]], fed: list[int], fed_covers: int,
              events: list[EngineEvent], **fields: Any) -> Answer:
    tokens, retokenized = prompt_tokens(engine.tokenizer, messages, None, fed, fed_covers=fed_covers)
    return Answer(session_id=session, tokens=tokens, retokenized=retokenized, fed_before=len(fed),
                   sampling=Sampling.of(fields.pop("max_tokens"), 0.0, 1.0), emit=events.append, **fields)


def done(events: list[EngineEvent]) -> Done:
    assert isinstance(events[-1], Done), events[-1]
    return events[-1]


def run_to_end(engine: Engine) -> None:
    engine.step()
    while engine.statistics().running:
        engine.step()


def generated(engine: Engine, sid: str) -> int:
    return engine.statistics().answers[sid].generated


def fed(engine: Engine, sid: str) -> int:
    return engine.statistics().answers[sid].fed


def test_a_long_prompt_is_fed_a_chunk_per_step(engine: Engine) -> None:
    events: list[EngineEvent] = []
    engine.submit(job(engine, "a" * 16, LONG, events))
    engine.step()  # starts the turn and feeds its first chunk
    progress = events[0]
    assert isinstance(progress, AnswerProgress) and progress.total > 4 * STEP
    steps = 1
    while not any(isinstance(e, AnswerDelta) for e in events):
        engine.step()
        steps += 1
    assert steps == -(-progress.total // STEP)  # ceil: the last chunk yields the first token
    run_to_end(engine)
    assert done(events).usage["completion_tokens"] == 32


def test_first_token_path_is_exact(engine: Engine, tmp_path: Path) -> None:
    """The first token comes from the last chunk's logits (the head run over its last position only:
    prefill.last_position); the whole answer equals mlx-lm's own."""
    assert engine.steps is not None and engine.steps.last is not None
    events: list[EngineEvent] = []
    engine.submit(job(engine, "b" * 16, LONG, events, max_tokens=24))
    run_to_end(engine)
    end = done(events)
    assert end.tokens is not None
    prompt_len = end.usage["prompt_tokens"]
    answer = end.tokens[prompt_len:]
    assert len(answer) == 24 or (answer and answer[-1] in engine.tokenizer.eos_token_ids)
    assert answer == greedy_reference(tmp_path / "models" / "tiny", end.tokens[:prompt_len], len(answer))


def test_after_the_first_token_the_engine_waits_for_it_to_be_handed_out(engine: Engine,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The first delta is out before the engine's next step: the engine waits for the turn core's
    `handed` (here set by the test when it has the delta), and at most FIRST_HANDOFF_S when it never comes."""
    import threading
    import time

    from daemon.engine import steps

    monkeypatch.setattr(steps, "FIRST_HANDOFF_S", 0.3)
    for hand_over in (True, False):
        handed = threading.Event()
        events: list[EngineEvent] = []
        times: list[float] = []

        def emit(event: EngineEvent, events: list[EngineEvent] = events, times: list[float] = times,
                 handed: threading.Event = handed, hand_over: bool = hand_over) -> None:
            events.append(event)
            times.append(time.monotonic())
            if isinstance(event, AnswerDelta) and hand_over:
                handed.set()

        j = job(engine, f"hand-{hand_over}", "Hello there", events, max_tokens=2)
        j.emit, j.handed = emit, handed
        engine.submit(j)
        t0 = time.monotonic()
        run_to_end(engine)
        took = time.monotonic() - t0
        first = next(i for i, e in enumerate(events) if isinstance(e, AnswerDelta))
        assert isinstance(events[-1], Done) and events[-1].usage["completion_tokens"] == 2
        if hand_over:
            assert handed.is_set()
        else:  # nobody handed it out: the engine went on after its bound (0.3 s, less a clock's grain)
            assert not handed.is_set() and times[-1] - times[first] >= 0.25 and took >= 0.25


def test_speculation_changes_no_token_and_can_be_turned_off(engine: Engine, tmp_path: Path) -> None:
    """The tiny model's greedy answer loops, so prompt lookup drafts it; off, nothing is drafted."""
    answers = {}
    for mode in ("auto", "off"):
        engine.config = replace(engine.config, speculate=mode)
        events: list[EngineEvent] = []
        engine.submit(job(engine, ("c" if mode == "auto" else "d") * 16, LONG, events, max_tokens=48))
        run_to_end(engine)
        end = done(events)
        assert end.tokens is not None
        answers[mode] = (end.tokens, end.usage["drafted_tokens"], end.usage["accepted_tokens"])
    (on, drafted, accepted), (off, none, _) = answers["auto"], answers["off"]
    assert on == off and drafted >= accepted > 0 and none == 0


def test_one_token_answer_is_not_fed(engine: Engine) -> None:
    events: list[EngineEvent] = []
    engine.submit(job(engine, "c" * 16, "Hello there.", events, max_tokens=1))
    run_to_end(engine)
    end = done(events)
    assert end.finish_reason == "length" and end.usage["completion_tokens"] == 1
    assert sum(isinstance(e, AnswerDelta) for e in events) == 1
    # The token was shown, so the session's history holds it; the cache holds the prompt
    # alone (the token was sampled but never fed), so the next turn feeds it first.
    assert end.tokens is not None and len(end.tokens) == end.usage["prompt_tokens"] + 1
    assert_next_turn_starts_from(engine, "c" * 16, "Hello there.", events, end)


def assert_next_turn_starts_from(engine: Engine, sid: str, text: str, events: list[EngineEvent],
                                 end: Done) -> None:
    """The next turn appends to exactly `end.tokens` and restores the prompt the cache holds."""
    answer = "".join(e.text for e in events if isinstance(e, AnswerDelta))
    assert end.tokens is not None
    nxt: list[EngineEvent] = []
    messages = [{"role": "user", "content": text}, {"role": "assistant", "content": answer},
                {"role": "user", "content": "And then?"}]
    j = submitted(engine, sid, messages, end.tokens, 2, nxt, max_tokens=2)
    assert not j.retokenized
    engine.submit(j)
    run_to_end(engine)
    assert done(nxt).usage["cached_tokens"] == end.usage["prompt_tokens"]
    # The prompt began with exactly those ids (the next history is the prompt, then the answer).
    tokens = done(nxt).tokens
    assert tokens is not None and end.tokens is not None and tokens[:len(end.tokens)] == end.tokens


def test_cancel_before_the_first_token_is_fed_keeps_it_in_the_history(engine: Engine) -> None:
    """A cancel between the prefill's first token and the decode step that feeds it."""
    sid = "f" * 16
    events: list[EngineEvent] = []
    engine.submit(job(engine, sid, "Hello there.", events))
    while not any(isinstance(e, AnswerDelta) for e in events):
        engine.step()  # the prompt is fed and the first token shown; no decode step has run
    engine.cancel(sid)
    engine.step()
    end = done(events)
    assert end.finish_reason == "cancelled" and end.usage["completion_tokens"] == 1
    assert end.tokens is not None and len(end.tokens) == end.usage["prompt_tokens"] + 1
    assert_next_turn_starts_from(engine, sid, "Hello there.", events, end)


def test_cancel_mid_prefill_keeps_what_was_fed(engine: Engine) -> None:
    sid = "d" * 16
    events: list[EngineEvent] = []
    engine.submit(job(engine, sid, LONG, events))
    for _ in range(3):
        engine.step()
    engine.cancel(sid)
    engine.step()
    end = done(events)
    assert end.finish_reason == "cancelled" and end.usage["completion_tokens"] == 0
    assert end.tokens is None  # nothing was generated: the session's fed ids stay as they were
    assert not any(isinstance(e, AnswerDelta) for e in events)
    # The three chunks fed are kept: a retry restores them and prefills only the rest.
    retry: list[EngineEvent] = []
    engine.submit(job(engine, sid, LONG, retry))
    engine.step()
    engine.cancel(sid)
    engine.step()
    assert done(retry).usage["cached_tokens"] == 3 * STEP


def test_a_prefill_never_freezes_the_batch(engine: Engine) -> None:
    """While B's long prompt is fed, A gets a token at every step."""
    a_events: list[EngineEvent] = []
    engine.submit(job(engine, "e" * 16, "Hi.", a_events, max_tokens=200))
    engine.step()
    while generated(engine, "e" * 16) < 2:  # A is in the batch and decoding
        engine.step()
    b_events: list[EngineEvent] = []
    engine.submit(job(engine, "f" * 16, LONG, b_events))
    steps = 0
    while not any(isinstance(e, AnswerDelta) for e in b_events):
        before = generated(engine, "e" * 16)
        engine.step()
        assert generated(engine, "e" * 16) == before + 1
        steps += 1
    assert steps > 4  # B's prompt took several chunks, each beside a decode step for A
    engine.cancel("e" * 16)
    engine.cancel("f" * 16)
    engine.step()


def test_beside_decoding_sessions_chunks_follow_the_time_slice(tmp_path: Path) -> None:
    """Alone, a prompt goes in prefill_step_size chunks; beside a decoding session, in slices."""
    e = Engine(load_config(None, data_dir=tmp_path, model="builtin:tiny", prefill_step_size=64, prefill_slice=1e-6))
    e.load()
    alone: list[EngineEvent] = []
    e.submit(job(e, "1" * 16, LONG, alone))
    e.step()  # starts the turn and feeds its first chunk
    assert fed(e, "1" * 16) == 64  # nobody else is decoding: a whole step
    run_to_end(e)
    a_events: list[EngineEvent] = []
    e.submit(job(e, "2" * 16, "Hi.", a_events, max_tokens=200))
    e.step()
    while generated(e, "2" * 16) < 2:
        e.step()
    # Another prompt: the same one would start from session 1's cache (shared), with nothing to slice.
    e.submit(job(e, "3" * 16, "Something else. " + LONG, []))
    e.step()
    assert e.statistics().answers["3" * 16].phase == "prefill"
    seen = [fed(e, "3" * 16)]
    for _ in range(3):
        e.step()
        seen.append(fed(e, "3" * 16))
    # A microsecond slice rounds down to the smallest chunk worth a forward.
    assert [b - a for a, b in zip(seen, seen[1:])] == [MIN_CHUNK] * 3
    e.cancel("2" * 16)
    e.cancel("3" * 16)
    e.step()
    assert e.caches is not None
    e.caches.close()


def test_the_model_is_warmed_up_before_ready(tmp_path: Path) -> None:
    """The first forward after a load is paid before `ready`, not by the first user's turn."""
    e = Engine(load_config(None, data_dir=tmp_path, model="builtin:tiny"))
    e.start()
    assert e.ready.wait(120)
    try:
        assert e.load_error is None
        assert e.warm_up_ms is not None and e.warm_up_ms > 0
        assert e.stats["warm_up_ms"] == e.warm_up_ms  # published with the first statistics
        # The turn core's tokenizer copy is made before `ready` too: a first turn never waits for it.
        assert e.stage_tokenizer is not None and e.stage_tokenizer is not e.tokenizer
        assert e.stage_tokenizer.encode("Hello, who are you?") == e.tokenizer.encode("Hello, who are you?")
        # The device line (daemon/device.py), for the start line and `kvd status`, and the config's 0
        # chunk resolved to the device's; on a CPU the choices kvd always made there.
        here = device.current()
        assert e.stats["device"] == here.line("float32")
        assert e.config.prefill_step_size == here.prefill_step and e.config.speculate == "auto"
        if here.device.kind == "cpu":
            assert e.stats["device"] == "device: cpu, float32 weights, kvd attention"
            assert e.config.prefill_step_size == 512
    finally:
        e.stop()


@pytest.mark.parametrize("temperature", [0.7, 0.0])
def test_the_warm_up_draws_a_token_as_the_configured_sampling_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   temperature: float) -> None:
    """A sampled turn's kernels (MLX compiles each with g++ the first time, ~1 s on this CPU with an
    empty kernel cache) are compiled by the warm-up, not by the first sampled turn; greedy needs none."""
    from daemon.engine import draws

    drawn: list[tuple[float, float, tuple[int, ...]]] = []
    take = draws.Draws.take

    def recorded(self: draws.Draws, logprobs: Any) -> Any:
        drawn.append((self.temperature, self.top_p, tuple(logprobs.shape)))
        return take(self, logprobs)

    monkeypatch.setattr(draws.Draws, "take", recorded)
    e = Engine(load_config(None, data_dir=tmp_path, model="builtin:tiny", temperature=temperature, top_p=0.9))
    e.load()
    try:
        assert e.load_error is None
        vocab = e.model.args.vocab_size  # the logits' width (the tokenizer may know a few ids fewer)
        assert drawn == ([(temperature, 0.9, (1, vocab))] if temperature else [])
    finally:
        assert e.caches is not None
        e.caches.close()


def test_an_answer_submitted_as_the_engine_stops_ends_cut_short(tmp_path: Path) -> None:
    """A turn that was tokenizing while kvd stopped submits its answer to an engine whose thread has ended:
    it gets its Done (cancelled, nothing generated) at once, and kvd's stop does not wait for it forever."""
    e = Engine(load_config(None, data_dir=tmp_path, model="builtin:tiny"))
    e.start()
    assert e.ready.wait(120)
    events: list[EngineEvent] = []
    answer = job(e, "0123456789abcdef", "hello", events)  # ids made while the model is loaded
    e.stop()
    e.submit(answer)
    assert done(events).finish_reason == "cancelled" and done(events).tokens is None
    assert len(events) == 1


def test_an_answer_left_in_a_stopped_engines_inbox_is_heard_on_its_sinks_loop(tmp_path: Path) -> None:
    """What the inbox holds as the engine thread ends is handed back from that thread: its Done goes to the
    turn's sink on the sink's own event loop (the turn core's feed is that loop's alone), as the hand-off does."""
    import asyncio
    import threading

    from daemon.engine.jobs import Inbox

    e = Engine(load_config(None, data_dir=tmp_path, model="builtin:tiny"))
    e.start()
    assert e.ready.wait(120)
    answer = job(e, "0123456789abcdef", "hello", [])
    e.stop()

    async def heard() -> tuple[list[EngineEvent], set[int]]:
        got: list[EngineEvent] = []
        threads: set[int] = set()
        arrived = asyncio.Event()

        class Sink:
            loop = asyncio.get_running_loop()

            def many(self, events: list[EngineEvent]) -> None:
                threads.add(threading.get_ident())
                got.extend(events)
                arrived.set()

            def __call__(self, event: EngineEvent) -> None:
                self.many([event])

        answer.emit = Sink()
        inbox = Inbox()
        inbox.put(answer)
        closing = threading.Thread(target=inbox.close, args=(e._late,))  # as the engine thread closes it
        closing.start()
        await asyncio.wait_for(arrived.wait(), 60)
        closing.join()
        return got, threads

    got, threads = asyncio.run(heard())
    assert threads == {threading.get_ident()}  # this test's loop runs on this thread
    assert len(got) == 1 and done(got).finish_reason == "cancelled"
