"""Checking a segment file that nothing vouches for, then loading it.

Reads trust nothing: the checksum of the bytes is verified before MLX sees
them (MLX loads a bit-flipped file without complaint), then the fingerprint,
the format version and every invariant a live cache relies on; any failure is
a :class:`~cachestore.errors.CorruptSegment`, never a crash.

Checksum: xxh3-64 for new files (segformat.CHECKSUM says why); crc32 in
older indexes still reads. Measurements from before xxh3, on a warm
100 MB segment (2-core AMD EPYC, zlib 1.2.13; ranges over quiet and busy
runs): zlib.crc32 2.5-4.2 GB/s, sha256 (SHA-NI) 1.7-1.8, sha1 1.9, blake2b
0.7-0.9, md5 0.8; ``Path.read_bytes`` 1.2-1.9 GB/s (its fresh 100 MB buffer
page-faults), ``mx.load`` by path 3-9 GB/s. Reading once into bytes and
handing MLX a ``BytesIO`` (which it accepts) costs 0.6-0.9 GB/s overall;
checksumming in 4 MB chunks and then letting MLX read the same descriptor
again from the page cache gives :func:`read_segment` 1.5-2.4 GB/s, above
plain ``read_bytes``.
"""

from __future__ import annotations

import io
import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

import mlx.core as mx

import cachestore.segformat as fmt  # not `from . import`: that names the package, whose door imports this

from .errors import (
    ChecksumMismatch,
    FingerprintMismatch,
    InvariantViolation,
    SegmentMissing,
    SegmentTruncated,
    UnsupportedFormat,
)
from .kinds import KINDS
from .layers import BadLayer, Spec
from .snapshot import LayerSnapshot, Snapshot

__all__ = ["SegmentHeader", "Verified", "check_header", "hasher_for", "load_verified", "read_header",
           "read_raw_header", "read_segment", "verify_segment"]

_MAX_HEADER = 100 << 20  # safetensors' own limit


def read_segment(path: Path, *, checksum: str, fingerprint: str) -> Snapshot:
    """Read, verify and rebuild the snapshot at ``path``.

    Order: checksum of the bytes (before MLX sees them), fingerprint, format
    version, layout and invariants (from the header, still before MLX), then
    MLX loads the very file descriptor that was checksummed.
    """
    return load_verified(verify_segment(path, checksum=checksum, fingerprint=fingerprint))


@dataclass
class Verified:
    """A segment whose bytes and header passed every check, its file still open for MLX to load.

    :func:`verify_segment` reads the disk (the I/O worker's reader runs it);
    :func:`load_verified` hands the open descriptor to MLX, whose pages the
    check has just read (the engine thread runs it: MLX work stays there).
    """

    file: io.FileIO
    path: Path
    start: int
    end: int
    layout: tuple[_Node, ...]
    specs: dict[str, Spec]

    def close(self) -> None:
        self.file.close()


def verify_segment(path: Path, *, checksum: str, fingerprint: str) -> Verified:
    """Checksum, fingerprint, format version, layout and invariants; no MLX. The file stays open."""
    path = Path(path)
    algo = checksum.partition(":")[0]
    want = hasher_for(checksum, path)[1]
    try:
        f = open(path, "rb", buffering=0)
    except FileNotFoundError:
        raise SegmentMissing("no such file", path=path) from None
    except OSError as e:
        raise SegmentMissing(f"cannot open it: {e.strerror or e}", path=path) from None
    try:
        try:
            size, got = fmt.digest(f, algo)
            if got != want:
                claimed = _claimed_size(f)
                if claimed is not None and claimed > size:
                    raise SegmentTruncated(f"{size} bytes, its header describes {claimed}", path=path)
                raise ChecksumMismatch(f"{algo} is {got}, the index says {want}", path=path)
            header = _read_header(f, size, path)
        except OSError as e:
            raise SegmentMissing(f"cannot read it: {e.strerror or e}", path=path) from None
        _, start, end, layout, specs = _checked(header, path, fingerprint=fingerprint)
    except BaseException:
        f.close()
        raise
    return Verified(f, path, start, end, layout, specs)


