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

import contextlib
import io
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from .errors import ChecksumMismatch, CorruptSegment, SegmentMissing, SegmentTruncated
from .segformat import Hasher
from .segread import check_header, hasher_for, read_raw_header

__all__ = ["Allocation", "Buffers", "Direct", "FileSpan", "FillRate", "Filled", "Scan", "allocate", "capacity",
           "fill", "finish", "read_direct", "scan"]

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
    """Read a contiguous chain of segments from token 0 into fresh live caches, on one thread.

    ``room``: tokens that will be appended right after (the rest of the
    prompt); the buffers are made large enough to take them without growing.
    ``None`` when the chain's layout is not one this path reads (nothing
    has been read that matters then; the caller reads it the general way).
    The three steps below, in a row; the cache store runs them on two
    threads (pagein.py): `scan` and `fill` on the I/O worker's reader,
    `allocate` and `finish` on the engine thread.
    """
    found = scan(pieces, fingerprint=fingerprint)
    if found is None:
        return None
    if found.shape is None:
        return Direct(None, 0, 0, found.bad)
    buffers = allocate(found, room)
    if buffers is None:
        return None
    return finish(buffers, fill(found, buffers, fingerprint=fingerprint))


@dataclass(frozen=True)
class Scan:
    """What the chain's headers say, before a byte of data is read: the buffers' shape, the pieces
    whose headers pass (``shape`` is None when the first does not), the first that fails and why."""

    pieces: list[FileSpan]
    shape: tuple[int, int, int, str] | None  # (layers, heads, head dim, dtype)
    bad: tuple[FileSpan, CorruptSegment] | None


@dataclass
class Buffers:
    """The live cache's buffers, allocated and evaluated on the engine thread at their final size,
    and the byte views of them that `fill` writes into (released by `finish`)."""

    arrays: list[tuple[mx.array, mx.array]]
    views: list[tuple[memoryview, memoryview]]
    capacity: int


@dataclass(frozen=True)
class Filled:
    tokens: int  # leading ids the buffers now hold
    bytes_read: int
    bad: tuple[FileSpan, CorruptSegment] | None


def scan(pieces: Sequence[FileSpan], *, fingerprint: str) -> Scan | None:
    """Check every piece's header (no MLX; the I/O worker's reader runs this). None: not this path."""
    if not pieces or pieces[0].start != 0:
        return None
    shape: tuple[int, int, int, str] | None = None
    done = 0
    ok: list[FileSpan] = []
    try:
        for piece in pieces:
            try:
                if piece.start != done:
                    raise ValueError(f"pieces must be contiguous: {piece.start} after {done}")
                with open(piece.path, "rb", buffering=0) as f:
                    hasher, _ = hasher_for(piece.checksum, piece.path)
                    layout, specs, offsets = _plain_kv(read_raw_header(f, piece.path, hasher), piece, fingerprint)
                heads, dim, dtype = _layer_shape(specs)
                _check_offsets(offsets, piece, heads * (piece.end - piece.start) * dim * _ITEMSIZE[dtype])
                if shape is not None and shape != (len(layout), heads, dim, dtype):
                    raise _Unsupported
                shape = (len(layout), heads, dim, dtype)
            except CorruptSegment as e:
                return Scan(ok, shape, (piece, e))
            except OSError as e:
                return Scan(ok, shape, (piece, SegmentMissing(f"cannot read it: {e.strerror or e}",
                                                              path=piece.path)))
            ok.append(piece)
            done = piece.use
            if piece.use < piece.end:
                break
    except _Unsupported:
        return None
    return Scan(ok, shape, None)


def allocate(found: Scan, room: int) -> Buffers | None:
    """The live cache's buffers for a scanned chain, with room for `room` more tokens, all at once
    (engine thread: MLX); None if MLX does not expose them as plain bytes (the general path reads
    the chain then)."""
    alloc = Allocation(found, room)
    while (got := alloc.step(None)) is None:
        pass
    return got if isinstance(got, Buffers) else None


@dataclass
class FillRate:
    """How fast buffers have been filled: the wait before an `Allocation` takes one in.

    Lowered to what a fill that made the engine wait really took; raised a
    little after each that was ready in time, so it follows the machine.
    """

    bytes_per_s: float = 1e9

    def took(self, nbytes: int, seconds: float, *, waited: float) -> None:
        if waited > 0.001:
            self.bytes_per_s = max(nbytes / max(seconds, 1e-6), 1e6)
        else:
            self.bytes_per_s *= 1.25


