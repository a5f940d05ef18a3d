"""Small llama GGUF files written with gguf-py (the GGML project's own writer).

The real default model's file holds Q4_1 and Q8_0 tensors only; these files
cover the other encodings kvd converts (F32, F16, Q4_0) and every one of
them at a size that converts in well under a second. Weights are random and
known, and attn_q / attn_k are permuted exactly as llama.cpp's converter
does, so a test can check that kvd undoes it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

HIDDEN = 64
HEADS = 4
KV_HEADS = 2
FFN = 128
LAYERS = 2
HEAD_DIM = HIDDEN // HEADS

# Encodings gguf-py's writer can make from floats; the rest are written as random blocks.
QUANTIZABLE = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)


def byte_symbols() -> list[str]:
    """GPT-2's byte-level alphabet: the symbol standing for each byte 0-255."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table = {b: b for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = 256 + n
            n += 1
    return [chr(table[b]) for b in range(256)]


def vocabulary() -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token types): specials first, then 256 byte symbols and a few merges."""
    merges = ["Ġ t", "h e", "Ġt he", "i n", "a n"]
    tokens = SPECIALS + byte_symbols() + ["Ġt", "he", "Ġthe", "in", "an"]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, merges, types


def llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def original_weights(seed: int = 0, *, hidden: int = HIDDEN, ffn: int = FFN) -> dict[str, np.ndarray]:
    """GGUF-named float32 weights before llama.cpp's permutation, as a Hugging Face model has them."""
    HIDDEN, FFN, HEAD_DIM = hidden, ffn, hidden // HEADS  # noqa: N806 (the module's names, resized)
    rng = np.random.default_rng(seed)
    n_vocab = len(vocabulary()[0])

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    w = {"token_embd.weight": normal(n_vocab, HIDDEN), "output_norm.weight": 1 + normal(HIDDEN),
         "output.weight": normal(n_vocab, HIDDEN)}
    for i in range(LAYERS):
        p = f"blk.{i}."
        w[p + "attn_norm.weight"] = 1 + normal(HIDDEN)
        w[p + "ffn_norm.weight"] = 1 + normal(HIDDEN)
        w[p + "attn_q.weight"] = normal(HEADS * HEAD_DIM, HIDDEN)
        w[p + "attn_k.weight"] = normal(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "attn_v.weight"] = normal(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "attn_output.weight"] = normal(HIDDEN, HEADS * HEAD_DIM)
        w[p + "ffn_gate.weight"] = normal(FFN, HIDDEN)
        w[p + "ffn_up.weight"] = normal(FFN, HIDDEN)
        w[p + "ffn_down.weight"] = normal(HIDDEN, FFN)
    return w


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """Rows of float32 (a multiple of 256 wide) as Q4_K blocks: llama.cpp's layout, a plain rounding.

    Each 256-value block: float16 d and dmin, twelve bytes of 6-bit sub-block scales and mins
    (eight sub-blocks of 32), then 128 bytes of 4-bit codes; value = d * sc * q - dmin * m.
    """
    rows, cols = x.shape
    b = x.reshape(-1, 8, 32).astype(np.float32)  # (blocks, sub-blocks, values)
    lo = np.minimum(b.min(axis=2), 0)  # a sub-block's min, as -m * dmin (m >= 0)
    scale = (b.max(axis=2) - lo) / 15
    d = (scale.max(axis=1) / 63).astype(np.float16)
    dmin = (-lo.min(axis=1) / 63).astype(np.float16)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(np.divide(-lo, dminf, out=np.zeros_like(lo), where=dminf > 0)), 0, 63).astype(np.uint8)
    step = (df * sc)[:, :, None]
    q = np.clip(np.round(np.divide(b + (dminf * mn)[:, :, None], step, out=np.zeros_like(b), where=step > 0)),
                0, 15).astype(np.uint8)
    scales = np.zeros((b.shape[0], 12), np.uint8)
    scales[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0xF) | ((mn[:, 4:8] & 0xF) << 4)
    qs = (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).reshape(-1, 128)
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales, qs], axis=1)
    return blocks.reshape(rows, cols // 256 * 144)


# K-quants this module encodes from floats (gguf-py decodes them but cannot encode them).
ENCODERS = {"Q4_K": quantize_q4_k}


def write_llama(path: Path, encoding: str, *, arch: str = "llama", seed: int = 0, hidden: int = HIDDEN,
                ffn: int = FFN) -> Path:
    """A llama GGUF file whose 2-D weights are all in `encoding` (norms stay F32).

    Encodings gguf-py cannot quantize (the K-quants, the IQ types) get random
    blocks of the right size, except Q4_K, encoded here (quantize_q4_k): the test compares kvd's reading of them with
    gguf-py's own, whatever the values. K-quants need rows of 256: hidden=256.
    """
    qtype = GGMLQuantizationType[encoding]
    rng = np.random.default_rng(seed + 1)
    tokens, merges, types = vocabulary()
    w = GGUFWriter(str(path), arch)
    w.add_name("kvd test llama")
    w.add_context_length(2048)
    w.add_embedding_length(hidden)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(ffn)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(hidden // HEADS)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    for name, value in original_weights(seed, hidden=hidden, ffn=ffn).items():
        if name.endswith("attn_q.weight"):
            value = llama_permute(value, HEADS)
        elif name.endswith("attn_k.weight"):
            value = llama_permute(value, KV_HEADS)
        if value.ndim == 1 or qtype == GGMLQuantizationType.F32:
            w.add_tensor(name, value)
        elif qtype == GGMLQuantizationType.F16:
            w.add_tensor(name, value.astype(np.float16))
        elif encoding in QUANTIZABLE:
            w.add_tensor(name, quantize(value, qtype), raw_dtype=qtype)
        elif encoding in ENCODERS:
            w.add_tensor(name, ENCODERS[encoding](value), raw_dtype=qtype)
        else:
            block, size = GGML_QUANT_SIZES[qtype]
            rows, cols = value.shape
            # Bit 6 cleared in every byte: no float16 field (a scale) can be inf or NaN.
            raw = rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8) & 0xBF
            w.add_tensor(name, raw, raw_shape=(rows, cols // block * size), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
