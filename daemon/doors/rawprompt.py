"""A prompt fed as it is, not through the chat template: Ollama's `raw` generate, a text completion, and
fill-in-the-middle (a `suffix`), made in the model's tokenizer stage (turns.py's `Prompt`).

Fill-in-the-middle needs the model's own markers: the tokenizer must hold one
of the known triples as single tokens (StarCoder's and SmolLM's
``<fim_prefix>``, Qwen2.5-Coder's and CodeGemma's ``<|fim_prefix|>``,
DeepSeek-Coder's ``<｜fim▁begin｜>``); the prompt is then prefix-suffix-middle
(PSM), as each model was trained. A model without any is refused at the door
(`fim_markers`), before anything is stored.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: (before the prefix, before the suffix, where the middle begins), by model family.
FIM_MARKERS: tuple[tuple[str, str, str], ...] = (
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
)


def _one_token(tokenizer: Any, text: str) -> bool:
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except Exception:  # a tokenizer that cannot say: no
        return False
    return len(ids) == 1 and tokenizer.decode(ids, skip_special_tokens=False) == text


def fim_markers(tokenizer: Any) -> tuple[str, str, str] | None:
    """The model's fill-in-the-middle markers, or None (tokenizer stage)."""
    return next((m for m in FIM_MARKERS if all(_one_token(tokenizer, t) for t in m)), None)


def encode_raw(tokenizer: Any, text: str) -> list[int]:
    """`text` as the model reads a raw prompt: its special tokens parsed, the model's BOS added as its
    tokenizer adds it, unless the text already begins with it."""
    bos = getattr(tokenizer, "bos_token", None)
    add = not (isinstance(bos, str) and bos and text.startswith(bos))
    return list(tokenizer.encode(text, add_special_tokens=add))


@dataclass(frozen=True)
class RawPrompt:
    """A prompt's ids without the chat template: `text` (or `ids` as given), with a `suffix` for
    fill-in-the-middle (`markers` from `fim_markers`)."""

    text: str = ""
    ids_given: Sequence[int] | None = None
    suffix: str | None = None
    markers: tuple[str, str, str] | None = None
    fed_before: int = 0
    raw: bool = True  # its answer continues its text: the first space is kept (engine/running.py)

    def ids(self, tokenizer: Any) -> tuple[list[int], bool]:
        if self.ids_given is not None:
            return list(self.ids_given), True
        if self.suffix is not None:
            assert self.markers is not None, "a suffix needs the model's fill-in-the-middle markers"
            pre, suf, mid = self.markers
            return encode_raw(tokenizer, f"{pre}{self.text}{suf}{self.suffix}{mid}"), True
        return encode_raw(tokenizer, self.text), True
