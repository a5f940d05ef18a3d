"""Random-weight tiny models of real mlx-lm hybrid architectures, built from mlx-lm's own classes.

Each is a model directory in mlx-lm's format, made with no download: the
architecture's own `Model(ModelArgs.from_dict(config))` with mlx's random
initialization under a fixed seed, its parameters saved with
`mx.save_safetensors`, a config.json, and the built-in models' tokenizer
(daemon/models/builtintok.py, ChatML), so `kvd serve --model DIR` loads it
as it loads any model directory. The configs are the smallest that keep each
architecture's mix of layers: recurrent or linear-attention layers (mlx-lm's
`ArraysCache`, inside a `CacheList` for Falcon-H1) beside full attention,
and, for gpt-oss, sliding-window layers with attention sinks
(`RotatingKVCache`) beside full ones.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

from daemon.models.builtintok import (
    EOS_TOKEN,
    IM_START,
    MAX_LEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    bpe_vocab_and_merges,
    tokenizer_config,
    tokenizer_json,
)

__all__ = ["ARCHS", "HYBRID", "build"]

_D = 64  # hidden size of every tiny model
_COMMON: dict[str, Any] = {"hidden_size": _D, "max_position_embeddings": MAX_LEN, "tie_word_embeddings": False}

#: model_type -> the config of its tiny model (vocab_size and the token ids are added by `build`).
ARCHS: dict[str, dict[str, Any]] = {
    # Gated DeltaNet linear attention, one full-attention layer in four.
    "qwen3_5": {**_COMMON, "num_hidden_layers": 4, "intermediate_size": 128, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
                "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
                "full_attention_interval": 4, "rms_norm_eps": 1e-6,
                "rope_parameters": {"type": "default", "mrope_section": [2, 1, 1], "rope_theta": 100000,
                                    "partial_rotary_factor": 0.5}},
    # Short convolutions (LFM2).
    "lfm2": {**_COMMON, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
             "norm_eps": 1e-5, "conv_bias": False, "conv_L_cache": 3, "block_dim": _D, "block_multiple_of": 16,
             "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": False, "block_ff_dim": 128,
             "layer_types": ["conv", "full_attention", "conv", "full_attention"]},
    # Mamba-2 layers, attention and MLP layers (Nemotron-H).
    "nemotron_h": {**_COMMON, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "head_dim": 16, "attention_bias": False, "mamba_num_heads": 4, "mamba_head_dim": 16,
                   "mamba_proj_bias": False, "ssm_state_size": 16, "conv_kernel": 4, "n_groups": 1,
                   "mlp_bias": False, "layer_norm_epsilon": 1e-5, "use_bias": False, "use_conv_bias": True,
                   "hybrid_override_pattern": ["M", "*", "M", "-"]},
    # Mamba-2 and attention in every layer side by side (Falcon-H1: a CacheList per layer).
    "falcon_h1": {**_COMMON, "num_hidden_layers": 3, "intermediate_size": 128, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 16, "mamba_d_conv": 4, "mamba_d_head": 16,
                  "mamba_d_ssm": 64, "mamba_d_state": 16, "mamba_expand": 1, "mamba_n_groups": 1,
                  "mamba_n_heads": 4, "mamba_chunk_size": 32, "rope_theta": 10000.0},
    # Mamba-2 and attention layers, dense MLPs (Granite 4's granitemoehybrid).
    "granitemoehybrid": {**_COMMON, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
                         "num_key_value_heads": 2, "attention_bias": False, "embedding_multiplier": 1.0,
                         "attention_multiplier": 0.25, "logits_scaling": 1.0, "residual_multiplier": 1.0,
                         "layer_types": ["mamba", "attention", "mamba", "attention"], "rms_norm_eps": 1e-6,
                         "shared_intermediate_size": 128, "mamba_n_heads": 4, "mamba_d_head": 16,
                         "mamba_proj_bias": False, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_n_groups": 1,
                         "mamba_expand": 1, "mamba_conv_bias": True, "position_embedding_type": "rope"},
    # Sliding-window layers with attention sinks beside full attention (gpt-oss), a mixture of experts.
    "gpt_oss": {**_COMMON, "num_hidden_layers": 2, "num_local_experts": 2, "num_experts_per_tok": 1,
                "intermediate_size": 64, "head_dim": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
                "sliding_window": 32, "rope_theta": 150000, "rms_norm_eps": 1e-5,
                "layer_types": ["sliding_attention", "full_attention"]},
}

#: The architectures whose caches hold recurrent state (all of ARCHS but gpt_oss's windows).
HYBRID = tuple(a for a in ARCHS if a != "gpt_oss")

SEED = 20250555


def build(arch: str, path: Path, *, seed: int = SEED, config: dict[str, Any] | None = None) -> Path:
    """Write the tiny `arch` model into `path` (a new directory) and return it; `config`: another shape of it
    (bench/hybrid.py's larger ones; any model_type mlx-lm has)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    vocab, merges = bpe_vocab_and_merges()
    special = {tok: len(vocab) + i for i, tok in enumerate(SPECIAL_TOKENS)}
    config = {"model_type": arch, **(config or ARCHS[arch]), "vocab_size": len(vocab) + len(SPECIAL_TOKENS),
              "eos_token_id": special[EOS_TOKEN], "pad_token_id": special[PAD_TOKEN], "torch_dtype": "float32"}
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    path.mkdir(parents=True)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "tokenizer.json").write_text(tokenizer_json(vocab, merges))
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(special), indent=2))
    (path / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "additional_special_tokens": [IM_START, EOS_TOKEN]}))
    return path
