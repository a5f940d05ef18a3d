"""What the engine thread hands the event loop: one batch per engine step, one wake-up.

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


class Handoff:
    """The events made since the last flush, with their sinks, in order."""

    def __init__(self) -> None:
        self._items: list[tuple[Sink, EngineEvent]] = []
        self.flushes = 0  # wake-ups of an event loop so far (bench/hostcost.py's figure)
        self.loop_s = 0.0  # seconds the event loop spent delivering them (for the step profile)

    def put(self, sink: Sink, event: EngineEvent) -> None:
        self._items.append((sink, event))

    def __len__(self) -> int:
        return len(self._items)

    def flush(self) -> None:
        """Hand every event made since the last flush to its sink: one wake-up per event loop."""
        if not self._items:
            return
        items, self._items = self._items, []
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
