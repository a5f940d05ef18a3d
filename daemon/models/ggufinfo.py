"""What a GGUF file holds, read from its header alone: metadata and tensor list.

MLX's own GGUF reader (`mx.load`) reads the tensors, but when a tensor's
encoding is one it cannot decode it fails with "gguf_tensor_to_f16 failed",
and a truncated file is only found out tensor by tensor. Reading the header
first lets kvd refuse a file at start with a line that names what it found
(the architecture, the encoding and the tensor) and what it supports, and
tell a truncated download from a wrong model. Pure file parsing; no MLX.

A GGUF file is untrusted input: every count, length, dimension and nesting
depth read from the header is checked against the bytes the file has left
before anything is allocated or read (a 100-byte file that claims 2^32-1
dimensions must not make kvd build a 4 GB format string), and only a
regular file is opened (a FIFO would block the start forever, /dev/zero
never ends).

The format (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md):
magic "GGUF", version, tensor count, metadata count, the metadata key/values,
the tensor infos (name, dims, type, offset), padding to `general.alignment`,
then the tensor data.
"""

from __future__ import annotations

import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

__all__ = ["GGMLType", "GGUFError", "GGUFInfo", "TensorInfo", "read_info", "TYPE_NAMES"]


class GGUFError(Exception):
    """The file is not a GGUF file kvd can read; the message says why."""


class GGMLType:
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q8_0 = 8
    BF16 = 30


#: ggml's names for its tensor types, so a refusal can name what it found.
TYPE_NAMES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
    23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16",
    34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}

#: (elements per block, bytes per block) of the encodings whose size kvd checks.
BLOCK_SIZES = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 8: (32, 34)}

_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# Long arrays (the vocabulary) are skipped, not decoded: the header is read
# to refuse or accept a file, and mx.load decodes the metadata kvd uses.
_KEEP_ARRAY = 64
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_DEPTH = 4  # arrays of arrays: GGUF files in the wild nest one level at most
MAX_ALIGNMENT = 1 << 16
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, at least one byte of value
_MIN_TENSOR_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dimension, type, offset


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: the fastest-varying dimension first
    type: int
    offset: int  # from the start of the data section

    @property
    def type_name(self) -> str:
        return TYPE_NAMES.get(self.type, f"type {self.type}")

    @property
    def nbytes(self) -> int | None:
        """Bytes on disk, for the encodings in BLOCK_SIZES; None for the others."""
        if self.type not in BLOCK_SIZES:
            return None
        per_block, block_bytes = BLOCK_SIZES[self.type]
        n = 1
        for d in self.shape:
            n *= d
        return n // per_block * block_bytes


@dataclass(frozen=True)
class GGUFInfo:
    version: int
    metadata: dict[str, Any]  # scalars and strings; arrays longer than _KEEP_ARRAY are None
    tensors: list[TensorInfo]
    data_offset: int
    file_size: int

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "?"))


def read_info(path: Path) -> GGUFInfo:
    """The header of the GGUF file at `path`; GGUFError if it is not one, is cut short or lies about itself."""
    mode = os.stat(path).st_mode  # follows a symlink: what would be read
    if not stat.S_ISREG(mode):
        what = ("a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a character device" if stat.S_ISCHR(mode)
                else "a block device" if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "a directory" if stat.S_ISDIR(mode) else "not a regular file")
        target = f" (it points to {os.path.realpath(path)})" if path.is_symlink() else ""
        raise GGUFError(f"{path} is {what}{target}, not a GGUF file; name the model file itself")
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            return _read(f, size)
    except (struct.error, EOFError, UnicodeDecodeError, MemoryError, RecursionError, OverflowError) as e:
        raise GGUFError(f"{path} is not a readable GGUF file ({size} bytes; {e or 'cut short'}); "
                        "download it again") from None


def _read(f: BinaryIO, size: int) -> GGUFInfo:
    if f.read(4) != _MAGIC:
        raise GGUFError(f"{getattr(f, 'name', 'the file')} is not a GGUF file (no GGUF magic number)")
    (version,) = _unpack(f, "<I")
    if version not in (2, 3):
        raise GGUFError(f"GGUF version {version} is not supported (kvd reads versions 2 and 3)")
    n_tensors, n_kv = _unpack(f, "<QQ")
    _fits(f, size, n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_BYTES,
          f"{n_kv} metadata entries and {n_tensors} tensors")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = _string(f, size)
        (vtype,) = _unpack(f, "<I")
        metadata[key] = _value(f, vtype, size)
    tensors = []
    for _ in range(n_tensors):
        name = _string(f, size)
        (n_dims,) = _unpack(f, "<I")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFError(f"tensor {name[:80]!r} claims {n_dims} dimensions (GGUF allows 1 to {MAX_DIMS})")
        shape = _unpack(f, "<" + "Q" * n_dims)
        ttype, offset = _unpack(f, "<IQ")
        tensors.append(TensorInfo(name, tuple(shape), ttype, offset))
    align = metadata.get("general.alignment", 32)
    if (not isinstance(align, int) or isinstance(align, bool) or not 1 <= align <= MAX_ALIGNMENT
            or align & (align - 1)):
        raise GGUFError(f"general.alignment is {str(align)[:40]!r}; it must be a power of two up to {MAX_ALIGNMENT}")
    data_offset = -(-f.tell() // align) * align
    for t in tensors:
        elements = 1
        for d in t.shape:
            elements *= d
        if elements > size * 8:  # no encoding packs more than 8 elements a byte (a short file: "truncated")
            raise GGUFError(f"tensor {t.name[:80]!r} claims {elements} elements, more than a {size}-byte "
                            "file can hold (a damaged or hostile file)")
    return GGUFInfo(version, metadata, tensors, data_offset, size)


def _fits(f: BinaryIO, size: int, need: int, what: str) -> None:
    if need > size - f.tell():
        raise GGUFError(f"the header claims {what}, more than the {size - f.tell()} bytes left in the file "
                        "hold (a damaged or hostile file)")


def _unpack(f: BinaryIO, fmt: str) -> tuple[Any, ...]:
    n = struct.calcsize(fmt)
    data = f.read(n)
    if len(data) != n:
        raise EOFError()
    return struct.unpack(fmt, data)


def _string(f: BinaryIO, size: int) -> str:
    (n,) = _unpack(f, "<Q")
    _fits(f, size, n, f"a string of {n} bytes")
    data = f.read(n)
    if len(data) != n:
        raise EOFError()
    return data.decode("utf-8")


def _value(f: BinaryIO, vtype: int, size: int, depth: int = 0) -> Any:
    if vtype in _SCALARS:
        return _unpack(f, _SCALARS[vtype])[0]
    if vtype == _STRING:
        return _string(f, size)
    if vtype == _ARRAY:
        if depth >= MAX_DEPTH:
            raise GGUFError(f"metadata arrays nested more than {MAX_DEPTH} deep")
        etype, count = _unpack(f, "<IQ")
        width = struct.calcsize(_SCALARS[etype]) if etype in _SCALARS else 8  # a string or array: >= 8
        _fits(f, size, width * count, f"an array of {count} values")
        if etype in _SCALARS and count > _KEEP_ARRAY:
            f.seek(width * count, 1)
            return None
        values = [_value(f, etype, size, depth + 1) for _ in range(count)]
        return values if count <= _KEEP_ARRAY else None
    raise GGUFError(f"unknown GGUF metadata type {vtype}")
