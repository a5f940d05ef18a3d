"""kvd's CPU attention against MLX's own: the softmax, every mask kind, GQA ratios, dtypes, query lengths;
and kvd's swiglu against mlx-lm's.

The reference is `mx.fast.scaled_dot_product_attention` (plain caches) and
mlx-lm's `quantized_scaled_dot_product_attention` (kv_bits), run on the same
inputs. The hook's own test (that a real model's forward goes through it) is
in tests/test_attention_model.py.
"""

from __future__ import annotations

import threading
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.activations import swiglu as mlx_swiglu
from mlx_lm.models.base import create_causal_mask, quantized_scaled_dot_product_attention
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache, RotatingKVCache

from daemon.engine import attention as attn
from daemon.engine.attention import attention, causal_mask, softmax
from daemon.engine.vexp import swiglu

# float32 on a GPU: CUDA's matmuls round differently from the CPU's BLAS (max 6e-4 against
# mx.fast's attention on an H100, 2026-11-27; docs/benchmarks.md), 2e-5 on the CPU.
TOLERANCE = {mx.float32: 2e-5 if mx.default_device() == mx.cpu else 2e-3, mx.float16: 4e-3, mx.bfloat16: 3e-2}


def qkv(B: int, H: int, KV: int, L: int, S: int, D: int = 64, dtype: Any = mx.float32,
        seed: int = 0) -> tuple[mx.array, mx.array, mx.array]:
    mx.random.seed(seed)
    q, k, v = (mx.random.normal((B, h, n, D)).astype(dtype)
               for h, n in ((H, L), (KV, S), (KV, S)))
    return q, k, v


def close(ours: mx.array, ref: mx.array, dtype: Any = mx.float32) -> float:
    assert ours.shape == ref.shape and ours.dtype == ref.dtype
    err = float(mx.max(mx.abs(ours.astype(mx.float32) - ref.astype(mx.float32))))
    assert err <= TOLERANCE[dtype], err
    return err


def test_softmax_equals_mlx_softmax_over_a_wide_range_of_scores() -> None:
    mx.random.seed(1)
    x = mx.concatenate([mx.random.normal((4, 2064)) * s for s in (0.1, 1.0, 10.0, 100.0)])
    ref = mx.softmax(x, axis=-1, precise=True)
    ours = softmax(x)
    assert float(mx.max(mx.abs(ours - ref))) < 1e-6
    assert float(mx.max(mx.abs(ours - ref) / mx.maximum(ref, 1e-30) * (ref > 1e-30))) < 1e-5
    assert float(mx.max(mx.abs(mx.sum(ours, axis=-1) - 1))) < 1e-5


def test_softmax_gives_masked_keys_exactly_zero_and_keeps_a_fully_masked_row_finite() -> None:
    x = mx.array([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    mask = mx.array([[True, False, True, False], [False, False, False, False]])
    out = softmax(x, mask)
    assert out[0, 1].item() == 0.0 and out[0, 3].item() == 0.0
    assert abs(out[0, 2].item() - float(mx.softmax(mx.array([1.0, 3.0]))[1])) < 1e-6
    assert bool(mx.all(mx.isfinite(out)))  # a left-padded prompt's padding rows: no NaN to spread


def test_the_exp_is_exact_at_zero_right_down_to_float32s_normals_and_zero_below() -> None:
    rows: Any = softmax(mx.array([[0.0, -1000.0, -88.0, -3.0e38, -87.0, -50.0]])).tolist()
    out = rows[0]
    assert out[:4] == [1.0, 0.0, 0.0, 0.0]
    assert out[4] == pytest.approx(1.6458114e-38, rel=1e-6) and out[5] == pytest.approx(1.9287498e-22, rel=1e-6)


@pytest.mark.parametrize("H,KV", [(9, 3), (8, 8), (8, 1), (14, 2)])
@pytest.mark.parametrize("L", [1, 16, 64])
@pytest.mark.parametrize("mask_kind", [None, "causal", "array"])
def test_attention_equals_mlx_fast_sdpa(H: int, KV: int, L: int, mask_kind: str | None) -> None:
    S = 300 + L
    q, k, v = qkv(1, H, KV, L, S)
    mask: Any = mask_kind
    if mask_kind == "array":
        mask = create_causal_mask(L, S - L)
    elif mask_kind == "causal" and L == 1:
        mask = None  # what mlx-lm passes for one query
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    close(attention(q, k, v, scale=0.125, mask=mask), ref)


@pytest.mark.parametrize("S", [1, 2, 3])
def test_a_first_token_over_an_empty_cache_and_other_tiny_shapes(S: int) -> None:
    """One key crashed MLX 0.32's compiled CPU kernels (a restored empty cache's first step)."""
    q, k, v = qkv(1, 4, 2, 1, S)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=None)
    close(attention(q, k, v, scale=0.125, mask=None), ref)
    q, k, v = qkv(1, 4, 2, S, S)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
    close(attention(q, k, v, scale=0.125, mask="causal"), ref)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_attention_keeps_the_inputs_dtype(dtype: Any) -> None:
    q, k, v = qkv(1, 9, 3, 16, 100, dtype=dtype)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
    close(attention(q, k, v, scale=0.125, mask="causal"), ref, dtype)


def test_an_additive_mask_and_a_per_head_mask() -> None:
    q, k, v = qkv(2, 9, 3, 8, 40)
    additive = mx.random.normal((2, 1, 8, 40))
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask=additive)
    close(attention(q, k, v, scale=0.2, mask=additive), ref)
    per_head = mx.random.uniform(shape=(2, 9, 8, 40)) > 0.3
    per_head = per_head | (mx.arange(40) == 0)  # every row keeps a key
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask=per_head)
    close(attention(q, k, v, scale=0.2, mask=per_head), ref)


