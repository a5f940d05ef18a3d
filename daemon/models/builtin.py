"""Built-in models that kvd writes itself: ``builtin:tiny`` and ``builtin:tiny-swa``.

kvd must run offline on a fresh machine (no model hub), and its tests need a
real mlx-lm model that is small, fast and reproducible. So kvd writes one: a
random-weight model in mlx-lm's on-disk format (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json,
special_tokens_map.json), generated from a fixed seed so two writes are
byte-identical on any machine with the same numpy.

- ``builtin:tiny`` is Qwen2.5-shaped (``model_type: qwen2``): every layer is a
  plain ``KVCache``.
- ``builtin:tiny-swa`` is Gemma-3-shaped (``model_type: gemma3_text``) and
  alternates sliding-window layers (``RotatingKVCache``, window 64) with
  global ones (``KVCache``), so the rotating-cache paths get exercised.

This module installs them (which files, published atomically, which version
is complete); the tokenizer is in :mod:`daemon.builtintok`, the weights
(nonsense by design, tilted so it looks like words) in
:mod:`daemon.builtinweights`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .builtintok import (
    EOS_TOKEN,
    IM_START,
    MAX_LEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    bpe_vocab_and_merges,
    tokenizer_config,
    tokenizer_json,
)
from .builtinweights import weights
from .modeldir import publish_dir, write_synced

__all__ = [
    "BUILTIN_NAMES",
    "BUILTIN_PREFIX",
    "BUILTIN_VERSION",
    "ensure_builtin",
    "is_builtin",
]

BUILTIN_PREFIX = "builtin:"
BUILTIN_NAMES = ("builtin:tiny", "builtin:tiny-swa")
#: Bump when anything written changes; an existing dir of another version is
#: rewritten, and its caches' fingerprints (which hash config.json) change too.
BUILTIN_VERSION = 2  # 2: the chat template calls tools

_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


@dataclass(frozen=True)
class _Spec:
    """One built-in model: its mlx-lm config (minus vocab) and its seed."""

    short: str
    seed: int
    config: dict[str, Any]


_SPECS: dict[str, _Spec] = {
    "builtin:tiny": _Spec(
        short="tiny",
        seed=20250101,
        config={
            "model_type": "qwen2",
            "architectures": ["Qwen2ForCausalLM"],
            "hidden_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 384,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "max_position_embeddings": MAX_LEN,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
        },
    ),
    "builtin:tiny-swa": _Spec(
        short="tiny-swa",
        seed=20250102,
        config={
            "model_type": "gemma3_text",
            "architectures": ["Gemma3ForCausalLM"],
            "hidden_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "intermediate_size": 384,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "rope_local_base_freq": 10000.0,
            "query_pre_attn_scalar": 32,
            "sliding_window": 64,
            "sliding_window_pattern": 2,
            "max_position_embeddings": MAX_LEN,
            "rope_scaling": None,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
        },
    ),
}


def is_builtin(name: str) -> bool:
    """True for any ``builtin:`` name, known or not (unknown ones then fail
    loudly in :func:`ensure_builtin` rather than being tried as a path)."""
    return name.startswith(BUILTIN_PREFIX)


def ensure_builtin(name: str, models_dir: Path) -> Path:
    """Return ``models_dir/<short name>``, writing the model first if needed.

    Published atomically (daemon/models/modeldir.py), so a crash never leaves a
    half-written model where the loader would find it. A dir that is
    incomplete or of another :data:`BUILTIN_VERSION` is replaced.
    """
    spec = _SPECS.get(name)
    if spec is None:
        known = ", ".join(BUILTIN_NAMES)
        raise ValueError(f"unknown built-in model {name!r}; known: {known}")

    def build(tmp: Path) -> None:
        for fname, data in _build_files(name, spec).items():
            write_synced(tmp / fname, data)

    return publish_dir(Path(models_dir) / spec.short, build, lambda p: _is_complete(p, name))


# --- on-disk state ---------------------------------------------------------


def _is_complete(path: Path, name: str) -> bool:
    """Every file present and config.json names this builtin at this version."""
    if not all((path / f).is_file() for f in _FILES):
        return False
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        ident = config["kvd_builtin"]
        return bool(ident["name"] == name and ident["version"] == BUILTIN_VERSION)
    except (OSError, ValueError, KeyError, TypeError):
        return False


# --- building the files ----------------------------------------------------


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def _build_files(name: str, spec: _Spec) -> dict[str, bytes]:
    vocab, merges = bpe_vocab_and_merges()
    tokenizer_json_text = tokenizer_json(vocab, merges)
    n_vocab = len(vocab) + len(SPECIAL_TOKENS)
    special_ids = {tok: len(vocab) + i for i, tok in enumerate(SPECIAL_TOKENS)}

    config = dict(spec.config)
    config["vocab_size"] = n_vocab
    config["eos_token_id"] = special_ids[EOS_TOKEN]
    config["pad_token_id"] = special_ids[PAD_TOKEN]
    config["kvd_builtin"] = {"name": name, "version": BUILTIN_VERSION, "seed": spec.seed}

    arrays = weights(config, spec.seed, vocab, special_ids)
    from safetensors.numpy import save as save_safetensors

    # One metadata key only: safetensors keeps metadata in a hash map, so two
    # keys would be serialized in a random order and break byte-identity.
    safetensors_bytes = save_safetensors(arrays, metadata={"format": "mlx"})
    return {
        "config.json": _json_bytes(config),
        "model.safetensors": safetensors_bytes,
        "tokenizer.json": tokenizer_json_text.encode("utf-8"),
        "tokenizer_config.json": _json_bytes(tokenizer_config(special_ids)),
        "special_tokens_map.json": _json_bytes(
            {
                "eos_token": EOS_TOKEN,
                "pad_token": PAD_TOKEN,
                "additional_special_tokens": [IM_START, EOS_TOKEN],
            }
        ),
    }
