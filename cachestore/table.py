"""One table of every cached block, whatever tier holds it, and every session's chain of them.

In the spirit of vLLM's ``cached_block_hash_to_block`` (v1/core/block_pool.py)
and SGLang's tree node with a device and a host value (hiradix_cache.py):
one entry per block key (blocks.py), saying where the block lives (the
resident sessions whose live cache holds it, its one warm copy, its file),
how many chains list it, and which blocks follow it. A session is its chain
of block keys plus a private tail; the chain is hashed once and extended as
its tokens arrive (`keys_for`).

Finding what restores a prefix is one walk down the wanted ids' block keys
(`walk`): no scan of other sessions, no re-hashing. Past the deepest block
in common, only the blocks and tails that follow that block are compared.

The disk part mirrors the index (SQLite, the durable record): loaded once at
start (`load`), then changed only by what the I/O worker reports it did
(`apply`, a `DiskNews` per job), on the engine thread. The index is never
the lookup path. Engine thread only; no MLX here (tested with plain objects).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.tokenids import pack_tokens, unpack_tokens

from .blocks import block_key
from .rows import BlockRow, DiskNews, SegmentRow


@dataclass(frozen=True, slots=True)
class BlockFile:
    """Where a block's file is (its name under the index's blocks/) and what it must check out as."""

    name: str
    nbytes: int
    checksum: str
    fingerprint: str


@dataclass(eq=False, slots=True)
class Block:
    key: str
    parent: str  # the previous block's key, or the table's root
    start: int
    end: int
    ids: bytes  # the ids [start, end), packed (common.tokenids)
    refs: int = 0  # block chains listing it: in memory (`SessionBlocks.keys`) and on disk (`.disk_keys`)
    live: set[str] = field(default_factory=set)  # resident sessions whose live cache holds it
    warm: Any = None  # its one warm copy (a Snapshot), or None
    warm_users: int = 0  # warm tails that need the warm copy
    disk: BlockFile | None = None  # its file, once the worker said it is indexed

    def tokens(self) -> list[int]:
        return unpack_tokens(self.ids)

    def agrees(self, wanted: Sequence[int]) -> int:
        """How many of its ids `wanted` (from this block's start) agrees with; most children of a
        shared block part at their first id, which is checked without unpacking the rest."""
        if self.start >= len(wanted) or int.from_bytes(self.ids[:4], "little") != wanted[self.start]:
            return 0
        if self.end <= len(wanted) and pack_tokens(wanted[self.start:self.end]) == self.ids:
            return self.end - self.start
        ids = unpack_tokens(self.ids)
        n = 0
        for a, b in zip(ids, wanted[self.start:self.end]):
            if a != b:
                break
            n += 1
        return n

    def row(self, blocks_dir: Path) -> BlockRow:
        assert self.disk is not None
        d = self.disk
        return BlockRow(self.key, self.parent, start=self.start, end=self.end, path=blocks_dir / d.name,
                        nbytes=d.nbytes, checksum=d.checksum, fingerprint=d.fingerprint, tokens=tuple(self.tokens()))


@dataclass(eq=False, slots=True)
class SessionBlocks:
    key: str
    tokens: list[int] = field(default_factory=list)  # the ids memory holds of it (live or warm)
    keys: list[str] = field(default_factory=list)  # its memory chain: the whole blocks before its tail
    hashed: tuple[list[int], list[str]] = field(default_factory=lambda: ([], []))  # ids hashed for it, their keys
    disk_keys: list[str] = field(default_factory=list)  # its chain on disk (as the worker last reported)
    disk_tail: list[SegmentRow] = field(default_factory=list)  # its private segments on disk

    @property
    def disk_bytes(self) -> int:
        return sum(r.nbytes for r in self.disk_tail)


@dataclass
class Walk:
    """How far the wanted ids' blocks reach in each tier (block counts from the first)."""

    keys: list[str]
    live: int = 0  # blocks some resident session's live cache holds (one cache holds them all)
    live_from: str | None = None  # that session
    warm: int = 0  # blocks with a warm copy, each of those before it too
    disk: int = 0  # blocks with a file, each of those before it too


class BlockTable:
    def __init__(self, root: str, block: int, blocks_dir: Path = Path("blocks")) -> None:
        self.root = root
        self.block = block
        self.blocks_dir = blocks_dir  # where block files are (SegmentIndex.blocks)
        self.blocks: dict[str, Block] = {}
        self.sessions: dict[str, SessionBlocks] = {}
        self.children: dict[str, set[str]] = {}  # a block key (or the root) -> the blocks after it
        self.followers: dict[str, set[str]] = {}  # a block key (or the root) -> sessions whose memory chain ends there
        # Disk totals, kept as the worker's news arrives (status must not sum 100,000 blocks).
        self.on_disk: set[str] = set()  # sessions with a chain or segments on disk
        self.disk_segments = 0
        self.disk_bytes = 0
        self.disk_blocks = 0
        self.disk_block_bytes = 0
        self.shared_bytes = 0  # bytes of blocks more than one disk chain lists
        self.saved_bytes = 0  # what listing them once saves
        self._disk_refs: dict[str, int] = {}

    # --- chains ---

    def session(self, key: str) -> SessionBlocks:
        s = self.sessions.get(key)
        if s is None:
            s = self.sessions[key] = SessionBlocks(key)
        return s

    def keys_for(self, key: str, tokens: Sequence[int]) -> list[str]:
        """The keys of every whole block of `tokens`, hashing only blocks the session has not hashed yet."""
        s = self.session(key)
        old_ids, old_keys = s.hashed
        want = len(tokens) // self.block
        same = 0
        while same < min(len(old_keys), want):
            lo, hi = same * self.block, (same + 1) * self.block
            if list(old_ids[lo:hi]) != list(tokens[lo:hi]):
                break
            same += 1
        keys = list(old_keys[:same])
        parent = keys[-1] if keys else self.root
        for k in range(same, want):
            parent = block_key(parent, tokens[k * self.block:(k + 1) * self.block])
            keys.append(parent)
        s.hashed = (list(tokens[:want * self.block]), keys)
        return keys

    def attach(self, key: str, tokens: list[int], keys: list[str]) -> None:
        """Make `keys` (whole blocks of `tokens`) the session's memory chain."""
        s = self.session(key)
        self.detach(key)
        s.tokens, s.keys = tokens, keys
        for k, bk in enumerate(keys):
            self._block(bk, keys[k - 1] if k else self.root, k, tokens).refs += 1
        self.followers.setdefault(keys[-1] if keys else self.root, set()).add(key)

    def detach(self, key: str) -> None:
        """The session holds nothing in memory any more (its disk chain stays)."""
        s = self.sessions.get(key)
        if s is None:
            return
        if s.tokens or s.keys:
            self.followers.get(s.keys[-1] if s.keys else self.root, set()).discard(key)
            for bk in s.keys:
                b = self.blocks[bk]
                b.refs -= 1
                b.live.discard(key)
                self._maybe_drop(b)
        s.tokens, s.keys = [], []

    def forget(self, key: str) -> None:
        """A session with nothing left in memory or on disk leaves the table."""
        s = self.sessions.get(key)
        if s is not None and not s.keys and not s.tokens and not s.disk_keys and not s.disk_tail:
            del self.sessions[key]

    def _block(self, bk: str, parent: str, k: int, tokens: Sequence[int]) -> Block:
        b = self.blocks.get(bk)
        if b is None:
            lo, hi = k * self.block, (k + 1) * self.block
            b = self.blocks[bk] = Block(bk, parent, lo, hi, pack_tokens(tokens[lo:hi]))
            self.children.setdefault(parent, set()).add(bk)
        return b

    def _maybe_drop(self, b: Block) -> None:
        if b.refs <= 0 and b.warm is None and b.disk is None and not b.live:
            del self.blocks[b.key]
            kids = self.children.get(b.parent)
            if kids is not None:
                kids.discard(b.key)
                if not kids:
                    del self.children[b.parent]

    def set_live(self, key: str, live: bool) -> None:
        """Whether the session's live cache (resident) holds its memory chain's blocks."""
        s = self.sessions.get(key)
        for bk in s.keys if s is not None else []:
            (self.blocks[bk].live.add if live else self.blocks[bk].live.discard)(key)

    # --- the walk ---

    def walk(self, keys: Sequence[str]) -> Walk:
        """How far the blocks keyed `keys` (a prefix's chain, in order) reach in each tier."""
        w = Walk(list(keys))
        warm_on = disk_on = True
        for k, bk in enumerate(keys):
            b = self.blocks.get(bk)
            if b is None:
                break
            if b.live:
                w.live, w.live_from = k + 1, next(iter(b.live))
            warm_on = warm_on and b.warm is not None
            disk_on = disk_on and b.disk is not None
            w.warm += warm_on
            w.disk += disk_on
            if not (b.live or warm_on or disk_on):
                break
        return w

    def after(self, parent: str) -> tuple[list[Block], list[SessionBlocks]]:
        """What follows a block (or the root): the blocks after it, and sessions whose tail does."""
        return ([self.blocks[c] for c in self.children.get(parent, ())],
                [self.sessions[s] for s in self.followers.get(parent, ())])

    # --- disk, as the worker reports it ---

    def load(self, blocks: Iterable[tuple[str, str, int, int, str, int, str, str, bytes]],
             chains: dict[str, list[str]], segments: dict[str, list[SegmentRow]]) -> None:
        """Fill the disk part from the index at start (`SegmentIndex.load_all`)."""
        for bk, parent, start, end, name, nbytes, checksum, fingerprint, ids in blocks:
            self._disk_file(bk, parent, start, end, bytes(ids), BlockFile(name, nbytes, checksum, fingerprint))
        self.apply(DiskNews({key: (chains.get(key, []), segments.get(key, []))
                             for key in {*chains, *segments}}, {}))

    def apply(self, news: DiskNews) -> None:
        for row in news.blocks.values():
            if row is not None:
                self._disk_block(row)
        for key, (keys, tail) in news.sessions.items():
            s = self.session(key)
            for bk in s.disk_keys:
                self._disk_ref(bk, -1)
            self.disk_segments -= len(s.disk_tail)
            self.disk_bytes -= s.disk_bytes
            s.disk_keys = [bk for bk in keys if bk in self.blocks and self.blocks[bk].disk is not None]
            s.disk_tail = list(tail)
            for bk in s.disk_keys:
                self._disk_ref(bk, +1)
            self.disk_segments += len(s.disk_tail)
            self.disk_bytes += s.disk_bytes
            (self.on_disk.add if s.disk_keys or s.disk_tail else self.on_disk.discard)(key)
            self.forget(key)
        for bk, row in news.blocks.items():
            b = self.blocks.get(bk)
            if row is None and b is not None and b.disk is not None:
                self.disk_blocks -= 1
                self.disk_block_bytes -= b.disk.nbytes
                self.disk_bytes -= b.disk.nbytes
                refs = self._disk_refs.pop(bk, 0)  # 0: the chains listing it were cut in this news
                self._disk_ref_totals(b.disk.nbytes, refs, 0)
                b.refs -= refs
                b.disk = None
                self._maybe_drop(b)

    def _disk_block(self, row: BlockRow) -> None:
        self._disk_file(row.block, row.parent, row.start, row.end, pack_tokens(row.tokens),
                        BlockFile(row.path.name, row.nbytes, row.checksum, row.fingerprint))

    def _disk_file(self, bk: str, parent: str, start: int, end: int, ids: bytes, file: BlockFile) -> None:
        b = self.blocks.get(bk)
        if b is None:
            b = self.blocks[bk] = Block(bk, parent, start, end, ids)
            self.children.setdefault(parent, set()).add(bk)
        old = b.disk.nbytes if b.disk is not None else 0
        self.disk_blocks += b.disk is None
        self.disk_block_bytes += file.nbytes - old
        self.disk_bytes += file.nbytes - old
        b.disk = file

    def _disk_ref(self, bk: str, delta: int) -> None:
        b = self.blocks[bk]
        before = self._disk_refs.get(bk, 0)
        after = before + delta
        if after:
            self._disk_refs[bk] = after
        else:
            self._disk_refs.pop(bk, None)
        b.refs += delta
        if b.disk is not None:
            self._disk_ref_totals(b.disk.nbytes, before, after)

    def _disk_ref_totals(self, nbytes: int, before: int, after: int) -> None:
        self.shared_bytes += nbytes * ((after > 1) - (before > 1))
        self.saved_bytes += nbytes * (max(after - 1, 0) - max(before - 1, 0))

    def disk_rows(self, key: str) -> tuple[list[BlockRow], list[SegmentRow]]:
        """The session's disk chain: its blocks' rows, then its private segments."""
        s = self.sessions.get(key)
        if s is None:
            return [], []
        return [self.blocks[bk].row(self.blocks_dir) for bk in s.disk_keys], list(s.disk_tail)

    def sharing(self) -> dict[str, int]:
        return {"blocks": self.disk_blocks, "block_bytes": self.disk_block_bytes,
                "shared_bytes": self.shared_bytes, "saved_bytes": self.saved_bytes}
