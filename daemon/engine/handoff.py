"""What the engine thread hands the event loop: at most one batch per engine step, one wake-up.

Every event an engine step makes (each row's new text, a finish, a refusal)
is put here as it is made and leaves in one `flush` at the end of the step:
one `call_soon_threadsafe` per event loop, carrying every answer's events in
the order they were made (llama.cpp's server hands its HTTP threads one
result batch per step the same way). Waking the loop once per token, as kvd
did, cost the loop a callback, a task switch and the GIL per token, just when
the engine wanted the GIL back to enqueue the next step.

Where an answer's events go is its `emit` (running.py): a sink the turn core
makes, which says which event loop it must be called on (`loop`) and takes
all of one step's events at once (`many`); a sink without a loop (a
follower rank's, a test's list) is called at the flush, on the engine
thread, once per event. Engine thread only, but for the delivery it schedules.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .jobs import EngineEvent

Sink = Callable[["EngineEvent"], None]


# How long a step's events may wait for the next step's when they are only more text of answers already
# streaming: the turn core publishes at most one delta an answer every 20 ms anyway (turn.py), and each
# wake-up of the event loop cost the engine a write to the loop's self-pipe (~8% of a micro model's step
# on the 2-core CPU, py-spy) and the loop a turn. Anything else (a first token, an end, an error, a queue
# position, progress) leaves at the end of its step, with whatever was held.
HOLD_S = 0.02


class Handoff:
    """The events made since the last flush, with their sinks, in order."""

    def __init__(self) -> None:
        self._items: list[tuple[Sink, EngineEvent]] = []
        self._urgent = False  # an event that must leave at the end of its step is among them
        self._since = 0.0  # when the held events' first wake-up was due (perf_counter), while some are held
        self.flushes = 0  # wake-ups of an event loop so far
        self.loop_s = 0.0  # seconds the event loop spent delivering them (for the step profile)

    def put(self, sink: Sink, event: EngineEvent) -> None:
        from ..events import AnswerDelta

        if not self._items:
            self._since = time.perf_counter()
        self._items.append((sink, event))
        if not (isinstance(event, AnswerDelta) and event.seq > 0) or getattr(sink, "loop", None) is None:
            self._urgent = True  # (a sink without a loop, a test's or a follower's, hears each step at once)

    def __len__(self) -> int:
        return len(self._items)

    def flush(self, *, force: bool = False) -> None:
        """Hand every event made since the last flush to its sink: one wake-up per event loop. Events that
        are only more text wait for the next step's, up to HOLD_S (`force`: none waits)."""
        if not self._items or not (force or self._urgent or time.perf_counter() - self._since >= HOLD_S):
            return
        items, self._items, self._urgent = self._items, [], False
        by_loop: dict[Any, list[tuple[Sink, EngineEvent]]] = {}
        for sink, event in items:
            loop = getattr(sink, "loop", None)
            if loop is None:
                sink(event)
            else:
                by_loop.setdefault(loop, []).append((sink, event))
        for loop, batch in by_loop.items():
            self.flushes += 1
            loop.call_soon_threadsafe(self._deliver, batch)

    def _deliver(self, batch: list[tuple[Sink, EngineEvent]]) -> None:
        """On the event loop: each sink's events, in order, in one call (a sink must not block)."""
        t0 = time.perf_counter()
        by_sink: dict[int, tuple[Sink, list[EngineEvent]]] = {}
        for sink, event in batch:
            by_sink.setdefault(id(sink), (sink, []))[1].append(event)
        for sink, events in by_sink.values():
            many = getattr(sink, "many", None)
            if many is not None:
                many(events)
            else:
                for event in events:
                    sink(event)
        self.loop_s += time.perf_counter() - t0
