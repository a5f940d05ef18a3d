"""Exact verification of drafts: which drafted tokens the target model keeps, and its next token.

Given the target's log-probabilities at the 1 + k positions a draft was fed
at (the pending token, then the k draft tokens), each position's own token is
drawn as a plain step would draw it (draws.py: greedy, or sampled with the
turn's key for that answer position); the row keeps the longest prefix of
its draft equal to those draws, then takes the draw after it.

- temperature 0: the answer is token for token the one plain greedy decoding gives.
- temperature > 0: this is standard speculative sampling (Leviathan et al.,
  Chen et al.) with the draft distribution q a point mass on the drafted
  token, as prompt lookup's is: draft token d is kept with probability
  P(x = d) = p(d) = min(1, p(d)/q(d)); at the first rejection the token is x
  given x != d, which is p with d removed, renormalised (the residual); when
  all k are kept the next token is drawn from p at the last position. The
  tokens are distributed exactly as the target's own samples, and, since each
  draw is tied to its answer position's key, they are the very tokens plain
  decoding of the same turn draws, with or without drafts, alone or batched.
  p is the distribution the plain sampler draws from: `top_p` applied to
  the log-probabilities first (mlx-lm's `apply_top_p`), then the temperature.

A draft model with a real q would need the ratio test and the residual draw
instead of `_prefix`; its callers would not change.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from .draws import Draws


@dataclass(frozen=True)
class Target:
    """How the target chooses a sequence's tokens (the turn's sampling parameters)."""

    temperature: float
    top_p: float


@dataclass(frozen=True)
class DraftVerdict:
    accepted: int  # draft tokens kept
    token: int  # the target's next token after them (drawn, not yet fed)


def target_logits(logprobs: mx.array, target: Target) -> mx.array:
    """Log-weights whose softmax is the distribution the plain sampler draws from."""
    return Draws(target.temperature, target.top_p, seed=0, size=1).logits(logprobs)


def verify(logprobs: mx.array, drafts: Sequence[Sequence[int]], draws: Sequence[Draws],
           also: mx.array | None = None) -> list[DraftVerdict]:
    """The verdict on every row's draft: `logprobs` (rows, 1 + K, vocab), row i's draft `drafts[i]`.

    Row i's positions are drawn with `draws[i]` from its `drawn` on (which this does not move).
    A row without a draft is drawn at its first position only, as a plain step would. One wait for
    the device, which evaluates `also` too (the step's pending tokens).
    """
    lazy = [d.choose(logprobs[i, :len(drafts[i]) + 1]) for i, d in enumerate(draws)]
    mx.eval(lazy if also is None else [*lazy, also])
    out: list[DraftVerdict] = []
    for choices, draft in zip(lazy, drafts):
        got: Any = choices.tolist()
        a = _prefix(got, draft)
        out.append(DraftVerdict(a, int(got[a])))
    return out


def _prefix(choices: Sequence[int], draft: Sequence[int]) -> int:
    a = 0
    while a < len(draft) and choices[a] == draft[a]:
        a += 1
    return a
