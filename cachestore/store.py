"""Every session's cache across the tiers: resident, warm, disk.

Runs on the engine thread (it holds live MLX caches), except the disk
writes: the engine thread only evaluates what a turn writes, and the I/O
worker (ioworker.py) runs writeback.py's half of the store, so no decode
step waits on disk. Each thread has its own connection to the index; every
index write after start-up runs on the worker, in the order the engine
asked for it. The policy:

- After a turn, the session's live cache is *resident*, and what the turn
  added is written *behind* it to disk: the whole blocks it completed (see
  below) and a rewritten private tail, so page-out cost grows with the new
  tokens, not the history.
- Resident over budget or idle: the least recently used cache is demoted to
  *warm*, a compact evaluated snapshot trimmed to its offset.
- Warm over budget or idle: dropped; disk already holds it (while disk
  writes are queued, the snapshot is kept aside until the worker is done).
- Disk over budget: the least recently used sessions are forgotten on disk
  (their private files, and the blocks no other session lists).
- Resume (`checkout`) restores the longest prefix of the wanted token ids
  that anything kvd holds: the session's own cache (resident, warm, disk),
  another session's resident or warm cache (a copy of the shared prefix),
  or blocks on disk that any session wrote; the caller prefills the rest.

Content-addressed blocks (issue 14). A session's disk chain is its whole
blocks ``[k*B, (k+1)*B)`` (B = `Budgets.block_tokens`) followed by private
segments ``[m*B, n)``, at least one token long. A block is keyed by the hash
chain of every id up to its end (blocks.py) and stored once under
``blocks/``; any session whose ids pass through it lists it in its chain, so
a long system prompt many sessions share is written, stored and counted
against the disk budget once, and a new session resumes from it, also
after a restart. A block's reference count is the number of chains listing
it; when the last one goes (delete, eviction, a rewind), the file goes.

Only a cache that can be cut anywhere (plain and quantized KV layers)
yields blocks: the live cache at n holds every position, so each block is a
slice of it. A sliding-window layer at n holds only the window ending at n,
not the window at an earlier block boundary, and a window restored at the
wrong position would be silently wrong; so caches with rotating or
recurrent layers keep a private chain from 0 (as before issue 14) and share
only through other sessions' resident or warm caches, at exactly their end.

A disk file that fails its checksum, fingerprint or invariants is dropped
with everything after it (a bad block: in every chain that lists it); the
sessions then prefill from there: slower, never wrong.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from . import direct
from .blocks import block_keys, root_key
from .errors import CannotSplit, CorruptSegment
from .index import BlockRow, SegmentIndex, SegmentRow
from .ioworker import IOWorker
from .lru import Tier
from .packing import pack, unpack
from .prefix import common_prefix_len
from .rebuild import rebuild_index
from .segments import read_segment
from .snapshot import Snapshot, merge, restore, rewind, section, snapshot, trimmable, truncate
from .writeback import NOTHING, NOTHING_TO_EVICT, Pieces, Promise, Writeback, plan

__all__ = ["NOTHING_TO_EVICT", "Budgets", "Checkout", "SessionCaches"]

log = logging.getLogger("kvd.cache")

Cache = list[Any]

PREFETCH_ROOM = 64  # tokens a prefetched live cache can take before it grows: a typical next message

#: Fewer ids in common with another session's cache in memory are prefilled, not copied: a
#: chat template's head ("<|im_start|>user\n") is shared by every conversation, and a
#: forward over a few tokens costs about what copying them out of another cache does.
MIN_SHARED = 16

#: Warm entries holding a whole block start with this; a session's key never does (hex).
BLOCK_ENTRY = "#"


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
    block_tokens: int = 128  # token ids per content-addressed disk block


@dataclass
class Checkout:
    cache: Cache | None
    tokens: int  # how many leading ids of the wanted tokens `cache` holds
    source: str  # "resident" | "warm" | "disk" | "shared" | "none"
    restore_ms: float
    shared_tokens: int = 0  # of `tokens`, those another session's cache or blocks supplied


def cache_nbytes(cache: Cache) -> int:
    return sum(int(c.nbytes) for c in cache)


Piece = BlockRow | SegmentRow


@dataclass
class _DiskPlan:
    pieces: list[Piece]
    end: int  # tokens the plan restores (the last piece is cut there if it ends later)
    own: int  # of those, the tokens the session's own chain holds


class SessionCaches:
    def __init__(self, root: Path, fingerprint: str, budgets: Budgets,
                 *, clock: Callable[[], float] = time.time):
        if budgets.block_tokens < 1:
            raise ValueError("block_tokens must be at least 1")
        self.fingerprint = fingerprint
        self.budgets = budgets
        self.block = budgets.block_tokens
        self.root = root_key(fingerprint)
        self._clock = clock
        self._dir = root
        self._indexes = threading.local()  # each thread's own connection to the index
        self._indexes.index = SegmentIndex(root)
        if self.index.lost is not None:
            rebuild_index(self.index, self.root, self.index.lost)
        if removed := self.index.sweep():
            log.info("removed %d cache file(s) left incomplete by a crash", removed)
        self.resident: Tier[tuple[Cache, list[int]]] = Tier("resident", budgets.resident_bytes,
                                                                  budgets.resident_sessions)
        self.warm: Tier[tuple[Snapshot, list[int]]] = Tier("warm", budgets.warm_bytes)
        self.disk_stats = {"hits": 0, "misses": 0, "page_ins": 0, "page_outs": 0,
                           "bytes_written": 0, "bytes_read": 0, "dropped_corrupt": 0,
                           "evicted_full": 0, "blocks_written": 0, "blocks_reused": 0}
        self.shared_stats = {"restores": 0, "tokens": 0}
        self.prefetch_stats = {"planned": 0, "done": 0, "resident": 0, "warm": 0, "bytes": 0}
        self._writer = Writeback(lambda: self.index, fingerprint=fingerprint, root=self.root,
                                 block=self.block, disk_bytes=budgets.disk_bytes,
                                 max_segments=budgets.max_segments, stats=self.disk_stats, clock=clock)
        self._writer.enforce_disk_budget(keep=None)
        self._io = IOWorker()
        self._promised: dict[str, Promise] = {}  # disk chains as they will be once queued jobs are done
        self._held: dict[str, tuple[Snapshot, list[int]]] = {}  # left warm while disk jobs were queued

    @property
    def index(self) -> SegmentIndex:
        """This thread's connection to the index (a SQLite connection stays on its thread)."""
        index: SegmentIndex | None = getattr(self._indexes, "index", None)
        if index is None:
            index = self._indexes.index = SegmentIndex(self._dir)
        return index

    def close(self) -> None:
        """Finish every queued disk job, then close the index."""
        self._io.submit(self._close_index)
        self._io.close()
        self._close_index()

    def _close_index(self) -> None:
        index = getattr(self._indexes, "index", None)
        if index is not None:
            index.close()
            del self._indexes.index

    # --- the I/O worker ---

    def flush(self) -> None:
        """Wait until disk holds everything asked of it so far (shutdown, tests, tools; never a turn)."""
        self._io.flush()
        self._settle()

    def after_writes(self, fn: Callable[[], object]) -> None:
        """Call `fn` on the I/O worker once every disk job queued so far is done; it must not block."""
        self._io.submit(fn)

    def _settle(self) -> None:
        """Take in the worker's finished jobs (engine thread): what they wrote is in the index now."""
        for key in self._io.settle():
            self._promised.pop(key, None)
        if self._held and self._io.idle():
            self._held.clear()  # disk holds them now (or never will: they were not writable)

    def _later(self, job: Callable[[], object], key: str | None = None) -> None:
        """An index write asked for on the engine thread: run on the worker, after the jobs before it."""
        if self._io.on_worker():
            job()
        else:
            self._io.submit(job, key=key)

    def _warm_peek(self, key: str) -> tuple[Snapshot, list[int]] | None:
        return self.warm.peek(key) or self._held.get(key)

    def _leave_warm(self, dropped: list[tuple[str, tuple[Snapshot, list[int]]]]) -> None:
        for cold, entry in dropped:
            if not self._io.idle():
                self._held[cold] = entry  # until the worker has written what is queued
                log.debug("warm snapshot of %s kept aside until disk holds it", cold)
            else:
                log.debug("warm snapshot of %s dropped; disk holds it", cold)

    # --- resume ---

    def checkout(self, key: str, wanted: Sequence[int]) -> Checkout:
        """Take the session's cache out of the tiers, holding the longest usable prefix anything holds.

        At least one wanted token is always left to feed. Candidates, best
        first on a tie: the session's own resident cache (rewound in place),
        its own warm snapshot, another session's resident cache or warm
        snapshot (a copy of the shared prefix; that session keeps its own),
        then disk (the session's chain, and blocks any session wrote).
        """
        t0 = time.perf_counter()
        limit = len(wanted) - 1
        def ms() -> float:
            return (time.perf_counter() - t0) * 1000

        self._settle()

        own: Checkout | None = None
        if (res := self.resident.take(key)) is not None:
            cache, toks = res
            n = min(common_prefix_len(toks, wanted), limit)
            if n > 0 and rewind(cache, len(toks) - n):
                self.warm.discard(key)
                own = Checkout(cache, n, "resident", 0.0)
            else:
                log.debug("resident cache of %s not reusable (shares %d tokens)", key, n)
        own_warm = self._warm_peek(key) if own is None else None
        own_warm_n = self._usable_warm(own_warm, wanted, limit) if own_warm is not None else 0

        best_n = max(own.tokens if own else 0, own_warm_n)
        other: tuple[str, str, int] | None = None  # (tier, session, tokens)
        for other_key in self.resident:
            res = self.resident.peek(other_key)
            if other_key != key and res is not None:
                n = _usable(res, wanted, limit)
                if n > best_n and n >= MIN_SHARED:
                    best_n, other = n, ("resident", other_key, n)
        for other_key in self.warm:
            w = self.warm.peek(other_key)
            if other_key != key and not other_key.startswith(BLOCK_ENTRY) and w is not None:
                n = self._usable_warm(w, wanted, limit)
                if n > best_n and n >= MIN_SHARED:
                    best_n, other = n, ("warm", other_key, n)
        plan = self._disk_plan(key, wanted, limit)
        if plan.end > best_n:
            live = self._restore_plan(key, plan, room=len(wanted) - plan.end)
            if live is not None:
                cache, end, own_tokens = live
                now = self._clock()
                self._later(lambda: self.index.touch(key, now))
                shared = max(end - own_tokens, 0)
                return self._counted(Checkout(cache, end, "shared" if shared else "disk", ms(), shared))
            plan = _DiskPlan([], 0, 0)
        if other is not None:
            tier_name, other_key, n = other
            if tier_name == "resident":
                value = self.resident.peek(other_key)
                assert value is not None
                copied = _copy(value, n)
            else:
                copied = self._copy_warm(other_key, n)
            if copied is not None:
                return self._counted(Checkout(copied, n, "shared", ms(), n))
        if own is not None:
            own.restore_ms = ms()
            return own
        if own_warm is not None and own_warm_n > 0:
            copied = self._copy_warm(key, own_warm_n)
            self.warm.take(key)
            self._held.pop(key, None)
            if copied is not None:
                return Checkout(copied, own_warm_n, "warm", ms())
        self.disk_stats["misses"] += 1
        return Checkout(None, 0, "none", ms())

    # --- warm: a session's tail after its whole blocks, each block held once ---

    def _warm_parts(self, value: tuple[Snapshot, list[int]]) -> list[Snapshot]:
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
            entry = self._warm_peek(BLOCK_ENTRY + block)
            if entry is None:
                return parts
            parts.append(entry[0])
        return [*parts, tail]

    def _usable_warm(self, value: tuple[Snapshot, list[int]], wanted: Sequence[int], limit: int) -> int:
        """How many wanted ids a warm entry (with the blocks it needs) can give a copy of."""
        parts = self._warm_parts(value)
        held = parts[-1].end if parts else 0
        n = min(common_prefix_len(value[1][:held], wanted), limit)
        if n <= 0:
            return 0
        last = next(p for p in parts if p.end >= n)
        return n if n == last.end or trimmable(last) else 0

    def _copy_warm(self, key: str, n: int) -> Cache | None:
        """Live caches holding the first n ids of a warm entry; the entry stays as it is."""
        value = self._warm_peek(key)
        if value is None:
            return None
        parts = [p for p in self._warm_parts(value) if p.start < n]
        try:
            return restore(truncate(merge(*[unpack(p) for p in parts]), n)) if parts else None
        except CannotSplit:
            return None

    def _counted(self, out: Checkout) -> Checkout:
        if out.shared_tokens:
            self.shared_stats["restores"] += 1
            self.shared_stats["tokens"] += out.shared_tokens
        return out

    def _disk_plan(self, key: str, wanted: Sequence[int], limit: int) -> _DiskPlan:
        """Which files restore the longest prefix of `wanted` (at most `limit` ids), read nothing yet.

        Either the session's own chain (its blocks, then its private
        segments), or the blocks any session wrote whose keys are the
        wanted ids' own: whichever holds more.
        """
        mine: list[Piece] = []
        pos = 0
        blocks = self.index.blocks_of(key)
        pieces: list[Piece] = [*blocks, *self._valid_chain(key)]
        for piece in pieces:
            if piece.start != pos or piece.fingerprint != self.fingerprint:
                break
            shared = common_prefix_len(piece.tokens, wanted[piece.start:piece.end])
            if shared == 0:
                break
            mine.append(piece)
            pos = min(piece.start + shared, limit)
            if pos < piece.end:
                break
        own = _DiskPlan(mine, pos, pos)
        keys = block_keys(wanted[:limit + self.block - 1 if limit else 0], self.block, self.root)
        found = self.index.find_blocks(keys)
        shared_pieces: list[BlockRow] = []
        end = 0
        for b in keys:
            row = found.get(b)
            if row is None or row.fingerprint != self.fingerprint or row.start != end \
                    or tuple(wanted[row.start:row.end]) != row.tokens[:len(wanted[row.start:row.end])]:
                break
            shared_pieces.append(row)
            end = min(row.end, limit)
        if end < limit and end == len(shared_pieces) * self.block:
            # Past the last whole block in common: the block some session wrote next that
            # agrees longest with the wanted ids, cut where they part (KV blocks cut anywhere).
            parent = shared_pieces[-1].block if shared_pieces else self.root
            best, agree = None, 0
            for row in self.index.children(parent):
                n = min(common_prefix_len(row.tokens, wanted[end:limit]), limit - end)
                if n > agree and row.fingerprint == self.fingerprint and row.start == end:
                    best, agree = row, n
            if best is not None and end + agree >= MIN_SHARED:  # a template's head alone: not worth a read
                shared_pieces.append(best)
                end += agree
        if end <= own.end:
            return own
        mine_blocks = sum(1 for b in blocks if b in shared_pieces)
        return _DiskPlan(list(shared_pieces), end, min(mine_blocks * self.block, end))

    def _restore_plan(self, key: str, plan: _DiskPlan, *, room: int, use: bool = True
                      ) -> tuple[Cache, int, int] | None:
        """Live caches holding a plan's tokens: (cache, tokens held, of those the session's own).

        Plain-KV caches are read straight into the live cache's buffers, with
        room for `room` more tokens (direct.py); other layouts are read,
        merged and restored.
        """
        parts = [direct.Piece(row.path, row.checksum, row.start, row.end, min(row.end, plan.end))
                 for row in plan.pieces]
        got = direct.read_direct(parts, fingerprint=self.fingerprint, room=room) if parts else None
        if got is None:
            merged = self._read_plan(key, plan, use=use)
            return (restore(merged[0]), merged[0].end, merged[1]) if merged is not None else None
        self.disk_stats["bytes_read"] += got.bytes_read
        if got.bad is not None:
            part, e = got.bad
            self._drop_bad(key, plan.pieces[parts.index(part)], e)
        if got.cache is None:
            return None
        if use:  # a prefetch is not a use
            blocks = [row.block for row in plan.pieces if row.start < got.tokens and isinstance(row, BlockRow)]
            now = self._clock()
            self._later(lambda: self.index.touch_blocks(blocks, now))
            self.disk_stats["hits"] += 1
            self.disk_stats["page_ins"] += 1
        return got.cache, got.tokens, min(plan.own, got.tokens)

    def _drop_bad(self, key: str, row: Piece, e: CorruptSegment) -> None:
        """A file failed verification: unlist it and what follows it (a block: in every chain)."""
        self.disk_stats["dropped_corrupt"] += 1
        if isinstance(row, BlockRow):
            block = row.block
            log.warning("dropping cache block %s: %s; every session that lists it will prefill "
                        "from token %d", row.path, e, row.start)
            self._later(lambda: self.index.drop_block(block))
            self._promised.clear()  # any chain may list it: plan from the index again
        else:
            log.warning("dropping cache file %s: %s; the session will prefill instead", row.path, e)
            start = row.start
            held = self._promised.get(key)
            self._promised[key] = _cut_promise(held if held is not None else self._writer.promise(key), start)
            self._later(lambda: self.index.drop_from(key, start), key)

    def _read_plan(self, key: str, plan: _DiskPlan, *, use: bool = True) -> tuple[Snapshot, int] | None:
        """Read and merge a plan's files; a bad file ends it there (and is dropped with what follows)."""
        pieces: list[Snapshot] = []
        for row in plan.pieces:
            try:
                piece = read_segment(row.path, checksum=row.checksum, fingerprint=self.fingerprint)
            except CorruptSegment as e:
                self._drop_bad(key, row, e)
                break
            self.disk_stats["bytes_read"] += row.nbytes
            if piece.end > plan.end:
                try:
                    piece = truncate(piece, plan.end)
                except CannotSplit:
                    break
            pieces.append(piece)
        if not pieces:
            return None
        if use:  # a prefetch is not a use
            blocks = [row.block for row in plan.pieces[:len(pieces)] if isinstance(row, BlockRow)]
            now = self._clock()
            self._later(lambda: self.index.touch_blocks(blocks, now))
            self.disk_stats["hits"] += 1
            self.disk_stats["page_ins"] += 1
        merged = merge(*pieces)
        return merged, min(plan.own, merged.end)

    # --- prefetch after a restart ---

    def prefetch_plan(self) -> list[str]:
        """Sessions only on disk that memory has room for, most recently used first.

        Planned once the model is ready after a start: the sessions people were
        just using are paged in before anyone asks, so the first turn after a
        restart finds its cache in memory. Only free room is planned (the
        resident tier's, then the warm tier's); a prefetch never evicts anything.
        """
        resident = self.resident.budget - self.resident.nbytes
        warm = self.warm.budget - self.warm.nbytes
        plan = []
        for key, nbytes in reversed(self.index.keys_by_use()):
            if key in self.resident or key in self.warm or nbytes <= 0:
                continue
            if (live := _live_bytes(self._rows(key))) <= resident:
                resident -= live
            elif nbytes <= warm:
                warm -= nbytes
            else:
                continue
            plan.append(key)
        self.prefetch_stats["planned"] += len(plan)
        return plan

    def prefetch(self, key: str) -> str | None:
        """Page one session's whole disk chain into memory if it fits; the tier it went to.

        Resident first: after a restart that tier is empty, and a live cache
        there (read straight into its buffers by direct.py, with room for a
        typical next message) makes the first turn cost what a turn before the
        restart did; a warm snapshot still needs a copy into a live cache.
        Otherwise warm. Not a use: the session keeps its place in the disk
        LRU, and it goes in at the tier's cold end (behind what people used
        since), so prefetching never changes what is evicted first.
        """
        if key in self.resident or key in self.warm:
            return None
        rows = self._rows(key)
        tokens = [t for row in rows for t in row.tokens]
        if not tokens:
            return None
        plan = self._disk_plan(key, tokens, len(tokens))
        if not plan.pieces:
            return None
        if self.resident.fits(_live_bytes(rows)):
            live = self._restore_plan(key, plan, room=PREFETCH_ROOM, use=False)
            if live is None:
                return None
            cache, end, _ = live
            nbytes = cache_nbytes(cache)
            if self.resident.offer(key, (cache, tokens[:end]), nbytes, self._clock()):
                self._prefetched("resident", nbytes)
                return "resident"
            return None
        got = self._read_plan(key, plan, use=False)
        if got is None:
            return None
        snap = got[0]
        toks = tokens[:snap.end]
        if self.budgets.warm_bits:
            snap = pack(snap, self.budgets.warm_bits)
        if not self.warm.offer(key, (snap, toks), snap.nbytes, self._clock()):
            return None
        self._prefetched("warm", snap.nbytes)
        return "warm"

    def _rows(self, key: str) -> list[Piece]:
        """The session's disk chain: its blocks, then its private segments."""
        return [*self.index.blocks_of(key), *self._valid_chain(key)]

    def _prefetched(self, tier: str, nbytes: int) -> None:
        self.prefetch_stats["done"] += 1
        self.prefetch_stats[tier] += 1
        self.prefetch_stats["bytes"] += nbytes

    def _valid_chain(self, key: str) -> list[SegmentRow]:
        """The session's private segments, without those another model or layout wrote (dropped on the worker)."""
        chain = self.index.chain(key)
        for row in chain:
            if row.fingerprint != self.fingerprint:
                self._later(lambda: self._writer.valid_chain(key), key)
                return [r for r in chain if r.start < row.start]
        return chain

    # --- after a turn ---

    def checkin(self, key: str, cache: Cache, tokens: Sequence[int]) -> None:
        """Keep a session's live cache resident and queue the writing of its new tokens behind it."""
        tokens = list(tokens)
        self._settle()
        self._write_behind(key, cache, tokens)
        self.warm.discard(key)
        self._held.pop(key, None)
        now = self._clock()
        for cold, (c, toks) in self.resident.put(key, (cache, tokens), cache_nbytes(cache), now):
            self._demote(cold, c, toks, now)

    def _demote(self, key: str, cache: Cache, tokens: list[int], now: float) -> None:
        """A live cache becomes warm: its whole blocks (those not warm already) and its tail."""
        whole = (len(tokens) - 1) // self.block if all(_cuttable(c) for c in cache) else 0
        snap = snapshot(cache, 0)
        keys = block_keys(tokens[:whole * self.block], self.block, self.root)
        for k, block in enumerate(keys):
            held = self._warm_peek(BLOCK_ENTRY + block)
            piece = held[0] if held is not None else self._packed(
                section(snap, k * self.block, (k + 1) * self.block))
            self._warm_put(BLOCK_ENTRY + block, piece, tokens[k * self.block:(k + 1) * self.block], now)
        tail = self._packed(section(snap, whole * self.block, snap.end))
        self._warm_put(key, tail, tokens, now)

    def _packed(self, snap: Snapshot) -> Snapshot:
        return pack(snap, self.budgets.warm_bits) if self.budgets.warm_bits else snap

    def _warm_put(self, key: str, snap: Snapshot, tokens: list[int], now: float) -> None:
        self._held.pop(key, None)
        self._leave_warm(self.warm.put(key, (snap, tokens), snap.nbytes, now))

    def _write_behind(self, key: str, cache: Cache | Snapshot, tokens: list[int], *,
                      evict: bool = True) -> None:
        """Evaluate what disk will lack of `tokens` and queue its writing (engine thread).

        `cache` is a live cache, or a snapshot of all of `tokens` (page_out_all).
        The plan is taken on the chain as it will be once the jobs queued
        before are done; the worker checks it against the index as it is.
        """
        n = len(tokens)
        splittable = trimmable(cache) if isinstance(cache, Snapshot) else all(_cuttable(c) for c in cache)
        held = self._promised.get(key)
        if held is None:
            held = self._writer.promise(key)
        rewrite = isinstance(cache, Snapshot) and not splittable  # a window: written whole or not at all
        blocks_from, private_from, after = plan(held, tokens, splittable=splittable, block=self.block,
                                                max_segments=self.budgets.max_segments, rewrite=rewrite)
        pieces: Pieces = {}
        starts = [s for s in (blocks_from, private_from) if s is not None]
        if starts:
            lo = min(starts)
            whole = snapshot(cache, lo) if isinstance(cache, list) else \
                (cache if lo == cache.start else section(cache, lo, n))
            spans = [(k, k + self.block) for k in range(blocks_from, after.base, self.block)] \
                if blocks_from is not None else []
            if private_from is not None:
                spans.append((private_from, n))
            pieces = {(a, b): whole if (a, b) == (whole.start, whole.end) else section(whole, a, b)
                      for a, b in spans}
            mx.eval([x for p in pieces.values() for x in p.arrays()])  # the worker only writes bytes
        self._promised[key] = after
        self._io.submit(lambda: self._writer.persist(key, pieces, tokens, splittable=splittable, evict=evict,
                                                     rewrite=rewrite), key=key)

    # --- housekeeping ---

    def maintain(self) -> None:
        """Idle demotions: resident -> warm after resident_idle, warm dropped after warm_idle."""
        self._settle()
        now = self._clock()
        for key, (cache, toks) in self.resident.idle(now, self.budgets.resident_idle):
            self._demote(key, cache, toks, now)
        self._leave_warm(self.warm.idle(now, self.budgets.warm_idle))

    def page_out_all(self) -> None:
        """Make sure disk holds every session kept in memory (on shutdown).

        No evictions for this: it must not push out caches used more recently.
        The writes are queued like a turn's, then waited for.
        """
        self.flush()
        for key in self.resident:
            entry = self.resident.peek(key)
            if entry is not None:
                try:
                    self._write_behind(key, entry[0], entry[1], evict=False)
                except Exception as e:
                    log.warning("could not page out %s: %s", key, e)
        for key in [*self.warm, *self._held]:
            w = self._warm_peek(key)
            if w is None or key.startswith(BLOCK_ENTRY):
                continue
            parts = self._warm_parts(w)
            if not parts or parts[0].start != 0:
                continue
            try:
                # A packed snapshot is saved at its rounded precision: the best there is.
                snap = merge(*[unpack(p) for p in parts])
                self._write_behind(key, snap, w[1][:snap.end], evict=False)
            except Exception as e:
                log.warning("could not page out %s: %s", key, e)
        self.flush()

    def forget(self, key: str) -> None:
        """A deleted session: its caches go, and every block no other session lists."""
        self.resident.discard(key)
        held = self._held.pop(key, None)
        gone = self.warm.discard(key) or held
        if gone is not None and gone[0].start > 0:
            mine = set(block_keys(gone[1][:gone[0].start], self.block, self.root))
            for other in self.warm:
                entry = self.warm.peek(other)
                if entry is not None and not other.startswith(BLOCK_ENTRY) and entry[0].start > 0:
                    mine -= set(block_keys(entry[1][:entry[0].start], self.block, self.root))
            for block in mine:
                self.warm.discard(BLOCK_ENTRY + block)
        self._later(lambda: self.index.drop_from(key, 0), key)  # after its queued writes, which it undoes
        self._promised[key] = NOTHING

    def locations(self) -> dict[str, str]:
        """Where each session's cache lives now: its fastest tier."""
        self._settle()
        where = {key: "disk" for key in self.index.keys()}
        where.update({key: "warm" for key in [*self._held, *self.warm] if not key.startswith(BLOCK_ENTRY)})
        where.update({key: "resident" for key in self.resident})
        return where

    def _warm_blocks(self) -> dict[str, int]:
        """The warm tier's sessions and whole blocks (each held once, whoever's tails follow it)."""
        blocks = [k for k in self.warm if k.startswith(BLOCK_ENTRY)]
        return {"sessions": len(self.warm) - len(blocks), "blocks": len(blocks),
                "block_bytes": sum(e[0].nbytes for k in blocks if (e := self.warm.peek(k)) is not None)}

    def statistics(self) -> dict[str, Any]:
        self._settle()
        sessions, segments = self.index.count()
        return {
            "resident": self.resident.statistics(),
            "warm": {**self.warm.statistics(), **self._warm_blocks()},
            "prefetched": {"sessions": self.prefetch_stats["done"], "bytes": self.prefetch_stats["bytes"],
                           "resident": self.prefetch_stats["resident"], "warm": self.prefetch_stats["warm"]},
            "disk": {"sessions": sessions, "segments": segments, "bytes": self.index.total_bytes(),
                     "budget": self.budgets.disk_bytes, "block_tokens": self.block,
                     **self.index.sharing(), **self.disk_stats},
            "shared": dict(self.shared_stats),
        }


