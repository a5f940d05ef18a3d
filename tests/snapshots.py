"""Comparing snapshots array by array, for the snapshot and segment tests."""

from __future__ import annotations

import mlx.core as mx

from cachestore.snapshot import LayerSnapshot, Snapshot


def assert_same(a: Snapshot, b: Snapshot) -> None:
    assert (a.start, a.end, len(a.layers)) == (b.start, b.end, len(b.layers))
    for x, y in zip(a.layers, b.layers, strict=True):
        assert_same_layer(x, y)


def assert_same_layer(x: LayerSnapshot, y: LayerSnapshot) -> None:
    assert (x.kind, x.meta, len(x.arrays), len(x.children)) == (
        y.kind,
        y.meta,
        len(y.arrays),
        len(y.children),
    )
    for p, q in zip(x.arrays, y.arrays, strict=True):
        assert p.dtype == q.dtype and p.shape == q.shape
        assert mx.array_equal(p, q).item()
    for p2, q2 in zip(x.children, y.children, strict=True):
        assert_same_layer(p2, q2)
