"""Snapshot, restore, merge, split and rewind a session's per-layer mlx-lm caches.

One contract for every cache kind (after the Ollama MLX runner's cache
contract), built on what mlx-lm's caches share: ``offset``, ``state``,
``is_trimmable`` / ``trim``. A :class:`Snapshot` covers the tokens
``[start, end)``; what "covering" means is each kind's own business
(:mod:`cachestore.kinds`: one object per kind, in a fixed table). This module
walks the layers and asks each one's kind, so it never names a kind.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from .errors import CannotSplit, SnapshotError
from .kinds import (
    KINDS,
    cut_layer,
    kind_of,
    layer_at,
    layer_cuttable,
    live_at,
    merge_layers,
    restore_layer,
)
from .layers import LayerSnapshot

__all__ = [
    "KINDS",
    "LayerSnapshot",
    "Snapshot",
    "at_point",
    "checkpoint",
    "layer_kinds",
    "layout",
    "merge",
    "cuttable",
    "restore",
    "rewind",
    "rewind_to",
    "rewindable",
    "section",
    "snapshot",
    "split",
    "truncate",
]


@dataclass(frozen=True, eq=False)
class Snapshot:
    """The state of a whole cache for the tokens ``[start, end)``."""

    start: int
    end: int
    layers: tuple[LayerSnapshot, ...]

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def arrays(self) -> list[mx.array]:
        """Every array held, in layer order (children after their parent)."""
        return [a for layer in self.layers for node in layer.walk() for a in node.arrays]


# -- snapshot / restore -------------------------------------------------------


def snapshot(cache: Sequence[Any], start: int = 0, *, offset: int | None = None,
             upto: int | None = None) -> Snapshot:
    """Copy the state of tokens ``[start, offset)`` (or ``[start, upto)``) out of a live cache.

    ``upto`` copies only a prefix of what the cache holds (a new session
    starting from another's shared prefix): a cache whose layers can all be
    cut (KV, quantized) only, since a window or a recurrent state at ``upto``
    is not in a cache that has moved past it.

    ``offset`` is read from the layers (they must all agree); pass it only
    for a cache whose layers are all recurrent (``ArraysCache`` records no
    token count), or to have it checked. Works on caches straight out of
    ``BatchGenerator`` (``extract_cache`` / ``remove(...,
    return_prompt_caches=True)``) as well as on caches a model call filled.
    """
    end = _common_offset(cache, offset)
    if upto is not None and upto != end:
        if not 0 <= upto <= end or not cuttable(cache):
            raise CannotSplit(f"cannot snapshot the first {upto} of the {end} tokens this cache holds")
        end = upto
    if not 0 <= start <= end:
        raise SnapshotError(f"start {start} is outside [0, {end}], the tokens the cache holds")
    snap = Snapshot(start, end, tuple(kind_of(c).snapshot(c, start, end) for c in cache))
    mx.eval(snap.arrays())
    return snap


def _offsets(cache: Iterable[Any]) -> set[int]:
    return {o for c in cache for o in kind_of(c).offsets(c)}


def _common_offset(cache: Iterable[Any], offset: int | None) -> int:
    found = _offsets(cache)
    if len(found) > 1:
        raise SnapshotError(f"the layers disagree on the token count: {sorted(found)}")
    if not found:
        if offset is None:
            raise SnapshotError("no layer records a token count (recurrent-only cache): pass offset=")
        return offset
    (end,) = found
    if offset is not None and offset != end:
        raise SnapshotError(f"offset={offset} given, but the layers hold {end} tokens")
    return end


def restore(snap: Snapshot) -> list[Any]:
    """New live cache objects holding ``snap``, ready for the model's next forward.

    They go straight into the model or into ``BatchGenerator.insert(caches=[...])``
    (with ``all_tokens`` the ``snap.end`` tokens they hold). The arrays are
    shared with the snapshot, copy-on-write, so restoring twice is fine.
    """
    if snap.start != 0:
        raise SnapshotError(
            f"cannot restore tokens [{snap.start}, {snap.end}) alone: merge it onto its prefix first"
        )
    return [restore_layer(layer, snap.end) for layer in snap.layers]


# -- merge / split / truncate -------------------------------------------------


def merge(first: Snapshot, *rest: Snapshot) -> Snapshot:
    """``[s0.start, s0.end)`` + ``[s0.end, s1.end)`` + ... -> ``[s0.start, last.end)``.

    KV layers concatenate; rotating and recurrent layers keep the last part's
    state (the latest is the only one valid at its end). All parts are joined
    in one concatenation per array: merging a disk chain pairwise copied the
    growing prefix once per segment (93 of 172 ms restoring a 2k-token,
    8-segment SmolLM2-sized cache), n-way copies each byte once.
    """
    parts = (first, *rest)
    for a, b in zip(parts, parts[1:]):
        if a.end != b.start:
            raise SnapshotError(
                f"cannot merge [{a.start}, {a.end}) with [{b.start}, {b.end}): not adjacent"
            )
        if len(a.layers) != len(b.layers):
            raise SnapshotError(f"cannot merge snapshots of {len(a.layers)} and {len(b.layers)} layers")
    if not rest:
        return first
    start, end = first.start, parts[-1].end
    layers = tuple(merge_layers(list(group), start, end) for group in zip(*(s.layers for s in parts)))
    snap = Snapshot(start, end, layers)
    mx.eval(snap.arrays())
    return snap


def split(s: Snapshot, at: int) -> tuple[Snapshot, Snapshot]:
    """``[start, end)`` -> ``[start, at)``, ``[at, end)``; KV / quantized layers only."""
    _check_cut(s, at)
    first, second = _part(s, s.start, at), _part(s, at, s.end)
    mx.eval(first.arrays(), second.arrays())
    return first, second


def section(s: Snapshot, lo: int, hi: int) -> Snapshot:
    """The tokens ``[lo, hi)`` of a cuttable snapshot, one copy of that range only.

    ``(s.start, s.end)`` itself is always allowed (nothing to cut).
    """
    if (lo, hi) == (s.start, s.end):
        return s
    _check_cut(s, lo)
    _check_cut(s, hi)
    if lo > hi:
        raise CannotSplit(f"cannot take [{lo}, {hi}) out of [{s.start}, {s.end})")
    part = _part(s, lo, hi)
    mx.eval(part.arrays())
    return part


def truncate(s: Snapshot, end: int) -> Snapshot:
    """The first ``end - s.start`` tokens of ``s``: a resume point inside a segment.

    ``end == s.end`` is always allowed (nothing to cut), even for rotating or
    recurrent snapshots; anything else needs a cuttable snapshot. Only the
    part kept is copied.
    """
    if end == s.end:
        return s
    _check_cut(s, end)
    first = _part(s, s.start, end)
    mx.eval(first.arrays())
    return first


def _check_cut(s: Snapshot, at: int) -> None:
    if not cuttable(s):
        kinds = sorted({n.kind for layer in s.layers for n in layer.walk() if not layer_cuttable(n)})
        raise CannotSplit(f"a snapshot with {', '.join(kinds)} layers keeps no earlier state to cut at")
    if not s.start <= at <= s.end:
        raise CannotSplit(f"cannot split [{s.start}, {s.end}) at {at}")


def _part(s: Snapshot, lo: int, hi: int) -> Snapshot:
    """``[lo, hi)`` of a cuttable ``s``, unevaluated."""
    return Snapshot(lo, hi, tuple(cut_layer(layer, s.start, lo, hi) for layer in s.layers))


# -- rewind / cuttable / layout ---------------------------------------------


def rewind(cache: Sequence[Any], n: int) -> bool:
    """Drop the last ``n`` tokens of a live cache in place, if every layer can.

    KV and quantized layers always can; a rotating layer only while it has
    not wrapped (``offset < max_size``: once it has, the older entries were
    overwritten); a recurrent layer only for ``n == 0``. On ``False`` the
    cache is untouched.
    """
    if n < 0:
        raise ValueError(f"cannot rewind by {n} tokens")
    if n == 0 or not cache:
        return True
    offsets = _offsets(cache)
    if len(offsets) > 1:
        raise SnapshotError(f"the layers disagree on the token count: {sorted(offsets)}")
    if not offsets or n > offsets.pop() or not all(c.is_trimmable() for c in cache):
        return False
    for c in cache:
        c.trim(n)
    return True


def cuttable(x: Snapshot | LayerSnapshot | Sequence[Any]) -> bool:
    """Whether a snapshot, or a live cache's state, holds every position of its range,
    so it can be cut at any earlier point (plain and quantized KV; lists of them)."""
    if isinstance(x, Snapshot):
        return all(layer_cuttable(layer) for layer in x.layers)
    if isinstance(x, LayerSnapshot):
        return layer_cuttable(x)
    return all(_live_cuttable(c) for c in x)


def _live_cuttable(c: Any) -> bool:
    kind = kind_of(c)
    return all(_live_cuttable(x) for x in c.caches) if kind.has_children else kind.cuttable


def rewindable(cache: Sequence[Any]) -> bool:
    """Whether a live cache can drop its last tokens in place now (mlx-lm's ``is_trimmable``:
    a rotating layer only until it wraps); see `rewind`."""
    return all(c.is_trimmable() for c in cache)


def layout(cache: Sequence[Any]) -> list[str]:
    """The per-layer cache layout of a live cache, for ``segments.fingerprint``.

    Take it from the model's fresh ``make_prompt_cache(model)``, so that the
    reader (which has only the model) computes the same list as the writer.
    """
    return [kind_of(c).layout_entry(c) for c in cache]


# -- checkpoints: the state of the layers that cannot be cut, kept at a point -----------


def checkpoint(cache: Sequence[Any], end: int) -> Snapshot:
    """A live cache's state at ``end`` (the tokens it holds) that cannot be had later: ``[end, end)``, so
    its plain and quantized KV layers hold nothing (any later cache or snapshot holds their positions)
    and its recurrent layers their state, its window layers their window (cachestore/checkpoints.py)."""
    return snapshot(cache, end, offset=end)


def _check_point(point: Snapshot, layers: int) -> None:
    if point.start != point.end:
        raise SnapshotError(f"a checkpoint is [n, n), not [{point.start}, {point.end})")
    if len(point.layers) != layers:
        raise SnapshotError(f"a checkpoint of {len(point.layers)} layers for a cache of {layers}")


def at_point(source: Sequence[Any] | Snapshot, point: Snapshot, start: int = 0) -> Snapshot:
    """``[start, point.end)`` of a live cache or a snapshot that holds more: each layer that keeps every
    position cut at ``point.end``, every other one ``point``'s own state there."""
    _check_point(point, len(source.layers) if isinstance(source, Snapshot) else len(source))
    end = point.end
    if isinstance(source, Snapshot):
        if not source.start <= start <= end <= source.end:
            raise CannotSplit(f"[{start}, {end}) is not in [{source.start}, {source.end})")
        layers = tuple(layer_at(x, p, source.start, start, end) for x, p in zip(source.layers, point.layers))
    else:
        layers = tuple(layer_at(c, p, 0, start, end) for c, p in zip(source, point.layers))
    snap = Snapshot(start, end, layers)
    mx.eval(snap.arrays())
    return snap


def _same_kinds(c: Any, layer: LayerSnapshot) -> bool:
    kind = kind_of(c)
    if kind.name != layer.kind:
        return False
    return not kind.has_children or (len(c.caches) == len(layer.children) and all(
        _same_kinds(x, y) for x, y in zip(c.caches, layer.children)))


def rewind_to(cache: Sequence[Any], point: Snapshot) -> list[Any]:
    """A live cache (holding ``point.end`` tokens or more) moved back to its checkpoint ``point``: its KV
    layers trimmed in place, the others restored from ``point``. Raises, touching nothing, if ``point``
    is not a checkpoint of this cache's layers."""
    _check_point(point, len(cache))
    end = point.end
    if not all(_same_kinds(c, p) for c, p in zip(cache, point.layers)):
        raise SnapshotError("a checkpoint of another cache layout")
    if any(o < end for o in _offsets(cache)):
        raise SnapshotError(f"a cache of {sorted(_offsets(cache))} tokens has no state at {end}")
    return [live_at(c, p, end) for c, p in zip(cache, point.layers)]


def layer_kinds(cache: Sequence[Any]) -> list[str]:
    """A live cache's layers by kind name, a cache list's children in its place (``["arrays", "arrays", "kv"]``)."""
    return [name for c in cache for name in (layer_kinds(c.caches) if kind_of(c).has_children else [kind_of(c).name])]
