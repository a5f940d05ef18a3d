"""The built-in models' weights: random, seeded, and tilted towards whole words.

Their output is nonsense by design. To make the nonsense *look* like text, and
never a stream of raw bytes or terminal control characters, the ``lm_head``
rows of whole-word tokens (" the", " water", ...) are large and every other
row is small, so greedy decoding almost always picks a word. float32 from a
fixed seed, so two writes are byte-identical on any machine with the same
numpy.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from .builtintok import EOS_TOKEN, word_tokens

__all__ = ["weights"]

_PROJ_STD = 0.05
_EMBED_STD = 0.05
_HEAD_WORD_STD = 0.2
_HEAD_OTHER_SCALE = 0.05  # bytes, prefixes, bare words, specials
_HEAD_EOS_SCALE = 1.9  # <|im_end|>: some answers end by themselves
# A word's lm_head row minus its own embedding: the token (or context) that
# dominates the residual stream scores itself low, so greedy decoding wanders
# through many words instead of repeating one forever.
_HEAD_ANTI_REPEAT = 3.0


def weights(
    config: dict[str, Any],
    seed: int,
    vocab: dict[str, int],
    special_ids: dict[str, int],
) -> dict[str, np.ndarray]:
    """float32 weights named exactly as mlx-lm's model class expects them."""
    rng = np.random.default_rng(seed)
    d = int(config["hidden_size"])
    n_vocab = int(config["vocab_size"])
    n_heads = int(config["num_attention_heads"])
    n_kv = int(config["num_key_value_heads"])
    head_dim = int(config.get("head_dim", d // n_heads))
    ffn = int(config["intermediate_size"])
    gemma = config["model_type"] == "gemma3_text"
    # Gemma's RMSNorm scales by (1 + weight): zeros there mean "identity".
    norm = np.zeros if gemma else np.ones

    def normal(shape: Iterable[int], std: float) -> np.ndarray:
        return rng.standard_normal(tuple(shape), dtype=np.float32) * np.float32(std)

    w: dict[str, np.ndarray] = {}
    w["model.embed_tokens.weight"] = normal((n_vocab, d), _EMBED_STD)
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = normal((n_heads * head_dim, d), _PROJ_STD)
        w[p + "self_attn.k_proj.weight"] = normal((n_kv * head_dim, d), _PROJ_STD)
        w[p + "self_attn.v_proj.weight"] = normal((n_kv * head_dim, d), _PROJ_STD)
        w[p + "self_attn.o_proj.weight"] = normal((d, n_heads * head_dim), _PROJ_STD)
        if gemma:
            w[p + "self_attn.q_norm.weight"] = norm(head_dim, dtype=np.float32)
            w[p + "self_attn.k_norm.weight"] = norm(head_dim, dtype=np.float32)
            for n in (
                "input_layernorm",
                "post_attention_layernorm",
                "pre_feedforward_layernorm",
                "post_feedforward_layernorm",
            ):
                w[p + n + ".weight"] = norm(d, dtype=np.float32)
        else:
            w[p + "self_attn.q_proj.bias"] = np.zeros(n_heads * head_dim, np.float32)
            w[p + "self_attn.k_proj.bias"] = np.zeros(n_kv * head_dim, np.float32)
            w[p + "self_attn.v_proj.bias"] = np.zeros(n_kv * head_dim, np.float32)
            w[p + "input_layernorm.weight"] = norm(d, dtype=np.float32)
            w[p + "post_attention_layernorm.weight"] = norm(d, dtype=np.float32)
        w[p + "mlp.gate_proj.weight"] = normal((ffn, d), _PROJ_STD)
        w[p + "mlp.up_proj.weight"] = normal((ffn, d), _PROJ_STD)
        w[p + "mlp.down_proj.weight"] = normal((d, ffn), _PROJ_STD)
    w["model.norm.weight"] = norm(d, dtype=np.float32)

    head = normal((n_vocab, d), _HEAD_WORD_STD)
    scale = np.full((n_vocab, 1), _HEAD_OTHER_SCALE, dtype=np.float32)
    words = np.array([vocab[t] for t in word_tokens()])
    scale[words] = 1.0
    scale[special_ids[EOS_TOKEN]] = _HEAD_EOS_SCALE
    head *= scale
    head[words] -= np.float32(_HEAD_ANTI_REPEAT) * w["model.embed_tokens.weight"][words]
    w["lm_head.weight"] = head
    return w
