"""Each GGUF architecture kvd converts, against mlx-lm: a small random model written the way
llama.cpp's converter writes it (gguf-py's writer, the converter's renames, permutations and
norm shifts done here, independently of kvd's table), converted by kvd, gives the logits mlx-lm
gives for the same weights loaded from its own safetensors layout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGUFWriter

from daemon.models.ggufarch import llama3_factors
from daemon.models.sources import prepare_model
from ggufmake import CHAT_TEMPLATE, llama_permute, vocabulary

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 64, 4, 2, 16, 96
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}

# mlx-lm's config per case, and the GGUF architecture llama.cpp writes it as.
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {"model_type": "llama", "num_hidden_layers": 2, "rope_theta": 10000.0}),
    "llama 3.x rope": ("llama", {"model_type": "llama", "num_hidden_layers": 2, "rope_theta": 500000.0,
                                 "rope_scaling": LLAMA3}),
    "qwen2": ("qwen2", {"model_type": "qwen2", "num_hidden_layers": 2, "rope_theta": 1000000.0}),
    "qwen3": ("qwen3", {"model_type": "qwen3", "num_hidden_layers": 2, "rope_theta": 1000000.0}),
    "phi3": ("phi3", {"model_type": "phi3", "num_hidden_layers": 2, "rope_theta": 10000.0}),
    "gemma2": ("gemma2", {"model_type": "gemma2", "num_hidden_layers": 2, "rope_theta": 10000.0,
                          "query_pre_attn_scalar": HEAD_DIM, "attn_logit_softcapping": 50.0,
                          "final_logit_softcapping": 30.0}),
    "gemma3": ("gemma3", {"model_type": "gemma3_text", "num_hidden_layers": 6, "rope_theta": 1000000.0,
                          "sliding_window": 8, "sliding_window_pattern": 6, "query_pre_attn_scalar": HEAD_DIM,
                          "rope_local_base_freq": 10000.0}),
}

# HF/mlx-lm names -> llama.cpp's (the converter's tensor map, for these architectures).
LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm"}
LAYER_LLAMA = {**LAYER, "post_attention_layernorm": "ffn_norm", "self_attn.qkv_proj": "attn_qkv",
               "mlp.gate_up_proj": "ffn_up"}
LAYER_GEMMA = {**LAYER, "post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def reference(case: str, tmp: Path) -> tuple[Any, dict[str, np.ndarray], dict[str, Any]]:
    """A random mlx-lm model of the case's architecture: (model, its weights by mlx-lm name, config)."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    _, extra = CASES[case]
    config = {"hidden_size": HIDDEN, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
              "head_dim": HEAD_DIM, "intermediate_size": FFN, "rms_norm_eps": 1e-6,
              "vocab_size": len(vocabulary()[0]), "max_position_embeddings": 2048,
              "tie_word_embeddings": extra["model_type"].startswith("gemma"), **extra}
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    rng = np.random.default_rng(7)
    weights: dict[str, np.ndarray] = {}
    params: Any = tree_flatten(model.parameters())
    for name, value in params:
        if case.startswith("gemma") and name == "lm_head.weight":
            continue  # tied
        shift = 1.0 if name.endswith("norm.weight") and not case.startswith("gemma") else 0.0
        weights[name] = np.asarray(shift + rng.standard_normal(value.shape) * 0.2, dtype=np.float32)
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()], strict=False)
    if case == "gemma3":
        model.tie_word_embeddings = True  # gemma2 always ties
    return model, weights, config


def write_gguf(case: str, path: Path, weights: dict[str, np.ndarray], config: dict[str, Any]) -> Path:
    """The file llama.cpp's converter would write for these weights."""
    arch, _ = CASES[case]
    tokens, merges, types = vocabulary()
    w = GGUFWriter(str(path), arch)
    w.add_context_length(2048)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(config["rope_theta"])
    if arch == "gemma3":
        w.add_sliding_window(config["sliding_window"])
    if arch == "gemma2":
        w.add_float32("gemma2.attn_logit_softcapping", config["attn_logit_softcapping"])
        w.add_float32("gemma2.final_logit_softcapping", config["final_logit_softcapping"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHAT_TEMPLATE)
    layer = LAYER_GEMMA if arch.startswith("gemma") else LAYER_LLAMA
    for name, value in weights.items():
        if name.startswith("model.layers."):
            i, rest = name[len("model.layers."):].split(".", 1)
            module, suffix = rest.rsplit(".", 1)
            gguf = f"blk.{i}.{layer[module]}.{suffix}"
        else:
            gguf = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                    "lm_head.weight": "output.weight"}[name]
        if arch == "llama" and gguf.endswith("attn_q.weight"):
            value = llama_permute(value, HEADS)
        elif arch == "llama" and gguf.endswith("attn_k.weight"):
            value = llama_permute(value, KV_HEADS)
        if arch.startswith("gemma") and gguf.endswith("norm.weight"):
            value = value + 1.0  # Gemma's norm_shift
        w.add_tensor(gguf, value)
    if "rope_scaling" in config:
        w.add_tensor("rope_freqs.weight", np.array(llama3_factors(HEAD_DIM, config["rope_theta"],
                                                                  config["rope_scaling"]), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("mode", ["float32", "quantized"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_converted_architecture_gives_mlx_lms_logits(case: str, mode: str, tmp_path: Path) -> None:
    """Both modes: float32 (gguf-py's reader, the CPU's) and quantized (MLX's reader, Metal's; these
    float32 tensors stay float32 there, so the renames, permutations and shifts are what is checked)."""
    from mlx_lm.utils import load_model

    model, weights, config = reference(case, tmp_path)
    converted = prepare_model(str(write_gguf(case, tmp_path / f"{case}.gguf", weights, config)),
                              tmp_path / "models", mode=mode)
    theirs = load_model(converted)[0]
    written = json.loads((converted / "config.json").read_text())
    assert written["model_type"] == config["model_type"]
    ids = mx.array([[5, 9, 40, 77, 120, 3, 200, 33, 150, 8, 99, 250, 17, 64, 180, 31, 7, 222, 90, 12]])
    want, got = model(ids), theirs(ids)
    assert np.allclose(np.array(got), np.array(want), atol=1e-4, rtol=1e-4), float(mx.abs(got - want).max())
    if case == "llama 3.x rope":
        # The rope scaling is in the result: without it the logits differ.
        assert written["rope_scaling"]["factor"] == 8.0
        plain, _, _ = reference("llama", tmp_path)
        plain.load_weights([(k, mx.array(v)) for k, v in weights.items()])
        assert not np.allclose(np.array(plain(ids)), np.array(want), atol=1e-4)
