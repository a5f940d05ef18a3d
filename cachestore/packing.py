"""Warm snapshots kept 8-bit (or 4-bit): smaller pinned copies, restored to full precision.

Opt-in (`cache.warm_bits`), because it is lossy: a snapshot's plain KV layers
are quantized with `mx.quantize` when a cache is demoted to warm, and
dequantized when it is restored, so the session's cache afterwards is an
ordinary float cache whose keys and values differ from the original by the
rounding (answers after a warm restore are then close to, not equal to, a
fresh prefill's). Only the warm tier ever holds packed layers: disk segments
are written from live caches, and a packed layer has a kind of its own that
`snapshot.restore` refuses, so it cannot be restored or saved by mistake.

Rotating, recurrent and already quantized layers are kept as they are.
"""

from __future__ import annotations

import mlx.core as mx

from .snapshot import LayerSnapshot, Snapshot

PACKED = "kv_packed"
GROUP_SIZES = (64, 32)


def pack(snap: Snapshot, bits: int) -> Snapshot:
    if bits not in (4, 8):
        raise ValueError("bits must be 4 or 8")
    packed = Snapshot(snap.start, snap.end, tuple(_pack_layer(layer, bits) for layer in snap.layers))
    mx.eval(packed.arrays())
    return packed


def unpack(snap: Snapshot) -> Snapshot:
    if not is_packed(snap):
        return snap
    plain = Snapshot(snap.start, snap.end, tuple(_unpack_layer(layer) for layer in snap.layers))
    mx.eval(plain.arrays())
    return plain


def is_packed(snap: Snapshot) -> bool:
    return any(node.kind == PACKED for layer in snap.layers for node in layer.walk())


def _group_size(head_dim: int) -> int | None:
    return next((g for g in GROUP_SIZES if head_dim % g == 0), None)


def _pack_layer(layer: LayerSnapshot, bits: int) -> LayerSnapshot:
    if layer.kind == "list":
        return LayerSnapshot(layer.kind, layer.arrays, layer.meta,
                             tuple(_pack_layer(c, bits) for c in layer.children))
    if layer.kind != "kv" or not layer.arrays:
        return layer
    keys, values = layer.arrays
    group = _group_size(keys.shape[-1])
    if group is None or keys.dtype not in (mx.float32, mx.float16, mx.bfloat16):
        return layer
    kq: tuple[mx.array, ...] = tuple(mx.quantize(keys, group_size=group, bits=bits))
    vq: tuple[mx.array, ...] = tuple(mx.quantize(values, group_size=group, bits=bits))
    arrays = (*kq, *vq)
    meta = {**layer.meta, "group_size": group, "bits": bits, "dtype": _DTYPES.index(keys.dtype)}
    return LayerSnapshot(PACKED, arrays, meta)


def _unpack_layer(layer: LayerSnapshot) -> LayerSnapshot:
    if layer.kind == "list":
        return LayerSnapshot(layer.kind, layer.arrays, layer.meta,
                             tuple(_unpack_layer(c) for c in layer.children))
    if layer.kind != PACKED:
        return layer
    m = layer.meta
    a = layer.arrays
    dtype = _DTYPES[m["dtype"]]
    g, bits = m["group_size"], m["bits"]
    keys = mx.dequantize(a[0], a[1], a[2], group_size=g, bits=bits).astype(dtype)
    values = mx.dequantize(a[3], a[4], a[5], group_size=g, bits=bits).astype(dtype)
    meta = {k: v for k, v in m.items() if k not in ("group_size", "bits", "dtype")}
    return LayerSnapshot("kv", (keys, values), meta)


_DTYPES = [mx.float32, mx.float16, mx.bfloat16]
