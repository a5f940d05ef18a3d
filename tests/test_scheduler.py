"""Admission, queue places, prefill order and chunk sizes, with plain values for answers (no model, no MLX)."""

from __future__ import annotations

from dataclasses import dataclass

from daemon.engine.scheduler import MIN_CHUNK, Phase, Scheduler, SchedulerStatistics


@dataclass(eq=False)
class A:
    """An answer as the scheduler sees it: its session, its phase, its bytes, its last told place."""

    key: str
    need: int = 0
    phase: Phase = Phase.WAITING
    told: int = 0
    rows: int = 1  # decode rows: a request's n choices ride on one answer until its prompt is read


def make(max_running: int = 2, step: int = 512, slice_: float = 0.1) -> Scheduler[A]:
    return Scheduler(max_running=max_running, prefill_step=step, prefill_slice=slice_)


def start(s: Scheduler[A], key: str, need: int = 0) -> A:
    """An answer admitted from memory: its prompt is fed next."""
    a = A(key, need)
    s.admit(a)
    s.prefill(a)
    return a


def keys(answers: list[A]) -> list[str]:
    return [a.key for a in answers]


def test_past_max_running_jobs_wait_and_are_told_only_when_their_place_moves() -> None:
    s = make(max_running=1)
    start(s, "a")
    assert not s.has_room()
    assert s.wait(A("b")) == 1 and s.wait(A("c")) == 2 and s.wait(A("d")) == 3
    assert s.moved() == []  # each was told its place when it arrived
    assert list(s.admissible()) == []  # no room yet
    c = s.get("c")
    assert c is not None and c.phase is Phase.WAITING
    assert s.end("c") is c  # cancelled while waiting
    assert s.end("c") is None
    assert [(a.key, a.told) for a in s.moved()] == [("d", 2)]
    s.end("a")
    started = []
    for a in s.admissible():
        s.admit(a)
        s.prefill(a)
        started.append(a.key)
    assert started == ["b"]  # first come, first served; then no room again
    assert [(a.key, a.told) for a in s.moved()] == [("d", 1)]
    assert s.statistics() == SchedulerStatistics(running=1, waiting=1, prefilling=1, decoding=0)


def test_an_answer_carrying_choices_takes_a_slot_for_each_of_its_rows() -> None:
    """n choices decode in n rows: admitted only where max_running has room for all of them, and first come
    first served still (a single answer behind it waits); once forked, each row is an answer of its own."""
    s = make(max_running=4)
    start(s, "a")
    four = A("four", rows=4)
    assert not s.has_room(rows=4) and s.has_room(rows=3)
    s.wait(four)
    s.wait(A("one"))
    assert list(s.admissible()) == []  # "one" would fit, but comes after
    s.end("a")
    admitted = []
    for a in s.admissible():
        s.admit(a)  # (each admitted before the next is considered)
        admitted.append(a.key)
    assert admitted == ["four"] and not s.has_room()
    four.rows = 1  # its prompt read: its three other choices decode as answers of their own
    for key in ("b", "c", "d"):
        s.decode(A(key))
    assert not s.has_room() and s.statistics().decoding == 3
    s.end("d")
    assert [a.key for a in s.admissible()] == ["one"]


def test_room_is_checked_before_each_admission() -> None:
    """An answer started from the queue takes room; one whose start failed takes none."""
    s = make(max_running=2)
    for key in "abc":
        s.wait(A(key))
    admitted = []
    for a in s.admissible():
        admitted.append(a.key)
        if a.key == "b":
            s.admit(a)  # "a" failed to start (e.g. too long): it never ran
            s.prefill(a)
    assert admitted == ["a", "b", "c"]
    start(s, "c")
    assert not s.has_room() and list(s.admissible()) == []


def test_a_session_with_a_turn_running_or_waiting_is_held() -> None:
    s = make(max_running=1)
    start(s, "a")
    s.wait(A("b"))
    assert s.holds("a") and s.holds("b") and not s.holds("c")
    s.end("a")
    assert not s.holds("a")


def test_prompts_are_fed_one_at_a_time_first_come_first() -> None:
    s = make(max_running=3)
    assert s.next_prefill() is None
    a = start(s, "a")
    b = start(s, "b")
    assert s.next_prefill() is a
    s.decode(a)
    assert s.next_prefill() is b and s.any_decoding()
    s.end("b")  # cancelled mid-prefill
    assert s.next_prefill() is None
    assert s.end("a") is a and not s.any_decoding() and s.started() == []
    assert s.end("a") is None


