"""GGUF files as a model source, checked against gguf-py (the GGML project's own reader).

On the CPU kvd dequantizes every tensor with gguf-py and converts it itself
(undo llama.cpp's rope permutation, rename); the reference here reads the
same tensors independently, un-permuting row by row. Every converted weight
must equal it, for every encoding gguf-py reads: the small files here cover
each one, and test_realmodel.py runs the same comparison over the real
default model's file. The GPU's mode ("quantized": MLX's own reader, or
Q4_K's codes taken over, weights kept quantized) is checked against the
float32 mode, weight by weight and by greedy answers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGUFReader
from gguf.quants import dequantize

from daemon.models.gguf import read_weights
from daemon.models.ggufinfo import read_info
from daemon.models.gguftok import build_tokenizer
from daemon.models.sources import ModelError, prepare_model
from ggufmake import HEADS, KV_HEADS, llama_permute, original_weights, write_llama

ENCODINGS = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
# Rows of 256 values: the K-quants' and IQ types' block size.
WIDE = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS",
        "IQ3_S", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4"]

# GGUF name -> mlx-lm name, written out by hand (not taken from daemon/models/gguf.py).
LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
         "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
         "ffn_down": "mlp.down_proj"}
TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def mlx_name(gguf_name: str) -> str:
    base = gguf_name[: -len(".weight")]
    if base in TOP:
        return TOP[base] + ".weight"
    _, layer, kind = base.split(".")
    return f"model.layers.{layer}.{LAYER[kind]}.weight"


def unpermuted_by_index(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's permutation by following where each row went (no reshape trick)."""
    went_to = llama_permute(np.arange(w.shape[0]), heads)  # file row i holds original row went_to[i]
    out = np.empty_like(w)
    out[went_to] = w
    return out


def reference(path: Path, heads: int, kv_heads: int) -> dict[str, np.ndarray]:
    """gguf-py's float32 reading of every tensor, un-permuted, named for mlx-lm."""
    out = {}
    for t in GGUFReader(str(path)).tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float32)
        if t.name.endswith("attn_q.weight"):
            w = unpermuted_by_index(w, heads)
        elif t.name.endswith("attn_k.weight"):
            w = unpermuted_by_index(w, kv_heads)
        out[mlx_name(t.name)] = w
    return out


def assert_equal_to_reference(path: Path, heads: int, kv_heads: int) -> int:
    ours, _, _ = read_weights(path, "float32")
    ref = reference(path, heads, kv_heads)
    assert sorted(ours) == sorted(ref)
    for name, want in ref.items():
        got = np.array(ours[name])
        assert got.dtype == np.float32 and got.shape == want.shape, name
        assert np.array_equal(got, want), f"{name}: max diff {np.abs(got - want).max()}"
        assert np.isfinite(got).all(), name
    return len(ref)


@pytest.fixture(scope="module")
def small_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf")
    files = {e: write_llama(root / f"llama-{e}.gguf", e) for e in ENCODINGS}
    files |= {e: write_llama(root / f"llama-{e}.gguf", e, hidden=256, ffn=256) for e in WIDE}
    return files


@pytest.mark.parametrize("encoding", ENCODINGS + WIDE)
def test_every_converted_weight_equals_gguf_py(small_files: dict[str, Path], encoding: str) -> None:
    n = assert_equal_to_reference(small_files[encoding], HEADS, KV_HEADS)
    assert n == 3 + 9 * 2


def test_a_k_quant_file_converts_and_loads_in_mlx_lm(small_files: dict[str, Path], tmp_path: Path) -> None:
    from mlx_lm import load

    converted = prepare_model(str(small_files["Q4_K"]), tmp_path / "models", mode="float32")
    loaded = load(str(converted))
    model, tokenizer = loaded[0], loaded[1]
    logits = model(mx.array([tokenizer.encode("the then")]))
    assert logits.shape[-1] == len(tokenizer.get_vocab()) and bool(mx.isfinite(logits).all())


def test_unpermuted_f32_weights_are_the_original_ones(small_files: dict[str, Path]) -> None:
    """Exactly the Hugging Face weights llama.cpp started from: the rope permutation is undone."""
    ours, _, _ = read_weights(small_files["F32"], "float32")
    for name, want in original_weights().items():
        assert np.array_equal(np.array(ours[mlx_name(name)]), want), name


