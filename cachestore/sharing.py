"""Another session's memory holding a prefix of the wanted ids: found down the block table, never by a scan.

The walk (table.py) says how deep the wanted ids' blocks reach in live
caches and in warm copies. Past the deepest block in common, only what
follows that block is compared with the wanted ids: the blocks after it
(cut where the ids part: blocks are plain or quantized KV, which cut
anywhere) and the sessions whose tail follows it. Sessions without blocks
(shorter than a block, or a cache with a window or a recurrent state, which
cannot be cut at an earlier boundary) follow the root, and are compared
from their first id; those that cannot be cut share only their whole self.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from .lru import Tier
from .prefix import MIN_SHARED, common_prefix_len
from .snapshot import cuttable
from .table import BlockTable, Walk
from .warm import Cache, WarmTier, copy_live, copy_parts

#: How many ids a copy holds, and the copy (made only if chosen).
Found = tuple[int, Callable[[], Cache | None]]


def find_shared(table: BlockTable, resident: Tier[Cache], warm: WarmTier, key: str, wanted: Sequence[int],  # noqa: C901
                # 16, counting its inner offer(): one walk over both memory tiers keeping the best find
                limit: int, walk: Walk, best: int) -> Found | None:
    """The longest prefix (more than `best` ids, at least MIN_SHARED) another session's memory holds."""
    found: Found | None = None

    def offer(n: int, copy: Callable[[], Cache | None]) -> None:
        nonlocal found, best
        if n > best and n >= MIN_SHARED:
            best, found = n, (n, copy)

    size = table.block
    # Live caches: one resident cache holds every block up to the deepest it holds.
    if walk.live and walk.live_from != key and (cache := resident.peek(walk.live_from or "")) is not None:
        n = min(walk.live * size, limit)
        if cuttable(cache) or n == len(table.sessions[walk.live_from or ""].tokens):
            offer(n, partial(copy_live, cache, n))
    start = walk.live * size
    children, followers = _after(table, walk.keys, walk.live)
    for c in children:
        src = next(iter(c.live), None)
        if src is not None and src != key and (cache := resident.peek(src)) is not None and cuttable(cache):
            n = min(c.start + c.agrees(wanted), limit)
            offer(n, partial(copy_live, cache, n))
    for s in followers:
        if s.key != key and (cache := resident.peek(s.key)) is not None:
            from_ = start if s.keys else 0
            n = min(from_ + common_prefix_len(s.tokens[from_:], wanted[from_:]), limit)
            if n == len(s.tokens) or cuttable(cache):
                offer(n, partial(copy_live, cache, n))
    # Warm copies: each block's copy is its own, so the blocks in common from the first.
    parts = [table.blocks[bk].warm for bk in walk.keys[:walk.warm]]
    if parts:
        n = min(walk.warm * size, limit)
        offer(n, partial(copy_parts, parts, n))
    children, followers = _after(table, walk.keys, walk.warm)
    for c in children:
        if c.warm is not None:
            n = min(c.start + c.agrees(wanted), limit)
            if n == c.end or cuttable(c.warm):  # a window's block holds the state at its end only
                offer(n, partial(copy_parts, [*parts, c.warm], n))
    for s in followers:
        if s.key != key and (n := warm.usable(s.key, wanted, limit)) > 0:
            offer(n, partial(warm.copy, s.key, n))
    return found


def _after(table: BlockTable, keys: Sequence[str], depth: int) -> tuple[list, list]:  # type: ignore[type-arg]
    """What follows the block at `depth` (the root at 0), and the sessions following the root."""
    parent = keys[depth - 1] if depth else table.root
    children, followers = table.after(parent)
    if depth:
        followers = [*followers, *table.after(table.root)[1]]
    return children, followers
