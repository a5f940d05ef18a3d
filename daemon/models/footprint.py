"""What a prepared model will take before it is loaded: its weights' bytes as run, its context length.

The registry (daemon/engine/registry.py) decides whether a model fits
(daemon/device.py's room_to_load) before it loads a single weight, so the
weights' size comes from the safetensors headers only: each tensor's shape
times the bytes of the dtype it will run in (the device policy casts floats
to float32 on the CPU, which doubles a bf16 checkpoint). Listing (`kvd
models`, `/v1/models`) reads the context length from config.json the same
way, without loading anything.
"""

from __future__ import annotations

import json
import logging
import math
import struct
from pathlib import Path
from typing import Any

from .untrusted import StoreError, read_json

__all__ = ["context_length", "parameter_count", "weights_bytes"]

log = logging.getLogger("kvd.models")

HEADER_CAP = 100 << 20  # bytes of a safetensors header read at most (real ones: a few hundred KB)
CONFIG_CAP = 16 << 20
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2,
             "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_FLOATS = {"F64", "F32", "F16", "BF16"}
_RUN_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def _header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        if size > HEADER_CAP:
            raise ValueError(f"{path}: a safetensors header of {size} bytes")
        header = json.loads(f.read(size))
    if not isinstance(header, dict):
        raise ValueError(f"{path}: its safetensors header is not an object")
    return header


def weights_bytes(model_dir: Path, weights_dtype: str | None) -> int:
    """The bytes the weights in `model_dir` take once loaded, floats cast to `weights_dtype` (None: as stored)."""
    total = 0
    run = _RUN_ITEMSIZE.get(weights_dtype or "")
    for file in sorted(model_dir.glob("*.safetensors")):
        for name, tensor in _header(file).items():
            if name == "__metadata__" or not isinstance(tensor, dict):
                continue
            dtype = str(tensor.get("dtype"))
            n = math.prod(int(d) for d in tensor.get("shape", []))
            total += n * (run if run is not None and dtype in _FLOATS else _ITEMSIZE.get(dtype, 4))
    return total


def parameter_count(path: Path) -> int | None:
    """How many parameters a model's weights hold (a GGUF file's tensors, or a folder's safetensors), from the
    headers alone; None where they cannot be read. A quantized folder's packed integers count as stored."""
    try:
        if path.is_file():
            from .ggufinfo import GGUFError, read_info

            try:
                return sum(math.prod(t.shape) for t in read_info(path).tensors)
            except GGUFError:
                return None
        total = 0
        for file in sorted(path.glob("*.safetensors")):
            for name, tensor in _header(file).items():
                if name != "__metadata__" and isinstance(tensor, dict) and str(tensor.get("dtype")) in _FLOATS:
                    total += math.prod(int(d) for d in tensor.get("shape", []))
        return total or None
    except (OSError, ValueError, TypeError, KeyError) as e:
        log.debug("could not count the parameters of %s: %s", path, e)
        return None


def context_length(config: dict[str, Any]) -> int | None:
    """A model's context length as its config.json says it (a multimodal one: its text model's)."""
    for c in (config, config.get("text_config") or {}):
        if isinstance(c, dict):
            for key in ("max_position_embeddings", "max_seq_len", "n_positions", "seq_length"):
                value = c.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
    return None


def dir_context_length(model_dir: Path) -> int | None:
    try:
        return context_length(read_json(model_dir / "config.json", None, CONFIG_CAP))
    except (OSError, StoreError):
        return None