def test_quantized_mode_keeps_the_files_codes(small_files: dict[str, Path]) -> None:
    """Metal's mode keeps each quantized tensor as MLX triples with its own bits; they
    dequantize to exactly the float32 mode's weights."""
    floats, _, _ = read_weights(small_files["Q4_1"], "float32")
    packed, quant, _ = read_weights(small_files["Q4_1"], "quantized")
    assert quant["model.embed_tokens"] == {"group_size": 32, "bits": 4}
    for module, q in quant.items():
        w = mx.dequantize(packed[f"{module}.weight"], packed[f"{module}.scales"].astype(mx.float32),
                          packed[f"{module}.biases"].astype(mx.float32), **q)
        assert np.array_equal(np.array(w), np.array(floats[f"{module}.weight"])), module
    _, bits8, _ = read_weights(small_files["Q8_0"], "quantized")
    assert {q["bits"] for q in bits8.values()} == {8}


@pytest.mark.parametrize("mode", ["float32", "quantized"])
def test_a_converted_file_loads_in_mlx_lm_and_answers(small_files: dict[str, Path], tmp_path: Path,
                                                      mode: str) -> None:
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load

    path = prepare_model(str(small_files["Q4_0"]), tmp_path, mode=mode)
    assert path.parent == tmp_path / "gguf" and path.name.endswith(f"-{mode}")
    model, tokenizer = load(str(path))[:2]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "the"}], add_generation_prompt=True)
    suffix = [2, *tokenizer.encode("\n"), 1, *tokenizer.encode("assistant\n")]  # <|im_end|>\n<|im_start|>
    assert prompt[:1] == [1] and prompt[-len(suffix):] == suffix
    tokens = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=4)]
    assert len(tokens) == 4
    # The second start finds the converted dir and does not convert again.
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert prepare_model(str(small_files["Q4_0"]), tmp_path, mode=mode) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime


def test_header_reader_agrees_with_gguf_py(small_files: dict[str, Path]) -> None:
    for path in small_files.values():
        info = read_info(path)
        theirs = GGUFReader(str(path))
        assert info.architecture == "llama"
        assert [(t.name, t.type) for t in info.tensors] == [(t.name, int(t.tensor_type)) for t in theirs.tensors]
        assert info.data_offset == theirs.data_offset
        assert [info.data_offset + t.offset for t in info.tensors] == [int(t.data_offset) for t in theirs.tensors]


@pytest.mark.parametrize(("make", "found"), [
    (lambda p: write_llama(p, "F32", arch="gpt2"),
     "is a 'gpt2' model; kvd converts GGUF files of architecture llama, qwen2, qwen3, phi3, gemma2, gemma3 only"),
    (lambda p: p.write_bytes(write_llama(p, "Q8_0").read_bytes()[:-1000]) and p, "is truncated"),
    (lambda p: p.write_bytes(b"PK\x03\x04 not a gguf") and p, "is not a GGUF file"),
])
def test_files_kvd_cannot_convert_are_refused_naming_what_was_found(tmp_path: Path, make: Any, found: str) -> None:
    path = tmp_path / "model.gguf"
    make(path)
    with pytest.raises(ModelError, match=found.replace(".", r"\.").replace("(", r"\(").replace(")", r"\)")):
        prepare_model(str(path), tmp_path / "models")
    assert not (tmp_path / "models" / "gguf").exists() or not any(
        p.name.endswith("-float32") for p in (tmp_path / "models" / "gguf").iterdir())


@pytest.mark.parametrize(("mode", "encoding"), [("float32", "Q8_1"), ("quantized", "Q8_1")])
def test_an_encoding_the_mode_cannot_read_is_refused_naming_it(tmp_path: Path, mode: str, encoding: str) -> None:
    path = write_llama(tmp_path / "model.gguf", encoding)
    with pytest.raises(ModelError, match=f"tensor token_embd.weight is encoded as {encoding}; kvd converts "
                                         "GGUF tensors in F32, F16, "):
        prepare_model(str(path), tmp_path / "models", mode=mode)


def test_small_vocabulary_tokenizer(small_files: dict[str, Path]) -> None:
    _, _, meta = read_weights(small_files["F16"], "float32")
    tok = build_tokenizer(meta)
    ids = tok.encode("<|im_start|>user\nthe then<|im_end|>").ids
    tokens = meta["tokenizer.ggml.tokens"]
    assert [tokens[i] for i in ids] == ["<|im_start|>", "u", "s", "e", "r", "Ċ", "t", "he", "Ġthe", "n", "<|im_end|>"]


