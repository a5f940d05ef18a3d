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

Their output is nonsense by design. To make the nonsense *look* like text, and
never a stream of raw bytes or terminal control characters, the ``lm_head``
rows of whole-word tokens (" the", " water", ...) are large and every other
row is small, so greedy decoding almost always picks a word.

The tokenizer is a byte-level BPE that encodes any text exactly (all 256 byte
symbols are in the vocabulary) plus ~300 English words built by hand-written
merge chains: no training, so nothing depends on a trainer's tie-breaking.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

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
BUILTIN_VERSION = 1

_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
_SPECIAL_TOKENS = (PAD_TOKEN, IM_START, EOS_TOKEN)
_MAX_LEN = 8192

# ChatML, as Qwen2.5 uses it, minus Qwen's default system prompt and tools.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{{- message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

# The 300 most common English words; each becomes a token with and without a
# leading space.
_WORDS = """
the of and to in is it you that he was for on are with as his they be at one
have this from or had by not word but what some we can out other were all
there when up use your how said an each she which do their time if will way
about many then them write would like so these her long make thing see him
two has look more day could go come did number sound no most people my over
know water than call first who may down side been now find any new work part
take get place made live where after back little only round man year came
show every good me give our under name very through just form sentence great
think say help low line differ turn cause much mean before move right boy
old too same tell does set three want air well also play small end put home
read hand port large spell add even land here must big high such follow act
why ask men change went light kind off need house picture try us again
animal point mother world near build self earth father head stand own page
should country found answer school grow study still learn plant cover food
sun four between state keep eye never last let thought city tree cross farm
hard start might story saw far sea draw left late run while press close
night real life few north open seem together next white children begin got
walk example ease paper group always music those both mark often letter
until mile river car feet care second book carry took science eat room
friend began idea fish mountain stop once base hear horse cut sure watch
color face wood main enough plain girl
""".split()


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
            "max_position_embeddings": _MAX_LEN,
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
            "max_position_embeddings": _MAX_LEN,
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

    Published atomically (daemon/modeldir.py), so a crash never leaves a
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
    vocab, merges = _bpe_vocab_and_merges()
    tokenizer_json = _tokenizer_json(vocab, merges)
    n_vocab = len(vocab) + len(_SPECIAL_TOKENS)
    special_ids = {tok: len(vocab) + i for i, tok in enumerate(_SPECIAL_TOKENS)}

    config = dict(spec.config)
    config["vocab_size"] = n_vocab
    config["eos_token_id"] = special_ids[EOS_TOKEN]
    config["pad_token_id"] = special_ids[PAD_TOKEN]
    config["kvd_builtin"] = {"name": name, "version": BUILTIN_VERSION, "seed": spec.seed}

    weights = _weights(config, spec.seed, vocab, special_ids)
    from safetensors.numpy import save as save_safetensors

    # One metadata key only: safetensors keeps metadata in a hash map, so two
    # keys would be serialized in a random order and break byte-identity.
    safetensors_bytes = save_safetensors(weights, metadata={"format": "mlx"})
    return {
        "config.json": _json_bytes(config),
        "model.safetensors": safetensors_bytes,
        "tokenizer.json": tokenizer_json.encode("utf-8"),
        "tokenizer_config.json": _json_bytes(_tokenizer_config(special_ids)),
        "special_tokens_map.json": _json_bytes(
            {
                "eos_token": EOS_TOKEN,
                "pad_token": PAD_TOKEN,
                "additional_special_tokens": [IM_START, EOS_TOKEN],
            }
        ),
    }


# --- tokenizer -------------------------------------------------------------


def _bytes_to_unicode() -> list[str]:
    """GPT-2's printable stand-in for each byte value, indexed by byte."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table: dict[int, int] = {b: b for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = 256 + n
            n += 1
    return [chr(table[b]) for b in range(256)]


def _bpe_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Bytes first (ids 0-255, in byte order), then each merge's product.

    Each word gets the left-to-right chain ``(t,h) -> th, (th,e) -> the``, so
    every prefix is a token too; merges shared between words are kept once.
    All space-led chains rank before all bare ones: in a pre-token such as
    "Ġhand" the only symbol that can start with "Ġ" is the growing prefix, so
    its chain always wins and every listed word after a space encodes as one
    token. (Bare words can lose to each other, "hand" -> "h" "and"; that only
    costs a token, never exactness.)
    """
    symbols = _bytes_to_unicode()
    vocab: dict[str, int] = {s: i for i, s in enumerate(symbols)}
    merges: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()
    space = symbols[ord(" ")]  # "Ġ"
    forms = [space + w for w in _WORDS] + list(_WORDS)
    for form in forms:
        left = form[0]
        for ch in form[1:]:
            pair = (left, ch)
            left = left + ch
            if pair not in seen:
                seen.add(pair)
                merges.append(pair)
            if left not in vocab:
                vocab[left] = len(vocab)
    return vocab, merges


def _word_tokens() -> list[str]:
    """The tokens greedy decoding should pick: space-led whole words."""
    space = _bytes_to_unicode()[ord(" ")]
    return [space + w for w in _WORDS]


# Qwen2's pre-tokenizer split (GPT-4-like: words keep their leading space,
# digits are single).
_QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _tokenizer_json(vocab: dict[str, int], merges: list[tuple[str, str]]) -> str:
    """Exactly Qwen2's pipeline around our vocab and merges.

    transformers 5 ignores tokenizer.json's pipeline for ``model_type:
    qwen2`` and rebuilds Qwen2Tokenizer's own (NFC, this split, ByteLevel)
    from the vocab and merges alone, while for ``gemma3_text`` it reads the
    file verbatim. Writing Qwen2's pipeline into the file makes both models,
    and the raw ``tokenizers`` library, tokenize identically. The price is
    NFC: decomposed input ("e" + U+0301) comes back composed, as with the
    real Qwen2.5.
    """
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
    )

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in _SPECIAL_TOKENS]
    )
    return tok.to_str(pretty=True)


def _tokenizer_config(special_ids: dict[str, int]) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "additional_special_tokens": [IM_START, EOS_TOKEN],
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for t, i in special_ids.items()
        },
        "model_max_length": _MAX_LEN,
        # Exact round trips: no " ." -> "." clean-up on decode.
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
        "chat_template": CHAT_TEMPLATE,
    }


# --- weights ---------------------------------------------------------------

_PROJ_STD = 0.05
_EMBED_STD = 0.05
_HEAD_WORD_STD = 0.2
_HEAD_OTHER_SCALE = 0.05  # bytes, prefixes, bare words, specials
_HEAD_EOS_SCALE = 1.9  # <|im_end|>: some answers end by themselves
# A word's lm_head row minus its own embedding: the token (or context) that
# dominates the residual stream scores itself low, so greedy decoding wanders
# through many words instead of repeating one forever.
_HEAD_ANTI_REPEAT = 3.0


def _weights(
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
    words = np.array([vocab[t] for t in _word_tokens()])
    scale[words] = 1.0
    scale[special_ids[EOS_TOKEN]] = _HEAD_EOS_SCALE
    head *= scale
    head[words] -= np.float32(_HEAD_ANTI_REPEAT) * w["model.embed_tokens.weight"][words]
    w["lm_head.weight"] = head
    return w
