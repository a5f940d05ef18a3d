"""What the engine tells its cache store (`SessionCaches.tell`): things that happened, never orders.

The engine's door into the store is a handful of calls, each named for what the engine needs
(store.py's "the engine's door"). What the store does when it hears these — the budget protocol
every model's stores share (pool.py, shares.py: demote for another model, stop wanting room), the
I/O worker's manners (ioworker.py's `FirstTokens`: its writes give way while an answer wants its
first token), the reads' buffers (pagein.py), idle demotions, paging out at the end — is the
store's own business, behind the door. Plain values, cheap to make (one is told after every engine step:
a frozen dataclass cost 4 µs to make there, a named tuple a tenth of it); importing them loads no MLX.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from .terms import Pending

__all__ = ["ARRIVED", "IDLE", "READS_REPORTED", "STOPPING", "WOKEN", "Abandoned", "Arrived", "Idle",
           "ReadsReported", "Stepped", "Stopping", "Told", "Took", "Woken"]


class Arrived:
    """An answer is on its way to the engine (any thread: the event loop's `Engine.submit`)."""

    __slots__ = ()


class Took(NamedTuple):
    """The engine took an arrived answer; `wanting`: whether its answers still want their first token."""

    wanting: bool


class Stepped(NamedTuple):
    """The engine moved its answers one step. `running`: answers are prefilling or decoding (a read's
    buffers are then made a few at a time, beside their steps); `wanting`: some still want their first
    token; `waiting`: some are queued for room."""

    running: bool
    wanting: bool
    waiting: bool


class ReadsReported:
    """The reader reported on a read (the store's `on_read` said so): a restore or a prefetch goes on, or ends."""

    __slots__ = ()


class Woken:
    """The store's `on_room` woke the engine: another model waits for room, or room came back, or the
    budgets changed."""

    __slots__ = ()


class Idle:
    """Nothing runs: time for idle upkeep (caches unused for long move down a tier)."""

    __slots__ = ()


class Abandoned(NamedTuple):
    """The answer that held this pending read is gone (cancelled, or its session deleted)."""

    read: Pending


class Stopping:
    """The engine stops (kvd stops, or its model unloads): disk must hold every cache memory holds."""

    __slots__ = ()


ARRIVED, READS_REPORTED, WOKEN, IDLE, STOPPING = Arrived(), ReadsReported(), Woken(), Idle(), Stopping()

Told = Arrived | Took | Stepped | ReadsReported | Woken | Idle | Abandoned | Stopping
