"""Log-probabilities an answer asked for (a request's logprobs / top_logprobs), taken where its tokens are
drawn: the prompt's last logits for the first token (steps.py), each decode step's for the rest (decode.py),
every prompt position's for a prompt that wants its own (prefill.py: a text completion's echo).

A value is the log-softmax of the model's logits at that position: the distribution before temperature and
top_p (mlx-lm's `generate_step` yields the same), after a grammar's mask where the answer has one. Taken
lazily, beside the draw (`pick`); read once the step that evaluates them is done (`records`), so an answer
that asks for none costs nothing and one that does costs a gather and a top-k per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ..events import TokenLogprob


@dataclass(frozen=True)
class Picked:
    """Per row: the chosen token's log-probability, and the top k ids and theirs (most likely first); lazy."""

    chosen: mx.array  # (n,)
    ids: mx.array | None  # (n, k)
    values: mx.array | None  # (n, k)

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.chosen, self.ids, self.values) if a is not None]


def pick(logprobs: mx.array, tokens: mx.array, k: int) -> Picked:
    """`logprobs` (n, vocab) normalised; `tokens` (n,) the tokens taken at those positions; `k` alternatives."""
    chosen = mx.take_along_axis(logprobs, tokens.reshape(-1, 1).astype(mx.int32), axis=-1)[:, 0]
    if k <= 0:
        return Picked(chosen, None, None)
    k = min(k, logprobs.shape[-1])
    ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
    values = mx.take_along_axis(logprobs, ids, axis=-1)
    order = mx.argsort(-values, axis=-1)
    return Picked(chosen, mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(values, order, axis=-1))


def records(tokens: list[int], picked: Picked) -> list[TokenLogprob]:
    """The picked values as TokenLogprobs (reads them: evaluate them first, or this waits for them)."""
    chosen: Any = picked.chosen.astype(mx.float32).tolist()
    ids: Any = picked.ids.tolist() if picked.ids is not None else [[] for _ in tokens]
    values: Any = picked.values.astype(mx.float32).tolist() if picked.values is not None else [[] for _ in tokens]
    return [TokenLogprob(t, float(c), tuple((int(i), float(v)) for i, v in zip(row_ids, row_values)))
            for t, c, row_ids, row_values in zip(tokens, chosen, ids, values)]
