"""A cache's bytes by its length (cachestore/cost.py), the figure turns are admitted by."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache

from cachestore.cost import STEP, cache_cost
from cachestore.warm import cache_nbytes


def fed(cache: list[Any], tokens: int, heads: int = 2, dim: int = 8) -> list[Any]:
    for c in cache:
        if isinstance(c, ArraysCache):
            c[0] = mx.zeros((1, 4, 16))
            continue
        c.update_and_fetch(mx.zeros((1, heads, tokens, dim)), mx.zeros((1, heads, tokens, dim)))
    mx.eval([c.state for c in cache])
    return cache


def test_plain_layers_cost_what_mlx_lm_allocates_at_every_length() -> None:
    cost = cache_cost(fed([KVCache(), KVCache()], 3))
    for n in (1, STEP - 1, STEP, STEP + 1, 5 * STEP + 7):
        assert cost(n) == cache_nbytes(fed([KVCache(), KVCache()], n))


def test_a_window_stops_growing_at_its_size_and_a_recurrent_state_never_grows() -> None:
    cache = [KVCache(), RotatingKVCache(max_size=STEP), ArraysCache(size=1)]
    cost = cache_cost(fed(cache, 5))
    plain = cache_cost(fed([KVCache()], 5))
    window = cost(4 * STEP) - plain(4 * STEP) - cost.fixed
    assert window == cost(2 * STEP) - plain(2 * STEP) - cost.fixed  # past the window: no more
    assert cost.fixed == 4 * 16 * 4  # the recurrent state's float32 array
    assert cost(10 * STEP) > cost(STEP)


def test_quantized_layers_count_their_scales_too() -> None:
    q = cache_cost(fed([QuantizedKVCache(group_size=32, bits=4)], 3, dim=64))
    plain = cache_cost(fed([KVCache()], 3, dim=64))
    assert 0 < q(STEP) < plain(STEP)
    for n in (1, STEP + 1, 3 * STEP):
        assert q(n) == cache_nbytes(fed([QuantizedKVCache(group_size=32, bits=4)], n, dim=64))
