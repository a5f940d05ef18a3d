"""Restore a chain of plain-KV segments straight into the live cache's buffers.

The general path (:func:`~cachestore.segments.read_segment`, then
:func:`~cachestore.snapshot.merge`, then :func:`~cachestore.snapshot.restore`)
touches every byte of a restored cache three times after reading it: MLX
loads each file into its own arrays, the merge concatenates them, and the
first forward grows the cache by a step (mlx-lm's ``KVCache`` concatenates
its whole buffer with a new 256-token block). Each of those is a fresh
allocation the size of the cache, so the pages are faulted in again too.
Measured on SmolLM2-135M (float32, 2k tokens, 94 MB in 8 segments, page
cache warm): restore 167 ms and a first forward 150 ms slower than a
resident one.

Here each file is read once, with ``readinto``, into the one buffer per
layer that the live cache keeps: allocated at its final size (the tokens
restored plus room for the prompt that follows, rounded up to mlx-lm's
step), so neither a merge nor the first forward copies it again. The
checksum is computed over the bytes where they land, in file order, so the
guarantee of the general path holds: a file whose bytes are not the bytes
written is never used. Its header is checked by the same code
(:func:`~cachestore.segread.check_header`) before a byte of data is read.

Only layouts where every layer is a plain ``KVCache`` in float32, float16 or
bfloat16 take this path (float32 is the default on the CPU; a GPU runs the
checkpoint's dtype, most often bfloat16, whose buffer MLX exposes as
2-byte items like float16's); anything else (quantized, rotating, recurrent
layers) returns ``None`` and the caller uses the general path.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from .errors import ChecksumMismatch, CorruptSegment, SegmentMissing, SegmentTruncated
from .segformat import Hasher
from .segread import check_header, hasher_for, read_raw_header

__all__ = ["FileSpan", "Direct", "capacity", "read_direct"]

STEP = KVCache.step  # mlx-lm grows a KVCache by this many tokens at a time
_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2}
_DTYPE = {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16}


@dataclass(frozen=True)
class FileSpan:
    """One segment of a chain: ``[start, end)`` on disk, of which ``[start, use)`` is wanted."""

    path: Path
    checksum: str
    start: int
    end: int
    use: int


@dataclass
class Direct:
    """What :func:`read_direct` restored: live caches holding ``tokens`` ids, and how far it got.

    ``bad`` is the first piece that failed verification (with why); the
    caches then hold everything before it.
    """

    cache: list[Any] | None
    tokens: int
    bytes_read: int
    bad: tuple[FileSpan, CorruptSegment] | None = None


def capacity(tokens: int, room: int) -> int:
    """Tokens a live buffer holding `tokens` with `room` more is allocated for: whole steps, as mlx-lm's."""
    return -(-(tokens + max(room, 1)) // STEP) * STEP


class _Unsupported(Exception):
    """The chain is readable, but not by this path; the general path reads it."""


def read_direct(pieces: Sequence[FileSpan], *, fingerprint: str, room: int = 0) -> Direct | None:
    """Read a contiguous chain of segments from token 0 into fresh live caches.

    ``room``: tokens that will be appended right after (the rest of the
    prompt); the buffers are made large enough to take them without growing.
    ``None`` when the chain's layout is not one this path reads (nothing
    has been read that matters then; the caller reads it the general way).
    """
    if not pieces or pieces[0].start != 0:
        return None
    want = pieces[-1].use
    size = capacity(max(p.end for p in pieces), room)
    buffers: list[tuple[mx.array, mx.array]] | None = None
    views: list[tuple[memoryview, memoryview]] = []
    shape: tuple[int, int, str] | None = None
    done, nbytes = 0, 0
    bad: tuple[FileSpan, CorruptSegment] | None = None
    try:
        for piece in pieces:
            try:
                f = open(piece.path, "rb", buffering=0)
            except OSError as e:
                bad = (piece, SegmentMissing(f"cannot open it: {e.strerror or e}", path=piece.path))
                break
            with f:
                try:
                    if piece.start != done:
                        raise ValueError(f"pieces must be contiguous: {piece.start} after {done}")
                    hasher, want_digest = hasher_for(piece.checksum, piece.path)
                    header = read_raw_header(f, piece.path, hasher)
                    layout, specs, offsets = _plain_kv(header, piece, fingerprint)
                    if buffers is None:
                        shape, buffers, views = _allocate(specs, len(layout), size)
                    elif _layer_shape(specs) != shape or len(layout) != len(buffers):
                        raise _Unsupported
                    assert shape is not None
                    n = _read_data(f, piece, offsets, views, shape, size, hasher)
                except CorruptSegment as e:
                    bad = (piece, e)
                    break
                except OSError as e:
                    bad = (piece, SegmentMissing(f"cannot read it: {e.strerror or e}", path=piece.path))
                    break
            if (got := hasher.hexdigest()) != want_digest:
                bad = (piece, ChecksumMismatch(f"its hash is {got}, the index says {piece.checksum}",
                                               path=piece.path))
                break
            nbytes += n
            done = piece.use
            if piece.use < piece.end:
                break
    except _Unsupported:
        return None
    finally:
        for k, v in views:
            k.release()
            v.release()
    del views
    if buffers is None or done == 0:
        return Direct(None, 0, nbytes, bad)
    assert done <= want
    caches = []
    for keys, values in buffers:
        c = KVCache()
        c.keys, c.values, c.offset = keys, values, done
        caches.append(c)
    return Direct(caches, done, nbytes, bad)


def _plain_kv(header: dict[str, Any], piece: FileSpan, fingerprint: str
              ) -> tuple[list[str], dict[str, tuple[tuple[int, ...], str]], list[tuple[int, int, str]]]:
    """The header checked as the general path checks it; only all-KV float layouts pass."""
    offsets = []
    for name, entry in header.items():
        if name != "__metadata__":
            begin, end = entry["data_offsets"]
            offsets.append((int(begin), int(end), name))
    start, end, kinds, specs = check_header(header, piece.path, fingerprint=fingerprint)
    if (start, end) != (piece.start, piece.end):
        raise SegmentTruncated(f"holds [{start}, {end}), the index says [{piece.start}, {piece.end})",
                               path=piece.path)
    if end == start or any(k != "kv" for k in kinds) or any(d not in _ITEMSIZE for _, d in specs.values()):
        raise _Unsupported
    offsets.sort()
    return kinds, specs, offsets


def _layer_shape(specs: dict[str, tuple[tuple[int, ...], str]]) -> tuple[int, int, str]:
    """(heads, head dim, dtype) shared by every layer's keys and values, or _Unsupported."""
    shapes = {(s[1], s[3], d) for s, d in specs.values()}
    if len(shapes) != 1:
        raise _Unsupported  # layers of different shapes: not worth a special case here
    (shape,) = shapes
    return shape


def _allocate(specs: dict[str, tuple[tuple[int, ...], str]], layers: int, capacity: int
              ) -> tuple[tuple[int, int, str], list[tuple[mx.array, mx.array]],
                         list[tuple[memoryview, memoryview]]]:
    shape = _layer_shape(specs)
    heads, dim, dtype = shape
    buffers = [(mx.zeros((1, heads, capacity, dim), _DTYPE[dtype]),
                mx.zeros((1, heads, capacity, dim), _DTYPE[dtype])) for _ in range(layers)]
    mx.eval(buffers)
    views = []
    for k, v in buffers:
        # Fresh, evaluated, referenced by nothing else yet: MLX's buffer
        # protocol exposes its memory, which readinto fills in place.
        kv, vv = memoryview(k).cast("B"), memoryview(v).cast("B")  # type: ignore[arg-type]
        views.append((kv, vv))
        if not (kv.contiguous and vv.contiguous and kv.nbytes == k.nbytes == vv.nbytes):
            for a, b in views:
                a.release()
                b.release()
            raise _Unsupported
    return shape, buffers, views


def _read_data(f: io.FileIO, piece: FileSpan, offsets: list[tuple[int, int, str]],
               views: list[tuple[memoryview, memoryview]], shape: tuple[int, int, str], capacity: int,
               hasher: Hasher) -> int:
    """Every tensor's bytes, in file order, into its layer's buffer, hashed where they land; the file's size."""
    heads, dim, dtype = shape
    itemsize = _ITEMSIZE[dtype]
    base = f.tell()
    length = piece.end - piece.start
    run = length * dim * itemsize  # one head's tokens: contiguous in the file and in the buffer
    row = capacity * dim * itemsize
    pos = 0
    for begin, end, name in offsets:
        if begin != pos or end - begin != heads * run:
            raise _Unsupported  # gaps or padding between tensors: the general path reads those
        layer, which = name[1:].split(".")
        view = views[int(layer)][int(which)]
        for h in range(heads):
            at = h * row + piece.start * dim * itemsize
            dest = view[at:at + run]
            if f.readinto(dest) != run:
                raise SegmentTruncated("shorter than its header describes", path=piece.path)
            hasher.update(dest)
        pos = end
    tail = f.read()  # bytes after the last tensor are part of the file's checksum
    hasher.update(tail)
    return base + pos + len(tail)
