"""Writing a segment file: atomically, durably, checksummed on the way.

Writes are atomic and durable (``protocol.durable``: temp file in the same
directory, fsync, rename, fsync of the directory): a crash leaves either no
file or a whole one at ``path``, plus at worst a hidden ``.*.tmp`` file,
which no index row lists, so the index's sweep at start removes it.
Only then may the file get its index row ("durable, then indexed").
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx

import cachestore.segformat as fmt  # not `from . import`: that names the package, whose door imports this
import common.durable as durable

from .snapshot import LayerSnapshot, Snapshot

__all__ = ["SegmentFile", "write_segment"]


@dataclass(frozen=True)
class SegmentFile:
    """A written segment: what the index row needs to find and verify it."""

    path: Path
    nbytes: int
    checksum: str  # "xxh3:<16 hex>"


def write_segment(path: Path, snap: Snapshot, *, fingerprint: str,
                  tokens: Sequence[int] | None = None) -> SegmentFile:
    """Write ``snap`` to ``path`` atomically and durably; return its checksum.

    The snapshot's arrays should already be evaluated (this may run on an I/O
    worker). MLX streams the file through a shim that checksums it on the
    way, so the file is never read back. ``tokens`` (the ids of
    ``[start, end)``) go in the header, so a lost index can be rebuilt from
    the files alone (:func:`read_header`).
    """
    path = Path(path)
    tensors, layout = _flatten(snap)
    metadata = {
        fmt.FORMAT: str(fmt.FORMAT_VERSION),
        fmt.FINGERPRINT: fingerprint,
        fmt.START: str(snap.start),
        fmt.END: str(snap.end),
        fmt.LAYOUT: json.dumps(layout, separators=(",", ":")),
    }
    if tokens is not None:
        if len(tokens) != snap.end - snap.start:
            raise ValueError("a segment's token ids must cover exactly [start, end)")
        metadata[fmt.TOKENS] = fmt.encode_tokens(tokens)
    with durable.replacing(path) as f:
        shim = _ChecksumWriter(f, fmt.HASHERS[fmt.CHECKSUM]())
        # A file object, not a name: MLX would append ".safetensors" to a name.
        mx.save_safetensors(shim, tensors, metadata)  # type: ignore[arg-type]
        nbytes = f.tell()
        if shim.sequential:
            checksum = f"{fmt.CHECKSUM}:{shim.hasher.hexdigest()}"
        else:  # a future MLX that seeks while writing: read it back instead
            f.flush()
            f.seek(0)
            checksum = f"{fmt.CHECKSUM}:{fmt.digest(f, fmt.CHECKSUM)[1]}"
    return SegmentFile(path, nbytes, checksum)


def _flatten(snap: Snapshot) -> tuple[dict[str, mx.array], list[dict[str, Any]]]:
    tensors: dict[str, mx.array] = {}

    def node(layer: LayerSnapshot, name: str) -> dict[str, Any]:
        for j, a in enumerate(layer.arrays):
            tensors[f"{name}.{j}"] = a
        return {
            "kind": layer.kind,
            "meta": dict(layer.meta),
            "arrays": len(layer.arrays),
            "children": [node(c, f"{name}.c{k}") for k, c in enumerate(layer.children)],
        }

    return tensors, [node(layer, f"L{i}") for i, layer in enumerate(snap.layers)]


class _Writable(Protocol):
    @property
    def closed(self) -> bool: ...

    def write(self, data: Any, /) -> int: ...
    def seek(self, offset: int, whence: int = 0, /) -> int: ...
    def tell(self) -> int: ...
    def flush(self) -> None: ...


class _ChecksumWriter:
    """The file object MLX writes to: forwards every write and hashes it on the way."""

    def __init__(self, f: _Writable, hasher: fmt.Hasher) -> None:
        self._f = f
        self.hasher = hasher
        self.pos = 0
        self.sequential = True  # the hash is only the file's if nothing was overwritten

    @property
    def closed(self) -> bool:
        return self._f.closed

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._f.write(view)
        self.hasher.update(view)
        self.pos += view.nbytes
        return view.nbytes

    def seek(self, offset: int, whence: int = 0) -> int:
        pos = self._f.seek(offset, whence)
        if pos != self.pos:
            self.sequential = False
        return pos

    def tell(self) -> int:
        return self._f.tell()

    def flush(self) -> None:
        self._f.flush()
