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

__all__ = ["Allocation", "Buffers", "Direct", "FileSpan", "FillRate", "Filled", "Filling", "Scan", "allocate",
           "capacity", "fill", "finish", "read_direct", "scan"]

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
    order: tuple[int, ...] = ()  # the buffers (2 * layer + 0 for keys, 1 for values) in the first file's order


@dataclass
class Buffers:
    """The live cache's buffers, made and evaluated on the engine thread at their final size, by
    slot (2 * layer, + 1 for the values), and the byte views of them that the reader writes into
    (released by `finish`). A slot not made yet is None."""

    arrays: list[mx.array | None]
    views: list[memoryview | None]
    capacity: int

    def release(self) -> None:
        """Let go of the views (the arrays may be freed then): the reader is done with them."""
        for v in self.views:
            if v is not None:
                v.release()
        self.views = [None] * len(self.views)

    def made(self) -> dict[int, memoryview]:
        """The views of the slots made so far (a copy the reader can keep)."""
        return {k: v for k, v in enumerate(self.views) if v is not None}


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
    order: tuple[int, ...] = ()
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
                order = order or tuple(_slot(name, len(layout)) for _, _, name in offsets)
            except CorruptSegment as e:
                return Scan(ok, shape, (piece, e), order)
            except OSError as e:
                return Scan(ok, shape, (piece, SegmentMissing(f"cannot read it: {e.strerror or e}",
                                                              path=piece.path)), order)
            ok.append(piece)
            done = piece.use
            if piece.use < piece.end:
                break
    except _Unsupported:
        return None
    return Scan(ok, shape, None, order)


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

    Buffers are made in the order the files hold them (`Scan.order`), and
    each one made is exposed at once (`made`, `buffers.views`), so the reader
    can read the files' first tensors into it while the next are being made
    (`Filling`): the reading and the allocating overlap.
    """

    def __init__(self, found: Scan, room: int, stream: Any = None, rate: FillRate | None = None) -> None:
        assert found.shape is not None and found.pieces
        self.layers, self.heads, self.dim, self.dtype = found.shape
        self.capacity = capacity(max(p.end for p in found.pieces), room)
        self.stream = stream
        self.rate = rate or FillRate()
        n = 2 * self.layers
        order = list(found.order) if sorted(found.order) == list(range(n)) else list(range(n))
        self.todo = order  # slots not launched yet, in the order they are made
        self.launched: list[tuple[int, mx.array]] = []  # being filled on `stream`
        self.since = 0.0  # when they were launched
        self.buffers = Buffers([None] * n, [None] * n, self.capacity)
        self.made: list[int] = []  # slots made (evaluated, viewed), in the order they were

    @property
    def complete(self) -> bool:
        return not self.todo and not self.launched

    def step(self, nbytes: int | None, *, now: bool = False) -> Buffers | bool | None:
        """Take in the buffers launched before once they should be filled (`now`: at once, waiting
        for them), and launch the next, worth at least `nbytes` (None: make all now); the Buffers
        once all are made, None while more are to come, False if MLX does not expose them as plain
        bytes (found on the first, before any was exposed)."""
        if self.launched:
            size = sum(a.nbytes for _, a in self.launched)
            if not now and nbytes is not None and time.perf_counter() - self.since < size / self.rate.bytes_per_s:
                return None  # not yet: the decode steps go on meanwhile
            t0 = time.perf_counter()
            mx.eval([a for _, a in self.launched])
            self.rate.took(size, time.perf_counter() - self.since, waited=time.perf_counter() - t0)
            launched, self.launched = self.launched, []
            if not self._take(launched):
                return False
        if self.todo and nbytes is None:
            made = [(k, self._zeros()) for k in self.todo]
            self.todo = []
            mx.eval([a for _, a in made])
            if not self._take(made):
                return False
        elif self.todo:
            size = 0
            while self.todo and size < nbytes:  # type: ignore[operator]
                with mx.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
                    a = self._zeros()
                    mx.async_eval(a)
                self.launched.append((self.todo.pop(0), a))
                size += a.nbytes
            self.since = time.perf_counter()
            return None
        return self.buffers if self.complete else None

    def _take(self, made: list[tuple[int, mx.array]]) -> bool:
        """Buffers made: viewed as bytes, for the reader to fill in place. False if MLX does not
        expose the first as plain bytes (nothing has been read into any then)."""
        for k, a in made:
            # Fresh, evaluated, referenced by nothing else yet: MLX's buffer protocol exposes its
            # memory, which readinto fills in place (on the reader: the bytes are written there,
            # no MLX call is made off the engine thread).
            view = memoryview(a).cast("B")  # type: ignore[arg-type]
            if not (view.contiguous and view.nbytes == a.nbytes):
                view.release()
                if not self.made:
                    self.buffers.release()
                    return False
                raise RuntimeError("MLX exposed one restore buffer as plain bytes and not the next")
            self.buffers.arrays[k], self.buffers.views[k] = a, view
            self.made.append(k)
        return True

    def _zeros(self) -> mx.array:
        return mx.zeros((1, self.heads, self.capacity, self.dim), _DTYPE[self.dtype])


class Filling:
    """The reader's side of a direct read: the files read into the buffers as they are made.

    `advance` reads, for every piece, its tensors in file order up to the
    first whose buffer is not made yet, hashing every byte where it lands;
    called again with more buffers made, it goes on from there (each file's
    hash and position are kept here; the file is opened again, and a file
    replaced meanwhile fails its hash). With every buffer made (`last`), it
    reads the rest, checks each file's hash and answers what the buffers hold.
    A piece that fails ends the chain there: the pieces after it are not
    read any more. Only the reader touches this (its jobs run one at a time).
    """

    def __init__(self, found: Scan, capacity: int, *, fingerprint: str) -> None:
        assert found.shape is not None
        self.found = found
        self.capacity = capacity
        self.fingerprint = fingerprint
        self.limit = len(found.pieces)  # pieces from here on are not read (one before failed)
        self.bad: tuple[FileSpan, CorruptSegment] | None = None
        self._state: dict[int, _PieceRead] = {}

    def advance(self, views: dict[int, memoryview], *, last: bool) -> Filled | None:
        """Read what the made buffers (`views`, by slot) can take; the Filled once `last`."""
        for i, piece in enumerate(self.found.pieces):
            if i >= self.limit:
                break
            try:
                self._piece(i, piece, views, last)
            except CorruptSegment as e:
                self._fail(i, piece, e)
            except OSError as e:
                self._fail(i, piece, SegmentMissing(f"cannot read it: {e.strerror or e}", path=piece.path))
        if not last:
            return None
        done, nbytes = 0, 0
        for i in range(self.limit):
            done, nbytes = self.found.pieces[i].use, nbytes + self._state[i].size
        return Filled(done, nbytes, self.bad or self.found.bad)

    def _fail(self, i: int, piece: FileSpan, e: CorruptSegment) -> None:
        if i < self.limit:
            self.limit, self.bad = i, (piece, e)

    def _piece(self, i: int, piece: FileSpan, views: dict[int, memoryview], last: bool) -> None:
        st = self._state.get(i)
        if st is not None and st.finished:
            return
        _, heads, dim, dtype = self.found.shape  # type: ignore[misc]
        with open(piece.path, "rb", buffering=0) as f:
            if st is None:
                hasher, want = hasher_for(piece.checksum, piece.path)
                header = read_raw_header(f, piece.path, hasher)
                try:
                    layout, specs, offsets = _plain_kv(header, piece, self.fingerprint)
                    if (len(layout), *_layer_shape(specs)) != self.found.shape:
                        raise _Unsupported
                    _check_offsets(offsets, piece, heads * (piece.end - piece.start) * dim * _ITEMSIZE[dtype])
                    slots = [_slot(name, len(layout)) for _, _, name in offsets]
                except _Unsupported:
                    raise SegmentTruncated("changed since its header was read", path=piece.path) from None
                st = self._state[i] = _PieceRead(hasher, want, slots, f.tell())
            f.seek(st.at)
            while st.next < len(st.slots) and (view := views.get(st.slots[st.next])) is not None:
                _read_tensor(f, piece, view, (heads, dim, dtype), self.capacity, st.hasher)
                st.next += 1
            st.at = f.tell()
            if st.next < len(st.slots):
                if last:
                    raise RuntimeError("a restore's buffers were all made but not all given to the reader")
                return
            tail = f.read()  # bytes after the last tensor are part of the file's checksum
            st.hasher.update(tail)
            st.size = st.at + len(tail)
            st.finished = True
        if (got := st.hasher.hexdigest()) != st.want:
            raise ChecksumMismatch(f"its hash is {got}, the index says {piece.checksum}", path=piece.path)


@dataclass
class _PieceRead:
    """How far one file has been read into the buffers, and its hash so far."""

    hasher: Hasher
    want: str
    slots: list[int]  # the buffer each tensor goes to, in file order
    at: int  # the file's position after what was read
    next: int = 0  # the next tensor to read
    size: int = 0
    finished: bool = False


def fill(found: Scan, buffers: Buffers, *, fingerprint: str) -> Filled:
    """Every scanned piece's data into the buffers, all made, hashed where it lands (no MLX: the
    reader runs this). Each header is read and checked again (the bytes are hashed in file order,
    and a file replaced since the scan must not pass as the old one)."""
    got = Filling(found, buffers.capacity, fingerprint=fingerprint).advance(buffers.made(), last=True)
    assert got is not None
    return got


def finish(buffers: Buffers, filled: Filled) -> Direct:
    """The live caches holding what the reader read (engine thread); the views are released."""
    buffers.release()
    if filled.tokens == 0:
        return Direct(None, 0, filled.bytes_read, filled.bad)
    caches = []
    for keys, values in zip(buffers.arrays[0::2], buffers.arrays[1::2], strict=True):
        assert keys is not None and values is not None
        c = KVCache()
        c.keys, c.values, c.offset = keys, values, filled.tokens
        caches.append(c)
    return Direct(caches, filled.tokens, filled.bytes_read, filled.bad)


def _slot(name: str, layers: int) -> int:
    """The buffer a tensor named ``L<layer>.<0 keys | 1 values>`` goes to: 2 * layer + which."""
    layer, which = name[1:].split(".")
    k, w = int(layer), int(which)
    if not (0 <= k < layers and w in (0, 1)):
        raise _Unsupported
    return 2 * k + w


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


def _read_tensor(f: io.FileIO, piece: FileSpan, view: memoryview, shape: tuple[int, int, str], capacity: int,
                 hasher: Hasher) -> None:
    """One tensor's bytes, from the file's position, into its buffer's token range, hashed where they land."""
    heads, dim, dtype = shape
    itemsize = _ITEMSIZE[dtype]
    run = (piece.end - piece.start) * dim * itemsize  # one head's tokens: contiguous in the file and the buffer
    row = capacity * dim * itemsize
    for h in range(heads):
        at = h * row + piece.start * dim * itemsize
        dest = view[at:at + run]
        if f.readinto(dest) != run:
            raise SegmentTruncated("shorter than its header describes", path=piece.path)
        hasher.update(dest)
