"""Random-weight Llama models of real shapes, made on the device (no hub): the GPU and host-cost benches'.

`write_model(root, shape)` saves one with mlx-lm's own llama module and builtin:tiny's
tokenizer (a pip-installed built-in: no network). Rows of the output head past the
tokenizer's vocabulary, and its end-of-turn row, are zero, so a greedy answer is real
tokens and runs to its max_tokens. The dtype is the device's (daemon/device.py's
policy): bfloat16 on a GPU, float32 on the CPU (where kvd computes in float32 too,
and half precision is ~20x slower), so in-process mlx-lm runs what kvd runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx

LLAMA = {"model_type": "llama", "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
         "architectures": ["LlamaForCausalLM"]}
SHAPES: dict[str, dict[str, Any]] = {
    "1b": {"hidden_size": 2048, "num_hidden_layers": 16, "intermediate_size": 8192, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "tie_word_embeddings": True},
    "8b": {"hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "tie_word_embeddings": False},
    # The same code on shapes a 2-core CPU runs in a minute ("small": a few minutes)
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 4096, "tie_word_embeddings": True},
    "small": {"hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 512, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 4096, "tie_word_embeddings": False},
    # bench/hostcost.py's: one layer, 64 wide, so a forward is nearly free and the host's path is what is left
    "micro": {"hidden_size": 64, "num_hidden_layers": 1, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 4096, "tie_word_embeddings": True},
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def device_dtype() -> str:
    """The weights' dtype kvd runs on this device: the checkpoint's (bf16) on a GPU, float32 on the CPU."""
    from daemon.device import current

    return current().weights_dtype or "bfloat16"


def write_model(root: Path, shape: str, dtype: str | None = None) -> Path:
    """A random-weight Llama of `shape` in `dtype` (default: the device's), with builtin:tiny's tokenizer."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    from daemon.models.builtin import ensure_builtin

    dtype = dtype or device_dtype()
    dest = root / f"llama-{shape}-{dtype}"
    if (dest / "model.safetensors").exists():
        return dest
    tiny = ensure_builtin("builtin:tiny", root / "builtin")
    tiny_config = json.loads((tiny / "config.json").read_text())
    vocab, eos = int(tiny_config["vocab_size"]), int(tiny_config["eos_token_id"])
    config = {**LLAMA, **SHAPES[shape], "torch_dtype": dtype, "eos_token_id": eos,
              "bos_token_id": tiny_config.get("bos_token_id"), "pad_token_id": tiny_config.get("pad_token_id")}
    assert config["vocab_size"] >= vocab
    dest.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        (dest / name).write_bytes((tiny / name).read_bytes())
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    dt = getattr(mx, dtype)
    model.set_dtype(dt)
    weights = dict(tree_flatten(model.parameters()))
    head = "model.embed_tokens.weight" if config["tie_word_embeddings"] else "lm_head.weight"
    rows = mx.arange(config["vocab_size"])[:, None]
    # Only the tokenizer's ids can win a greedy argmax, and never its end of turn: answers run to max_tokens.
    weights[head] = mx.where((rows < vocab) & (rows != eos), weights[head], 0).astype(dt)
    mx.eval(weights)
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    (dest / "config.json").write_text(json.dumps(config))
    del model, weights
    mx.clear_cache()
    return dest