def test_the_causal_mask_is_one_array_per_shape() -> None:
    assert causal_mask(16, 2064) is causal_mask(16, 2064)
    assert causal_mask(16, 2064).tolist() == create_causal_mask(16, 2048).tolist()


def test_each_thread_builds_its_own_causal_mask() -> None:
    """An MLX array is its thread's (its stream is): a mask one model's engine thread built, handed to
    another's, failed that forward ("There is no Stream(cpu, 0) in current thread"), or crashed kvd
    when both evaluated it at once (issue 51)."""
    here = causal_mask(16, 48)
    there: list[mx.array] = []

    def build() -> None:  # another engine thread: its mask is made, and evaluated, on it
        mask = causal_mask(16, 48)
        mx.eval(mask)
        there.append(mask)

    t = threading.Thread(target=build)
    t.start()
    t.join()
    assert there[0] is not here and there[0].tolist() == here.tolist()


def test_batched_decode_with_left_padding() -> None:
    """BatchGenerator's cache: rows of different lengths, left-padded; its mask per row."""
    lengths = [37, 12, 50]
    cache = BatchKVCache(left_padding=[max(lengths) - n for n in lengths])
    q, k, v = qkv(3, 9, 3, max(lengths), max(lengths))
    for L in (max(lengths), 1, 1):  # the padded prompt, then two decode steps
        mask = cache.make_mask(L, return_array=True)  # as a model does: before the layers update the cache
        keys, values = cache.update_and_fetch(k[:, :, :L], v[:, :, :L])
        qq = q[:, :, :L]
        out = attention(qq, keys, values, scale=0.125, mask=mask)
        ref = mx.fast.scaled_dot_product_attention(qq, keys, values, scale=0.125, mask=mask)
        assert bool(mx.all(mx.isfinite(out)))
        # Padding rows (queries before a row's first token) attend to nothing real: compare the rest.
        real = mx.arange(L)[None, None, :, None] >= (mx.array([0 if L == 1 else max(lengths) - n
                                                               for n in lengths]))[:, None, None, None]
        close(mx.where(real, out, 0), mx.where(real, ref, 0))


@pytest.mark.parametrize("L", [1, 7])  # (mlx-lm's own mask and keys disagree in shape for a chunk of 64)
def test_a_rotating_cache_past_its_window(L: int) -> None:
    cache = RotatingKVCache(max_size=128, keep=4)
    q, k, v = qkv(1, 9, 3, 200, 200, seed=3)
    cache.update_and_fetch(k[:, :, :100], v[:, :, :100])
    for i in range(100, 150):  # decode steps: the cache wraps around its window in place
        cache.update_and_fetch(k[:, :, i:i + 1], v[:, :, i:i + 1])
    mask = cache.make_mask(L, window_size=128, return_array=False)  # as gemma3 passes its window
    keys, values = cache.update_and_fetch(k[:, :, 150:150 + L], v[:, :, 150:150 + L])
    qq = q[:, :, :L]
    ref = mx.fast.scaled_dot_product_attention(qq, keys, values, scale=0.125, mask=mask)
    close(attention(qq, keys, values, scale=0.125, mask=mask), ref)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("L", [1, 16])
