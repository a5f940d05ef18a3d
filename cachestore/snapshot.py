"""Snapshot, restore, merge, split and rewind a session's per-layer mlx-lm caches.

One contract for every cache kind (after the Ollama MLX runner's cache
contract), built on what mlx-lm's caches share: ``offset``, ``state``,
``is_trimmable`` / ``trim``. A :class:`Snapshot` covers the tokens
``[start, end)``; the kinds differ only in what "covering" means:

- ``kv`` / ``quantized``: the keys and values of exactly those positions, so
  snapshots of consecutive ranges concatenate (:func:`merge`) and cut
  (:func:`split`) anywhere. This is what lets disk writes be incremental.
- ``rotating`` (sliding window): the whole window as of ``end``, in temporal
  order, whatever ``start`` is. Older positions are gone, so no cut.
- ``arrays`` (recurrent state): the state at exactly ``end``. No cut either.
- ``list``: a ``CacheList`` of the above, snapshotted child by child.

Rotating caches, the subtle one. A live ``RotatingKVCache`` holds its entries
either in temporal order (after a multi-token update: up to
``max_size - 1 + S`` entries, ``_idx == len``), or as a ring of ``max_size``
entries whose oldest slot is ``_idx`` (after one-token updates wrapped), or
in a pre-allocated buffer longer than ``offset`` (before the first wrap).
Before its next forward the cache itself cuts any of these down to the last
``max_size - 1`` entries (plus the ``keep`` first ones), yet a snapshot must
keep ``min(offset, max_size)`` of them, in temporal order (sinks first), with
``_idx`` set to that length: a wrapped buffer shorter than ``max_size`` makes
the next one-token update "grow" it by ``max_size - offset`` (negative: an
MLX error), and ``BatchRotatingKVCache.merge`` (how
``BatchGenerator.insert(caches=...)`` takes it) copies the last ``size() ==
min(offset, max_size)`` entries. That is also the form
``BatchRotatingKVCache.extract`` produces for a wrapped batch.

Arrays in snapshots are evaluated and never the live cache's own
``mx.array`` objects: an MLX slice assignment (``keys[..., i, :] = x``, which
the caches do) rewrites the Python object it is applied to, so a shared
object would let the live cache scribble over the snapshot. Restore likewise
hands out fresh array objects, so one snapshot can be restored many times.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from .errors import CannotSplit, SnapshotError

__all__ = [
    "KINDS",
    "LayerSnapshot",
    "Snapshot",
    "layout",
    "merge",
    "restore",
    "rewind",
    "section",
    "snapshot",
    "split",
    "trimmable",
    "truncate",
]

#: The cache kinds a snapshot can hold, and the exact classes they map to.
#: Classes are only ever chosen from this table, never from a name in a file.
KINDS: dict[str, type] = {
    "kv": KVCache,
    "rotating": RotatingKVCache,
    "quantized": QuantizedKVCache,
    "arrays": ArraysCache,
    "list": CacheList,
}
_KIND_OF: dict[type, str] = {cls: kind for kind, cls in KINDS.items()}
#: Kinds whose snapshots hold every position of their range, so they can be cut.
_SPLITTABLE = frozenset({"kv", "quantized"})


@dataclass(frozen=True, eq=False)
class LayerSnapshot:
    """The saved state of one layer's cache (see the module doc per kind).

    ``arrays`` per kind: kv ``(keys, values)``; quantized ``(k_packed,
    k_scales, k_biases, v_packed, v_scales, v_biases)``; rotating ``(keys,
    values)`` of the window; arrays the present slots in order; list none
    (its state is in ``children``). A layer covering no tokens has no arrays.
    ``eq=False``: comparing ``mx.array`` tuples has no single truth value.
    """

    kind: str
    arrays: tuple[mx.array, ...]
    meta: dict[str, int]
    children: tuple[LayerSnapshot, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays) + sum(c.nbytes for c in self.children)

    def walk(self) -> Iterator[LayerSnapshot]:
        """This layer, then its children depth first."""
        yield self
        for child in self.children:
            yield from child.walk()


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


# -- snapshot -----------------------------------------------------------------


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
        if not 0 <= upto <= end or not all(_kind(c) in _SPLITTABLE for c in cache):
            raise CannotSplit(f"cannot snapshot the first {upto} of the {end} tokens this cache holds")
        end = upto
    if not 0 <= start <= end:
        raise SnapshotError(f"start {start} is outside [0, {end}], the tokens the cache holds")
    layers = tuple(_snapshot_layer(c, start, end) for c in cache)
    snap = Snapshot(start, end, layers)
    mx.eval(snap.arrays())
    return snap


def _kind(c: Any) -> str:
    # The nearest known class in the MRO: a subclass that adds behaviour but no
    # state (kvd's batchable quantized cache) snapshots as its base kind.
    kind = next((_KIND_OF[k] for k in type(c).__mro__ if k in _KIND_OF), None)
    if kind is None:
        raise SnapshotError(f"cannot snapshot a {type(c).__name__}: not a supported cache kind")
    return kind


def _layer_offsets(c: Any) -> Iterator[int]:
    kind = _kind(c)
    if kind == "list":
        for child in c.caches:
            yield from _layer_offsets(child)
    elif kind != "arrays":
        if not isinstance(c.offset, int):
            raise SnapshotError(f"{type(c).__name__}.offset is not an int (a batched cache?)")
        yield c.offset


def _common_offset(cache: Iterable[Any], offset: int | None) -> int:
    found = {o for c in cache for o in _layer_offsets(c)}
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


def _copy(x: mx.array) -> mx.array:
    # mx.contiguous copies a strided or partial view and returns a new array
    # object either way: never the live cache's own object.
    return mx.contiguous(x)


def _one_sequence(x: mx.array, what: str) -> None:
    if x.shape[0] != 1:
        raise SnapshotError(
            f"{what} holds a batch of {x.shape[0]} sequences; snapshot one session's cache"
        )


def _snapshot_layer(c: Any, start: int, end: int) -> LayerSnapshot:
    kind = _kind(c)
    if kind == "kv":
        return LayerSnapshot(
            "kv", _kv_range(c, (c.keys,), (c.values,), start, end), {"start": start, "offset": end}
        )
    if kind == "quantized":
        keys = tuple(c.keys) if c.keys is not None else None
        values = tuple(c.values) if c.values is not None else None
        meta = {"start": start, "offset": end, "group_size": c.group_size, "bits": c.bits}
        return LayerSnapshot("quantized", _kv_range(c, keys, values, start, end), meta)
    if kind == "rotating":
        return _snapshot_rotating(c, end)
    if kind == "arrays":
        present = 0
        arrays = []
        for i, a in enumerate(c.cache):
            if a is not None:
                _one_sequence(a, "an ArraysCache")
                present |= 1 << i
                arrays.append(_copy(a))
        # left_padding / lengths are batch bookkeeping that ArraysCache.extract drops too.
        return LayerSnapshot(
            "arrays", tuple(arrays), {"offset": end, "slots": len(c.cache), "present": present}
        )
    children = tuple(_snapshot_layer(child, start, end) for child in c.caches)
    return LayerSnapshot("list", (), {"offset": end}, children)


def _kv_range(
    c: Any, keys: tuple[mx.array, ...] | None, values: tuple[mx.array, ...] | None, start: int, end: int
) -> tuple[mx.array, ...]:
    if start == end:
        return ()
    if keys is None or values is None or keys[0] is None:
        raise SnapshotError(f"{type(c).__name__} claims {end} tokens but holds no keys")
    held = keys[0].shape[2]
    if held < end:
        raise SnapshotError(f"{type(c).__name__} claims {end} tokens but holds {held}")
    _one_sequence(keys[0], type(c).__name__)
    return tuple(_copy(a[..., start:end, :]) for a in (*keys, *values))


def _snapshot_rotating(c: Any, end: int) -> LayerSnapshot:
    window = min(end, c.max_size)
    meta = {"offset": end, "max_size": c.max_size, "keep": c.keep, "idx": window}
    if window == 0:
        return LayerSnapshot("rotating", (), meta)
    if c.keys is None:
        raise SnapshotError(f"RotatingKVCache claims {end} tokens but holds no keys")
    _one_sequence(c.keys, "RotatingKVCache")
    arrays = []
    for v in (c.keys, c.values):
        # mlx-lm's own reading of the buffer: ring -> temporal, unused tail dropped.
        v = c._temporal_order(v)
        held = v.shape[2]
        if held < window:
            raise SnapshotError(
                f"RotatingKVCache at offset {end} holds {held} of the {window} entries"
                " its next step needs"
            )
        if held > window:  # a long multi-token update leaves up to max_size - 1 + S
            sinks = min(c.keep, window)
            v = mx.concatenate([v[..., :sinks, :], v[..., held - (window - sinks) :, :]], axis=2)
        arrays.append(_copy(v))
    return LayerSnapshot("rotating", tuple(arrays), meta)


# -- restore ------------------------------------------------------------------


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
    return [_restore_layer(layer, snap.end) for layer in snap.layers]


def _fresh(x: mx.array) -> mx.array:
    # A new array object on the same data: the cache's in-place writes then
    # copy instead of reaching into the snapshot (see the module doc).
    return x[...]


def _restore_layer(layer: LayerSnapshot, end: int) -> Any:
    a = tuple(_fresh(x) for x in layer.arrays)
    m = layer.meta
    if m["offset"] != end:
        raise SnapshotError(f"a {layer.kind} layer holds {m['offset']} tokens, the snapshot {end}")
    held = m.get("idx", end) if layer.kind in ("kv", "quantized", "rotating") else None
    if held is not None and bool(a) != (held > 0):
        raise SnapshotError(f"a {layer.kind} layer of {held} entries has {len(a)} arrays")
    if layer.kind == "kv":
        kv = KVCache()
        if a:
            kv.keys, kv.values = a
            kv.offset = end
        return kv
    if layer.kind == "quantized":
        q: Any = QuantizedKVCache(group_size=m["group_size"], bits=m["bits"])
        if a:
            q.keys, q.values = a[:3], a[3:]
            q.offset = end
        return q
    if layer.kind == "rotating":
        r = RotatingKVCache(max_size=m["max_size"], keep=m["keep"])
        if a:
            r.keys, r.values = a
            r.offset = end
            r._idx = m["idx"]
        return r
    if layer.kind == "arrays":
        arrays = ArraysCache(m["slots"])
        it = iter(a)
        for i in range(m["slots"]):
            if m["present"] >> i & 1:
                arrays[i] = next(it)
        return arrays
    if layer.kind == "list":
        return CacheList(*(_restore_layer(child, end) for child in layer.children))
    raise SnapshotError(f"unknown layer kind {layer.kind!r}")


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
    layers = tuple(_merge_layer(list(group), start, end) for group in zip(*(s.layers for s in parts)))
    snap = Snapshot(start, end, layers)
    mx.eval(snap.arrays())
    return snap


def _merge_layer(group: list[LayerSnapshot], start: int, end: int) -> LayerSnapshot:
    x = group[0]
    for y in group[1:]:
        if x.kind != y.kind:
            raise SnapshotError(f"cannot merge a {x.kind} layer with a {y.kind} layer")
        fixed = {k: v for k, v in x.meta.items() if k not in ("start", "offset", "idx", "present")}
        if any(y.meta.get(k) != v for k, v in fixed.items()):
            raise SnapshotError(f"cannot merge {x.kind} layers of different shape: {x.meta} vs {y.meta}")
    last = group[-1]
    if x.kind == "list":
        if len({len(y.children) for y in group}) != 1:
            raise SnapshotError("cannot merge cache lists of different lengths")
        children = tuple(_merge_layer(list(kids), start, end) for kids in zip(*(y.children for y in group)))
        return LayerSnapshot("list", (), {"offset": end}, children)
    if x.kind not in _SPLITTABLE:
        return last
    meta = {**last.meta, "start": start, "offset": end}
    holding = [y.arrays for y in group if y.arrays]
    if len(holding) <= 1:
        return LayerSnapshot(x.kind, holding[0] if holding else (), meta)
    if len({len(arrays) for arrays in holding}) != 1:
        raise SnapshotError(f"cannot merge {x.kind} layers of {sorted({len(a) for a in holding})} arrays")
    for column in zip(*holding):
        p = column[0]
        for q in column[1:]:
            if p.dtype != q.dtype or p.shape[:2] != q.shape[:2] or p.shape[3:] != q.shape[3:]:
                raise SnapshotError(
                    f"cannot merge {x.kind} arrays {p.shape} {p.dtype} and {q.shape} {q.dtype}"
                )
    arrays = tuple(mx.concatenate(list(column), axis=2) for column in zip(*holding))
    return LayerSnapshot(x.kind, arrays, meta)


def split(s: Snapshot, at: int) -> tuple[Snapshot, Snapshot]:
    """``[start, end)`` -> ``[start, at)``, ``[at, end)``; KV / quantized layers only."""
    if not trimmable(s):
        kinds = sorted({n.kind for layer in s.layers for n in layer.walk()} - _SPLITTABLE - {"list"})
        raise CannotSplit(f"a snapshot with {', '.join(kinds)} layers keeps no earlier state to cut at")
    if not s.start <= at <= s.end:
        raise CannotSplit(f"cannot split [{s.start}, {s.end}) at {at}")
    first = Snapshot(s.start, at, tuple(_cut(layer, s.start, s.start, at) for layer in s.layers))
    second = Snapshot(at, s.end, tuple(_cut(layer, s.start, at, s.end) for layer in s.layers))
    mx.eval(first.arrays(), second.arrays())
    return first, second


def _cut(layer: LayerSnapshot, origin: int, lo: int, hi: int) -> LayerSnapshot:
    """The part ``[lo, hi)`` of a splittable layer whose arrays start at ``origin``."""
    if layer.kind == "list":
        return LayerSnapshot(
            "list", (), {"offset": hi}, tuple(_cut(c, origin, lo, hi) for c in layer.children)
        )
    meta = {**layer.meta, "start": lo, "offset": hi}
    if lo == hi or not layer.arrays:
        return LayerSnapshot(layer.kind, (), meta)
    arrays = tuple(_copy(a[..., lo - origin : hi - origin, :]) for a in layer.arrays)
    return LayerSnapshot(layer.kind, arrays, meta)


def section(s: Snapshot, lo: int, hi: int) -> Snapshot:
    """The tokens ``[lo, hi)`` of a splittable snapshot, one copy of that range only.

    ``(s.start, s.end)`` itself is always allowed (nothing to cut).
    """
    if (lo, hi) == (s.start, s.end):
        return s
    if not trimmable(s) or not s.start <= lo <= hi <= s.end:
        raise CannotSplit(f"cannot take [{lo}, {hi}) out of [{s.start}, {s.end})")
    part = Snapshot(lo, hi, tuple(_cut(layer, s.start, lo, hi) for layer in s.layers))
    mx.eval(part.arrays())
    return part


def truncate(s: Snapshot, end: int) -> Snapshot:
    """The first ``end - s.start`` tokens of ``s``: a resume point inside a segment.

    ``end == s.end`` is always allowed (nothing to cut), even for rotating or
    recurrent snapshots; anything else needs a splittable snapshot.
    """
    if end == s.end:
        return s
    return split(s, end)[0]


# -- rewind / trimmable / layout ---------------------------------------------


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
    offsets = {o for c in cache for o in _layer_offsets(c)}
    if len(offsets) > 1:
        raise SnapshotError(f"the layers disagree on the token count: {sorted(offsets)}")
    if not offsets or n > offsets.pop() or not all(c.is_trimmable() for c in cache):
        return False
    for c in cache:
        c.trim(n)
    return True


def trimmable(snap_or_cache: Snapshot | LayerSnapshot | Sequence[Any]) -> bool:
    """Whether split/truncate (snapshot) or rewind (live cache) work at any point."""
    if isinstance(snap_or_cache, Snapshot):
        return all(trimmable(layer) for layer in snap_or_cache.layers)
    if isinstance(snap_or_cache, LayerSnapshot):
        return all(n.kind in _SPLITTABLE or n.kind == "list" for n in snap_or_cache.walk())
    return all(c.is_trimmable() for c in snap_or_cache)


def layout(cache: Sequence[Any]) -> list[str]:
    """The per-layer cache layout of a live cache, for ``segments.fingerprint``.

    Take it from the model's fresh ``make_prompt_cache(model)``, so that the
    reader (which has only the model) computes the same list as the writer.
    """
    return [_layout_entry(c) for c in cache]


def _layout_entry(c: Any) -> str:
    kind = _kind(c)
    if kind == "rotating":
        return f"rotating(max_size={c.max_size},keep={c.keep})"
    if kind == "quantized":
        return f"quantized(group_size={c.group_size},bits={c.bits})"
    if kind == "arrays":
        return f"arrays({len(c.cache)})"
    if kind == "list":
        return f"list({','.join(_layout_entry(x) for x in c.caches)})"
    return kind