def test_a_bit_flipped_conversion_is_noticed_and_converted_again(small_files: dict[str, Path], tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    converted = prepare_model(str(small_files["Q8_0"]), tmp_path / "models", mode="float32")
    weights = converted / "model.safetensors"
    good = weights.read_bytes()
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x10  # inside a tensor: MLX would load it without a word
    weights.write_bytes(bytes(flipped))
    with caplog.at_level("WARNING"):
        again = prepare_model(str(small_files["Q8_0"]), tmp_path / "models", mode="float32")
    assert again == converted and (again / "model.safetensors").read_bytes() == good
    assert any("is damaged (its weights fail their checksum); converting it again" in r.message
               for r in caplog.records)


# --- the GPU's conversion ("quantized" mode, daemon/device.py) against the CPU's float32 one ---

PROMPTS = ["the", "then the", "in an", "hello there, how", "an inn in the", "42 is the answer", "xyz", "the the the"]
GREEDY = 24


def greedy_answers(model: Any, tokenizer: Any) -> list[list[int]]:
    from mlx_lm.generate import generate_step

    return [[int(t) for t, _ in generate_step(mx.array(tokenizer.encode(p)), model, max_tokens=GREEDY)]
            for p in PROMPTS]


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_q4_k_codes_are_taken_over_exactly(small_files: dict[str, Path], tmp_path: Path) -> None:
    """Q4_K's sub-blocks are MLX groups: the triples dequantize to gguf-py's values but for the
    float16 rounding of each scale and bias (as MLX's own reader gives Q4_0's)."""
    path = write_llama(tmp_path / "q4k.gguf", "Q4_K", hidden=256, ffn=256)
    floats, _, _ = read_weights(path, "float32")
    packed, quant, _ = read_weights(path, "quantized")
    assert {q["bits"] for q in quant.values()} == {4} and len(quant) == 2 + 7 * 2  # every 2-D weight
    assert packed["model.layers.0.mlp.up_proj.weight"].dtype == mx.uint32
    for module, q in quant.items():
        w = mx.dequantize(packed[f"{module}.weight"], packed[f"{module}.scales"].astype(mx.float32),
                          packed[f"{module}.biases"].astype(mx.float32), **q)
        want = np.array(floats[f"{module}.weight"])
        assert np.abs(np.array(w) - want).max() <= 2e-3 * np.abs(want).max(), module


@pytest.mark.parametrize("encoding", ["Q4_0", "Q8_0", "Q4_K"])
def test_a_gpu_conversion_answers_as_the_float32_one(tmp_path: Path, encoding: str) -> None:
    """The same file converted in both modes, greedy answers over PROMPTS. Tolerance, as the first
    position where the answers differ (the tiny random model's logits are nearly tied, so a rounding
    can flip a token):
    - run in float32 (as kvd runs any model on the CPU): every prompt agrees on its first 16 of 24
      tokens (measured: all 24 for Q4_0 and Q8_0, whose codes are the file's; Q4_K 17 on one prompt);
    - run as converted, float16 scales and activations (as on a GPU): at least 6 of 8 prompts
      agree on their first 16 tokens (measured 7, 7 and 8).
    """
    from mlx_lm.utils import load

    path = write_llama(tmp_path / f"{encoding}.gguf", encoding, hidden=256, ffn=256)
    reference = load(str(prepare_model(str(path), tmp_path / "models", mode="float32")))
    want = greedy_answers(reference[0], reference[1])
    converted = prepare_model(str(path), tmp_path / "models", mode="quantized")
    bits = {q["bits"] for m, q in json.loads((converted / "config.json").read_text())["quantization"].items()
            if m.startswith("model.")}
    assert bits == {8 if encoding == "Q8_0" else 4}  # kept quantized, at the file's own bits
    model, tokenizer = load(str(converted))[:2]
    as_gpu = [first_divergence(a, b) for a, b in zip(greedy_answers(model, tokenizer), want, strict=True)]
    assert sum(d >= 16 for d in as_gpu) >= 6, as_gpu
    model.set_dtype(mx.float32)
    as_cpu = [first_divergence(a, b) for a, b in zip(greedy_answers(model, tokenizer), want, strict=True)]
    assert min(as_cpu) >= 16, as_cpu
