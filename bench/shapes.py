"""The model shape both benchmarks use: Qwen2.5-0.5B's, as an mlx-lm qwen2 config."""

from __future__ import annotations

from typing import Any

QWEN25_05B: dict[str, Any] = dict(
    model_type="qwen2", hidden_size=896, num_hidden_layers=24, intermediate_size=4864,
    num_attention_heads=14, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=151936,
    rope_theta=1e6, max_position_embeddings=32768, tie_word_embeddings=True,
)
