"""Which answers run, which wait, whose prompt is fed next and in what size of chunk.

The engine's policy without the engine: no MLX, no threads, no clock of its
own (the engine reports how long each chunk took), so it is tested with plain
objects like cachestore/lru.py is. The engine thread is its only caller.

- The scheduler holds one list of answers, each with one `phase`: waiting,
  restoring (admitted, its cache checked out of the tiers: from disk, for as
  long as the read takes), prefilling, decoding (vLLM v1's one `Request` per
  request, with no prefill or decode lists). The list is in the order each
  answer entered its phase: waiting ones in arrival order, prefilling ones
  in the order they started.
- At most `max_running` answers are admitted at once (an answer carrying a
  request's other choices counts one for each: they decode in rows of their
  own once its prompt is read), and their caches fit
  `budget` bytes together (running caches count against the memory budget,
  as vLLM's `allocate_slots` counts a request's blocks before it runs): an
  answer is admitted with the bytes its cache reaches at its prompt plus
  `max_tokens` (`need`, reckoned by the engine), held until it ends; a
  restoring one holds its slot and its bytes too. The rest wait first come
  first served, and each waiting answer learns its place again whenever it
  moves up. An answer whose cache alone is larger than the budget waits
  until nothing else runs, then runs alone: memory then holds that one
  cache, over the budget by what it needs (a budget of 0, "keep no idle
  cache resident", still runs one answer at a time). Idle caches do not
  count here: the cache store evicts them to make room for what runs. Where
  several models share the budget, `admit` (the cache store's) decides the
  bytes instead, across every model's running and idle caches.
- Prompts are fed one at a time, first come first (a prompt is one unpadded
  sequence: prefill.py), one chunk per engine step.
- Alone, a chunk is `prefill_step` tokens. Beside decoding answers, a chunk
  is as many tokens as take about `prefill_slice` seconds at the last
  chunk's rate, never below MIN_CHUNK, so the decoding streams keep moving
  through a long prefill.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Generic, Protocol, TypeVar

MIN_CHUNK = 8  # prompt tokens: smaller prefill chunks would mostly re-read the weights


class Phase(Enum):
    WAITING = "waiting"  # past max_running or the byte budget: not admitted yet
    RESTORING = "restoring"  # admitted: its cache is checked out of the tiers (read from disk meanwhile)
    PREFILLING = "prefilling"  # its prompt is fed a chunk per step
    DECODING = "decoding"  # in the decode batch


class Scheduled(Protocol):
    """What the scheduler reads and writes on an answer (the engine's `Answer`; a test's plain value)."""

    @property
    def key(self) -> str: ...  # its session: one answer per session at a time

    @property
    def rows(self) -> int: ...  # the decode rows it takes (a request's n choices ride on one answer)

    phase: Phase
    need: int  # bytes its cache may reach: held while it is admitted
    told: int  # the queue position it was last told, while it waits


A = TypeVar("A", bound=Scheduled)


@dataclass(frozen=True)
class SchedulerStatistics:
    running: int  # answers admitted and not yet finished (restoring + prefilling + decoding)
    waiting: int  # answers past max_running or the byte budget, not started yet
    prefilling: int  # answers whose prompt is still being fed
    decoding: int  # answers in the decode batch
    restoring: int = 0  # admitted answers whose cache is being read from disk
    running_bytes: int = 0  # what the admitted answers' caches may reach together
    budget: int | None = None  # the bytes they may take together (None: no byte limit)


class Scheduler(Generic[A]):
    def __init__(self, *, max_running: int, prefill_step: int, prefill_slice: float, budget: int | None = None):
        self.max_running = max_running
        self.prefill_step = prefill_step
        self.prefill_slice = prefill_slice
        self.budget = budget
        #: Where the budget is shared with other models' engines: whether an answer on a session (`key`)
        #: of `need` bytes fits beside everything every model holds (the cache store's `admit`, which
        #: holds the bytes for it when it does). None: the bytes are counted here, against `budget`.
        self.room: Callable[[str, int], bool] | None = None
        self.answers: list[A] = []  # in the order each entered its phase
        self._prefill_tps: float | None = None  # the last chunk's tokens per second

    def get(self, key: str) -> A | None:
        """The session's answer, in whatever phase (None: it has none)."""
        return next((a for a in self.answers if a.key == key), None)

    def phase(self, phase: Phase) -> list[A]:
        """The answers in `phase`, in the order they entered it."""
        return [a for a in self.answers if a.phase is phase]

    def started(self) -> list[A]:
        """The answers started: prefilling or decoding (`running`, in the statistics, counts the
        restoring ones too: every admitted answer)."""
        return [a for a in self.answers if a.phase is Phase.PREFILLING or a.phase is Phase.DECODING]

    def _to(self, a: A, phase: Phase) -> None:
        """`a` enters `phase`: last in the list, so each phase keeps the order its answers entered it."""
        self._drop(a)
        a.phase = phase
        self.answers.append(a)

    def _drop(self, a: A) -> None:
        self.answers = [x for x in self.answers if x is not a]  # by identity: answers are not values

    # --- admission ---

    def holds(self, key: str) -> bool:
        """The session has an answer in any phase (a second one is refused as busy)."""
        return self.get(key) is not None

    def alone(self, need: int) -> bool:
        """A cache of `need` bytes is larger than the budget: it runs only when nothing else does."""
        return self.budget is not None and need > self.budget

    def held_bytes(self) -> int:
        """What the admitted answers' caches may reach together."""
        return sum(a.need for a in self.answers if a.phase is not Phase.WAITING)

    def has_room(self, need: int = 0, key: str = "", rows: int = 1) -> bool:
        """An answer whose cache may reach `need` bytes, decoding in `rows` rows, can be admitted now (and
        nobody waits before it)."""
        admitted = [a for a in self.answers if a.phase is not Phase.WAITING]
        if sum(a.rows for a in admitted) + rows > self.max_running:
            return False
        if self.room is not None:
            return self.room(key, need)
        return self.budget is None or not admitted or sum(a.need for a in admitted) + need <= self.budget

    def wait(self, a: A) -> int:
        """Queue an answer that found no room; its place in the queue (1: next)."""
        self._to(a, Phase.WAITING)
        a.told = len(self.phase(Phase.WAITING))
        return a.told

    def admissible(self) -> Iterator[A]:
        """Waiting answers to admit now, in arrival order, while there is room for the next one;
        each leaves the list until the engine `admit`s it.

        First come first served: an answer that does not fit yet keeps those
        behind it waiting (no small answer overtakes a large one forever).
        Room is checked again before each one: the engine admits each
        before the next is considered.
        """
        while (waiting := self.phase(Phase.WAITING)) and self.has_room(waiting[0].need, waiting[0].key,
                                                                         waiting[0].rows):
            self._drop(waiting[0])
            yield waiting[0]

    def admit(self, a: A) -> None:
        """An answer is admitted: its cache is checked out (`restoring`), and its `need` bytes are
        held for it until it `end`s."""
        self._to(a, Phase.RESTORING)

    def moved(self) -> list[A]:
        """Waiting answers whose place changed since they were last told (`told` is the new one)."""
        out = []
        for position, a in enumerate(self.phase(Phase.WAITING), start=1):
            if a.told != position:
                a.told = position
                out.append(a)
        return out

    # --- a running answer's phases ---

    def prefill(self, a: A) -> None:
        """An answer has its cache: its prompt is fed next after those already being fed."""
        self._to(a, Phase.PREFILLING)

    def decode(self, a: A) -> None:
        """The answer's prompt is fed; it decodes in the batch from now on."""
        self._to(a, Phase.DECODING)

    def end(self, key: str) -> A | None:
        """The answer is over (finished, cancelled, failed): it leaves the list, and its bytes are free."""
        a = self.get(key)
        if a is not None:
            self._drop(a)
        return a

    def next_prefill(self) -> A | None:
        """Whose prompt gets this step's chunk."""
        return next((a for a in self.answers if a.phase is Phase.PREFILLING), None)

    def any_decoding(self) -> bool:
        return any(a.phase is Phase.DECODING for a in self.answers)

    # --- chunk sizing ---

    def chunk_size(self) -> int:
        """Prompt tokens to feed this step."""
        step = self.prefill_step
        if not self.any_decoding():
            return step
        if self._prefill_tps is None:
            return min(step, MIN_CHUNK)
        return max(min(step, MIN_CHUNK), min(step, int(self._prefill_tps * self.prefill_slice)))

    def chunk_fed(self, tokens: int, seconds: float) -> None:
        """How long the last chunk took: the rate the next chunk beside decoding answers is sized by."""
        self._prefill_tps = tokens / max(seconds, 1e-6)

    def before_first_tokens(self) -> bool:
        """Some answer waits, restores or prefills: it has not had its first token yet."""
        return any(a.phase is not Phase.DECODING for a in self.answers)

    def statistics(self) -> SchedulerStatistics:
        n = {phase: 0 for phase in Phase}
        for a in self.answers:
            n[a.phase] += 1
        return SchedulerStatistics(running=len(self.answers) - n[Phase.WAITING], waiting=n[Phase.WAITING],
                                   prefilling=n[Phase.PREFILLING], decoding=n[Phase.DECODING],
                                   restoring=n[Phase.RESTORING], running_bytes=self.held_bytes(),
                                   budget=self.budget)
