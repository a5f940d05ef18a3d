"""Warm snapshots kept 8-bit: smaller, restored as ordinary float caches, close to the original."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from cachestore.errors import SnapshotError
from cachestore.packing import is_packed, pack, unpack
from cachestore.snapshot import restore, snapshot
from cachestore.store import Budgets, SessionCaches
from conftest import client, running_daemon

PROMPT = list(range(20, 120))  # 100 tokens: tiny-swa's 64-token window has wrapped


def filled(model: Any) -> list[Any]:
    cache = make_prompt_cache(model)
    model(mx.array([PROMPT]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


@pytest.mark.parametrize("bits, most", [(8, 0.32), (4, 0.19)])  # head_dim 32: groups of 32
def test_pack_shrinks_plain_layers_and_restores_close(models: dict[str, Any], bits: int, most: float) -> None:
    model = models["builtin:tiny"]
    exact = snapshot(filled(model), 0)
    packed = pack(exact, bits)
    assert is_packed(packed) and packed.nbytes <= most * exact.nbytes
    with pytest.raises(SnapshotError):
        restore(packed)  # only ever restored through unpack
    back = restore(unpack(packed))
    for original, restored in zip(restore(exact), back, strict=True):
        assert type(restored) is type(original) and restored.offset == original.offset
        k0, k1 = original.keys[..., :original.offset, :], restored.keys[..., :restored.offset, :]
        assert k1.dtype == k0.dtype and k1.shape == k0.shape
        tol = (0.02 if bits == 8 else 0.2) * largest(k0)
        assert largest(k1 - k0) <= tol
        assert not mx.array_equal(k1, k0).item()  # it is lossy, and the test can tell
    # Next-token logits from the rounded cache stay close to the exact ones.
    x = mx.array([[7]])
    exact_logits = model(x, cache=restore(exact))
    packed_logits = model(x, cache=back)
    assert largest(packed_logits - exact_logits) < (0.05 if bits == 8 else 1.0)


def test_sliding_window_layers_stay_exact(models: dict[str, Any]) -> None:
    exact = snapshot(filled(models["builtin:tiny-swa"]), 0)
    packed = pack(exact, 8)
    kinds = [(a.kind, b.kind) for a, b in zip(exact.layers, packed.layers)]
    assert ("rotating", "rotating") in kinds and ("kv", "kv_packed") in kinds
    for a, b in zip(exact.layers, packed.layers):
        if a.kind == "rotating":
            assert b is a


def test_warm_tier_holds_packed_snapshots(models: dict[str, Any], tmp_path: Path) -> None:
    model = models["builtin:tiny"]
    budgets = Budgets(resident_bytes=0, warm_bytes=1 << 30, disk_bytes=1 << 30, resident_idle=60.0,
                      warm_idle=600.0, max_segments=16, warm_bits=8)
    caches = SessionCaches(tmp_path, "fp", budgets)
    cache = filled(model)
    exact_bytes = sum(c.nbytes for c in cache)
    caches.checkin("aaaa", cache, PROMPT)
    assert caches.warm.nbytes <= 0.32 * exact_bytes
    got = caches.checkout("aaaa", PROMPT + [7])
    assert got.restored_from == "warm" and got.tokens == len(PROMPT)
    assert got.cache is not None and all(type(c).__name__ == "KVCache" for c in got.cache)
    caches.close()


@pytest.mark.anyio
async def test_a_turn_resumes_from_packed_warm(tmp_path: Path) -> None:
    async with running_daemon(tmp_path, resident_bytes=0, warm_bits=8) as d:
        async with client(d) as c:
            sid = (await c.request("session.create"))["session"]["id"]
            await c.chat(sid, "Tell me about caches.", max_tokens=8, temperature=0)
            deltas, done = await c.chat(sid, "And then?", max_tokens=8, temperature=0)
    assert done["type"] == "chat.done" and deltas
    assert done["usage"]["restored_from"] == "warm"


def largest(a: mx.array) -> float:
    """The largest absolute value in `a`."""
    return cast(float, mx.abs(a).max().item())
