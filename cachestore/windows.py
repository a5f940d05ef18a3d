"""A sliding window's blocks, captured while its prefill passes each block's end.

A sliding-window layer at n holds only the window ending at n; a block of it
is the state at the block's end, so it is taken when the prefill is there
(the global layers' part is the block's own slice): two sessions with one
long system prompt then share it like plain KV. A cache that can be cut
anywhere needs none of this: its blocks are slices of it at any time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from .blocks import whole_blocks
from .snapshot import Snapshot, cuttable, snapshot
from .table import BlockTable


class Captures:
    """The blocks each session's prefill took (engine thread), until its checkin writes them."""

    def __init__(self, table: BlockTable) -> None:
        self.table = table
        self._taken: dict[str, dict[str, Snapshot]] = {}  # session -> block key -> its snapshot

    def capture(self, key: str, cache: list[Any], tokens: Sequence[int]) -> None:
        """A prefill into a window's cache reached `len(tokens)`: keep the block that ends here, if one does."""
        n, block = len(tokens), self.table.block
        if n == 0 or n % block:
            return
        snap = snapshot(cache, n - block)
        mx.eval(snap.arrays())
        self._taken.setdefault(key, {})[self.table.keys_for(key, tokens)[-1]] = snap

    def pop(self, key: str) -> dict[str, Snapshot]:
        """What the session's prefill took (empty: nothing), forgotten here."""
        return self._taken.pop(key, {})


def attach(table: BlockTable, key: str, held: Any, tokens: list[int],
           captured: dict[str, Snapshot] | None = None) -> list[str]:
    """Make the session's memory chain the whole blocks of `tokens`: all of them for a cache that can be cut; for
    a window, those from the first on that its prefill captured or kvd holds."""
    keys = table.keys_for(key, tokens)[:whole_blocks(len(tokens), table.block)]
    if not cuttable(held):
        have = 0
        for bk in keys if isinstance(held, list) else ():
            b = table.blocks.get(bk)
            if not (captured and bk in captured) and (b is None or (b.disk is None and b.warm is None)):
                break
            have += 1
        keys = keys[:have]
    table.attach(key, tokens, keys)
    return keys