def test_an_answer_whose_read_ends_later_is_fed_after_those_started_before_it() -> None:
    """Prompts are fed in the order the answers started, not arrived: a read does not overtake."""
    s = make(max_running=3)
    a = A("a")
    s.admit(a)  # its cache is read from disk
    b = start(s, "b")
    s.prefill(a)  # the read ended
    assert s.next_prefill() is b and keys(s.phase(Phase.PREFILLING)) == ["b", "a"]


def test_alone_a_chunk_is_a_whole_step() -> None:
    s = make(step=512, slice_=0.1)
    start(s, "a")
    assert s.chunk_size() == 512
    s.chunk_fed(8, 10.0)  # however slow the last chunk was
    assert s.chunk_size() == 512


def test_beside_decoding_turns_a_chunk_fills_the_time_slice() -> None:
    s = make(max_running=2, step=512, slice_=0.1)
    s.decode(start(s, "a"))
    start(s, "b")
    assert s.chunk_size() == MIN_CHUNK  # no rate measured yet: the smallest chunk worth a forward
    s.chunk_fed(1000, 1.0)  # 1000 tokens/s: 0.1 s is 100 tokens
    assert s.chunk_size() == 100
    s.chunk_fed(100, 0.0)  # a chunk too fast to time: capped at a whole step
    assert s.chunk_size() == 512
    s.chunk_fed(1, 1.0)  # 1 token/s: never below MIN_CHUNK
    assert s.chunk_size() == MIN_CHUNK
    small = make(step=4, slice_=0.1)
    small.decode(start(small, "a"))
    assert small.chunk_size() == 4  # a step below MIN_CHUNK is the cap


def test_turns_are_admitted_by_the_bytes_their_caches_may_reach() -> None:
    """Running caches share the budget: an answer that does not fit beside them waits, first come first."""
    s: Scheduler[A] = Scheduler(max_running=8, prefill_step=512, prefill_slice=0.1, budget=100)
    assert s.has_room(60)
    start(s, "a", 60)
    assert not s.has_room(50) and s.has_room(40)
    assert s.wait(A("b", 50)) == 1
    assert s.wait(A("c", 10)) == 2  # would fit, but b came first
    assert list(s.admissible()) == []
    s.end("a")  # a's bytes are free again
    assert s.held_bytes() == 0
    admitted = []
    for a in s.admissible():
        s.admit(a)
        admitted.append(a.key)
    assert admitted == ["b", "c"] and s.held_bytes() == 60
    assert s.statistics().running_bytes == 60 and s.statistics().budget == 100


def test_a_turn_larger_than_the_budget_runs_alone() -> None:
    s: Scheduler[A] = Scheduler(max_running=8, prefill_step=512, prefill_slice=0.1, budget=100)
    assert s.alone(150) and not s.alone(100)
    s.admit(A("a", 10))
    assert not s.has_room(150)  # it waits for the others to end...
    s.wait(A("big", 150))
    s.end("a")
    assert keys(list(s.admissible())) == ["big"]  # ...then runs by itself
    s.admit(A("big", 150))
    assert not s.has_room(1)


def test_a_turn_restoring_from_disk_holds_its_slot_and_bytes_until_it_ends() -> None:
    s: Scheduler[A] = Scheduler(max_running=2, prefill_step=512, prefill_slice=0.1, budget=100)
    a = A("a", 70)
    s.admit(a)  # its cache is read from disk: it restores until the read ends
    assert a.phase is Phase.RESTORING and s.holds("a") and not s.has_room(40)
    assert s.statistics() == SchedulerStatistics(running=1, waiting=0, prefilling=0, decoding=0, restoring=1,
                                                 running_bytes=70, budget=100)
    assert s.next_prefill() is None and s.started() == []  # nothing to feed until the read ends
    assert s.before_first_tokens()
    s.prefill(a)
    assert s.held_bytes() == 70 and s.next_prefill() is a
    s.admit(A("b", 10))
    s.end("b")  # cancelled while its cache was read
    assert s.get("b") is None and s.held_bytes() == 70 and not s.holds("b")