def load_verified(v: Verified) -> Snapshot:
    """MLX loads a verified segment's open file (engine thread); the file is closed."""
    with v.file:
        tensors = _load(v.file, v.path, v.specs)
    return _build(v.start, v.end, v.layout, tensors)


@dataclass(frozen=True)
class SegmentHeader:
    """What a segment file says about itself: enough to list it in the index again."""

    start: int
    end: int
    fingerprint: str
    tokens: tuple[int, ...]
    nbytes: int
    checksum: str  # of the file as it is now


def read_header(path: Path) -> SegmentHeader:
    """Verify a segment's structure from its own header, without MLX; checksum it as it is.

    Everything :func:`read_segment` checks before MLX sees a byte (sizes,
    format version, layout, every invariant) except the checksum, which only
    the lost index knew: a file that passes here is a whole segment that
    :func:`read_segment` accepts with the checksum returned. Files written
    before token ids were kept in the header fail (UnsupportedFormat): their
    ids are gone with the index.
    """
    path = Path(path)
    try:
        f = open(path, "rb", buffering=0)
    except OSError as e:
        raise SegmentMissing(f"cannot open it: {e.strerror or e}", path=path) from None
    with f:
        try:
            size, digest = fmt.digest(f, fmt.CHECKSUM)
            header = _read_header(f, size, path)
        except OSError as e:
            raise SegmentMissing(f"cannot read it: {e.strerror or e}", path=path) from None
    meta, start, end, layout, specs = _checked(header, path)
    if not isinstance(meta.get(fmt.TOKENS), str):
        raise UnsupportedFormat("written by an older kvd: no token ids in its header", path=path)
    try:
        ids = fmt.decode_tokens(meta[fmt.TOKENS])
    except ValueError:
        raise UnsupportedFormat("unreadable token ids in its header", path=path) from None
    if len(ids) != end - start:
        raise InvariantViolation(f"{len(ids)} token ids for the range [{start}, {end})", path=path)
    return SegmentHeader(start, end, meta[fmt.FINGERPRINT], tuple(ids), size, f"{fmt.CHECKSUM}:{digest}")


def hasher_for(checksum: str, path: Path) -> tuple[fmt.Hasher, str]:
    """A fresh hasher of the index's checksum kind and the digest it must reach, or ChecksumMismatch."""
    got = fmt.hasher_for(checksum)
    if got is None:
        raise ChecksumMismatch(
            f"unknown checksum {checksum!r} (expected one of {', '.join(f'{a}:<hex>' for a in fmt.HASHERS)})",
            path=path,
        )
    return got


def read_raw_header(f: io.FileIO, path: Path, hasher: fmt.Hasher) -> dict[str, Any]:
    """A segment's parsed safetensors header, its bytes fed to ``hasher``, ``f`` left at the data.

    For readers that hash the data as they place it (cachestore/direct.py):
    the header is checked with :func:`check_header` before any data is read.
    """
    size = os.fstat(f.fileno()).st_size
    header = _read_header(f, size, path)
    data = f.tell()
    f.seek(0)
    hasher.update(f.read(data))
    if f.tell() != data:
        raise SegmentTruncated("changed while it was read", path=path)
    return header


def check_header(header: dict[str, Any], path: Path, *, fingerprint: str
                 ) -> tuple[int, int, list[str], dict[str, Spec]]:
    """Every check :func:`read_segment` makes before MLX sees a byte: (start, end, layer kinds, tensors)."""
    _, start, end, layout, specs = _checked(dict(header), path, fingerprint=fingerprint)
    return start, end, [node.kind for node in layout], specs


