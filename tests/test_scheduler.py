"""Admission, queue places, prefill order and chunk sizes, with plain strings for jobs (no model, no MLX)."""

from __future__ import annotations

from daemon.engine.scheduler import MIN_CHUNK, Scheduler, SchedulerStatistics


def make(max_running: int = 2, step: int = 512, slice_: float = 0.1) -> Scheduler[str, str]:
    return Scheduler(max_running=max_running, prefill_step=step, prefill_slice=slice_)


def test_past_max_running_jobs_wait_and_are_told_only_when_their_place_moves() -> None:
    s = make(max_running=1)
    s.start("a", "A")
    assert not s.has_room()
    assert s.wait("b", "job-b") == 1 and s.wait("c", "job-c") == 2 and s.wait("d", "job-d") == 3
    assert s.moved() == []  # each was told its place when it arrived
    assert list(s.admissible()) == []  # no room yet
    assert s.withdraw("c") == "job-c"  # cancelled while waiting
    assert s.withdraw("c") is None
    assert s.moved() == [("job-d", 2)]
    s.end("a")
    started = []
    for job in s.admissible():
        s.start(job, job)
        started.append(job)
    assert started == ["job-b"]  # first come, first served; then no room again
    assert s.moved() == [("job-d", 1)]
    assert s.statistics() == SchedulerStatistics(running=1, waiting=1, prefilling=1, decoding=0)


def test_room_is_checked_before_each_admission() -> None:
    """A job started from the queue takes room; one whose start failed takes none."""
    s = make(max_running=2)
    for key in "abc":
        s.wait(key, key)
    admitted = []
    for job in s.admissible():
        admitted.append(job)
        if job == "b":
            s.start(job, job)  # "a" failed to start (e.g. too long): it never ran
    assert admitted == ["a", "b", "c"]
    s.start("c", "c")
    assert not s.has_room() and list(s.admissible()) == []


def test_a_session_with_a_turn_running_or_waiting_is_held() -> None:
    s = make(max_running=1)
    s.start("a", "A")
    s.wait("b", "B")
    assert s.holds("a") and s.holds("b") and not s.holds("c")
    s.end("a")
    assert not s.holds("a")


def test_prompts_are_fed_one_at_a_time_first_come_first() -> None:
    s = make(max_running=3)
    assert s.next_prefill() is None
    s.start("a", "A")
    s.start("b", "B")
    assert s.next_prefill() == "a"
    s.decode("a")
    assert s.next_prefill() == "b" and s.any_decoding()
    s.end("b")  # cancelled mid-prefill
    assert s.next_prefill() is None
    assert s.end("a") == "A" and not s.any_decoding() and s.running == {}
    assert s.end("a") is None


def test_alone_a_chunk_is_a_whole_step() -> None:
    s = make(step=512, slice_=0.1)
    s.start("a", "A")
    assert s.chunk_size() == 512
    s.chunk_fed(8, 10.0)  # however slow the last chunk was
    assert s.chunk_size() == 512


def test_beside_decoding_turns_a_chunk_fills_the_time_slice() -> None:
    s = make(max_running=2, step=512, slice_=0.1)
    s.start("a", "A")
    s.decode("a")
    s.start("b", "B")
    assert s.chunk_size() == MIN_CHUNK  # no rate measured yet: the smallest chunk worth a forward
    s.chunk_fed(1000, 1.0)  # 1000 tokens/s: 0.1 s is 100 tokens
    assert s.chunk_size() == 100
    s.chunk_fed(100, 0.0)  # a chunk too fast to time: capped at a whole step
    assert s.chunk_size() == 512
    s.chunk_fed(1, 1.0)  # 1 token/s: never below MIN_CHUNK
    assert s.chunk_size() == MIN_CHUNK
    small = make(step=4, slice_=0.1)
    small.start("a", "A")
    small.decode("a")
    assert small.chunk_size() == 4  # a step below MIN_CHUNK is the cap


def test_turns_are_admitted_by_the_bytes_their_caches_may_reach() -> None:
    """Running caches share the budget: a turn that does not fit beside them waits, first come first."""
    s: Scheduler[str, str] = Scheduler(max_running=8, prefill_step=512, prefill_slice=0.1, budget=100)
    assert s.has_room(60)
    s.admit("a", 60)
    s.start("a", "A")
    assert not s.has_room(50) and s.has_room(40)
    assert s.wait("b", "job-b", 50) == 1
    assert s.wait("c", "job-c", 10) == 2  # would fit, but b came first
    assert list(s.admissible()) == []
    s.end("a")  # a's bytes are free again
    assert s.held_bytes() == 0
    admitted = []
    for job in s.admissible():
        s.admit(job[-1], {"job-b": 50, "job-c": 10}[job])
        admitted.append(job)
    assert admitted == ["job-b", "job-c"] and s.held_bytes() == 60
    assert s.statistics().running_bytes == 60 and s.statistics().budget == 100


def test_a_turn_larger_than_the_budget_runs_alone() -> None:
    s: Scheduler[str, str] = Scheduler(max_running=8, prefill_step=512, prefill_slice=0.1, budget=100)
    assert s.alone(150) and not s.alone(100)
    s.admit("a", 10)
    assert not s.has_room(150)  # it waits for the others to end...
    s.wait("big", "job-big", 150)
    s.end("a")
    assert list(s.admissible()) == ["job-big"]  # ...then runs by itself
    s.admit("big", 150)
    assert not s.has_room(1)


def test_a_turn_restoring_from_disk_holds_its_slot_and_bytes_until_it_ends() -> None:
    s: Scheduler[str, str] = Scheduler(max_running=2, prefill_step=512, prefill_slice=0.1, budget=100)
    s.admit("a", 70)
    s.restoring("a", "job-a")
    assert s.holds("a") and not s.has_room(40)
    assert s.statistics() == SchedulerStatistics(running=1, waiting=0, prefilling=0, decoding=0, restoring=1,
                                                 running_bytes=70, budget=100)
    assert s.next_prefill() is None  # nothing to feed until the read reports
    assert s.restored("a") == "job-a"
    s.start("a", "A")
    assert s.held_bytes() == 70 and s.next_prefill() == "a"
    s.admit("b", 10)
    s.restoring("b", "job-b")
    s.end("b")  # cancelled while its cache was read
    assert s.restored("b") is None and s.held_bytes() == 70 and not s.holds("b")
