"""Attention at the CPU's speed: kvd's `scaled_dot_product_attention` for MLX's CPU backend.

Why. On MLX's Linux CPU backend `mx.exp` is a scalar loop, so the softmax
dominates attention over a long cache: for 16 queries, 9 heads and 3 KV heads
over 2,064 keys (SmolLM2-135M) `mx.fast.scaled_dot_product_attention` took
5.9 ms per layer, 4.66 ms of it in the softmax (issue 26). Here:

- the grouped query heads are folded into one GEMM per KV head: queries
  (B, H, L, D) are viewed as (B, KV, G*L, D), so no key or value is repeated
  and the score matmul is one larger GEMM instead of G small ones;
- the softmax's exp is built from operations MLX does vectorize
  (Cody-Waite range reduction, a degree-6 Taylor polynomial on
  [-ln2/2, ln2/2], 2^n from the exponent bits by `left_shift` and `view`),
  in two `mx.compile(shapeless=True)` kernels so a growing cache does not
  recompile each step (`view` cannot be traced shapeless, so it sits
  between them; it copies nothing);
- the causal mask for `mask="causal"` is built once per (queries, keys)
  shape, i.e. once per forward, not once per layer.

Accuracy: a softmax only feeds the exp x - max(x) <= 0; there its relative
error is a few float32 ulps down to exp(-87), and below that (masked keys
included) it is exactly 0. Scores and probabilities are float32 whatever the
inputs' dtype; masked keys get float32's lowest value, not -inf, so a row
with every key masked (a left-padded prompt's padding) stays finite, as in
mlx-lm's own quantized path.

The hook. mlx-lm's models call `scaled_dot_product_attention` from
`mlx_lm.models.base`, but each model module binds the name at import
(`from .base import scaled_dot_product_attention`), so replacing it in
`base` alone reaches only modules imported afterwards. `install()` replaces
it in `base` *and* in every already imported `mlx_lm.models.*` module that
holds base's function; it is called by `load_model` after mlx-lm imported the
model's module. If mlx-lm ever changes so a model no longer goes through that
name (calls `mx.fast.scaled_dot_product_attention` itself, renames the
function), `tests/test_attention.py` fails: it counts the calls one forward of
the real default model makes through the hook. On Metal nothing is
installed: MLX's fused kernel is the fast path there.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import mlx.core as mx

__all__ = ["ENV_VAR", "attention", "install", "installed", "softmax", "uninstall"]

ENV_VAR = "KVD_ATTENTION"  # "mlx": keep MLX's own attention on the CPU too

# exp(x) = 2^n * exp(r), n = round(x / ln2), r = x - n*ln2 (ln2 split hi + lo so n*ln2_hi is exact).
_LOG2E = 1.4426950408889634
_LN2_HI = 0.693145751953125
_LN2_LO = 1.428606765330187045e-06
_ROUND = 12582912.0  # 1.5 * 2^23: adding and subtracting it rounds a float32 to the nearest integer
# Below it 2^n would leave float32's normal range: clamped there, n = -127 and the exponent bits
# are all zero, so exp(x) is exactly 0 (the true value, under 1.2e-38, is a subnormal).
_FLOOR = -88.0
_LOWEST = float(mx.finfo(mx.float32).min)
_TAYLOR = (1.0 / 720, 1.0 / 120, 1.0 / 24, 1.0 / 6, 0.5, 1.0, 1.0)


def _reduce(x: mx.array) -> tuple[mx.array, mx.array]:
    """exp(x - max(x)) along the last axis as (polynomial, exponent bits of 2^n)."""
    x = mx.maximum(x - mx.max(x, axis=-1, keepdims=True), _FLOOR)
    n = (x * _LOG2E + _ROUND) - _ROUND
    r = (x - n * _LN2_HI) - n * _LN2_LO
    p = mx.array(_TAYLOR[0], dtype=mx.float32)
    for c in _TAYLOR[1:]:
        p = p * r + c
    return p, mx.left_shift(n.astype(mx.int32) + 127, 23)


def _masked_reduce(x: mx.array, mask: mx.array) -> tuple[mx.array, mx.array]:
    return _reduce(mx.where(mask, x, _LOWEST))


def _additive_reduce(x: mx.array, mask: mx.array) -> tuple[mx.array, mx.array]:
    return _reduce(x + mask)


def _normalize(p: mx.array, two_n: mx.array) -> mx.array:
    e = p * two_n
    return e * (1.0 / mx.sum(e, axis=-1, keepdims=True))


_reduce_c = mx.compile(_reduce, shapeless=True)
_masked_reduce_c = mx.compile(_masked_reduce, shapeless=True)
_additive_reduce_c = mx.compile(_additive_reduce, shapeless=True)
_normalize_c = mx.compile(_normalize, shapeless=True)


def softmax(scores: mx.array, mask: mx.array | None = None) -> mx.array:
    """Softmax along the last axis, in float32; `mask` (broadcast to `scores`) is boolean (False
    drops a key) or added to the scores."""
    s = scores.astype(mx.float32)
    if mask is None:
        p, bits = _reduce_c(s)
    elif mask.dtype == mx.bool_:
        p, bits = _masked_reduce_c(s, mask)
    else:
        p, bits = _additive_reduce_c(s, mask.astype(mx.float32))
    return _normalize_c(p, bits.view(mx.float32))


_causal: dict[tuple[int, int], mx.array] = {}


def causal_mask(queries: int, keys: int) -> mx.array:
    """The (queries, keys) causal mask, the queries being the last ones; one array per shape, so the
    layers of one forward share it (and a graph computes it once)."""
    mask = _causal.get((queries, keys))
    if mask is None:
        if len(_causal) >= 8:
            _causal.clear()
        mask = mx.arange(keys - queries, keys)[:, None] >= mx.arange(keys)[None]
        _causal[(queries, keys)] = mask
    return mask


def _grouped_mask(mask: mx.array | str | None, L: int, S: int) -> mx.array | None:
    """The mask in the (B, KV, G, L, S) layout the grouped scores are viewed in."""
    if mask is None:
        return None
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown attention mask {mask!r}")
        return causal_mask(L, S) if L > 1 else None
    if mask.ndim == 4 and mask.shape[1] > 1:  # per query head: (B, H, L, S) -> (B, KV, G, L, S) below
        return mask
    if mask.ndim == 4:
        return mx.expand_dims(mask, 2)  # (B, 1, L, S) -> (B, 1, 1, L, S)
    return mask


def attention(
    queries: mx.array,
    keys: mx.array | tuple[mx.array, mx.array, mx.array],
    values: mx.array | tuple[mx.array, mx.array, mx.array],
    *,
    scale: float,
    mask: mx.array | str | None,
    group_size: int = 64,
    bits: int | None = None,
) -> mx.array:
    """softmax(scale * Q K^T + mask) V for Q (B, H, L, D), K and V (B, KV, S, D), H a multiple of KV.

    `bits` set: keys and values are mlx-lm's quantized (packed, scales, biases) triples.
    The queries go in blocks whose scores stay under BLOCK floats (see there).
    """
    B, H, L, D = queries.shape
    S = (keys[0] if isinstance(keys, tuple) else keys).shape[2]
    m = _grouped_mask(mask, L, S)
    step = max(1, BLOCK // max(B * H * S, 1))
    if step >= L:
        return _block(queries, keys, values, m, scale, group_size, bits)
    outs = []
    for i in range(0, L, step):
        bm = None if m is None else (m if m.shape[-2] == 1 else m[..., i:i + step, :])
        outs.append(_block(queries[:, :, i:i + step], keys, values, bm, scale, group_size, bits))
    return mx.concatenate(outs, axis=2)


# Scores per block of queries, in floats (512 KiB). On this machine MLX's CPU kernels slow down
# 5-10x per element once arrays leave the caches (an add over 1M floats 1.0 ms, over 512k
# 0.21 ms; the softmax's first kernel 27 ms against 3.0 ms), so a long prefill chunk over a long
# cache goes in blocks of queries; 2^17 and 2^18 measured best for 16-64 queries over 2k-4k keys.
BLOCK = 1 << 17


def _block(queries: mx.array, keys: Any, values: Any, m: mx.array | None, scale: float,
           group_size: int, bits: int | None) -> mx.array:
    B, H, L, D = queries.shape
    KV = (keys[0] if isinstance(keys, tuple) else keys).shape[1]
    G = H // KV
    q = (queries * scale).reshape(B, KV, G * L, D)
    if isinstance(keys, tuple):
        kw, ks, kb = keys
        scores = mx.quantized_matmul(q, kw, ks, kb, transpose=True, group_size=group_size, bits=bits)
    else:
        scores = q @ keys.swapaxes(-1, -2)
    S = scores.shape[-1]
    if m is not None and m.ndim == 4 and m.shape[1] == H:
        m = m.reshape(B, KV, G, L, S)
    probs = softmax(scores.reshape(B, KV, G, L, S), m).reshape(B, KV, G * L, S)
    if isinstance(values, tuple):
        vw, vs, vb = values
        out = mx.quantized_matmul(probs.astype(queries.dtype), vw, vs, vb, transpose=False,
                                  group_size=group_size, bits=bits)
    else:
        out = probs.astype(values.dtype) @ values
    return out.reshape(B, H, L, out.shape[-1])


def scaled_dot_product_attention(
    queries: mx.array,
    keys: Any,
    values: Any,
    cache: Any,
    scale: float,
    mask: Any,
    sinks: mx.array | None = None,
) -> mx.array:
    """mlx-lm's `base.scaled_dot_product_attention`, same signature, on kvd's CPU attention."""
    calls[0] += 1
    if sinks is not None:  # attention sinks (gpt-oss): MLX's own path
        return _original(queries, keys, values, cache, scale, mask, sinks)
    if hasattr(cache, "bits"):
        return attention(queries, keys, values, scale=scale, mask=mask,
                         group_size=cache.group_size, bits=cache.bits)
    return attention(queries, keys, values, scale=scale, mask=mask)


calls = [0]  # forwards' attention calls through the hook (a test counts them)
_original: Callable[..., mx.array]


def _base() -> Any:
    import mlx_lm.models.base as base

    return base


def installed() -> bool:
    return _base().scaled_dot_product_attention is scaled_dot_product_attention


def _rebind(old: object, new: object) -> int:
    """Point every imported mlx_lm.models module's `scaled_dot_product_attention` at `new`."""
    n = 0
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and getattr(module, "scaled_dot_product_attention", None) is old:
            setattr(module, "scaled_dot_product_attention", new)  # noqa: B010 (a module's name, on purpose)
            n += 1
    return n


def install() -> bool:
    """Use kvd's attention in every mlx-lm model, on the CPU backend only; whether it is in use.

    Call after `mlx_lm.utils.load` (the model's module is imported by then);
    modules imported later take it from `base`. Idempotent. `KVD_ATTENTION=mlx`
    in the environment keeps MLX's own (a benchmark's A/B, a suspected bug).
    """
    global _original
    if mx.metal.is_available() or os.environ.get(ENV_VAR, "").lower() == "mlx":
        return False
    base = _base()
    if base.scaled_dot_product_attention is not scaled_dot_product_attention:
        _original = base.scaled_dot_product_attention
        _rebind(_original, scaled_dot_product_attention)
    return True


def uninstall() -> None:
    """Back to mlx-lm's own attention (a benchmark's A/B, a test's reference)."""
    if installed():
        _rebind(scaled_dot_product_attention, _original)
