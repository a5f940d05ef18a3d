"""A GGUF file's SentencePiece tokenizer (``tokenizer.ggml.model = "llama"``: Gemma, Llama 2, Mistral).

llama.cpp's converter keeps a SentencePiece model as its pieces: their text,
scores and types (``tokenizer.ggml.tokens``, ``scores``, ``token_type``),
whose numbers are SentencePiece's own (1 normal, 2 unknown, 3 control,
4 user-defined, 5 unused, 6 byte). From those this module writes the
SentencePiece ``ModelProto`` back (the ``sentencepiece`` package ships its
schema) as the folder's tokenizer.model, and lets transformers' own
converter for the family (Gemma's, or Llama's) turn it into the fast
tokenizer.json mlx-lm loads, once, at conversion; a start then reads
tokenizer.json and nothing is converted again.

One detail of llama.cpp's files: user-defined pieces made of whitespace are
stored with real spaces ("  "), where SentencePiece keeps them escaped
("▁▁"); written back escaped, they match again, and the tokenizer agrees
with the sentencepiece library's own encoding (tests/test_ggufspm.py).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["model_proto", "tokenizer_files"]

_BPE = 2
_UNKNOWN, _CONTROL, _USER_DEFINED, _BYTE = 2, 3, 4, 6


class UnsupportedSentencePiece(Exception):
    """The GGUF file's SentencePiece vocabulary is incomplete or malformed; the message names what."""


def _int(meta: dict[str, Any], key: str, default: int) -> int:
    value = meta.get(key, default)
    value = value.item() if hasattr(value, "item") else value
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else default


def _flag(meta: dict[str, Any], key: str, default: bool) -> bool:
    value = meta.get(key, default)
    value = value.item() if hasattr(value, "item") else value
    return bool(value)


def model_proto(meta: dict[str, Any]) -> bytes:
    """The SentencePiece model the GGUF metadata describes, serialized."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise UnsupportedSentencePiece("tokenizer.ggml.tokens must be a non-empty list of strings")
    n = len(tokens)
    scores = [float(s) for s in meta.get("tokenizer.ggml.scores", [0.0] * n)]
    types = [int(t) for t in meta.get("tokenizer.ggml.token_type", [1] * n)]
    if len(scores) != n or len(types) != n or not all(1 <= t <= 6 for t in types):
        raise UnsupportedSentencePiece(f"the tokenizer's scores and types do not match its {n} tokens")
    m = pb.ModelProto()  # type: ignore[attr-defined]
    spec = m.trainer_spec
    spec.model_type = _BPE
    spec.vocab_size = n
    spec.byte_fallback = _BYTE in types
    spec.allow_whitespace_only_pieces = True
    spec.unk_id = _int(meta, "tokenizer.ggml.unknown_token_id", types.index(_UNKNOWN) if _UNKNOWN in types else 0)
    spec.bos_id = _int(meta, "tokenizer.ggml.bos_token_id", -1)
    spec.eos_id = _int(meta, "tokenizer.ggml.eos_token_id", -1)
    spec.pad_id = _int(meta, "tokenizer.ggml.padding_token_id", -1)
    norm = m.normalizer_spec
    norm.name = "identity"
    norm.add_dummy_prefix = _flag(meta, "tokenizer.ggml.add_space_prefix", True)
    norm.remove_extra_whitespaces = False
    norm.escape_whitespaces = True
    for text, score, kind in zip(tokens, scores, types):
        piece = m.pieces.add()
        piece.piece = text.replace(" ", "▁") if kind == _USER_DEFINED else text
        piece.score = score
        piece.type = kind
    data: bytes = m.SerializeToString()
    return data


def tokenizer_files(meta: dict[str, Any], family: str, template: str | None) -> dict[str, bytes]:
    """tokenizer.model, tokenizer.json and tokenizer_config.json for mlx-lm's loader.

    `family` is transformers' tokenizer class for the architecture
    ("GemmaTokenizer", "LlamaTokenizer"); `template` the chat template.
    """
    from transformers import AutoTokenizer

    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])

    def token(key: str) -> str | None:
        i = _int(meta, key, -1)
        return tokens[i] if 0 <= i < len(tokens) else None

    config: dict[str, Any] = {
        "tokenizer_class": family,
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "add_bos_token": _flag(meta, "tokenizer.ggml.add_bos_token", True),
        "add_eos_token": _flag(meta, "tokenizer.ggml.add_eos_token", False),
        "clean_up_tokenization_spaces": False,
        "legacy": False,
    }
    with tempfile.TemporaryDirectory(prefix="kvd-spm-") as tmp:
        src, out = Path(tmp) / "src", Path(tmp) / "out"
        src.mkdir()
        (src / "tokenizer.model").write_bytes(model_proto(meta))
        (src / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
        converted: Any = AutoTokenizer.from_pretrained(str(src))
        if template:
            converted.chat_template = template
        converted.save_pretrained(str(out))
        files = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
        files["tokenizer.model"] = (src / "tokenizer.model").read_bytes()
    return files