def _live_bytes(rows: Sequence[Piece]) -> int:
    """An upper bound of a prefetched live cache's bytes: its buffers are whole steps, the files' headers count."""
    tokens = rows[-1].end if rows else 0
    return sum(row.nbytes for row in rows) * direct.capacity(tokens, PREFETCH_ROOM) // tokens if tokens else 0


def _cuttable(c: Any) -> bool:
    """A live layer whose state can be sliced at any earlier position (KV, quantized, lists of them)."""
    from mlx_lm.models.cache import CacheList, KVCache, QuantizedKVCache

    if isinstance(c, CacheList):
        return all(_cuttable(x) for x in c.caches)
    return isinstance(c, (KVCache, QuantizedKVCache))


def _usable(value: tuple[Cache | Snapshot, list[int]], wanted: Sequence[int], limit: int) -> int:
    """How many wanted ids a resident cache or warm snapshot can give a copy of."""
    held, toks = value
    n = min(common_prefix_len(toks, wanted), limit)
    if n <= 0:
        return 0
    end = held.end if isinstance(held, Snapshot) else len(toks)
    if n == end:
        return n
    cuttable = trimmable(held) if isinstance(held, Snapshot) else all(_cuttable(c) for c in held)
    return n if cuttable else 0


def _copy(value: tuple[Cache | Snapshot, list[int]], n: int) -> Cache | None:
    """Live caches holding the first n ids of a resident cache or warm snapshot; the source is untouched."""
    held, _ = value
    try:
        if isinstance(held, Snapshot):
            return restore(truncate(unpack(held), n))
        return restore(snapshot(held, 0, upto=n))
    except CannotSplit:
        return None


def _cut_promise(held: Promise, start: int) -> Promise:
    """A promised chain once its private segments from `start` on are dropped."""
    ends = tuple(e for e in held.ends if e <= start)
    end = ends[-1] if ends else held.base
    return Promise(held.tokens[:end], held.base, ends)
