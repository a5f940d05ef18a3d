"""The contract every cache kind keeps, and what they share.

:class:`LayerSnapshot` is one layer's saved state, whatever its kind;
:class:`Kind` is what a kind must know about its layers (the kinds
themselves, and the table of them, are in :mod:`cachestore.kinds`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import mlx.core as mx

from .errors import CannotSplit, SnapshotError

__all__ = [
    "BITS",
    "FLOAT",
    "GROUP_SIZES",
    "INT",
    "BadLayer",
    "Kind",
    "LayerSnapshot",
    "Spec",
    "check_kv",
    "copy_array",
    "fresh_arrays",
    "one_sequence",
]


@dataclass(frozen=True, eq=False)
class LayerSnapshot:
    """The saved state of one layer's cache (see each kind for its arrays).

    A layer covering no tokens has no arrays; a ``list`` layer never has
    any (its state is in ``children``). ``eq=False``: comparing ``mx.array``
    tuples has no single truth value.
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


#: A tensor as a segment's header describes it: (shape, safetensors dtype).
Spec = tuple[tuple[int, ...], str]


class BadLayer(Exception):
    """A file's layer breaks an invariant its cache relies on (segread says which file)."""


FLOAT = frozenset({"F16", "BF16", "F32", "F64"})
INT = frozenset({"I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64"})
BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)


class Kind:
    """The contract of a cache kind; the defaults fit a kind that cannot be cut."""

    #: The name written in segment layouts; never a class name.
    name: ClassVar[str]
    #: The mlx-lm class it snapshots (and its subclasses that add no state).
    cache_class: ClassVar[type]
    #: Exactly the meta ints its layers carry (a file with others is refused).
    meta_keys: ClassVar[frozenset[str]]
    #: Its snapshots hold every position of their range: merge concatenates, cut works anywhere.
    cuttable: ClassVar[bool] = False
    #: Its layers hold child layers (a CacheList) instead of arrays.
    has_children: ClassVar[bool] = False

    def offsets(self, c: Any) -> Iterator[int]:
        """The token counts the live cache records (none for recurrent state)."""
        if not isinstance(c.offset, int):
            raise SnapshotError(f"{type(c).__name__}.offset is not an int (a batched cache?)")
        yield c.offset

    def snapshot(self, c: Any, start: int, end: int) -> LayerSnapshot:
        raise NotImplementedError

    def restore(self, layer: LayerSnapshot, end: int) -> Any:
        """A new live cache holding ``layer`` (whose offset is already checked to be ``end``)."""
        raise NotImplementedError

    def merge(self, group: list[LayerSnapshot], start: int, end: int) -> LayerSnapshot:
        """Adjacent layers of this kind (kind and shape checked) as one; by default the
        last, whose state is the only one valid at ``end``."""
        return group[-1]

    def cut(self, layer: LayerSnapshot, origin: int, lo: int, hi: int) -> LayerSnapshot:
        """The part ``[lo, hi)`` of a layer whose arrays start at ``origin``."""
        raise CannotSplit(f"a {self.name} layer keeps no earlier state to cut at")

    def layout_entry(self, c: Any) -> str:
        return self.name

    def check(self, where: str, meta: dict[str, int], arrays: list[Spec], children: int,
              start: int, end: int) -> None:
        """Raise :class:`BadLayer` unless a file's layer is a state this cache can be in.

        ``meta`` has exactly :attr:`meta_keys`, all ints, and ``offset == end``;
        ``arrays`` are the specs of the layer's tensors, all present.
        """
        raise NotImplementedError


# -- helpers shared by the kinds ----------------------------------------------


def copy_array(x: mx.array) -> mx.array:
    # mx.contiguous copies a strided or partial view and returns a new array
    # object either way: never the live cache's own object.
    return mx.contiguous(x)


def fresh_arrays(layer: LayerSnapshot, held: int) -> tuple[mx.array, ...]:
    """New array objects on the snapshot's data (the cache's in-place writes then
    copy instead of reaching into the snapshot), checked against ``held`` entries."""
    if bool(layer.arrays) != (held > 0):
        raise SnapshotError(f"a {layer.kind} layer of {held} entries has {len(layer.arrays)} arrays")
    return tuple(x[...] for x in layer.arrays)


def one_sequence(x: mx.array, what: str) -> None:
    if x.shape[0] != 1:
        raise SnapshotError(
            f"{what} holds a batch of {x.shape[0]} sequences; snapshot one session's cache"
        )


def check_kv(where: str, arrays: list[Spec], length: int, dtypes: tuple[frozenset[str], ...]) -> None:
    """Arrays of shape (1, heads, length, dim), one per dtype set, agreeing with each other."""
    if length == 0:
        if arrays:
            raise BadLayer(f"{where}: no tokens, yet {len(arrays)} arrays")
        return
    if len(arrays) != len(dtypes):
        raise BadLayer(f"{where}: {len(arrays)} arrays, expected {len(dtypes)}")
    for (shape, dtype), allowed in zip(arrays, dtypes, strict=True):
        if dtype not in allowed:
            raise BadLayer(f"{where}: dtype {dtype}, expected one of {sorted(allowed)}")
        if len(shape) != 4 or shape[0] != 1:
            raise BadLayer(f"{where}: shape {shape}, expected (1, heads, tokens, dim)")
        if shape[:3] != arrays[0][0][:3] or shape[2] != length:
            raise BadLayer(
                f"{where}: shapes {[s for s, _ in arrays]} disagree"
                f" with each other or with {length} tokens"
            )
    float_dtypes = {d for _, d in arrays if d in FLOAT}
    if len(float_dtypes) > 1:
        raise BadLayer(f"{where}: mixed dtypes {sorted(float_dtypes)}")