def _checked(header: dict[str, Any], path: Path, *, fingerprint: str | None = None
             ) -> tuple[dict[str, Any], int, int, tuple[_Node, ...], dict[str, Spec]]:
    """A header's metadata and structure, every invariant checked, before MLX sees a byte.

    With `fingerprint`, a segment written for another model is refused first.
    """
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict) or not isinstance(meta.get(fmt.FINGERPRINT), str):
        raise UnsupportedFormat("not a kvd segment: no fingerprint in its metadata", path=path)
    if fingerprint is not None and meta[fmt.FINGERPRINT] != fingerprint:
        raise FingerprintMismatch(
            f"written for fingerprint {meta[fmt.FINGERPRINT]}, this model's is {fingerprint}", path=path
        )
    if meta.get(fmt.FORMAT) != str(fmt.FORMAT_VERSION):
        raise UnsupportedFormat(
            f"format version {meta.get(fmt.FORMAT)!r}, this kvd reads {fmt.FORMAT_VERSION}", path=path
        )
    start, end, layout = _parse_layout(meta, path)
    specs = _parse_specs(header, path)
    try:
        names = set(_check_layers(layout, specs, start, end))
    except BadLayer as e:
        raise InvariantViolation(str(e), path=path) from None
    if unnamed := specs.keys() - names:
        raise InvariantViolation(
            f"tensors the layout does not account for: {sorted(unnamed)[:5]}", path=path
        )
    return meta, start, end, layout, specs


def _claimed_size(f: io.FileIO) -> int | None:
    """The size the file's own header describes, if that much can be read."""
    f.seek(0)
    raw = f.read(8)
    if len(raw) < 8:
        return 8
    n = int(struct.unpack("<Q", raw)[0])
    if n > _MAX_HEADER:
        return None
    head = f.read(n)
    if len(head) < n:
        return 8 + n
    try:
        header = json.loads(head)
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None
    return 8 + n + max(ends, default=0)


def _read_header(f: io.FileIO, size: int, path: Path) -> dict[str, Any]:
    f.seek(0)
    raw = f.read(8)
    if len(raw) < 8:
        raise SegmentTruncated(f"{size} bytes: not even a safetensors header", path=path)
    n = int(struct.unpack("<Q", raw)[0])
    if n > _MAX_HEADER:
        raise UnsupportedFormat(f"a {n}-byte header: not a safetensors file", path=path)
    if 8 + n > size:
        raise SegmentTruncated(f"{size} bytes, its header alone claims {8 + n}", path=path)
    try:
        header = json.loads(f.read(n))
    except ValueError as e:
        raise UnsupportedFormat(f"unreadable safetensors header: {e}", path=path) from None
    if not isinstance(header, dict):
        raise UnsupportedFormat("the safetensors header is not an object", path=path)
    ends = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            ends.append(int(entry["data_offsets"][1]))
        except (TypeError, KeyError, IndexError, ValueError):
            raise UnsupportedFormat(f"tensor {name!r} has no data_offsets", path=path) from None
    if 8 + n + max(ends, default=0) > size:
        raise SegmentTruncated(f"{size} bytes, its header describes {8 + n + max(ends)}", path=path)
    return header


@dataclass(frozen=True)
class _Node:
    kind: str
    meta: dict[str, int]
    arrays: int
    children: tuple[_Node, ...]


def _parse_layout(meta: dict[str, Any], path: Path) -> tuple[int, int, tuple[_Node, ...]]:
    def node(x: Any, depth: int) -> _Node:
        if not isinstance(x, dict) or x.get("kind") not in KINDS:
            raise ValueError(f"unknown layer {str(x)[:80]}")
        kind = x["kind"]
        m, arrays, children = x.get("meta"), x.get("arrays", -1), x.get("children", [])
        if not isinstance(m, dict) or set(m) != KINDS[kind].meta_keys:
            raise ValueError(f"a {kind} layer's meta must have {sorted(KINDS[kind].meta_keys)}, not {m}")
        if not all(_is_int(v) for v in m.values()) or not _is_int(arrays) or not 0 <= arrays <= 64:
            raise ValueError(f"malformed {kind} layer {str(x)[:80]}")
        if not isinstance(children, list):
            raise ValueError(f"malformed {kind} layer {str(x)[:80]}")
        if depth > 4 or (children and not KINDS[kind].has_children):
            raise ValueError(f"malformed nesting in a {kind} layer")
        return _Node(kind, dict(m), arrays, tuple(node(c, depth + 1) for c in children))

    try:
        start, end = int(meta[fmt.START]), int(meta[fmt.END])
        raw = json.loads(meta[fmt.LAYOUT])
        if not isinstance(raw, list):
            raise ValueError("the layout is not a list")
        return start, end, tuple(node(x, 0) for x in raw)
    except (KeyError, TypeError, ValueError) as e:
        raise UnsupportedFormat(f"bad layout metadata: {e}", path=path) from None