@pytest.mark.parametrize("H,KV", [(9, 3), (4, 4)])
def test_quantized_caches_equal_mlx_lms_quantized_path(bits: int, L: int, H: int, KV: int) -> None:
    cache = QuantizedKVCache(group_size=64, bits=bits)
    q, k, v = qkv(1, H, KV, L, 200 + L, seed=5)
    qk, qv = cache.update_and_fetch(k, v)
    mask: Any = "causal" if L > 1 else None
    ours = attention(q, qk, qv, scale=0.125, mask=mask, group_size=64, bits=bits)
    # A cache restored from a snapshot holds its triples as lists.
    as_lists = attention(q, list(qk), list(qv), scale=0.125, mask=mask, group_size=64, bits=bits)
    mx.eval(ours, as_lists)
    # (mlx-lm's path scales its queries in place, `queries *= scale`: it runs last)
    close(ours, quantized_scaled_dot_product_attention(q, qk, qv, scale=0.125, mask=mask, group_size=64, bits=bits))
    close(as_lists, ours)


@pytest.mark.parametrize("L,S", [(16, 16), (1, 300), (16, 300)])
def test_a_plain_cache_through_the_hooks_signature(L: int, S: int) -> None:
    """Through the hook: kvd's attention from MIN_SCORES scores up, exactly MLX's own below."""
    from daemon.engine.attention import scaled_dot_product_attention

    cache = KVCache()
    q, k, v = qkv(1, 9, 3, L, S)
    keys, values = cache.update_and_fetch(k, v)
    mask = "causal" if L > 1 else None
    ref = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.125, mask=mask)
    out = scaled_dot_product_attention(q, keys, values, cache, 0.125, mask)
    close(out, ref)
    ours = 9 * L * S >= attn.MIN_SCORES
    assert attn.pays(q, keys) == ours
    which = attention(q, keys, values, scale=0.125, mask=mask) if ours else ref
    assert bool(mx.array_equal(out, which))


@pytest.mark.parametrize("shape", [(1, 1, 128), (1, 1, 1536), (1, 16, 1536)])
def test_the_hooks_swiglu_is_mlx_lms_below_its_size_and_vexps_above(shape: tuple[int, ...]) -> None:
    gate, x = mx.random.normal(shape) * 4, mx.random.normal(shape)
    which = swiglu if gate.size >= attn.MIN_SWIGLU else mlx_swiglu
    assert bool(mx.array_equal(attn.swiglu(gate, x), which(gate, x)))


@pytest.mark.parametrize("B,L,S", [(1, 64, 2100), (3, 40, 900)])
def test_queries_in_blocks_equal_one_block(monkeypatch: pytest.MonkeyPatch, B: int, L: int, S: int) -> None:
    q, k, v = qkv(B, 9, 3, L, S, seed=7)
    padding = mx.array([0, 5, 17][:B])
    mask = create_causal_mask(L, S - L, left_padding=padding)  # (B, 1, L, S), as a batch's
    whole = attention(q, k, v, scale=0.125, mask=mask)
    monkeypatch.setattr(attn, "BLOCK", 9 * S * B * 7)  # blocks of 7 queries, the last one shorter
    close(attention(q, k, v, scale=0.125, mask=mask), whole)  # (BLAS sums a GEMM of other rows alike or not)
    close(whole, mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask))


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_swiglu_equals_mlx_lms(dtype: Any) -> None:
    mx.random.seed(2)
    gate = (mx.random.normal((2, 16, 1536)) * 8).astype(dtype)
    x = mx.random.normal((2, 16, 1536)).astype(dtype)
    extremes = mx.broadcast_to(mx.tile(mx.array([-200.0, 200.0, 0.0, -88.5]), 384), (2, 1, 1536))
    gate = mx.concatenate([gate, extremes.astype(dtype)], axis=1)  # exp(-gate) overflowing, 0 and 1
    x = mx.concatenate([x, x[:, :1]], axis=1)
    ours = swiglu(gate, x)
    ref = mlx_swiglu(gate, x)
    assert ours.dtype == ref.dtype == dtype
    scale = float(mx.max(mx.abs(ref.astype(mx.float32))))
    err = float(mx.max(mx.abs(ours.astype(mx.float32) - ref.astype(mx.float32))))
    assert err <= TOLERANCE[dtype] * max(scale, 1.0), (err, scale)
    assert bool(mx.all(mx.isfinite(ours)))
