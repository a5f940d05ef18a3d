"""A GGUF file, converted once into an mlx-lm model directory.

People already have GGUF files (llama.cpp's format); mlx-lm loads its own
directory layout. This module checks a GGUF file against what it can
convert (the architectures of ggufarch.py: llama, qwen2, qwen3, phi3, gemma2, gemma3; a
byte-level BPE or a SentencePiece vocabulary), reads its tensors and writes
config.json, model.safetensors and the tokenizer files (gguftok.py,
ggufspm.py) into a new directory.

On the CPU ("float32" mode) every tensor is read and dequantized by gguf-py,
the GGML project's own reader (`gguf.quants.dequantize`), so every encoding
it knows converts: F32, F16, BF16, Q4_0 to Q8_0, the K-quants (Q2_K to
Q6_K, what Ollama's default tags and most GGUF repositories ship) and the IQ
types. On a GPU, Metal or CUDA ("quantized" mode, daemon/device.py), the
weights stay quantized in a format MLX runs natively: a file of F32, F16,
Q4_0, Q4_1 and Q8_0 tensors only goes through MLX's own GGUF reader, which
keeps each quantized tensor's codes as MLX affine triples (exactly the
file's values); any other file is read by gguf-py as on the CPU and each
quantized tensor stays quantized, never float32: Q4_K's codes are taken
over exactly (q4_k_triples), any other type is requantized with
`mx.quantize` (group size 32, REQUANT_BITS). A Q4_K_M file then stays ~5
bits a weight instead of growing ~7x. The requantized answers are checked
against the float32 conversion in tests/test_gguf.py.

Measured facts this rests on:

- `mx.load(path, return_metadata=True)` returns quantized tensors as MLX
  affine triples (``weight`` uint32, ``scales``, ``biases``; group size 32).
  The bits differ per tensor (SmolLM2's Q4_1 file keeps ``token_embd`` in
  Q8_0), so they are derived from the shapes: 32 * packed columns / columns.
- llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` for its
  rope layout in the llama family; mlx-lm's llama (``rope_traditional =
  false``) needs them back: reshape to (heads, rows/heads/2, 2, cols) and
  swap axes 1 and 2. Rows are the first axis of a weight and of its scales
  and biases alike. What else each architecture needs undone is ggufarch.py.
- On the CPU backend quantized matmuls are much slower than float32 ones
  with OpenBLAS interposed, so there weights are dequantized to float32
  (``mode="float32"``); on a GPU they stay quantized
  (``mode="quantized"``), with a per-layer bits entry in config.json.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import durable

from .ggufarch import ARCHITECTURES, LLAMA3_ROPE, Arch, llama3_factors
from .ggufinfo import GGMLType, GGUFInfo

__all__ = ["CONVERTER_VERSION", "MODES", "UnsupportedGGUF", "check_supported", "convert"]

#: Bump when the files written change; converted dirs of another version are rebuilt.
CONVERTER_VERSION = 3  # 2: float32 weights dequantized by gguf-py; 3: the architecture table
MODES = ("float32", "quantized")
GROUP_SIZE = 32

SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
TOKENIZERS = ("gpt2", "llama")  # byte-level BPE (gguftok.py); SentencePiece (ggufspm.py)
# What MLX's GGUF reader loads (the "quantized" mode's exact path).
MLX_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0)
FLOAT_TYPES = frozenset({GGMLType.F32, GGMLType.F16, GGMLType.BF16})
# "quantized" mode, a file MLX's reader cannot load: Q4_K (the bulk of a Q4_K_M file) is taken over
# exactly (its sub-blocks are MLX's affine groups of 32: q4_k_triples); every other quantized type
# is requantized by mx.quantize to 8 bits, whose 256 levels a group add almost nothing to the file's
# own rounding (at 5 or 6 bits the second rounding changed tiny models' greedy answers at once).
REQUANT_BITS = 8


def dequantizable() -> frozenset[int]:
    """The GGML type codes gguf-py can read as float32 (the "float32" mode's path)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import _type_traits

    return frozenset({GGMLQuantizationType.F32.value, GGMLQuantizationType.F16.value,
                      *(t.value for t in _type_traits)})

class UnsupportedGGUF(Exception):
    """The file is a GGUF file this converter does not handle; the message names what and why."""


def _supported_types(mode: str) -> str:
    from gguf import GGMLQuantizationType

    return ", ".join(GGMLQuantizationType(t).name for t in sorted(dequantizable()))


def check_supported(info: GGUFInfo, path: Path, mode: str = "float32") -> None:
    """Refuse, naming what was found, anything :func:`convert` cannot turn into a working model."""
    arch = info.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedGGUF(f"{path.name} is a {arch!r} model; kvd converts GGUF files of "
                              f"architecture {', '.join(SUPPORTED_ARCHITECTURES)} only")
    table = ARCHITECTURES[arch]
    for t in info.tensors:
        if t.type not in dequantizable():  # both modes: gguf-py reads what MLX's reader does not
            raise UnsupportedGGUF(f"{path.name}: tensor {t.name} is encoded as {t.type_name}; kvd "
                                  f"converts GGUF tensors in {_supported_types(mode)} only")
        if t.name.startswith("rope_factors"):
            raise UnsupportedGGUF(f"{path.name} uses long-context rope scaling ({t.name}, Phi 3's 128k "
                                  "variants); kvd converts files without it")
        if table.mlx_name(t.name) is None and not (t.name == ROPE_FREQS and arch == "llama"):
            raise UnsupportedGGUF(f"{path.name}: tensor {t.name} has no place in mlx-lm's {table.model_type} "
                                  "model (a variant of the architecture kvd does not convert)")
    end = max((t.offset + (t.nbytes or 0) for t in info.tensors), default=0) + info.data_offset
    if info.file_size < end:
        raise UnsupportedGGUF(f"{path} is truncated: {info.file_size} bytes where its tensors need "
                              f"{end}; download it again")
    # The model's shape from the header, before anything is built from it (a hostile block_count
    # must not build 100,000 layers; a head count of 0 or "3" must not reach a division).
    meta = info.metadata
    blocks = _int(meta, f"{arch}.block_count", high=4096)
    layers = {int(t.name.split(".")[1]) for t in info.tensors if t.name.startswith("blk.")}
    if layers != set(range(blocks)):
        raise UnsupportedGGUF(f"{path.name} says {arch}.block_count = {blocks} but holds tensors for "
                              f"{len(layers)} layer(s)")
    heads = _int(meta, f"{arch}.attention.head_count", high=4096)
    kv_heads = _int(meta, f"{arch}.attention.head_count_kv", heads, high=heads)
    hidden = _int(meta, f"{arch}.embedding_length")
    if hidden % heads or heads % kv_heads:
        raise UnsupportedGGUF(f"{path.name}: {hidden} dimensions, {heads} heads and {kv_heads} key/value "
                              "heads do not divide evenly")
    _float(meta, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    scaling = info.metadata.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise UnsupportedGGUF(f"{path.name} uses rope scaling {scaling!r}; kvd converts GGUF files "
                              "without it (Llama 3.x's, stored as rope_freqs, is converted)")
    model = info.metadata.get("tokenizer.ggml.model")
    if model not in TOKENIZERS:
        raise UnsupportedGGUF(f"{path.name} has a {model!r} tokenizer; kvd converts GGUF files with a "
                              "byte-level BPE ('gpt2') or SentencePiece ('llama') tokenizer only")


ROPE_FREQS = "rope_freqs.weight"  # Llama 3.x's rope scaling, as llama.cpp stores it


def _int(meta: dict[str, Any], key: str, default: int | None = None, *, low: int = 1, high: int = 1 << 24) -> int:
    """A whole number of the metadata in [low, high] (counts, sizes, ids), or UnsupportedGGUF naming it."""
    value = meta.get(key, default)
    if value is None:
        raise UnsupportedGGUF(f"the GGUF file has no {key}")
    value = value.item() if hasattr(value, "item") else value
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise UnsupportedGGUF(f"{key} is {str(value)[:40]!r}; it must be a whole number from {low} to {high}")
    return value


def _float(meta: dict[str, Any], key: str, default: float) -> float:
    value = meta.get(key, default)
    value = value.item() if hasattr(value, "item") else value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < float(value) < float("inf"):
        raise UnsupportedGGUF(f"{key} is {str(value)[:40]!r}; it must be a positive number")
    return float(value)


def model_config(meta: dict[str, Any], tied: bool, rope_freqs: Any = None) -> dict[str, Any]:
    """mlx-lm's config for the file's architecture, from the GGUF metadata (and its rope_freqs)."""
    a = str(meta["general.architecture"])
    table = ARCHITECTURES[a]
    heads = _int(meta, f"{a}.attention.head_count", high=4096)
    hidden = _int(meta, f"{a}.embedding_length")
    if hidden % heads:
        raise UnsupportedGGUF(f"{a}.embedding_length {hidden} does not divide into {heads} heads")
    kv_heads = _int(meta, f"{a}.attention.head_count_kv", heads, high=heads)
    if heads % kv_heads:
        raise UnsupportedGGUF(f"{heads} attention heads do not divide into {kv_heads} key/value heads")
    head_dim = _int(meta, f"{a}.attention.key_length", hidden // heads)
    rope_dims = _int(meta, f"{a}.rope.dimension_count", head_dim)
    if rope_dims != head_dim and a != "phi3":  # Phi 3's partial rotary is a config key of mlx-lm's
        raise UnsupportedGGUF(f"rope over {rope_dims} of {head_dim} head dimensions is not supported")
    config: dict[str, Any] = {
        "model_type": table.model_type,
        "architectures": [table.hf_class],
        "hidden_size": hidden,
        "num_hidden_layers": _int(meta, f"{a}.block_count"),
        "intermediate_size": _int(meta, f"{a}.feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": _float(meta, f"{a}.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": _float(meta, f"{a}.rope.freq_base", 10000.0),
        "rope_traditional": False,
        "max_position_embeddings": _int(meta, f"{a}.context_length"),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": tied,
        "eos_token_id": _int(meta, "tokenizer.ggml.eos_token_id", low=0),
    }
    if "tokenizer.ggml.bos_token_id" in meta:
        config["bos_token_id"] = _int(meta, "tokenizer.ggml.bos_token_id", low=0)
    config.update(table.config(meta, a))
    # A turn ends at the end-of-turn token too (Gemma's <end_of_turn>, ChatML's <|im_end|>), not only at
    # the end of text: llama.cpp keeps it as eot_token_id, or the family's template names it.
    ends = [config["eos_token_id"]]
    tokens = meta["tokenizer.ggml.tokens"]
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if key in meta:
            ends.append(_int(meta, key, low=0, high=len(tokens) - 1))
    ends += [i for i, t in enumerate(tokens) if t == table.end_of_turn] if table.end_of_turn else []
    if len(set(ends)) > 1:
        config["eos_token_id"] = sorted(set(ends), key=ends.index)
    if rope_freqs is not None:
        config["rope_scaling"] = _llama3_rope(rope_freqs, head_dim, config["rope_theta"])
    return config


def _llama3_rope(factors: Any, dims: int, base: float) -> dict[str, Any]:
    """mlx-lm's rope_scaling for Llama 3.x, rebuilt from the rope_freqs llama.cpp stored, and checked."""
    import numpy as np

    got = np.asarray(factors, dtype=np.float64).reshape(-1)
    scaling = {**LLAMA3_ROPE, "factor": float(got.max())}
    if got.shape != (dims // 2,) or not np.allclose(llama3_factors(dims, base, scaling), got, rtol=1e-5):
        raise UnsupportedGGUF("its rope_freqs are not Llama 3's rope scaling with Meta's parameters "
                              "(factor, low 1, high 4, original context 8192); kvd cannot rebuild them")
    return scaling


def unpermute(x: Any, heads: int) -> Any:
    """Undo llama.cpp's rope permutation of the rows of attn_q / attn_k (any trailing shape)."""
    rows, cols = x.shape
    return x.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def read_weights(path: Path, mode: str, on_tensor: Callable[[], None] | None = None
                 ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(weights named for mlx-lm, their quantization entries, the GGUF metadata).

    In "float32" mode every weight is a float32 array: quantized ones are
    dequantized with float32 scales and biases, so each value is the exact
    `scale * q + bias` of the file's float16 scale and bias. In "quantized"
    mode quantized weights stay triples and the second dict gives each
    module's bits. A Llama 3.x file's rope_freqs come back in the metadata,
    under ROPE_FREQS.
    """
    import mlx.core as mx

    if mode == "float32":
        return _read_dequantized(path, on_tensor)
    from .ggufinfo import read_info

    if any(t.type not in MLX_TYPES for t in read_info(path).tensors):
        return _read_dequantized(path, on_tensor, requantize=True)
    loaded: Any = mx.load(str(path), return_metadata=True)
    raw: dict[str, Any] = loaded[0]
    meta: dict[str, Any] = loaded[1]
    table = ARCHITECTURES[str(meta["general.architecture"])]
    weights: dict[str, Any] = {}
    quant: dict[str, Any] = {}
    for key in sorted(raw):
        base, _, part = key.rpartition(".")
        if key == ROPE_FREQS:
            meta[ROPE_FREQS] = raw[key]
            continue
        if part not in ("weight", "bias"):
            continue  # a quantized weight's scales and biases travel with it
        name = table.mlx_name(key)
        assert name is not None  # check_supported refused the file otherwise
        module = name.rpartition(".")[0]
        rows_heads = _permuted_heads(table, meta, base)
        triple = [raw[key], raw.get(f"{base}.scales"), raw.get(f"{base}.biases")] if part == "weight" else [raw[key]]
        if rows_heads:
            triple = [unpermute(t, rows_heads) if t is not None else None for t in triple]
        w, scales, biases = (triple + [None, None])[:3]
        if scales is None:
            weights[name] = _unshift(table, key, w.astype(mx.float32) if mode == "float32" else w)
        else:
            bits = 32 * w.shape[-1] // (scales.shape[-1] * GROUP_SIZE)
            if mode == "float32":
                weights[name] = mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32),
                                              group_size=GROUP_SIZE, bits=bits)
            else:
                weights[name] = w
                weights[f"{module}.scales"] = scales
                weights[f"{module}.biases"] = biases
                quant[module] = {"group_size": GROUP_SIZE, "bits": bits}
        mx.eval(*(v for k, v in weights.items() if k.startswith(module)))
        if on_tensor is not None:
            on_tensor()
    return weights, quant, meta


def metadata(reader: Any) -> dict[str, Any]:
    """gguf-py's fields as plain values: strings, numbers, lists of either."""
    from gguf import GGUFValueType

    meta: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue  # the header's own counts
        value = field.contents()
        if field.types and field.types[0] == GGUFValueType.ARRAY and not isinstance(value, list):
            value = list(value)
        meta[name] = value
    return meta


def _read_dequantized(path: Path, on_tensor: Callable[[], None] | None, *, requantize: bool = False
                      ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Every tensor through gguf-py: dequantized to float32 by the library, un-permuted, renamed.

    `requantize` ("quantized" mode, a file MLX's reader cannot load): each quantized 2-D tensor
    is quantized again by MLX (REQUANT_BITS, float16 scales and biases as MLX's reader gives),
    each float one kept in its own dtype.
    """
    import mlx.core as mx
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    meta = metadata(reader)
    table = ARCHITECTURES[str(meta["general.architecture"])]
    weights: dict[str, Any] = {}
    quant: dict[str, Any] = {}
    for t in reader.tensors:
        w = mx.array(np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32))
        if t.name == ROPE_FREQS:
            meta[ROPE_FREQS] = w
            continue
        name = table.mlx_name(t.name)
        assert name is not None  # check_supported refused the file otherwise
        rows_heads = _permuted_heads(table, meta, t.name.rpartition(".")[0])
        if requantize and t.tensor_type == GGMLQuantizationType.Q4_K and len(t.shape) == 2:
            # Q4_K's sub-blocks are affine groups of 32 already: taken over exactly, not requantized.
            module = name.rpartition(".")[0]
            triple = [mx.array(a) for a in q4_k_triples(np.asarray(t.data))]
            if rows_heads:
                triple = [unpermute(a, rows_heads) for a in triple]
            weights[name], weights[f"{module}.scales"], weights[f"{module}.biases"] = triple
            quant[module] = {"group_size": GROUP_SIZE, "bits": 4}
            mx.eval(*triple)
            if on_tensor is not None:
                on_tensor()
            continue
        weights[name] = _unshift(table, t.name, unpermute(w, rows_heads) if rows_heads else w)
        if requantize:
            _requantize(weights, quant, name, int(t.tensor_type))
        mx.eval(*(v for k, v in weights.items() if k.startswith(name.rpartition(".")[0])))
        if on_tensor is not None:
            on_tensor()
    return weights, quant, meta


def q4_k_triples(data: Any) -> tuple[Any, Any, Any]:
    """A Q4_K tensor's raw blocks (rows, blocks x 144 bytes) as MLX's 4-bit affine triples, group 32.

    A 256-value Q4_K block holds float16 `d` and `dmin`, eight 6-bit sub-block scales `sc` and
    mins `m` packed in 12 bytes, and 128 bytes of 4-bit codes `q` (low nibbles: sub-block 2j,
    high: 2j+1); a value is d*sc*q - dmin*m (llama.cpp's dequantize_row_q4_K). Each sub-block is
    an MLX group: the same codes, scale d*sc, bias -dmin*m (rounded to float16, as MLX's own GGUF
    reader gives Q4_0's). Returns (uint32 codes, 8 a word, the first in the low bits; scales; biases).
    """
    import numpy as np

    rows = data.shape[0]
    b = np.ascontiguousarray(data).reshape(-1, 144)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    s = b[:, 4:16]
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)], axis=1)
    mn = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
    qs = b[:, 16:144].reshape(-1, 4, 32)
    q = np.empty((b.shape[0], 8, 32), np.uint32)
    q[:, 0::2] = qs & 0xF
    q[:, 1::2] = qs >> 4
    packed = (q.reshape(-1, 8) << (4 * np.arange(8, dtype=np.uint32))).sum(axis=1, dtype=np.uint32)
    scales = (d * sc).astype(np.float16)
    biases = (-(dmin * mn)).astype(np.float16)
    return packed.reshape(rows, -1), scales.reshape(rows, -1), biases.reshape(rows, -1)


def _requantize(weights: dict[str, Any], quant: dict[str, Any], name: str, ggml_type: int) -> None:
    """`weights[name]` (float32, as gguf-py read it) back in the file's kind of encoding, MLX's way."""
    import mlx.core as mx

    w = weights[name]
    if ggml_type in FLOAT_TYPES:
        weights[name] = w.astype({GGMLType.F16: mx.float16, GGMLType.BF16: mx.bfloat16}.get(ggml_type, mx.float32))
        return
    module, _, part = name.rpartition(".")
    if part != "weight" or w.ndim != 2 or w.shape[-1] % GROUP_SIZE:
        return  # a vector or an odd width: MLX quantizes rows of whole groups only; it stays float32
    bits = REQUANT_BITS
    packed, scales, biases = mx.quantize(w, group_size=GROUP_SIZE, bits=bits)
    weights[name] = packed
    weights[f"{module}.scales"] = scales.astype(mx.float16)
    weights[f"{module}.biases"] = biases.astype(mx.float16)
    quant[module] = {"group_size": GROUP_SIZE, "bits": bits}


def _permuted_heads(table: Arch, meta: dict[str, Any], base: str) -> int:
    """The heads llama.cpp permuted this tensor's rows by (attn_q, attn_k of the llama family), or 0."""
    if not table.permuted_qk:
        return 0
    a = table.name
    heads = _int(meta, f"{a}.attention.head_count")
    if base.endswith("attn_q"):
        return heads
    if base.endswith("attn_k"):
        return _int(meta, f"{a}.attention.head_count_kv", heads)
    return 0


def _unshift(table: Arch, name: str, w: Any) -> Any:
    """Gemma's norms as mlx-lm keeps them: llama.cpp stored 1 + w."""
    return w - table.norm_offset if table.norm_offset and table.is_norm(name) else w


def weights_checksum(path: Path) -> str:
    """xxh3-64 of a converted weights file (10 GB/s: a start can afford to check it)."""
    import xxhash

    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def convert(path: Path, out: Path, *, mode: str, sha256: str,
            on_tensor: Callable[[], None] | None = None) -> None:
    """Write the mlx-lm model dir for the (already checked) GGUF file `path` into `out`.

    `on_tensor` is called once per tensor converted, for a progress bar.
    """
    import mlx.core as mx

    from . import ggufspm
    from .gguftok import tokenizer_files
    from .modeldir import write_synced

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}")
    weights, quant, meta = read_weights(path, mode, on_tensor)
    tied = "lm_head.weight" not in weights
    config = model_config(meta, tied, meta.pop(ROPE_FREQS, None))
    if quant:
        config["quantization"] = {"group_size": GROUP_SIZE, "bits": 4, **quant}
    config["torch_dtype"] = "float32" if mode == "float32" else "float16"
    # mx.save_safetensors appends ".safetensors" and never fsyncs: save, then fsync.
    mx.save_safetensors(str(out / "model"), weights, metadata={"format": "mlx"})
    with open(out / "model.safetensors", "rb+") as f:
        durable.fsync_file(f.fileno())
    # MLX loads a bit-flipped safetensors file without a word: a start checks this first.
    config["kvd_gguf"] = {"sha256": sha256, "mode": mode, "version": CONVERTER_VERSION,
                          "source": path.name, "weights_xxh3": weights_checksum(out / "model.safetensors")}
    table = ARCHITECTURES[str(meta["general.architecture"])]
    template = meta.get("tokenizer.chat_template")
    if not template:  # a base model: its family's turn format, said at every start (modelload.py)
        template = table.template
        config["kvd_gguf"]["chat_template_supplied"] = f"{table.name}'s turn format"
    if meta.get("tokenizer.ggml.model") == "llama":
        family = "GemmaTokenizer" if table.name.startswith("gemma") else "LlamaTokenizer"
        files = ggufspm.tokenizer_files(meta, family, str(template))
    else:
        files = tokenizer_files({**meta, "tokenizer.chat_template": template})
    write_synced(out / "config.json", (json.dumps(config, indent=2) + "\n").encode())
    for fname, data in files.items():
        write_synced(out / fname, data)
