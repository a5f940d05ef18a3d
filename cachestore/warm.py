"""The warm tier's layout: a session's tail after its whole blocks, each block held once.

A warm session entry is the tail ``[m*B, n)`` of its cache, an evaluated
snapshot (packed to 4 or 8 bits if `Budgets.warm_bits` says so); its whole
blocks are entries of their own under ``BLOCK_ENTRY + key`` (blocks.py), held
once however many sessions' tails follow them, so the warm budget counts a
shared prefix once. Taking a copy of a prefix means collecting the blocks a
tail needs, merging and restoring them.

Its own module because it is one data structure with its own invariants
(which entries a tail needs, when a block goes), used by every path of the
store (checkout, checkin, idle demotion, shutdown, delete) but needing only
the warm `Tier`, the I/O worker's idleness and the block size, which
`WarmBlocks` takes explicitly. The module helpers `usable` and `copy` answer
the same two questions for a single resident cache or warm snapshot.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from .blocks import block_keys
from .errors import CannotSplit
from .ioworker import IOWorker
from .lru import Tier
from .packing import pack, unpack
from .prefix import common_prefix_len
from .snapshot import Snapshot, merge, restore, section, snapshot, trimmable, truncate

log = logging.getLogger("kvd.cache")

Cache = list[Any]
Entry = tuple[Snapshot, list[int]]  # a snapshot and the token ids of the whole session it ends

#: Warm entries holding a whole block start with this; a session's key never does (hex).
BLOCK_ENTRY = "#"


def cache_nbytes(cache: Cache) -> int:
    return sum(int(c.nbytes) for c in cache)


class WarmBlocks:
    """The warm tier's session tails and shared blocks, and the snapshots kept aside (engine thread)."""

    def __init__(self, tier: Tier[Entry], io: IOWorker, *, block: int, root: str, bits: int) -> None:
        self.tier = tier
        self.held: dict[str, Entry] = {}  # left warm while disk jobs were queued
        self._io = io
        self.block = block
        self.root = root
        self.bits = bits

    def peek(self, key: str) -> Entry | None:
        return self.tier.peek(key) or self.held.get(key)

    def leave(self, dropped: list[tuple[str, Entry]]) -> None:
        for cold, entry in dropped:
            if not self._io.idle():
                self.held[cold] = entry  # until the worker has written what is queued
                log.debug("warm snapshot of %s kept aside until disk holds it", cold)
            else:
                log.debug("warm snapshot of %s dropped; disk holds it", cold)

    def parts(self, value: Entry) -> list[Snapshot]:
        """The warm snapshots that hold a session's prefix, in order, up to the first block missing.

        A session's warm entry is the tail ``[m*B, n)`` of its cache; its
        whole blocks are entries of their own (BLOCK_ENTRY + key), held once
        however many sessions' tails follow them, so the warm budget counts
        a shared prefix once.
        """
        tail, toks = value
        if tail.start == 0:
            return [tail]
        parts: list[Snapshot] = []
        for block in block_keys(toks[:tail.start], self.block, self.root):
            entry = self.peek(BLOCK_ENTRY + block)
            if entry is None:
                return parts
            parts.append(entry[0])
        return [*parts, tail]

    def usable(self, value: Entry, wanted: Sequence[int], limit: int) -> int:
        """How many wanted ids a warm entry (with the blocks it needs) can give a copy of."""
        parts = self.parts(value)
        held = parts[-1].end if parts else 0
        n = min(common_prefix_len(value[1][:held], wanted), limit)
        if n <= 0:
            return 0
        last = next(p for p in parts if p.end >= n)
        return n if n == last.end or trimmable(last) else 0

    def copy(self, key: str, n: int) -> Cache | None:
        """Live caches holding the first n ids of a warm entry; the entry stays as it is."""
        value = self.peek(key)
        if value is None:
            return None
        parts = [p for p in self.parts(value) if p.start < n]
        try:
            return restore(truncate(merge(*[unpack(p) for p in parts]), n)) if parts else None
        except CannotSplit:
            return None

    def demote(self, key: str, cache: Cache, tokens: list[int], now: float) -> None:
        """A live cache becomes warm: its whole blocks (those not warm already) and its tail."""
        whole = (len(tokens) - 1) // self.block if all(cuttable(c) for c in cache) else 0
        snap = snapshot(cache, 0)
        keys = block_keys(tokens[:whole * self.block], self.block, self.root)
        for k, block in enumerate(keys):
            held = self.peek(BLOCK_ENTRY + block)
            piece = held[0] if held is not None else self.packed(
                section(snap, k * self.block, (k + 1) * self.block))
            self.put(BLOCK_ENTRY + block, piece, tokens[k * self.block:(k + 1) * self.block], now)
        tail = self.packed(section(snap, whole * self.block, snap.end))
        self.put(key, tail, tokens, now)

    def packed(self, snap: Snapshot) -> Snapshot:
        return pack(snap, self.bits) if self.bits else snap

    def put(self, key: str, snap: Snapshot, tokens: list[int], now: float) -> None:
        self.held.pop(key, None)
        self.leave(self.tier.put(key, (snap, tokens), snap.nbytes, now))

    def forget(self, key: str) -> None:
        """A deleted session's warm tail goes, and every warm block no other warm tail needs."""
        held = self.held.pop(key, None)
        gone = self.tier.discard(key) or held
        if gone is not None and gone[0].start > 0:
            mine = set(block_keys(gone[1][:gone[0].start], self.block, self.root))
            for other in self.tier:
                entry = self.tier.peek(other)
                if entry is not None and not other.startswith(BLOCK_ENTRY) and entry[0].start > 0:
                    mine -= set(block_keys(entry[1][:entry[0].start], self.block, self.root))
            for block in mine:
                self.tier.discard(BLOCK_ENTRY + block)

    def statistics(self) -> dict[str, int]:
        """The warm tier's sessions and whole blocks (each held once, whoever's tails follow it)."""
        blocks = [k for k in self.tier if k.startswith(BLOCK_ENTRY)]
        return {"sessions": len(self.tier) - len(blocks), "blocks": len(blocks),
                "block_bytes": sum(e[0].nbytes for k in blocks if (e := self.tier.peek(k)) is not None)}


def cuttable(c: Any) -> bool:
    """A live layer whose state can be sliced at any earlier position (KV, quantized, lists of them)."""
    from mlx_lm.models.cache import CacheList, KVCache, QuantizedKVCache

    if isinstance(c, CacheList):
        return all(cuttable(x) for x in c.caches)
    return isinstance(c, (KVCache, QuantizedKVCache))


def usable(value: tuple[Cache | Snapshot, list[int]], wanted: Sequence[int], limit: int) -> int:
    """How many wanted ids a resident cache or warm snapshot can give a copy of."""
    held, toks = value
    n = min(common_prefix_len(toks, wanted), limit)
    if n <= 0:
        return 0
    end = held.end if isinstance(held, Snapshot) else len(toks)
    if n == end:
        return n
    can_cut = trimmable(held) if isinstance(held, Snapshot) else all(cuttable(c) for c in held)
    return n if can_cut else 0


def copy(value: tuple[Cache | Snapshot, list[int]], n: int) -> Cache | None:
    """Live caches holding the first n ids of a resident cache or warm snapshot; the source is untouched."""
    held, _ = value
    try:
        if isinstance(held, Snapshot):
            return restore(truncate(unpack(held), n))
        return restore(snapshot(held, 0, upto=n))
    except CannotSplit:
        return None
