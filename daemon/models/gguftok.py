"""A GGUF file's tokenizer, rebuilt as the files mlx-lm's loader reads.

A GGUF file carries its vocabulary in metadata: ``tokenizer.ggml.tokens``
(id order), ``merges`` ("a b" strings, by rank), ``token_type`` (3 marks a
control token such as ``<|im_end|>``), the special ids, ``tokenizer.ggml.pre``
(llama.cpp's name for the pre-tokenizer split) and
``tokenizer.chat_template``. From those this module builds a `tokenizers`
byte-level BPE with the control tokens added as special tokens (each one id,
never split), writes tokenizer.json, tokenizer_config.json (the chat
template kept) and special_tokens_map.json, and leaves loading to mlx-lm.

The pre-tokenizer is not in the file, only its name: each supported name
maps to the pipeline the model's original tokenizer.json uses.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["SUPPORTED_PRE", "build_tokenizer", "tokenizer_files"]

_CONTROL = 3
_USER_DEFINED = 4

# llama.cpp's split for Llama 3 ("llama-bpe"), as in Meta's tokenizer.json.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: tokenizer.ggml.pre values kvd can rebuild (llama.cpp's names).
SUPPORTED_PRE = ("smollm", "gpt2", "default", "llama-bpe")


class UnsupportedTokenizer(Exception):
    """The GGUF tokenizer is one kvd cannot rebuild; the message names it."""


def _pre_tokenizer(pre: str) -> Any:
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre == "smollm":  # SmolLM/SmolLM2: single digits, then GPT-2's split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("gpt2", "default"):
        return byte_level
    if pre == "llama-bpe":
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ])
    raise UnsupportedTokenizer(f"the GGUF tokenizer's pre-tokenizer is {pre!r}; kvd rebuilds "
                               f"{', '.join(SUPPORTED_PRE)} only")


def _ids(meta: dict[str, Any], key: str) -> int | None:
    value = meta.get(key)
    if value is None:
        return None
    return int(value.item() if hasattr(value, "item") else value)


def _types(meta: dict[str, Any], n: int) -> list[int]:
    value = meta.get("tokenizer.ggml.token_type")
    if value is None:
        return [1] * n
    return [int(t) for t in (value.tolist() if hasattr(value, "tolist") else value)]


def build_tokenizer(meta: dict[str, Any]) -> Any:
    """The `tokenizers.Tokenizer` the GGUF metadata describes."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise UnsupportedTokenizer(f"the GGUF tokenizer is {meta.get('tokenizer.ggml.model')!r}; kvd "
                                   "rebuilds byte-level BPE ('gpt2') tokenizers only")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise UnsupportedTokenizer("tokenizer.ggml.tokens must be a non-empty list of strings")
    vocab = {t: i for i, t in enumerate(tokens)}
    raw_merges = meta.get("tokenizer.ggml.merges") or []
    if not isinstance(raw_merges, list) or not all(isinstance(m, str) and m.count(" ") == 1 for m in raw_merges):
        raise UnsupportedTokenizer("tokenizer.ggml.merges must be a list of 'left right' strings")
    merges = [tuple(m.split(" ", 1)) for m in raw_merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    tok.pre_tokenizer = _pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "default")))
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    types = _types(meta, len(tokens))
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, t in enumerate(types) if t == _CONTROL])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i, t in enumerate(types) if t == _USER_DEFINED])
    return tok


def tokenizer_files(meta: dict[str, Any]) -> dict[str, bytes]:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json for mlx-lm's loader."""
    tok = build_tokenizer(meta)
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types = _types(meta, len(tokens))

    def token(key: str) -> str | None:
        i = _ids(meta, key)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    specials = {"bos_token": token("tokenizer.ggml.bos_token_id"),
                "eos_token": token("tokenizer.ggml.eos_token_id"),
                "pad_token": token("tokenizer.ggml.padding_token_id"),
                "unk_token": token("tokenizer.ggml.unknown_token_id")}
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "add_bos_token": bool(add_bos is not None and (add_bos.item() if hasattr(add_bos, "item") else add_bos)),
        "additional_special_tokens": [tokens[i] for i, t in enumerate(types) if t == _CONTROL],
        "added_tokens_decoder": {
            str(i): {"content": tokens[i], "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": t == _CONTROL}
            for i, t in enumerate(types) if t in (_CONTROL, _USER_DEFINED)
        },
        "model_max_length": _ids(meta, "llama.context_length") or 8192,
        "clean_up_tokenization_spaces": False,
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = str(template)

    def dump(obj: Any) -> bytes:
        return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8")

    return {
        "tokenizer.json": tok.to_str(pretty=True).encode("utf-8"),
        "tokenizer_config.json": dump(config),
        "special_tokens_map.json": dump({k: v for k, v in specials.items() if v is not None}),
    }