class Allocation:
    """The live cache's buffers, made a few at a time (engine thread: MLX).

    Making a buffer writes all of it (MLX has no uninitialised array), at
    memory speed, and the first touch of fresh memory costs more: 0.1-0.7 s
    for 500 MB on a small loaded CPU. So the engine launches each buffer's
    fill with `async_eval` on a stream of its own (`stream`: MLX runs it
    beside the decode steps), at most `nbytes` at a time, and waits for it
    (`eval`) only once it should be done at the rate fills have gone at so far
    (`FillRate`, shared by the allocations of one store): a large restore
    then delays the other sessions' steps by little, not by all of it.
    """

    def __init__(self, found: Scan, room: int, stream: Any = None, rate: FillRate | None = None) -> None:
        assert found.shape is not None and found.pieces
        self.layers, self.heads, self.dim, self.dtype = found.shape
        self.capacity = capacity(max(p.end for p in found.pieces), room)
        self.stream = stream
        self.rate = rate or FillRate()
        self.arrays: list[mx.array] = []  # made (evaluated)
        self.launched: list[mx.array] = []  # being filled on `stream`
        self.since = 0.0  # when they were launched

    def step(self, nbytes: int | None) -> Buffers | bool | None:
        """Take in the buffers launched before once they should be filled, and launch the next,
        worth at least `nbytes` (None: make all now); the Buffers once all are made, None while
        more are to come, False if MLX does not expose them as plain bytes."""
        if self.launched:
            size = sum(a.nbytes for a in self.launched)
            if nbytes is not None and time.perf_counter() - self.since < size / self.rate.bytes_per_s:
                return None  # not yet: the decode steps go on meanwhile
            t0 = time.perf_counter()
            mx.eval(self.launched)
            self.rate.took(size, time.perf_counter() - self.since, waited=time.perf_counter() - t0)
            self.arrays += self.launched
            self.launched = []
        todo = 2 * self.layers - len(self.arrays)
        if todo and nbytes is None:
            self.arrays += [self._zeros() for _ in range(todo)]
            mx.eval(self.arrays)
        elif todo and nbytes is not None:
            made = 0
            while len(self.arrays) + len(self.launched) < 2 * self.layers and made < nbytes:
                with mx.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
                    a = self._zeros()
                    mx.async_eval(a)
                self.launched.append(a)
                made += a.nbytes
            self.since = time.perf_counter()
            return None
        arrays = list(zip(self.arrays[0::2], self.arrays[1::2], strict=True))
        views = []
        for k, v in arrays:
            # Fresh, evaluated, referenced by nothing else yet: MLX's buffer protocol
            # exposes its memory, which readinto fills in place (on the reader: the
            # bytes are written there, no MLX call is made off the engine thread).
            kv, vv = memoryview(k).cast("B"), memoryview(v).cast("B")  # type: ignore[arg-type]
            views.append((kv, vv))
            if not (kv.contiguous and vv.contiguous and kv.nbytes == k.nbytes == vv.nbytes):
                for x, y in views:
                    x.release()
                    y.release()
                return False
        return Buffers(arrays, views, self.capacity)

    def _zeros(self) -> mx.array:
        return mx.zeros((1, self.heads, self.capacity, self.dim), _DTYPE[self.dtype])


def fill(found: Scan, buffers: Buffers, *, fingerprint: str) -> Filled:
    """Every scanned piece's data into the buffers, hashed where it lands (no MLX: the reader runs this).

    Each header is read and checked again (the bytes are hashed in file
    order, and a file replaced since the scan must not pass as the old one).
    """
    assert found.shape is not None
    _, heads, dim, dtype = found.shape
    done, nbytes = 0, 0
    for piece in found.pieces:
        try:
            f = open(piece.path, "rb", buffering=0)
        except OSError as e:
            return Filled(done, nbytes, (piece, SegmentMissing(f"cannot open it: {e.strerror or e}",
                                                               path=piece.path)))
        with f:
            try:
                hasher, want_digest = hasher_for(piece.checksum, piece.path)
                header = read_raw_header(f, piece.path, hasher)
                try:
                    layout, specs, offsets = _plain_kv(header, piece, fingerprint)
                    if (len(layout), *_layer_shape(specs)) != found.shape:
                        raise _Unsupported
                    n = _read_data(f, piece, offsets, buffers.views, (heads, dim, dtype), buffers.capacity,
                                   hasher)
                except _Unsupported:
                    raise SegmentTruncated("changed since its header was read", path=piece.path) from None
            except CorruptSegment as e:
                return Filled(done, nbytes, (piece, e))
            except OSError as e:
                return Filled(done, nbytes, (piece, SegmentMissing(f"cannot read it: {e.strerror or e}",
                                                                   path=piece.path)))
        if (got := hasher.hexdigest()) != want_digest:
            return Filled(done, nbytes, (piece, ChecksumMismatch(f"its hash is {got}, the index says "
                                                                 f"{piece.checksum}", path=piece.path)))
        nbytes += n
        done = piece.use
    return Filled(done, nbytes, found.bad)


def finish(buffers: Buffers, filled: Filled) -> Direct:
    """The live caches holding what `fill` read (engine thread); the views are released."""
    for k, v in buffers.views:
        k.release()
        v.release()
    buffers.views = []
    if filled.tokens == 0:
        return Direct(None, 0, filled.bytes_read, filled.bad)
    caches = []
    for keys, values in buffers.arrays:
        c = KVCache()
        c.keys, c.values, c.offset = keys, values, filled.tokens
        caches.append(c)
    return Direct(caches, filled.tokens, filled.bytes_read, filled.bad)


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


def _check_offsets(offsets: list[tuple[int, int, str]], piece: FileSpan, size: int) -> None:
    """Every tensor is `size` bytes, one after the other; gaps or padding: the general path reads those."""
    pos = 0
    for begin, end, _ in offsets:
        if begin != pos or end - begin != size:
            raise _Unsupported
        pos = end


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
    _check_offsets(offsets, piece, heads * run)
    pos = 0
    for _, end, name in offsets:
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
