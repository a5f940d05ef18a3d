"""What a session's live cache costs in bytes at a given length: the figure a turn is admitted by.

The engine admits a turn when its cache, grown by its prompt and
`max_tokens`, fits the memory budget beside the caches already running
(daemon/engine/scheduler.py). That needs the cache's size before the cache
exists, so it is reckoned from one live cache of the model (the warm-up's):
per layer, the bytes a token adds, capped at the window for a sliding-window
layer, and a fixed size for a recurrent state. Buffers grow in whole steps
(mlx-lm's), so lengths are rounded up to one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["CacheCost", "cache_cost"]

STEP = 256  # mlx-lm grows its KV buffers by this many tokens (direct.STEP, without importing MLX here)


@dataclass(frozen=True)
class CacheCost:
    per_token: float  # bytes each token adds to the layers that keep every token
    windows: tuple[tuple[int, float], ...] = ()  # (window, bytes per token) of sliding-window layers
    fixed: int = 0  # layers whose size does not grow with the tokens (recurrent state)

    def __call__(self, tokens: int, *, whole_steps: bool = True) -> int:
        """The bytes a live cache holding `tokens` ids takes, its buffers in whole steps (without
        `whole_steps`: what a snapshot of exactly those ids takes)."""
        t = -(-max(tokens, 0) // STEP) * STEP if whole_steps else max(tokens, 0)
        return int(self.per_token * t + sum(b * min(t, w) for w, b in self.windows)) + self.fixed

    def point(self, tokens: int) -> int:
        """The bytes of a checkpoint at `tokens` ids (checkpoints.py): the recurrent state and the windows; 0 for a
        cache that can be cut anywhere, which needs none."""
        return int(sum(b * min(max(tokens, 0), w) for w, b in self.windows)) + self.fixed


def cache_cost(cache: Sequence[Any]) -> CacheCost:
    """The cost of a model's caches, from one of its live caches that holds at least one token.

    Reads only the public surface of mlx-lm's cache classes: `keys`/`values`
    (an array, or a tuple of arrays for a quantized layer) whose third axis
    is the tokens allocated, `max_size` (a window), `caches` (a list of
    caches), `nbytes`.
    """
    per_token, windows, fixed = 0.0, [], 0
    for layer in _layers(cache):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if keys is None or values is None:
            fixed += int(getattr(layer, "nbytes", 0) or 0)
            continue
        arrays = [*keys, *values] if isinstance(keys, tuple) else [keys, values]
        allocated = int(arrays[0].shape[2])
        if allocated == 0:
            continue
        each = sum(int(a.nbytes) for a in arrays) / allocated
        window = getattr(layer, "max_size", None)
        if isinstance(window, int) and window > 0:
            windows.append((window, each))
        else:
            per_token += each
    return CacheCost(per_token, tuple(windows), fixed)


def _layers(cache: Sequence[Any]) -> list[Any]:
    out = []
    for layer in cache:
        inner = getattr(layer, "caches", None)
        out.extend(_layers(inner) if isinstance(inner, (list, tuple)) else [layer])
    return out
