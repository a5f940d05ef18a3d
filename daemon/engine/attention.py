"""Attention at the CPU's speed: kvd's `scaled_dot_product_attention` for MLX's CPU backend.

Why. On MLX's Linux CPU backend `mx.exp` is a scalar loop, so the softmax
dominates attention over a long cache: for 16 queries, 9 heads and 3 KV heads
over 2,064 keys (SmolLM2-135M) `mx.fast.scaled_dot_product_attention` took
5.9 ms per layer, 4.66 ms of it in the softmax (issue 26). Here:

- the grouped query heads are folded into one GEMM per KV head: queries
  (B, H, L, D) are viewed as (B, KV, G*L, D), so no key or value is repeated
  and the score matmul is one larger GEMM instead of G small ones;
- the softmax's exp is `vexp.exp_parts` (operations MLX does vectorize),
  in two `mx.compile(shapeless=True)` kernels: max, subtract, mask and
  exp; then scale by 2^n, sum and normalize;
- the causal mask for `mask="causal"` is built once per (queries, keys)
  shape, i.e. once per forward, not once per layer; and once per thread: an
  MLX array belongs to the thread that made it (its stream is that thread's,
  MLX 0.31.2 on), so a mask one engine thread built, shared with another
  model's engine thread, failed its forward ("There is no Stream(cpu, 0) in
  current thread") or crashed the daemon when both evaluated it at once
  (SIGSEGV in libmlx: issue 51);
- a long chunk of queries over a long cache goes in blocks (see BLOCK).

Accuracy: a softmax only feeds the exp x - max(x) <= 0; there its relative
error is a few float32 ulps down to exp(-87), and below that (masked keys
included) it is exactly 0. Scores and probabilities are float32 whatever the
inputs' dtype; masked keys get float32's lowest value, not -inf, so a row
with every key masked (a left-padded prompt's padding) stays finite, as in
mlx-lm's own quantized path.

The hook (`install`, called by `load_model`). mlx-lm's models call
`scaled_dot_product_attention` from `mlx_lm.models.base` (and `swiglu` from
`mlx_lm.models.activations`, replaced by `swiglu` here), but each model
module binds the names at import, so replacing them in `base` alone reaches
only modules imported afterwards. `install()` replaces each in its defining
module *and* in every already imported `mlx_lm.models.*` module that holds
the original. If mlx-lm ever changes so a model no longer goes through those
names (calls `mx.fast.scaled_dot_product_attention` itself, renames the
function), `tests/test_attention_model.py` fails: it counts the calls one
forward of the real default model makes through the hook. (mlx-lm 0.32's
deepseek_v41, muse_spark and plamo2 call `mx.fast` directly and keep MLX's
attention.) On a GPU (Metal or CUDA) nothing is installed: MLX's fused kernel is the
fast path there (daemon/device.py decides).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from ..device import ATTENTION_ENV as ENV_VAR
from . import vexp
from .vexp import LOW, exp_parts

__all__ = ["ENV_VAR", "attention", "install", "installed", "softmax", "uninstall"]


_LOWEST = float(mx.finfo(mx.float32).min)


def _reduce(x: mx.array) -> tuple[mx.array, mx.array]:
    """exp(x - max(x)) along the last axis as (polynomial, exponent bits of 2^n): see vexp."""
    return exp_parts(mx.maximum(x - mx.max(x, axis=-1, keepdims=True), LOW))


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
    if s.shape[-1] == 1:
        # One key (a first token over an empty cache): MLX 0.32's CPU compiler fails on the
        # shapeless kernels reduced over a length-1 axis (its JIT errors, then a segfault).
        if mask is not None:
            s = mx.where(mask, s, _LOWEST) if mask.dtype == mx.bool_ else s + mask
        return mx.softmax(s, axis=-1, precise=True)
    if mask is None:
        p, bits = _reduce_c(s)
    elif mask.dtype == mx.bool_:
        p, bits = _masked_reduce_c(s, mask)
    else:
        p, bits = _additive_reduce_c(s, mask.astype(mx.float32))
    return _normalize_c(p, bits.view(mx.float32))


class _Masks(threading.local):
    """Each thread's causal masks by shape: never another thread's (see the module's docstring)."""

    def __init__(self) -> None:
        self.by_shape: dict[tuple[int, int], mx.array] = {}


_causal = _Masks()


def causal_mask(queries: int, keys: int) -> mx.array:
    """The (queries, keys) causal mask, the queries being the last ones; one array per shape and
    thread, so the layers of one forward share it (and a graph computes it once)."""
    masks = _causal.by_shape
    mask = masks.get((queries, keys))
    if mask is None:
        if len(masks) >= 8:
            masks.clear()
        mask = mx.arange(keys - queries, keys)[:, None] >= mx.arange(keys)[None]
        masks[(queries, keys)] = mask
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
    keys: mx.array | Sequence[mx.array],
    values: mx.array | Sequence[mx.array],
    *,
    scale: float,
    mask: mx.array | str | None,
    group_size: int = 64,
    bits: int | None = None,
) -> mx.array:
    """softmax(scale * Q K^T + mask) V for Q (B, H, L, D), K and V (B, KV, S, D), H a multiple of KV.

    `bits` set: keys and values are mlx-lm's quantized (packed, scales, biases) triples (tuples or,
    from a restored cache, lists).
    The queries go in blocks whose scores stay under BLOCK floats (see there).
    """
    B, H, L, D = queries.shape
    S = (keys[0] if isinstance(keys, Sequence) else keys).shape[2]
    m = _grouped_mask(mask, L, S)
    step = max(1, BLOCK // max(B * H * S, 1))
    if step >= L:
        return _block(queries, keys, values, m, scale, group_size, bits)
    outs = []
    for i in range(0, L, step):
        bm = None if m is None else (m if m.shape[-2] == 1 else m[..., i:i + step, :])
        outs.append(_block(queries[:, :, i:i + step], keys, values, bm, scale, group_size, bits))
    return mx.concatenate(outs, axis=2)


# Scores per block of queries, in floats (1.5 MiB). On this machine MLX's CPU kernels slow down
# 5-10x per element once arrays leave the caches (an add over 1M floats 1.0 ms, over 512k
# 0.21 ms; the softmax's first kernel 27 ms against 3.0 ms), so a long prefill chunk over a long
# cache goes in blocks of queries. Sized so 16 queries x 9 heads over 2k keys (a next turn) stay
# one block; 64 queries over 4k keys took 65-69 ms in blocks of 2^18-3*2^17 floats against 114 ms
# in one (min of 25, loaded machine).
BLOCK = 3 << 17


def _block(queries: mx.array, keys: Any, values: Any, m: mx.array | None, scale: float,
           group_size: int, bits: int | None) -> mx.array:
    B, H, L, D = queries.shape
    KV = (keys[0] if bits is not None else keys).shape[1]
    G = H // KV
    q = (queries * scale).reshape(B, KV, G * L, D)
    if bits is not None:  # (packed, scales, biases), a tuple or a list
        kw, ks, kb = keys
        scores = mx.quantized_matmul(q, kw, ks, kb, transpose=True, group_size=group_size, bits=bits)
    else:
        scores = q @ keys.swapaxes(-1, -2)
    S = scores.shape[-1]
    if m is not None and m.ndim == 4 and m.shape[1] == H:
        m = m.reshape(B, KV, G, L, S)
    probs = softmax(scores.reshape(B, KV, G, L, S), m).reshape(B, KV, G * L, S)
    if bits is not None:
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
    if sinks is not None or not pays(queries, keys):  # attention sinks (gpt-oss), or too small: MLX's own
        return _original(queries, keys, values, cache, scale, mask, sinks)
    if hasattr(cache, "bits"):
        return attention(queries, keys, values, scale=scale, mask=mask,
                         group_size=cache.group_size, bits=cache.bits)
    return attention(queries, keys, values, scale=scale, mask=mask)


calls = [0]  # forwards' attention calls through the hook (a test counts them)

# Below these sizes MLX's own kernels win: kvd's path costs a fixed ~0.1 ms a call (its kernels'
# launches), MLX's grows with the scores. Measured on a 2-core Xeon (AVX-512), eval'd alone, ms per
# call, MLX's against kvd's: decode (one query) over 32 keys with 9 heads 0.079 / 0.104, with 32
# heads 0.115 / 0.135; one head over 1,024 keys 0.108 / 0.178, over 4,096 0.474 / 0.449; 9 heads
# over 512 keys 0.362 / 0.260, over 2,048 1.87 / 0.93; 16 queries over 128 keys, one head 0.191 /
# 0.278, 9 heads 1.02 / 0.65. So kvd's attention from 4,096 scores (batch x heads x queries x keys)
# up; its swiglu from 2,048 elements (one token of a 128-wide MLP 0.061 / 0.103 ms, of 1,536 0.080 /
# 0.101, of 8,192 0.309 / 0.110; 16 tokens of 128 0.101 / 0.102). A micro model (bench/hostcost.py's:
# 4 heads, 128-wide MLP) decoded at 0.77x in-process mlx-lm with kvd's kernels at every size.
MIN_SCORES = 4096
MIN_SWIGLU = 2048


def pays(queries: mx.array, keys: Any) -> bool:
    """Whether kvd's attention beats MLX's for these queries (B, H, L, D) over these keys (a quantized
    cache's keys are a (packed, scales, biases) triple)."""
    B, H, L, _ = queries.shape
    S = (keys[0] if isinstance(keys, Sequence) else keys).shape[2]
    return bool(B * H * L * S >= MIN_SCORES)


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """mlx-lm's `activations.swiglu`: vexp's from MIN_SWIGLU elements, MLX's own below."""
    if gate.size >= MIN_SWIGLU:
        return vexp.swiglu(gate, x)
    return _mlx("swiglu")(gate, x)


def _hooks() -> list[tuple[Any, str, Callable[..., mx.array]]]:
    """(mlx-lm module, name, kvd's replacement): what `install` rebinds."""
    import mlx_lm.models.activations as activations
    import mlx_lm.models.base as base

    return [(base, "scaled_dot_product_attention", scaled_dot_product_attention),
            (activations, "swiglu", swiglu)]


_originals: dict[str, Callable[..., mx.array]] = {}


def _mlx(name: str) -> Callable[..., mx.array]:
    """mlx-lm's own `name` (what `install` replaced, or what is there before it ran)."""
    fn = _originals.get(name)
    if fn is None:
        fn = next(getattr(module, n) for module, n, _ in _hooks() if n == name)
    return fn


def _original(*args: Any) -> mx.array:
    return _mlx("scaled_dot_product_attention")(*args)


def installed() -> bool:
    return all(getattr(module, name) is ours for module, name, ours in _hooks())


def _rebind(name: str, old: object, new: object) -> None:
    """Point every imported mlx_lm.models module's `name` that is `old` at `new`."""
    for key, module in list(sys.modules.items()):
        if key.startswith("mlx_lm.models.") and getattr(module, name, None) is old:
            setattr(module, name, new)


def install(wanted: bool | None = None) -> bool:
    """Use kvd's attention and swiglu in every mlx-lm model where the device policy says so
    (daemon/device.py: the CPU backend only); whether they are in use.

    mlx-lm's model modules bind both names at import (`from .base import
    scaled_dot_product_attention`, `from .activations import swiglu`), so each
    is rebound in its defining module and in every imported `mlx_lm.models.*`
    module holding the original; modules imported later take it from the
    defining module. Call after `mlx_lm.utils.load`. Idempotent.
    `wanted`: the decision, None to ask this process's device policy (where
    `KVD_ATTENTION=mlx` in the environment keeps MLX's own on the CPU too: a
    benchmark's A/B, a suspected bug).
    """
    if wanted is None:
        from ..device import current

        wanted = current().kvd_attention
    if not wanted:
        return False
    for module, name, ours in _hooks():
        current_fn = getattr(module, name)
        if current_fn is not ours:
            _originals[name] = current_fn
            _rebind(name, current_fn, ours)
    return True


def uninstall() -> None:
    """Back to mlx-lm's own functions (a benchmark's A/B, a test's reference)."""
    for module, name, ours in _hooks():
        if getattr(module, name) is ours:
            _rebind(name, ours, _originals[name])
