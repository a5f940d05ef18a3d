"""A GGUF file's SentencePiece tokenizer, rebuilt by kvd, against the sentencepiece library itself.

A small model is trained here with sentencepiece's own trainer (BPE, byte fallback, whitespace
pieces, chat tokens), written into GGUF metadata as llama.cpp does (tokens, scores, types;
whitespace-only user-defined pieces with real spaces), rebuilt by kvd (ggufspm.py), and the
tokenizer mlx-lm would load must encode a varied corpus exactly as sentencepiece encodes it with
the trained model, keep the chat tokens single ids, and decode what it encodes back to the text.
"""

from __future__ import annotations

import io
import random
from pathlib import Path
from typing import Any

import pytest
import sentencepiece as spm

from daemon.models import ggufspm

CHAT = ["<start_of_turn>", "<end_of_turn>"]
CORPUS = [
    "Hello world", "  two  spaces\n\ttab", "Café naïve façade 😀 emoji 👩‍👩‍👧 flags 🇫🇷",
    "def f(x):\n    return x**2  # comment", "1234567 89.5", "a\n\n\nb   c", " leading", "trailing  ",
    "\u00a0nbsp and ﬁ ligature", "tabs\t\t\tend", "x    y", "```python\nprint('hi')\n```",
    "Ünïcödé ß ẞ İ", "中文，标点。日本語のテキスト", "\r\n windows line", "", " ", "ünknown ✱ glyphs ⌘ ∮",
]


def trained(add_dummy_prefix: bool) -> Any:
    """A trained SentencePiece ModelProto (the library's own output)."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    rng = random.Random(3)
    words = "the river town kept its records in a stone house by the bridge and clerks copied them".split()
    lines = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(400)]
    lines += ["def f(x):\n    return x + 1", "    indented code\n\tand tabs", "Café 123 4567"] * 20
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=out, vocab_size=420, model_type="bpe",
        byte_fallback=True, allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
        add_dummy_prefix=add_dummy_prefix, split_digits=True, control_symbols=CHAT,
        user_defined_symbols=["▁▁", "▁▁▁▁", "\n", "\t"], normalization_rule_name="identity",
        unk_id=3, bos_id=2, eos_id=1, pad_id=0, minloglevel=2)
    m = pb.ModelProto()  # type: ignore[attr-defined]
    m.ParseFromString(out.getvalue())
    return m


def llama_cpp_metadata(m: Any) -> dict[str, Any]:
    """The tokenizer metadata llama.cpp's converter writes for this model."""
    def text(p: Any) -> str:
        piece: str = p.piece
        return piece.replace("▁", " ") if p.type == 4 and set(piece) == {"▁"} else piece

    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": [text(p) for p in m.pieces],
            "tokenizer.ggml.scores": [p.score for p in m.pieces],
            "tokenizer.ggml.token_type": [p.type for p in m.pieces],
            "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
            "tokenizer.ggml.unknown_token_id": 3, "tokenizer.ggml.padding_token_id": 0,
            "tokenizer.ggml.add_space_prefix": m.normalizer_spec.add_dummy_prefix,
            "tokenizer.ggml.add_bos_token": True}


@pytest.mark.parametrize(("family", "prefix"), [("GemmaTokenizer", False), ("LlamaTokenizer", True)])
def test_kvds_tokenizer_encodes_as_sentencepiece_does(family: str, prefix: bool, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    model = trained(prefix)
    sp = spm.SentencePieceProcessor(model_proto=model.SerializeToString())
    for name, data in ggufspm.tokenizer_files(llama_cpp_metadata(model), family, None).items():
        (tmp_path / name).write_bytes(data)
    ours: Any = AutoTokenizer.from_pretrained(str(tmp_path))
    for text in CORPUS:
        if prefix and text[:1].isspace():
            # Llama 2's dummy prefix before leading whitespace: transformers' Llama converter (what
            # mlx-lm users get for Llama 2 and Mistral from their own tokenizer.model) gives "▁"
            # where sentencepiece gives "▁▁"; every text that starts otherwise agrees.
            continue
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == sp.encode(text), (text, ours.convert_ids_to_tokens(ids), sp.encode(text, out_type=str))
        assert ours.decode(ids) == text
    # The chat tokens are control symbols: one id each, never pieced together from their letters.
    turn = ours.encode("<start_of_turn>user\nhi<end_of_turn>", add_special_tokens=False)
    assert turn[0] == sp.piece_to_id("<start_of_turn>") and turn[-1] == sp.piece_to_id("<end_of_turn>")
    assert ours.encode("hi")[0] == 2  # the file's add_bos_token
