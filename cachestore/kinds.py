"""One object per cache kind: everything kvd knows about one mlx-lm cache class.

Each kind owns, for its layers: how a live cache is snapshotted and restored,
how consecutive snapshots merge, how one is cut, its entry in the cache
layout (which feeds the fingerprint), the meta ints a segment file stores
for it and the invariants a file's layer must meet before MLX reads a byte.
:mod:`cachestore.snapshot` and :mod:`cachestore.segread` only dispatch
through :data:`KINDS`, so **adding a cache kind touches this file only**:
write its class (the contract, :class:`~cachestore.layers.Kind`, says what
it must know) and add an instance to :data:`KINDS`.

The kinds, and what a snapshot of ``[start, end)`` holds for each:

- ``kv`` / ``quantized``: the keys and values of exactly those positions, so
  snapshots of consecutive ranges concatenate (merge) and cut anywhere. This
  is what lets disk writes be incremental.
- ``rotating`` (sliding window): the whole window as of ``end``, in temporal
  order, whatever ``start`` is. Older positions are gone, so no cut.
- ``arrays`` (recurrent state): the state at exactly ``end``. No cut either.
- ``list``: a ``CacheList`` of the above, snapshotted child by child.

Arrays in snapshots are evaluated and never the live cache's own
``mx.array`` objects: an MLX slice assignment (``keys[..., i, :] = x``, which
the caches do) rewrites the Python object it is applied to, so a shared
object would let the live cache scribble over the snapshot. Restore likewise
hands out fresh array objects, so one snapshot can be restored many times.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from .errors import SnapshotError
from .layers import (
    BITS,
    FLOAT,
    GROUP_SIZES,
    INT,
    BadLayer,
    Kind,
    LayerSnapshot,
    Spec,
    check_kv,
    copy_array,
    fresh_arrays,
    one_sequence,
)

__all__ = [
    "KINDS",
    "cut_layer",
    "layer_at",
    "live_at",
    "kind_named",
    "kind_of",
    "merge_layers",
    "restore_layer",
    "layer_cuttable",
]


# -- the kinds ----------------------------------------------------------------


class _Positions(Kind):
    """A kind whose snapshot holds the keys and values of exactly ``[start, end)``."""

    cuttable = True

    def _range(self, c: Any, keys: Sequence[mx.array] | None, values: Sequence[mx.array] | None,
               start: int, end: int) -> tuple[mx.array, ...]:
        if start == end:
            return ()
        if keys is None or values is None or keys[0] is None:
            raise SnapshotError(f"{type(c).__name__} claims {end} tokens but holds no keys")
        held = keys[0].shape[2]
        if held < end:
            raise SnapshotError(f"{type(c).__name__} claims {end} tokens but holds {held}")
        one_sequence(keys[0], type(c).__name__)
        return tuple(copy_array(a[..., start:end, :]) for a in (*keys, *values))

    def merge(self, group: list[LayerSnapshot], start: int, end: int) -> LayerSnapshot:
        # One concatenation per array: merging a disk chain pairwise copied the
        # growing prefix once per segment, n-way copies each byte once.
        meta = {**group[-1].meta, "start": start, "offset": end}
        holding = [y.arrays for y in group if y.arrays]
        if len(holding) <= 1:
            return LayerSnapshot(self.name, holding[0] if holding else (), meta)
        if len({len(arrays) for arrays in holding}) != 1:
            counts = sorted({len(a) for a in holding})
            raise SnapshotError(f"cannot merge {self.name} layers of {counts} arrays")
        for column in zip(*holding):
            p = column[0]
            for q in column[1:]:
                if p.dtype != q.dtype or p.shape[:2] != q.shape[:2] or p.shape[3:] != q.shape[3:]:
                    raise SnapshotError(
                        f"cannot merge {self.name} arrays {p.shape} {p.dtype} and {q.shape} {q.dtype}"
                    )
        arrays = tuple(mx.concatenate(list(column), axis=2) for column in zip(*holding))
        return LayerSnapshot(self.name, arrays, meta)

    def cut(self, layer: LayerSnapshot, origin: int, lo: int, hi: int) -> LayerSnapshot:
        meta = {**layer.meta, "start": lo, "offset": hi}
        if lo == hi or not layer.arrays:
            return LayerSnapshot(self.name, (), meta)
        arrays = tuple(copy_array(a[..., lo - origin : hi - origin, :]) for a in layer.arrays)
        return LayerSnapshot(self.name, arrays, meta)

    def check(self, where: str, meta: dict[str, int], arrays: list[Spec], children: int,
              start: int, end: int) -> None:
        if meta["start"] != start:
            raise BadLayer(f"{where}: starts at {meta['start']}, the segment at {start}")


class _KV(_Positions):
    """``KVCache``; arrays ``(keys, values)``."""

    name = "kv"
    cache_class = KVCache
    meta_keys = frozenset({"start", "offset"})

    def snapshot(self, c: Any, start: int, end: int) -> LayerSnapshot:
        return LayerSnapshot(self.name, self._range(c, (c.keys,), (c.values,), start, end),
                             {"start": start, "offset": end})

    def restore(self, layer: LayerSnapshot, end: int) -> Any:
        a = fresh_arrays(layer, end)
        kv = KVCache()
        if a:
            kv.keys, kv.values = a
            kv.offset = end
        return kv

    def check(self, where: str, meta: dict[str, int], arrays: list[Spec], children: int,
              start: int, end: int) -> None:
        super().check(where, meta, arrays, children, start, end)
        check_kv(where, arrays, end - start, (FLOAT, FLOAT))


class _Quantized(_Positions):
    """``QuantizedKVCache``; arrays ``(k_packed, k_scales, k_biases, v_packed, v_scales, v_biases)``."""

    name = "quantized"
    cache_class = QuantizedKVCache
    meta_keys = frozenset({"start", "offset", "group_size", "bits"})

    def snapshot(self, c: Any, start: int, end: int) -> LayerSnapshot:
        keys = tuple(c.keys) if c.keys is not None else None
        values = tuple(c.values) if c.values is not None else None
        meta = {"start": start, "offset": end, "group_size": c.group_size, "bits": c.bits}
        return LayerSnapshot(self.name, self._range(c, keys, values, start, end), meta)

    def restore(self, layer: LayerSnapshot, end: int) -> Any:
        a = fresh_arrays(layer, end)
        q: Any = QuantizedKVCache(group_size=layer.meta["group_size"], bits=layer.meta["bits"])
        if a:
            q.keys, q.values = a[:3], a[3:]
            q.offset = end
        return q

    def layout_entry(self, c: Any) -> str:
        return f"quantized(group_size={c.group_size},bits={c.bits})"

    def check(self, where: str, meta: dict[str, int], arrays: list[Spec], children: int,
              start: int, end: int) -> None:
        super().check(where, meta, arrays, children, start, end)
        if meta["bits"] not in BITS or meta["group_size"] not in GROUP_SIZES:
            raise BadLayer(f"{where}: bits {meta['bits']}, group_size {meta['group_size']}")
        check_kv(where, arrays, end - start, (frozenset({"U32"}), FLOAT, FLOAT) * 2)
        for w, s, b in (arrays[:3], arrays[3:]):
            if s != b or w[0][-1] * 32 != s[0][-1] * meta["group_size"] * meta["bits"]:
                raise BadLayer(f"{where}: packed {w[0]}, scales {s[0]}, biases {b[0]} do not agree")


class _Rotating(Kind):
    """``RotatingKVCache`` (sliding window); arrays ``(keys, values)`` of the window.

    The subtle one. A live ``RotatingKVCache`` holds its entries either in
    temporal order (after a multi-token update: up to ``max_size - 1 + S``
    entries, ``_idx == len``), or as a ring of ``max_size`` entries whose
    oldest slot is ``_idx`` (after one-token updates wrapped), or in a
    pre-allocated buffer longer than ``offset`` (before the first wrap).
    Before its next forward the cache itself cuts any of these down to the
    last ``max_size - 1`` entries (plus the ``keep`` first ones), yet a
    snapshot must keep ``min(offset, max_size)`` of them, in temporal order
    (sinks first), with ``_idx`` set to that length: a wrapped buffer shorter
    than ``max_size`` makes the next one-token update "grow" it by
    ``max_size - offset`` (negative: an MLX error), and
    ``BatchRotatingKVCache.merge`` (how ``BatchGenerator.insert(caches=...)``
    takes it) copies the last ``size() == min(offset, max_size)`` entries.
    That is also the form ``BatchRotatingKVCache.extract`` produces for a
    wrapped batch.
    """

    name = "rotating"
    cache_class = RotatingKVCache
    meta_keys = frozenset({"offset", "max_size", "keep", "idx"})

    def snapshot(self, c: Any, start: int, end: int) -> LayerSnapshot:
        window = min(end, c.max_size)
        meta = {"offset": end, "max_size": c.max_size, "keep": c.keep, "idx": window}
        if window == 0:
            return LayerSnapshot(self.name, (), meta)
        if c.keys is None:
            raise SnapshotError(f"RotatingKVCache claims {end} tokens but holds no keys")
        one_sequence(c.keys, "RotatingKVCache")
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
            arrays.append(copy_array(v))
        return LayerSnapshot(self.name, tuple(arrays), meta)

    def restore(self, layer: LayerSnapshot, end: int) -> Any:
        m = layer.meta
        a = fresh_arrays(layer, m["idx"])
        r = RotatingKVCache(max_size=m["max_size"], keep=m["keep"])
        if a:
            r.keys, r.values = a
            r.offset = end
            r._idx = m["idx"]
        return r

    def layout_entry(self, c: Any) -> str:
        return f"rotating(max_size={c.max_size},keep={c.keep})"

    def check(self, where: str, meta: dict[str, int], arrays: list[Spec], children: int,
              start: int, end: int) -> None:
        if meta["max_size"] < 1 or not 0 <= meta["keep"] <= meta["max_size"]:
            raise BadLayer(f"{where}: max_size {meta['max_size']}, keep {meta['keep']}")
        window = min(end, meta["max_size"])
        if meta["idx"] != window:
            raise BadLayer(
                f"{where}: ring index {meta['idx']}, but {end} tokens"
                f" in a window of {meta['max_size']} fill {window}"
            )
        check_kv(where, arrays, window, (FLOAT, FLOAT))


class _Arrays(Kind):
    """``ArraysCache`` (recurrent state); arrays: the present slots, in order."""

    name = "arrays"
    cache_class = ArraysCache
    meta_keys = frozenset({"offset", "slots", "present"})

    def offsets(self, c: Any) -> Iterator[int]:
        return iter(())  # an ArraysCache records no token count

    def snapshot(self, c: Any, start: int, end: int) -> LayerSnapshot:
        present = 0
        arrays = []
        for i, a in enumerate(c.cache):
            if a is not None:
                one_sequence(a, "an ArraysCache")
                present |= 1 << i
                arrays.append(copy_array(a))
        # left_padding / lengths are batch bookkeeping that ArraysCache.extract drops too.
        meta = {"offset": end, "slots": len(c.cache), "present": present}
        return LayerSnapshot(self.name, tuple(arrays), meta)

    def restore(self, layer: LayerSnapshot, end: int) -> Any:
        m = layer.meta
        cache = ArraysCache(m["slots"])
        it = (x[...] for x in layer.arrays)
        for i in range(m["slots"]):
            if m["present"] >> i & 1:
                cache[i] = next(it)
        return cache

    def layout_entry(self, c: Any) -> str:
        return f"arrays({len(c.cache)})"

    def check(self, where: str, meta: dict[str, int], arrays: list[Spec], children: int,
              start: int, end: int) -> None:
        slots, present = meta["slots"], meta["present"]
        if not 0 <= slots <= 64 or not 0 <= present < 1 << slots or len(arrays) != bin(present).count("1"):
            raise BadLayer(f"{where}: {len(arrays)} arrays for slots {slots}, present {present:#x}")
        for shape, dtype in arrays:
            if not shape or shape[0] != 1 or dtype not in FLOAT | INT:
                raise BadLayer(f"{where}: a {dtype} state of shape {shape}")


class _List(Kind):
    """``CacheList``: child layers of the other kinds, no arrays of its own.

    It can be cut and merged as far as it goes: its children decide.
    """

    name = "list"
    cache_class = CacheList
    meta_keys = frozenset({"offset"})
    cuttable = True
    has_children = True

    def offsets(self, c: Any) -> Iterator[int]:
        for child in c.caches:
            yield from kind_of(child).offsets(child)

    def snapshot(self, c: Any, start: int, end: int) -> LayerSnapshot:
        children = tuple(kind_of(child).snapshot(child, start, end) for child in c.caches)
        return LayerSnapshot(self.name, (), {"offset": end}, children)

    def restore(self, layer: LayerSnapshot, end: int) -> Any:
        return CacheList(*(restore_layer(child, end) for child in layer.children))

    def merge(self, group: list[LayerSnapshot], start: int, end: int) -> LayerSnapshot:
        if len({len(y.children) for y in group}) != 1:
            raise SnapshotError("cannot merge cache lists of different lengths")
        children = tuple(merge_layers(list(kids), start, end) for kids in zip(*(y.children for y in group)))
        return LayerSnapshot(self.name, (), {"offset": end}, children)

    def cut(self, layer: LayerSnapshot, origin: int, lo: int, hi: int) -> LayerSnapshot:
        return LayerSnapshot(self.name, (), {"offset": hi},
                             tuple(cut_layer(c, origin, lo, hi) for c in layer.children))

    def layout_entry(self, c: Any) -> str:
        return f"list({','.join(kind_of(x).layout_entry(x) for x in c.caches)})"

    def check(self, where: str, meta: dict[str, int], arrays: list[Spec], children: int,
              start: int, end: int) -> None:
        if arrays or not children:
            raise BadLayer(f"{where}: a cache list needs children and holds no arrays")


#: The cache kinds a snapshot can hold. Classes are only ever chosen from this
#: table, never from a name in a file (safer than mlx-lm's ``globals()[name]``).
KINDS: dict[str, Kind] = {k.name: k for k in (_KV(), _Rotating(), _Quantized(), _Arrays(), _List())}
_BY_CLASS: dict[type, Kind] = {k.cache_class: k for k in KINDS.values()}


# -- dispatch -----------------------------------------------------------------


def kind_of(c: Any) -> Kind:
    """The kind of a live cache: the nearest known class in its MRO, so a subclass
    that adds behaviour but no state (kvd's batchable quantized cache) snapshots
    as its base kind."""
    kind = next((_BY_CLASS[k] for k in type(c).__mro__ if k in _BY_CLASS), None)
    if kind is None:
        raise SnapshotError(f"cannot snapshot a {type(c).__name__}: not a supported cache kind")
    return kind


def kind_named(name: str) -> Kind:
    kind = KINDS.get(name)
    if kind is None:
        raise SnapshotError(f"unknown layer kind {name!r}")
    return kind


def layer_cuttable(layer: LayerSnapshot) -> bool:
    """Whether every node of ``layer`` can be cut (an unknown kind cannot)."""
    return all(n.kind in KINDS and KINDS[n.kind].cuttable for n in layer.walk())


def restore_layer(layer: LayerSnapshot, end: int) -> Any:
    if layer.meta["offset"] != end:
        raise SnapshotError(f"a {layer.kind} layer holds {layer.meta['offset']} tokens, the snapshot {end}")
    return kind_named(layer.kind).restore(layer, end)


def merge_layers(group: list[LayerSnapshot], start: int, end: int) -> LayerSnapshot:
    """Adjacent layers as one, once they are checked to be of one kind and shape."""
    x = group[0]
    for y in group[1:]:
        if x.kind != y.kind:
            raise SnapshotError(f"cannot merge a {x.kind} layer with a {y.kind} layer")
        fixed = {k: v for k, v in x.meta.items() if k not in ("start", "offset", "idx", "present")}
        if any(y.meta.get(k) != v for k, v in fixed.items()):
            raise SnapshotError(f"cannot merge {x.kind} layers of different shape: {x.meta} vs {y.meta}")
    return kind_named(x.kind).merge(group, start, end)


def cut_layer(layer: LayerSnapshot, origin: int, lo: int, hi: int) -> LayerSnapshot:
    return kind_named(layer.kind).cut(layer, origin, lo, hi)


def layer_at(x: Any, point: LayerSnapshot, origin: int, start: int, end: int) -> LayerSnapshot:
    """The part ``[start, end)`` of a layer (a live cache's, or a snapshot's whose arrays start at
    ``origin``) that holds more: cut at ``end`` where its kind keeps every position, else ``point``'s
    own state there (a checkpoint, cachestore/checkpoints.py): a recurrent state or a window at ``end``."""
    if point.meta.get("offset") != end:
        raise SnapshotError(f"a checkpoint's {point.kind} layer holds {point.meta.get('offset')} tokens, not {end}")
    live = not isinstance(x, LayerSnapshot)
    kind = kind_of(x) if live else kind_named(x.kind)
    if kind.name != point.kind:
        raise SnapshotError(f"a {point.kind} checkpoint for a {kind.name} layer")
    if kind.has_children:
        children = x.caches if live else x.children
        if len(children) != len(point.children):
            raise SnapshotError("a checkpoint's cache list has another length")
        return LayerSnapshot(kind.name, (), {"offset": end},
                             tuple(layer_at(c, p, origin, start, end) for c, p in zip(children, point.children)))
    if not kind.cuttable:
        return point
    if live:
        held = next(kind.offsets(x))
        if held < end:
            raise SnapshotError(f"a {type(x).__name__} of {held} tokens has none at {end}")
        return kind.snapshot(x, start, end)
    return kind.cut(x, origin, start, end)


def live_at(c: Any, point: LayerSnapshot, end: int) -> Any:
    """A live layer as of ``end`` (its checkpoint ``point``'s token count): trimmed in place where its kind
    keeps every position, else a new layer restored from ``point``'s state."""
    kind = kind_of(c)
    if kind.name != point.kind:
        raise SnapshotError(f"a {point.kind} checkpoint for a {kind.name} layer")
    if kind.has_children:
        return CacheList(*(live_at(x, p, end) for x, p in zip(c.caches, point.children, strict=True)))
    if not kind.cuttable:
        return restore_layer(point, end)
    held = next(kind.offsets(c))
    if held < end:
        raise SnapshotError(f"a {type(c).__name__} of {held} tokens has none at {end}")
    c.trim(held - end)
    return c
