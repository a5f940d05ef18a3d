"""How one turn chooses its tokens: greedy, or sampled with its own random key per answer position.

A sampled answer draws token i of its answer with key i of its own table
(`mx.random.split` of the key its seed makes), never from MLX's global random
state. So a seeded answer is the same whether it runs alone or beside other
sessions (their draws never advance its state), and whether or not its
tokens came through speculation: the verifier (verify.py) draws each position's
token with that position's key, exactly as a plain step would, and keeps a
draft token only where it equals that draw. Keeping a point-mass draft d with
probability p(d) and otherwise drawing from p without d is standard
speculative sampling; drawing x ~ p and keeping d iff x == d is the same
rule, with the randomness tied to the position instead of the step.

A turn without a seed takes one from MLX's global generator when it starts
(so ranks seeded alike in a sharded group draw alike: Engine.load).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from common.limits import top_p_filters

SEED_RANGE = 2**31 - 1  # an unseeded turn's seed is drawn below this


class Draws:
    """One turn's token choice: `temperature` 0 is greedy; else sampled, `top_p` < 1, `min_p` and `top_k`
    cutting the tail (mlx-lm's filters, in its make_sampler's order).

    `size`: how many answer positions may be drawn (max_tokens, plus room for a
    draft's last position).
    """

    def __init__(self, temperature: float, top_p: float, *, seed: int | None, size: int, top_k: int = 0,
                 min_p: float = 0.0):
        self.temperature = temperature
        self.cuts = top_p_filters(top_p)  # (1, the top of top_p's range, means off: common/limits.py)
        self.top_p = top_p if self.cuts else 1.0
        self.top_k = top_k  # 0: off (a request's knob, as mlx-lm's make_sampler: after top_p and min_p)
        self.min_p = min_p  # 0: off
        self.size = max(1, size)
        self.drawn = 0  # answer positions drawn so far: the next draw uses key `drawn`
        self._seed = seed
        self._keys: mx.array | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def logits(self, logprobs: mx.array) -> mx.array:
        """Log-weights whose softmax is the distribution this turn samples from (top_p, then temperature).

        Renormalised first: a grammar's mask (grammar.py) leaves log-probabilities that no longer
        sum to one, and mlx-lm's `apply_top_p` before 0.32.2 assumed they did (its main branch at
        d78bf58 still does), cutting every allowed token when the allowed mass was under 1 - top_p.
        """
        if self.cuts or self.min_p or self.top_k:
            logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
        if self.cuts:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.min_p:
            logprobs = apply_min_p(logprobs, self.min_p)
        if 0 < self.top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs, self.top_k)
        return logprobs * (1.0 / self.temperature)

    def keys(self) -> mx.array:
        if self._keys is None:
            seed = self._seed
            if seed is None:
                value: Any = mx.random.randint(0, SEED_RANGE, shape=()).item()
                seed = int(value)
            self._keys = mx.random.split(mx.random.key(seed % 2**64), self.size)
        return self._keys

    def choose(self, logprobs: mx.array, start: int | None = None) -> mx.array:
        """The tokens drawn at consecutive answer positions from `start` (default `drawn`), lazily.

        `logprobs` (positions, vocab): row j is drawn with key `start + j`. Does not move `drawn`.
        """
        if self.greedy:
            return mx.argmax(logprobs, axis=-1)
        start = self.drawn if start is None else start
        keys = self.keys()
        weights = self.logits(logprobs)
        last = self.size - 1
        return mx.concatenate([mx.random.categorical(weights[j:j + 1], key=keys[min(start + j, last)])
                               for j in range(logprobs.shape[0])])

    def take(self, logprobs: mx.array) -> mx.array:
        """The next answer position's token (`logprobs` 1 x vocab), lazily; moves `drawn` on by one."""
        token = self.choose(logprobs)
        self.drawn += 1
        return token
