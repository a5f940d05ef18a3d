"""Another session's memory holding a prefix of the wanted ids: found down the block table, never by a scan.

The walk (table.py) says how deep the wanted ids' blocks reach in live
caches and in warm copies. Past the deepest block in common, only what
follows that block is compared with the wanted ids: the blocks after it
(cut where the ids part: blocks are plain or quantized KV, which cut
anywhere) and the sessions whose tail follows it. Sessions without blocks
(shorter than a block, or a cache with a window or a recurrent state, which
cannot be cut at an earlier boundary) follow the root, and are compared
from their first id; those that cannot be cut share their whole self, or
their state at a checkpoint (checkpoints.py) before where the ids part.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import partial

from .checkpoints import Checkpoints
from .lru import Tier
from .prefix import MIN_SHARED, common_prefix_len
from .snapshot import cuttable
from .table import BlockTable, Walk
from .warm import Cache, WarmTier, copy_live, copy_live_at, copy_parts

#: How many ids a copy holds, the copy (made only if chosen), and whether it is state kept at a point before the
#: end of what holds it (a checkpoint, a block's end) of a cache that cannot be cut.
Found = tuple[int, Callable[[], Cache | None], bool]


def find_shared(table: BlockTable, resident: Tier[Cache], warm: WarmTier, key: str, wanted: Sequence[int],
                limit: int, walk: Walk, best: int) -> Found | None:
    """The longest prefix (more than `best` ids, at least MIN_SHARED) another session's memory holds."""
    found: Found | None = None
    for got in (*_in_resident(table, resident, warm.points, key, wanted, limit, walk),
                *_in_warm(table, warm, key, wanted, limit, walk)):
        if got is not None and got[0] > best and got[0] >= MIN_SHARED:
            best, found = got[0], got
    return found


def _in_resident(table: BlockTable, resident: Tier[Cache], points: Checkpoints, key: str, wanted: Sequence[int],
                 limit: int, walk: Walk) -> Iterator[Found | None]:
    """What other sessions' live caches offer."""
    size = table.block
    # One resident cache holds every block up to the deepest it holds.
    if walk.live and walk.live_from != key and (cache := resident.peek(walk.live_from or "")) is not None:
        n = min(walk.live * size, limit)
        if cuttable(cache) or n == len(table.sessions[walk.live_from or ""].tokens):
            yield n, partial(copy_live, cache, n), False
    start = walk.live * size
    children, followers = _after(table, walk.keys, walk.live)
    for c in children:  # the block after: one live cache holding it, or each one's checkpoints
        for src in c.live:
            if src != key and (cache := resident.peek(src)) is not None:
                yield _live(points, src, cache, wanted, min(c.start + c.agrees(wanted), limit), None)
                if cuttable(cache):
                    break
    for s in followers:
        if s.key != key and (cache := resident.peek(s.key)) is not None:
            from_ = start if s.keys else 0
            n = min(from_ + common_prefix_len(s.tokens[from_:], wanted[from_:]), limit)
            yield _live(points, s.key, cache, wanted, n, len(s.tokens))


def _in_warm(table: BlockTable, warm: WarmTier, key: str, wanted: Sequence[int], limit: int,
             walk: Walk) -> Iterator[Found | None]:
    """What the warm copies of blocks and other sessions' warm snapshots offer: each block's copy is its own, so
    the blocks in common from the first (for a window or a recurrent state, up to the last whole one: its state is
    at its end only)."""
    size = table.block
    parts = [table.blocks[bk].warm for bk in walk.keys[:walk.warm]]
    if parts:
        whole = cuttable(parts[-1])
        n = min(walk.warm * size, limit) if whole else min(walk.warm, limit // size) * size
        yield n, partial(copy_parts, parts, n), not whole
    children, followers = _after(table, walk.keys, walk.warm)
    for c in children:
        if c.warm is not None:
            n = min(c.start + c.agrees(wanted), limit)
            if n == c.end or cuttable(c.warm):  # a window's block holds the state at its end only
                yield n, partial(copy_parts, [*parts, c.warm], n), not cuttable(c.warm)
    for s in followers:
        if s.key != key and (n := warm.usable(s.key, wanted, limit)) > 0:
            yield n, partial(warm.copy, s.key, n), n < warm.held_ids(s.key) and not warm.cuttable(s.key)


def _live(points: Checkpoints, key: str, cache: Cache, wanted: Sequence[int], n: int,
          held: int | None) -> Found | None:
    """A copy of the first `n` ids of another session's live cache (holding `held`: None, more than `n`), or,
    where it cannot be cut there, of its state at its latest checkpoint before."""
    if n == held or cuttable(cache):
        return n, partial(copy_live, cache, n), False
    if (at := points.nearest(key, wanted, n)) is not None:
        return at.end, partial(copy_live_at, cache, at), True
    return None


def _after(table: BlockTable, keys: Sequence[str], depth: int) -> tuple[list, list]:  # type: ignore[type-arg]
    """What follows the block at `depth` (the root at 0), and the sessions following the root."""
    parent = keys[depth - 1] if depth else table.root
    children, followers = table.after(parent)
    if depth:
        followers = [*followers, *table.after(table.root)[1]]
    return children, followers
