"""Checkpoints: each session's state, at the points a conversation comes back to, of the layers that cannot be cut.

A plain or quantized KV layer keeps every position, so a cache of n ids can
serve any prefix of them. A recurrent layer (mlx-lm's `ArraysCache`: Gated
DeltaNet, Mamba-2, LFM2's short convolutions) keeps one state, and a
sliding-window layer only its last window: at n they hold nothing of an
earlier point. So a regenerate, an edit, an API conversation that branches,
or a second conversation with the same beginning can use such a cache only
where its state was kept. A checkpoint is that state at one point n: the
snapshot ``[n, n)`` of the cache (snapshot.checkpoint), whose KV layers hold
nothing and whose other layers hold their state at n; any cache or snapshot
of the session that holds n ids or more then gives the rest (snapshot.at_point,
rewind_to). Its size is fixed by the model: the recurrent states, and the
windows (up to their size) of sliding-window layers.

Taken where a conversation may come back to (the Ollama MLX runner's
snapshots at a trie node, llama.cpp's context checkpoints per slot):

- the end of each prompt less its last id (a prefill stops there: a regenerate
  feeds that one id again and samples a new answer from it);
- the end of each answer (the cache checked in; when the next turn takes the
  cache on, its state there is kept: an edit of the next message comes back to it).

On disk the same points are the ends of a session's files: its private tail
ends a segment at each checkpoint a turn passes and at the turn's end
(writeback.py), and a prefill keeps the block at each block boundary
(windows.py); memory keeps them for the sessions it holds. Each session keeps
its last `keep` in memory (4 by default, `cache.checkpoints`: the last two
turns' prompt and answer ends; the oldest goes first: a conversation comes
back mostly to its recent turns); they count against the budget of the tier
that holds the session, and go with it (warm.py drops them when the warm tier
lets the session go: disk's stay). A point stays only while its ids agree
with the session's. docs/caches.md has their bytes and what each rewind costs.
Engine thread only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from common.sizes import CHECKPOINTS

from .prefix import common_prefix_len
from .snapshot import Snapshot, checkpoint, cuttable, layer_kinds, rewind, rewind_to

__all__ = ["Checkpoints"]


@dataclass
class _Held:
    tokens: list[int]  # ids every point agrees with (a point at n holds the state after tokens[:n])
    points: dict[int, Snapshot] = field(default_factory=dict)
    nbytes: int = 0


class Checkpoints:
    """Every session's checkpoints in memory, by session and by the ids they hold."""

    def __init__(self, keep: int = CHECKPOINTS) -> None:
        if keep < 0:
            raise ValueError("keep is a number of checkpoints >= 0")
        self.keep = keep
        self._held: dict[str, _Held] = {}
        self.taken = 0  # checkpoints taken so far
        self.restores = 0  # checkouts that restored one
        self.kinds: dict[str, int] = {}  # the model's cache layers by kind (`learn`)
        self.most = 0  # the bytes of one checkpoint at most (its windows full), 0: a cache that can be cut

    def learn(self, probe: Sequence[Any], *, most: int) -> None:
        """What the model's caches are (a live one of its, `probe`): its layers' kinds, and a checkpoint's bytes."""
        self.kinds = dict(Counter(layer_kinds(probe)))
        self.most = most

    def __contains__(self, key: str) -> bool:
        return key in self._held

    def take(self, key: str, cache: Sequence[Any], tokens: Sequence[int]) -> None:
        """Keep the state `cache` holds after `tokens` (every id it holds), unless held already."""
        n = len(tokens)
        if self.keep == 0 or n == 0:
            return
        h = self.follow(key, tokens)
        if n in h.points:
            return
        point = checkpoint(cache, n)
        h.points[n] = point
        h.nbytes += point.nbytes
        self.taken += 1
        while len(h.points) > self.keep:
            self._drop_point(h, min(h.points))

    def handed(self, key: str, cache: list[Any] | None, tokens: Sequence[int], *, checkpoint: bool) -> None:
        """A checkout's cache (holding `tokens`) goes to the engine: where it cannot be cut, its state there is kept
        first (the end of an answer, or a restored point: a later rewind comes back to it without a read);
        `checkpoint`: it was restored at one."""
        if cache is not None and tokens and not cuttable(cache):
            self.take(key, cache, tokens)
        self.restores += checkpoint

    def follow(self, key: str, tokens: Sequence[int]) -> _Held:
        """The session's ids are now `tokens` (a turn ended, a prefill went on): points they part from go."""
        h = self._held.get(key)
        if h is None:
            h = self._held[key] = _Held(list(tokens))
            return h
        agree = common_prefix_len(h.tokens, tokens)
        for end in [e for e in h.points if e > agree]:
            self._drop_point(h, end)
        if agree < len(tokens):  # (a prefix of what they held keeps the longer ids: its points stay valid)
            h.tokens = list(tokens)
        return h

    def nearest(self, key: str, wanted: Sequence[int], upto: int) -> Snapshot | None:
        """The latest checkpoint of the session at or before `upto` ids that `wanted` agrees with."""
        h = self._held.get(key)
        if h is None or not h.points:
            return None
        agree = min(upto, common_prefix_len(h.tokens, wanted))
        best = max((e for e in h.points if e <= agree), default=0)
        return h.points[best] if best else None

    def at(self, key: str, end: int) -> Snapshot | None:
        """The session's checkpoint at exactly `end` ids, if it keeps one."""
        h = self._held.get(key)
        return h.points.get(end) if h is not None else None

    def rewound(self, key: str, cache: list[Any], held: Sequence[int], wanted: Sequence[int],
                limit: int) -> tuple[list[Any], int, bool] | None:
        """The session's own live cache (holding `held`) moved back as far as `wanted` (at most `limit` ids)
        agrees with it: in place where every layer can drop its last ids, else to its latest checkpoint
        before (True: a checkpoint); None: neither can (the cache is untouched)."""
        n = min(common_prefix_len(held, wanted), limit)
        if n > 0 and rewind(cache, len(held) - n):
            return cache, n, False
        point = self.nearest(key, wanted, n)
        if point is None:
            return None
        return rewind_to(cache, point), point.end, True

    def of(self, key: str) -> dict[int, Snapshot]:
        """The session's checkpoints, by the ids they hold (a copy: the disk's write-behind splits its tail there)."""
        h = self._held.get(key)
        return dict(h.points) if h is not None else {}

    def ends(self, key: str) -> list[int]:
        """Where the session's checkpoints are, in order."""
        h = self._held.get(key)
        return sorted(h.points) if h is not None else []

    def nbytes(self, key: str) -> int:
        h = self._held.get(key)
        return h.nbytes if h is not None else 0

    def drop(self, key: str) -> None:
        """The session's cache left memory (or was forgotten): its checkpoints go with it."""
        self._held.pop(key, None)

    def _drop_point(self, h: _Held, end: int) -> None:
        h.nbytes -= h.points.pop(end).nbytes

    def statistics(self) -> dict[str, Any]:
        return {"kinds": self.kinds, "each_bytes": self.most,
                "sessions": sum(1 for h in self._held.values() if h.points),
                "held": sum(len(h.points) for h in self._held.values()),
                "bytes": sum(h.nbytes for h in self._held.values()),
                "keep": self.keep, "taken": self.taken, "restores": self.restores}
