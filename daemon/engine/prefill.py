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

import copy
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from ..events import TokenLogprob
from .logprobs import Picked, pick, records


class Prefill:
    """The state of one prompt's prefill: `cache` holds `tokens[:fed]`.

    `boundary`: a chunk never crosses a multiple of it, and `at_boundary(cache,
    ids fed)` is called at each one the prompt goes past (a cache with a
    sliding window, whose state at a block's end can only be taken there:
    cachestore's `SessionCaches.windows`).

    `last`: the model to feed the prompt's last chunk with, one that computes
    the logits of its last position only (`last_position`); None: `model`.

    `clear_cache`: return MLX's cached buffers after each chunk, as the CPU
    has always done (a 2-core machine's RAM is the tight resource); on CUDA
    that hands the allocator's buffers back only for the next chunk to
    allocate them again, so a GPU keeps them. None: the device policy's
    (daemon/device.py).
    """

    def __init__(self, model: Any, cache: list[Any], tokens: Sequence[int], fed: int, *, step: int,
                 boundary: int | None = None,
                 at_boundary: Callable[[list[Any], Sequence[int]], None] | None = None,
                 clear_cache: bool | None = None, last: Any | None = None, collect: int | None = None,
                 raw: bool = False):
        if not 0 <= fed < len(tokens):
            raise ValueError(f"a prefill needs at least one token to feed ({fed} of {len(tokens)} fed)")
        if step < 1:
            raise ValueError("step must be positive")
        self.model = model
        self.last = last if last is not None else model
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
        # The prompt's own log-probabilities, each position's next token's and `collect` alternatives (a text
        # completion's echo): every chunk then runs the whole head (engine/logprobs.py).
        self.collect = collect
        self.collected: list[tuple[list[int], Picked]] = []
        self.raw = raw  # the last position's logits as the model gives them (logits processors come first)

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.fed

    def advance(self, n: int | None = None) -> mx.array | None:
        """Feed the next `n` (default `step`) tokens.

        After the last ones: the next token's log-probabilities, shape (1, vocab) (`raw`: its logits).
        """
        n = n or self.step
        if self.boundary:
            n = min(n, self.boundary - self.fed % self.boundary)
        chunk = self.tokens[self.fed:self.fed + n]
        whole = self.collect is not None or self.fed + len(chunk) < len(self.tokens)
        logits = (self.model if whole else self.last)(mx.array(chunk)[None], cache=self.cache)
        if self.collect is not None:
            following = self.tokens[self.fed + 1:self.fed + len(chunk) + 1]  # each position's next prompt token
            if following:
                lp = logits[0, :len(following)]
                lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
                self.collected.append((following, pick(lp, mx.array(following), self.collect)))
        self.fed += len(chunk)
        if self.remaining:
            mx.eval([c.state for c in self.cache], [a for _, p in self.collected[-1:] for a in p.arrays()])
            if self.boundary and self.at_boundary and self.fed % self.boundary == 0:
                self.at_boundary(self.cache, self.tokens[:self.fed])
            if self.clear_cache:
                mx.clear_cache()
            return None
        last: mx.array = logits[:, -1, :]
        return last if self.raw else last - mx.logsumexp(last, axis=-1, keepdims=True)


    def prompt_logprobs(self) -> list[TokenLogprob]:
        """What `collect` gathered: every prompt token's, the first's None (read once the prefill is done)."""
        return [TokenLogprob(self.tokens[0], None),
                *(r for following, picked in self.collected for r in records(following, picked))]


def first_token(logprobs: mx.array, sampler: Callable[[mx.array], mx.array]) -> int:
    token = sampler(logprobs)
    mx.eval(token)
    value: Any = token.item()
    return int(value)


class _LastOnly:
    """A model's inner network (`Model.model` in mlx-lm) with its output cut to the last position."""

    def __init__(self, inner: Any):
        self.inner = inner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner(*args, **kwargs)[:, -1:, :]

    def __getattr__(self, name: str) -> Any:  # a tied head reads `model.embed_tokens`
        return getattr(self.inner, name)


def last_position(model: Any, make_cache: Callable[[], list[Any]]) -> Any | None:
    """The model as it computes the logits of the last position only, or None where that cannot be had.

    A prompt's first token needs its last position's logits only, and a
    model's head is its largest matrix (hidden size by vocabulary: 113 MB of
    float32 on SmolLM2-135M): a next turn of 16 new tokens over 2k spent 2-4%
    of its forward on 15 rows of logits nobody reads (166 against 170 ms, the
    medians of 30 alternated turns on the 2-core CPU). mlx-lm's models end
    `Model.__call__` with `self.model(...)` and then the head, position by
    position; a twin of the model (its weights shared) whose `model` cuts the
    hidden states to the last position gives the same last logits for a
    fraction of the head. Checked here, once, on two fresh caches: a model
    whose twin fails or differs (another structure, another `__call__`) keeps
    the whole head.
    """
    inner = model.get("model") if isinstance(model, dict) else None
    if inner is None or not callable(inner):
        return None
    twin = copy.copy(model)
    twin["model"] = _LastOnly(inner)
    chunk = mx.array([[1, 2, 3, 4]])
    try:
        whole = model(chunk, cache=make_cache())[:, -1, :]
        ours = twin(chunk, cache=make_cache())
        mx.eval(whole, ours)
    except Exception:  # a model of another shape: its own call stands
        return None
    if ours.shape != (1, 1, whole.shape[-1]):
        return None
    scale = float(mx.max(mx.abs(whole)))
    err = float(mx.max(mx.abs(ours[:, -1, :].astype(mx.float32) - whole.astype(mx.float32))))
    return twin if err <= 1e-3 * max(scale, 1.0) else None
