"""Which turns run, which wait, whose prompt is fed next and in what size of chunk.

The engine's policy without the engine: no MLX, no threads, no clock of its
own (the engine reports how long each chunk took), so it is tested with plain
objects like cachestore/lru.py is. The engine thread is its only caller.

- At most `max_running` turns run at once, and their caches fit `budget`
  bytes together (running caches count against the memory budget, as
  vLLM's `allocate_slots` counts a request's blocks before it runs): a turn
  is admitted with the bytes its cache reaches at its prompt plus
  `max_tokens` (`need`, reckoned by the engine), held until it ends. The
  rest wait first come first served, and each waiting job learns its place
  again whenever it moves up. A turn whose cache alone is larger than the
  budget waits until nothing else runs, then runs alone: memory then holds
  that one cache, over the budget by what it needs (a budget of 0, "keep
  no idle cache resident", still runs one turn at a time). Idle caches do
  not count here: the cache store evicts them to make room for what runs.
- A turn admitted while its cache is read from disk is `restoring`: it
  holds its slot and its bytes, and is started when the read reports.
- Running turns' prompts are fed one at a time, first come first (a prompt is
  one unpadded sequence: prefill.py), one chunk per engine step.
- Alone, a chunk is `prefill_step` tokens. Beside decoding turns, a chunk is
  as many tokens as take about `prefill_slice` seconds at the last chunk's
  rate, never below MIN_CHUNK, so the decoding streams keep moving through a
  long prefill.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

MIN_CHUNK = 8  # prompt tokens: smaller prefill chunks would mostly re-read the weights

J = TypeVar("J")  # a job waiting for room
T = TypeVar("T")  # a running turn


@dataclass(frozen=True)
class SchedulerStatistics:
    running: int  # turns admitted and not yet finished (restoring + prefilling + decoding)
    waiting: int  # jobs past max_running or the byte budget, not started yet
    prefilling: int  # running turns whose prompt is still being fed
    decoding: int  # running turns in the decode batch
    restoring: int = 0  # admitted turns whose cache is being read from disk
    running_bytes: int = 0  # what the admitted turns' caches may reach together
    budget: int | None = None  # the bytes they may take together (None: no byte limit)


@dataclass
class _Waiting(Generic[J]):
    key: str
    job: J
    told: int  # the position the job was last told
    need: int = 0  # bytes its cache may reach


class Scheduler(Generic[J, T]):
    def __init__(self, *, max_running: int, prefill_step: int, prefill_slice: float, budget: int | None = None):
        self.max_running = max_running
        self.prefill_step = prefill_step
        self.prefill_slice = prefill_slice
        self.budget = budget
        self.running: dict[str, T] = {}  # by session id
        self._restoring: dict[str, J] = {}  # admitted, their cache being read from disk
        self._held: dict[str, int] = {}  # admitted turns' bytes (restoring and running), by session
        self._waiting: list[_Waiting[J]] = []  # in arrival order
        self._prefilling: list[str] = []  # first come first
        self._decoding: set[str] = set()
        self._prefill_tps: float | None = None  # the last chunk's tokens per second

    # --- admission ---

    def holds(self, key: str) -> bool:
        """The session has a turn running, restoring or waiting (a second one is refused as busy)."""
        return key in self.running or key in self._restoring or any(w.key == key for w in self._waiting)

    def alone(self, need: int) -> bool:
        """A cache of `need` bytes is larger than the budget: it runs only when nothing else does."""
        return self.budget is not None and need > self.budget

    def held_bytes(self) -> int:
        """What the admitted turns' caches may reach together."""
        return sum(self._held.values())

    def has_room(self, need: int = 0) -> bool:
        """A turn whose cache may reach `need` bytes can be admitted now (and nobody waits before it)."""
        return (len(self.running) + len(self._restoring) < self.max_running
                and (self.budget is None or not self._held or self.held_bytes() + need <= self.budget))

    def wait(self, key: str, job: J, need: int = 0) -> int:
        """Queue a job that found no room; its place in the queue (1: next)."""
        self._waiting.append(_Waiting(key, job, told=len(self._waiting) + 1, need=need))
        return len(self._waiting)

    def admissible(self) -> Iterator[J]:
        """Waiting jobs to admit now, in arrival order, while there is room for the next one.

        First come first served: a job that does not fit yet keeps those
        behind it waiting (no small turn overtakes a large one forever).
        Room is checked again before each one: the engine admits each
        (`admit`) before the next is considered.
        """
        while self._waiting and self.has_room(self._waiting[0].need):
            yield self._waiting.pop(0).job

    def admit(self, key: str, need: int) -> None:
        """A turn is admitted: its cache's bytes are held for it until it `end`s."""
        self._held[key] = need

    def moved(self) -> list[tuple[J, int]]:
        """Waiting jobs whose place changed since they were last told, with their new place."""
        out = []
        for position, w in enumerate(self._waiting, start=1):
            if w.told != position:
                w.told = position
                out.append((w.job, position))
        return out

    def withdraw(self, key: str) -> J | None:
        """Take a waiting job out of the queue (cancelled before it started)."""
        for w in self._waiting:
            if w.key == key:
                self._waiting.remove(w)
                return w.job
        return None

    def waiting(self) -> list[J]:
        return [w.job for w in self._waiting]

    # --- a running turn's phases ---

    def restoring(self, key: str, job: J) -> None:
        """An admitted turn waits for its cache to be read from disk (it keeps its slot and bytes)."""
        self._restoring[key] = job

    def restoring_keys(self) -> list[str]:
        return list(self._restoring)

    def restored(self, key: str) -> J | None:
        """The read for an admitted turn reported: its job, to be started (None: cancelled meanwhile)."""
        return self._restoring.pop(key, None)

    def start(self, key: str, turn: T) -> None:
        """A turn runs: its prompt is fed next after those already being fed."""
        self._restoring.pop(key, None)
        self.running[key] = turn
        self._prefilling.append(key)

    def decode(self, key: str) -> None:
        """The turn's prompt is fed; it decodes in the batch from now on."""
        self._prefilling.remove(key)
        self._decoding.add(key)

    def end(self, key: str) -> T | None:
        """The turn is over (finished, cancelled, failed): it leaves every list, and its bytes are free."""
        if key in self._prefilling:
            self._prefilling.remove(key)
        self._decoding.discard(key)
        self._restoring.pop(key, None)
        self._held.pop(key, None)
        return self.running.pop(key, None)

    def next_prefill(self) -> str | None:
        """Whose prompt gets this step's chunk."""
        return self._prefilling[0] if self._prefilling else None

    def any_decoding(self) -> bool:
        return bool(self._decoding)

    # --- chunk sizing ---

    def chunk_size(self) -> int:
        """Prompt tokens to feed this step."""
        step = self.prefill_step
        if not self._decoding:
            return step
        if self._prefill_tps is None:
            return min(step, MIN_CHUNK)
        return max(min(step, MIN_CHUNK), min(step, int(self._prefill_tps * self.prefill_slice)))

    def chunk_fed(self, tokens: int, seconds: float) -> None:
        """How long the last chunk took: the rate the next chunk beside decoding turns is sized by."""
        self._prefill_tps = tokens / max(seconds, 1e-6)

    def before_first_tokens(self) -> bool:
        """Some turn waits, restores or prefills: it has not had its first token yet."""
        return bool(self._waiting or self._restoring or self._prefilling)

    def statistics(self) -> SchedulerStatistics:
        return SchedulerStatistics(running=len(self.running) + len(self._restoring), waiting=len(self._waiting),
                                   prefilling=len(self._prefilling), decoding=len(self._decoding),
                                   restoring=len(self._restoring), running_bytes=self.held_bytes(),
                                   budget=self.budget)
