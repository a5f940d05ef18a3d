"""Exact verification of drafts: which drafted tokens the target model keeps, and its next token.

Given the target's log-probabilities at the 1 + k positions a draft was fed
at (the pending token, then the k draft tokens):

- temperature 0: keep the longest prefix of the draft equal to the target's
  greedy choices, then take the target's own greedy token after it. The
  answer is token for token the one plain greedy decoding gives.
- temperature > 0: standard speculative sampling (Leviathan et al., Chen et
  al.) with the draft distribution q a point mass on the drafted token, as
  prompt lookup's is: draft token d is kept with probability min(1, p(d)/q(d))
  = p(d); at the first rejection the token is drawn from the residual
  max(0, p - q) renormalised, which is p with d removed; when all k are kept
  the next token is drawn from p at the last position. The tokens are then
  distributed exactly as the target's own samples. p is the distribution
  the plain sampler draws from: `top_p` applied to the log-probabilities
  first (mlx-lm's `apply_top_p`), then the temperature.

A draft model with a real q would change only `_accept_sampled` (the ratio
and the residual), not its callers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p

from common.limits import top_p_filters


@dataclass(frozen=True)
class Target:
    """How the target chooses a sequence's tokens (the turn's sampling parameters)."""

    temperature: float
    top_p: float


@dataclass(frozen=True)
class Verdict:
    accepted: int  # draft tokens kept
    token: int  # the target's next token after them (sampled, not yet fed)


def target_logits(logprobs: mx.array, target: Target) -> mx.array:
    """Log-weights whose softmax is the distribution the plain sampler draws from."""
    if top_p_filters(target.top_p):
        logprobs = apply_top_p(logprobs, target.top_p)
    return logprobs * (1.0 / target.temperature)


def verify(logprobs: mx.array, drafts: Sequence[Sequence[int]], targets: Sequence[Target],
           *, plain: Sequence[Callable[[mx.array], mx.array]]) -> list[Verdict]:
    """The verdict on every row's draft: `logprobs` (rows, 1 + K, vocab), row i's draft `drafts[i]`.

    A row without a draft is sampled with its own plain sampler `plain[i]`, as a
    plain decode step would.
    """
    greedy = mx.argmax(logprobs, axis=-1)
    lazy: list[Any] = []
    for i, (d, t) in enumerate(zip(drafts, targets)):
        if not d:
            lazy.append(plain[i](logprobs[i:i + 1, 0]))
        elif t.temperature == 0:
            lazy.append(None)
        else:
            lazy.append(_sampled_parts(logprobs[i, :len(d) + 1], d, t))
    mx.eval(greedy, [x for x in lazy if x is not None])
    g: list[list[int]] = greedy.tolist()  # type: ignore[assignment]
    out: list[Verdict] = []
    for i, (d, parts) in enumerate(zip(drafts, lazy)):
        if not d:
            out.append(Verdict(0, _int(parts)))
        elif parts is None:
            a = _greedy_prefix(g[i], d)
            out.append(Verdict(a, g[i][a]))
        else:
            out.append(_accept_sampled(*parts))
    return out


def _greedy_prefix(choices: Sequence[int], draft: Sequence[int]) -> int:
    a = 0
    while a < len(draft) and choices[a] == draft[a]:
        a += 1
    return a


def _sampled_parts(logprobs: mx.array, draft: Sequence[int], target: Target) -> tuple[mx.array, ...]:
    """Everything the accept rule needs, computed lazily in one go (one evaluation for the batch)."""
    k = len(draft)
    logits = target_logits(logprobs, target)  # (k + 1, vocab)
    probs = mx.softmax(logits, axis=-1)
    d = mx.array(list(draft), dtype=mx.uint32)
    p_draft = mx.take_along_axis(probs[:k], d[:, None], axis=-1)[:, 0]
    u = mx.random.uniform(shape=(k,))
    # The residual at each position: p without the drafted token (renormalised by categorical).
    hit = mx.arange(logits.shape[-1])[None, :] == d[:, None]
    residual = mx.random.categorical(mx.where(hit, -mx.inf, logits[:k]), axis=-1)
    bonus = mx.random.categorical(logits[k], axis=-1)
    return p_draft, u, residual, bonus


def _accept_sampled(p_draft: mx.array, u: mx.array, residual: mx.array, bonus: mx.array) -> Verdict:
    p: list[float] = p_draft.tolist()  # type: ignore[assignment]
    r: list[float] = u.tolist()  # type: ignore[assignment]
    for j, (pj, rj) in enumerate(zip(p, r)):
        if rj >= pj:  # rejected with probability 1 - p(d)
            return Verdict(j, _int(residual[j]))
    return Verdict(len(p), _int(bonus))


def _int(a: mx.array) -> int:
    value: Any = a.item()
    return int(value)
