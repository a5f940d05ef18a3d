"""What the store's front door trades in: the budgets a store is made with, and a checkout it hands out
(and, inside the store, a checkout still waiting for its read)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from common.sizes import BLOCK_TOKENS, CHECKPOINTS

if TYPE_CHECKING:
    from .pagein import Reading


@dataclass(frozen=True)
class Budgets:
    """Hard byte limits and idle times; the defaults live in the daemon's config."""

    resident_bytes: int
    warm_bytes: int
    disk_bytes: int
    resident_idle: float
    warm_idle: float
    max_segments: int
    resident_sessions: int | None = None  # at most this many live caches, whatever their size
    warm_bits: int = 0  # 4 | 8: warm snapshots kept quantized (packing.py); 0: exact copies
    block_tokens: int = BLOCK_TOKENS  # token ids per content-addressed disk block
    checkpoints: int = CHECKPOINTS  # a session's checkpoints kept in memory where caches cannot be cut


@dataclass
class Checkout:
    cache: list[Any] | None  # the live cache (warm.Cache), or None: nothing held, or a read under way
    tokens: int  # how many leading ids of the wanted tokens `cache` holds
    restored_from: str  # "resident" | "warm" | "disk" | "shared" | "none": the wire's word for it too
    restore_ms: float
    shared_tokens: int = 0  # of `tokens`, those another session's cache or blocks supplied
    prefetched: bool = False  # its own resident/warm cache, paged in from disk after a start, first use
    #: Restored at a checkpoint (checkpoints.py): state kept at an earlier point than the end of the cache it came
    #: from, for a cache whose layers cannot all be cut there (recurrent state, a window).
    checkpoint: bool = False
    read: Pending | None = None  # a disk read under way: the store's `restored` makes the checkout (cache None now)


@dataclass
class Pending:
    """A checkout waiting for its disk read, and what it falls back on should the read fail."""

    key: str
    wanted: list[int]
    t0: float
    reading: Reading
    own: Checkout | None  # the session's own resident cache, rewound (shorter than what disk holds)
    prefetched: bool
