"""The GGUF architectures kvd converts, in one table: names, tensor renames, config keys.

Each entry says how llama.cpp's converter (convert_hf_to_gguf.py) wrote a
Hugging Face model into a GGUF file, so the conversion back to mlx-lm's
layout undoes exactly that:

- tensor names: GGUF's ``blk.N.<name>`` and top-level names, to mlx-lm's;
- ``permuted_qk``: llama.cpp permutes the rows of attn_q / attn_k for its
  rope layout in the llama family (Llama, Mistral, SmolLM); Qwen and Gemma
  keep Hugging Face's layout;
- ``norm_offset``: Gemma's RMSNorm scales by ``1 + w``, and llama.cpp
  stores ``1 + w`` in the file; mlx-lm wants ``w`` back;
- the config mlx-lm's model class reads, from the file's metadata, with the
  values llama.cpp hard-codes for an architecture (Gemma 3's sliding-window
  pattern of 6, its local rope base of 10,000);
- the chat template to use when the file has none (a base model): the
  model family's own turn format.

Llama 3.x's rope scaling is in the file only as its result, a
``rope_freqs`` tensor of per-dimension factors; the converter rebuilds
mlx-lm's ``rope_scaling`` from it (Meta's published parameters) and checks
that they give those factors, or refuses the file.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

Meta = Mapping[str, Any]

# Layer tensors every supported architecture has (GGUF name after "blk.N." -> mlx-lm's after "model.layers.N.").
_ATTENTION_MLP = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LLAMA_LAYER = {**_ATTENTION_MLP, "ffn_norm": "post_attention_layernorm"}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GEMMA_LAYER = {
    **_ATTENTION_MLP, **_QK_NORM,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Phi 3: q, k and v in one matrix, gate and up in another (llama.cpp's ffn_up holds both).
_PHI3_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA2_LAYER = {k: v for k, v in _GEMMA_LAYER.items() if k not in _QK_NORM}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)
# Gemma's turns: no system role (a system prompt opens the first user turn), "model" for the assistant.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set first = messages[0]['content'] + '\\n\\n' %}{% set messages = messages[1:] %}"
    "{% else %}{% set first = '' %}{% endif %}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + (first if loop.first else '') + message['content'] | trim"
    " + '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
# Phi 3's turns (a system turn of its own).
PHI3_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
# Llama 2 and Mistral's [INST] turns (a system prompt inside the first one, as Llama 2 puts it).
INST_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set first = '<<SYS>>\\n' + messages[0]['content'] + '\\n<</SYS>>\\n\\n' %}{% set messages = messages[1:] %}"
    "{% else %}{% set first = '' %}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + (first if loop.first else '') + message['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + message['content'] + eos_token }}{% endif %}"
    "{% endfor %}"
)


@dataclass(frozen=True)
class Arch:
    name: str  # general.architecture
    model_type: str  # mlx-lm's module
    hf_class: str  # the "architectures" entry of config.json
    layer: Mapping[str, str]  # blk.N.<gguf> -> model.layers.N.<mlx-lm>
    template: str  # the chat template for a file that has none
    end_of_turn: str | None = None  # the token that ends a turn in the family's format
    permuted_qk: bool = False
    norm_offset: float = 0.0
    biases: frozenset[str] = frozenset()  # layer tensors that also have a .bias
    config: Callable[[Meta, str], dict[str, Any]] = field(default=lambda meta, prefix: {})

    def mlx_name(self, name: str) -> str | None:
        """mlx-lm's name for a GGUF tensor, or None if it has no place in this architecture's model."""
        base, _, suffix = name.rpartition(".")
        if base in TOP_NAMES and suffix == "weight":
            return f"{TOP_NAMES[base]}.weight"
        parts = base.split(".")
        if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit() or parts[2] not in self.layer:
            return None
        if suffix == "weight" or (suffix == "bias" and parts[2] in self.biases):
            return f"model.layers.{parts[1]}.{self.layer[parts[2]]}.{suffix}"
        return None

    def is_norm(self, name: str) -> bool:
        return name.endswith("norm.weight")


def _get(meta: Meta, key: str, default: Any = None) -> Any:
    """A metadata value as a plain number (MLX's GGUF reader gives arrays)."""
    value = meta.get(key, default)
    return value.item() if hasattr(value, "item") else value


def _qwen3(meta: Meta, a: str) -> dict[str, Any]:
    return {"head_dim": int(_get(meta, f"{a}.attention.key_length"))}


def _gemma2(meta: Meta, a: str) -> dict[str, Any]:
    heads, hidden = int(_get(meta, f"{a}.attention.head_count")), int(_get(meta, f"{a}.embedding_length"))
    head_dim = int(_get(meta, f"{a}.attention.key_length", hidden // heads))
    # llama.cpp: 1/sqrt(head_dim), except Gemma 2 27B (46 layers): 1/sqrt(hidden/heads).
    big = _get(meta, f"{a}.block_count") == 46
    return {
        "head_dim": head_dim,
        "query_pre_attn_scalar": hidden // heads if big else head_dim,
        "attn_logit_softcapping": float(_get(meta, f"{a}.attn_logit_softcapping", 50.0)),
        "final_logit_softcapping": float(_get(meta, f"{a}.final_logit_softcapping", 30.0)),
    }


def _phi3(meta: Meta, a: str) -> dict[str, Any]:
    heads, hidden = int(_get(meta, f"{a}.attention.head_count")), int(_get(meta, f"{a}.embedding_length"))
    rope_dims = int(_get(meta, f"{a}.rope.dimension_count", hidden // heads))
    return {"partial_rotary_factor": rope_dims / (hidden // heads)}


def _gemma3(meta: Meta, a: str) -> dict[str, Any]:
    heads, hidden = int(_get(meta, f"{a}.attention.head_count")), int(_get(meta, f"{a}.embedding_length"))
    head_dim = int(_get(meta, f"{a}.attention.key_length", hidden // heads))
    # llama.cpp scales queries by 1/sqrt(head_dim), except Gemma 3 27B (62 layers): 1/sqrt(hidden/heads).
    big = _get(meta, f"{a}.block_count") == 62
    return {
        "model_type": "gemma3_text",
        "head_dim": head_dim,
        "query_pre_attn_scalar": hidden // heads if big else head_dim,
        "sliding_window": int(_get(meta, f"{a}.attention.sliding_window", 512)),
        "sliding_window_pattern": 6,  # llama.cpp's, for every Gemma 3
        "rope_local_base_freq": float(_get(meta, f"{a}.rope.freq_base_swa", 10_000.0)),
        "rope_scaling": None,
    }


ARCHITECTURES: dict[str, Arch] = {a.name: a for a in (
    Arch("llama", "llama", "LlamaForCausalLM", _LLAMA_LAYER, INST_TEMPLATE, permuted_qk=True),
    Arch("qwen2", "qwen2", "Qwen2ForCausalLM", _LLAMA_LAYER, CHATML, "<|im_end|>",
         biases=frozenset({"attn_q", "attn_k", "attn_v"})),
    Arch("qwen3", "qwen3", "Qwen3ForCausalLM", {**_LLAMA_LAYER, **_QK_NORM}, CHATML, "<|im_end|>",
         config=_qwen3),
    Arch("phi3", "phi3", "Phi3ForCausalLM", _PHI3_LAYER, PHI3_TEMPLATE, "<|end|>", config=_phi3),
    Arch("gemma2", "gemma2", "Gemma2ForCausalLM", _GEMMA2_LAYER, GEMMA_TEMPLATE, "<end_of_turn>",
         norm_offset=1.0, config=_gemma2),
    Arch("gemma3", "gemma3_text", "Gemma3ForCausalLM", _GEMMA_LAYER, GEMMA_TEMPLATE, "<end_of_turn>",
         norm_offset=1.0, config=_gemma3),
)}

# What llama.cpp writes for a Llama 3.x model's rope scaling (rope_freqs): Meta's parameters.
LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


def llama3_factors(dims: int, base: float, scaling: Mapping[str, Any]) -> list[float]:
    """llama.cpp's rope_freqs for these parameters (convert_hf_to_gguf.py, LlamaModel)."""
    import math

    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old = float(scaling["original_max_position_embeddings"])
    out = []
    for i in range(0, dims, 2):
        wavelen = 2 * math.pi / (1.0 / base ** (i / dims))
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out
