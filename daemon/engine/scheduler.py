"""Which turns run, which wait, whose prompt is fed next and in what size of chunk.

The engine's policy without the engine: no MLX, no threads, no clock of its
own (the engine reports how long each chunk took), so it is tested with plain
objects like cachestore/lru.py is. The engine thread is its only caller.

- At most `max_running` turns run at once; the rest wait first come first
  served, and each waiting job learns its place again whenever it moves up.
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
    running: int  # turns started and not yet finished (prefilling + decoding)
    waiting: int  # jobs past max_running, not started yet
    prefilling: int  # running turns whose prompt is still being fed
    decoding: int  # running turns in the decode batch


@dataclass
class _Waiting(Generic[J]):
    key: str
    job: J
    told: int  # the position the job was last told


class Scheduler(Generic[J, T]):
    def __init__(self, *, max_running: int, prefill_step: int, prefill_slice: float):
        self.max_running = max_running
        self.prefill_step = prefill_step
        self.prefill_slice = prefill_slice
        self.running: dict[str, T] = {}  # by session id
        self._waiting: list[_Waiting[J]] = []  # in arrival order
        self._prefilling: list[str] = []  # first come first
        self._decoding: set[str] = set()
        self._prefill_tps: float | None = None  # the last chunk's tokens per second

    # --- admission ---

    def holds(self, key: str) -> bool:
        """The session has a turn running or waiting (a second one is refused as busy)."""
        return key in self.running or any(w.key == key for w in self._waiting)

    def has_room(self) -> bool:
        return len(self.running) < self.max_running

    def wait(self, key: str, job: J) -> int:
        """Queue a job that found no room; its place in the queue (1: next)."""
        self._waiting.append(_Waiting(key, job, told=len(self._waiting) + 1))
        return len(self._waiting)

    def admissible(self) -> Iterator[J]:
        """Waiting jobs to start now, in arrival order, while there is room.

        Room is checked again before each one: a job whose start fails takes none.
        """
        while self._waiting and self.has_room():
            yield self._waiting.pop(0).job

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

    def start(self, key: str, turn: T) -> None:
        """A turn runs: its prompt is fed next after those already being fed."""
        self.running[key] = turn
        self._prefilling.append(key)

    def decode(self, key: str) -> None:
        """The turn's prompt is fed; it decodes in the batch from now on."""
        self._prefilling.remove(key)
        self._decoding.add(key)

    def end(self, key: str) -> T | None:
        """The turn is over (finished, cancelled, failed): it leaves every list."""
        if key in self._prefilling:
            self._prefilling.remove(key)
        self._decoding.discard(key)
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

    def statistics(self) -> SchedulerStatistics:
        return SchedulerStatistics(running=len(self.running), waiting=len(self._waiting),
                                   prefilling=len(self._prefilling), decoding=len(self._decoding))
