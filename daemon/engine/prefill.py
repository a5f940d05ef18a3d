"""Feed a prompt into one session's cache, a chunk at a time, ending in its first token.

The engine prefills a session itself rather than through BatchGenerator's
prompt batch, for two reasons measured on the CPU backend:

- Time to first token. BatchGenerator feeds all but the last prompt token,
  then runs the last one as a decode step and hands its sampled token out only
  after launching the next forward, and it copies the whole cache twice on the
  way (merge into a batch, deep copy on split). After a 4k-token restore that
  cost ~0.2-0.4 s on top of the prefill. Here the last chunk's logits give
  the first token directly; the session then joins the decode batch with that
  token as its one-token prompt, which is exactly how BatchGenerator continues
  any sequence.
- Fairness and exactness. One chunk per engine step interleaves a long
  prefill with the other sessions' decoding, and a single unpadded sequence
  computes exactly what mlx-lm's own `generate_step` computes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx


class Prefill:
    """The state of one prompt's prefill: `cache` holds `tokens[:fed]`.

    `boundary`: a chunk never crosses a multiple of it, and `at_boundary(cache,
    ids fed)` is called at each one the prompt goes past (a cache with a
    sliding window, whose state at a block's end can only be taken there:
    cachestore's `SessionCaches.boundary` and `capture`).

    `clear_cache`: return MLX's cached buffers after each chunk, as the CPU
    has always done (a 2-core machine's RAM is the tight resource); on CUDA
    that hands the allocator's buffers back only for the next chunk to
    allocate them again, so a GPU keeps them. None: the device policy's
    (daemon/device.py).
    """

    def __init__(self, model: Any, cache: list[Any], tokens: Sequence[int], fed: int, *, step: int,
                 boundary: int | None = None,
                 at_boundary: Callable[[list[Any], Sequence[int]], None] | None = None,
                 clear_cache: bool | None = None):
        if not 0 <= fed < len(tokens):
            raise ValueError(f"a prefill needs at least one token to feed ({fed} of {len(tokens)} fed)")
        if step < 1:
            raise ValueError("step must be positive")
        self.model = model
        self.cache = cache
        self.tokens = list(tokens)
        self.fed = fed
        self.step = step
        self.boundary = boundary
        self.at_boundary = at_boundary
        if clear_cache is None:
            from ..device import current

            clear_cache = current().prefill_clear_cache
        self.clear_cache = clear_cache

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.fed

    def advance(self, n: int | None = None) -> mx.array | None:
        """Feed the next `n` (default `step`) tokens.

        After the last ones: the next token's log-probabilities, shape (1, vocab).
        """
        n = n or self.step
        if self.boundary:
            n = min(n, self.boundary - self.fed % self.boundary)
        chunk = self.tokens[self.fed:self.fed + n]
        logits = self.model(mx.array(chunk)[None], cache=self.cache)
        self.fed += len(chunk)
        if self.remaining:
            mx.eval([c.state for c in self.cache])
            if self.boundary and self.at_boundary and self.fed % self.boundary == 0:
                self.at_boundary(self.cache, self.tokens[:self.fed])
            if self.clear_cache:
                mx.clear_cache()
            return None
        last: mx.array = logits[:, -1, :]
        return last - mx.logsumexp(last, axis=-1, keepdims=True)


def first_token(logprobs: mx.array, sampler: Callable[[mx.array], mx.array]) -> int:
    token = sampler(logprobs)
    mx.eval(token)
    value: Any = token.item()
    return int(value)