def _is_int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _parse_specs(header: dict[str, Any], path: Path) -> dict[str, Spec]:
    specs = {}
    for name, entry in header.items():
        try:
            shape = tuple(entry["shape"])
            if not all(_is_int(d) and d >= 0 for d in shape) or not isinstance(entry["dtype"], str):
                raise TypeError
        except (TypeError, KeyError):
            raise UnsupportedFormat(f"tensor {name!r} has a malformed entry", path=path) from None
        specs[name] = (shape, entry["dtype"])
    return specs


def _check_layers(
    layout: tuple[_Node, ...], specs: dict[str, Spec], start: int, end: int
) -> Iterator[str]:
    """Check every invariant a restored cache relies on; yield the tensor names used."""
    if not 0 <= start <= end:
        raise BadLayer(f"token range [{start}, {end})")
    for i, node in enumerate(layout):
        yield from _check_node(node, f"L{i}", specs, start, end)


def _check_node(node: _Node, name: str, specs: dict[str, Spec], start: int, end: int) -> Iterator[str]:
    """What every layer must meet, then what its kind requires (cachestore/kinds.py)."""
    where = f"layer {name} ({node.kind})"
    if node.meta["offset"] != end:
        raise BadLayer(f"{where}: offset {node.meta['offset']}, the segment ends at {end}")
    names = [f"{name}.{j}" for j in range(node.arrays)]
    missing = [n for n in names if n not in specs]
    if missing:
        raise BadLayer(f"{where}: tensors {missing} are missing")
    KINDS[node.kind].check(where, node.meta, [specs[n] for n in names], len(node.children), start, end)
    for k, child in enumerate(node.children):
        yield from _check_node(child, f"{name}.c{k}", specs, start, end)
    yield from names


def _load(f: io.FileIO, path: Path, specs: dict[str, Spec]) -> dict[str, mx.array]:
    # Load the very file that was checksummed (a rename over `path` since
    # cannot swap it) by path rather than through Python: 3x faster.
    fd_path = f"/proc/self/fd/{f.fileno()}"
    source = fd_path if os.path.exists(fd_path) else str(path)
    try:
        tensors = mx.load(source, format="safetensors")
        mx.eval(tensors)
    except Exception as e:  # noqa: BLE001 - MLX reports everything as RuntimeError/ValueError
        raise UnsupportedFormat(f"MLX cannot load it: {e}", path=path) from None
    assert isinstance(tensors, dict)
    for name, (shape, _) in specs.items():
        if name not in tensors or tuple(tensors[name].shape) != shape:
            raise UnsupportedFormat(f"MLX read tensor {name!r} differently from its header", path=path)
    return tensors


def _build(start: int, end: int, layout: tuple[_Node, ...], tensors: dict[str, mx.array]) -> Snapshot:
    def layer(node: _Node, name: str) -> LayerSnapshot:
        arrays = tuple(tensors[f"{name}.{j}"] for j in range(node.arrays))
        children = tuple(layer(c, f"{name}.c{k}") for k, c in enumerate(node.children))
        return LayerSnapshot(node.kind, arrays, dict(node.meta), children)

    return Snapshot(start, end, tuple(layer(node, f"L{i}") for i, node in enumerate(layout)))
