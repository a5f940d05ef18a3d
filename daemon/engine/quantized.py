"""Quantized KV caches that kvd's decode batch (decode.py) can batch.

mlx-lm has a single-sequence ``QuantizedKVCache`` but no batched counterpart,
and the decode batch merges per-sequence caches with ``c.merge([c])``.
``BatchQuantizedKVCache`` is the quantized analogue of ``BatchKVCache`` (left
padding, per-row offsets, right-padding prepare/finalize, filter/extend/extract);
``KvdQuantizedKVCache`` is a ``QuantizedKVCache`` that knows how to merge into
one. Keys and values are ``(packed, scales, biases)`` triples; ``mx.quantize``
works along head_dim, so a row's data does not depend on the other rows or on
how the sequence was chunked, and every sequence-axis operation (pad, roll,
slice) is applied to all three arrays alike.
"""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import (
    KVCache,
    QuantizedKVCache,
    dynamic_roll,
    make_prompt_cache,
)

__all__ = ["BatchQuantizedKVCache", "KvdQuantizedKVCache", "as_batchable", "make_cache"]

_Triple = tuple[mx.array, mx.array, mx.array]


def _ints(a: mx.array) -> list[int]:
    return cast("list[int]", a.tolist())


def _tmap(f: Any, t: Any) -> Any:
    return tuple(f(x) for x in t)


class KvdQuantizedKVCache(QuantizedKVCache):
    """A ``QuantizedKVCache`` that the decode batch can merge into a batch."""

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchQuantizedKVCache:
        return BatchQuantizedKVCache.merge(caches)


class BatchQuantizedKVCache:
    """A left-padded batch of quantized KV caches (cf. mlx-lm's ``BatchKVCache``).

    A class of its own, not a subclass of mlx-lm's private cache base: it defines every
    method a batch cache is called with (the model's attention, the decode batch).
    """

    step = 256

    def __init__(self, left_padding: list[int], group_size: int = 64, bits: int = 8):
        self.keys: _Triple | None = None
        self.values: _Triple | None = None
        self.left_padding = mx.array(left_padding)
        self.offset = mx.array([-p for p in left_padding])
        self.used = 0
        self._right_padding: mx.array | None = None
        self.group_size = group_size
        self.bits = bits

    # -- forward ---------------------------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[_Triple, _Triple]:
        B, H, n, Dk = keys.shape
        Dv = values.shape[-1]
        prev = self.used
        if self.keys is None or self.values is None or prev + n > self.keys[0].shape[2]:
            el_per_int = 8 * mx.uint32.size // self.bits
            new_steps = (self.step + n - 1) // self.step * self.step
            shape = (B, H, new_steps)

            def init_quant(dim: int) -> _Triple:
                return (
                    mx.zeros((*shape, dim // el_per_int), dtype=mx.uint32),
                    mx.zeros((*shape, dim // self.group_size), dtype=keys.dtype),
                    mx.zeros((*shape, dim // self.group_size), dtype=keys.dtype),
                )

            if self.keys is not None and self.values is not None:
                ks, vs = self.keys, self.values
                if prev % self.step != 0:
                    ks = _tmap(lambda x: x[..., :prev, :], ks)
                    vs = _tmap(lambda x: x[..., :prev, :], vs)

                def grow(x: mx.array) -> mx.array:
                    return mx.concatenate(
                        [x, mx.zeros((*shape, x.shape[-1]), dtype=x.dtype)], axis=2)

                self.keys, self.values = _tmap(grow, ks), _tmap(grow, vs)
            else:
                self.keys, self.values = init_quant(Dk), init_quant(Dv)

        self.offset = self.offset + n
        self.used += n
        qk = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        qv = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        for i in range(3):
            self.keys[i][..., prev:self.used, :] = qk[i]
            self.values[i][..., prev:self.used, :] = qv[i]
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[_Triple, _Triple]:
        assert self.keys is not None and self.values is not None
        idx = self.used
        return (_tmap(lambda x: x[..., :idx, :], self.keys),
                _tmap(lambda x: x[..., :idx, :], self.values))

    def prepare(self, *, left_padding: Any = None, lengths: Any = None,
                right_padding: Any = None) -> None:
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("Left padding can only be added to an empty BatchQuantizedKVCache")
            lp = mx.array(left_padding)
            self.left_padding = self.left_padding + lp
            self.offset = self.offset - lp
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(right_padding)

    def finalize(self) -> None:
        if self._right_padding is not None:
            padding = self._right_padding
            if self.keys is not None and self.values is not None:
                shifts = padding[:, None]
                self.keys = _tmap(lambda x: dynamic_roll(x, shifts, axis=2), self.keys)
                self.values = _tmap(lambda x: dynamic_roll(x, shifts, axis=2), self.values)
            self.offset = self.offset - padding
            self.left_padding = self.left_padding + padding
            self._right_padding = None

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> mx.array:
        mask: mx.array = create_causal_mask(N, offset=self.used, left_padding=self.left_padding, **kwargs)
        return mask

    # -- batch management --------------------------------------------------------

    def filter(self, batch_indices: Any) -> None:
        if self.keys is not None and self.values is not None:
            self.keys = _tmap(lambda x: x[batch_indices], self.keys)
            self.values = _tmap(lambda x: x[batch_indices], self.values)
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        min_left_pad = min(_ints(self.left_padding))
        if min_left_pad > 0:
            if self.keys is not None and self.values is not None:
                self.keys = _tmap(lambda x: x[..., min_left_pad:, :], self.keys)
                self.values = _tmap(lambda x: x[..., min_left_pad:, :], self.values)
            self.used -= min_left_pad
            self.left_padding = self.left_padding - min_left_pad

    def extend(self, other: BatchQuantizedKVCache) -> None:
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        template = self if self.keys is not None else other
        assert template.keys is not None and template.values is not None
        tk, tv = template.keys, template.values
        max_idx = max(self.used, other.used)
        max_size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)

        def pad(c: BatchQuantizedKVCache) -> tuple[_Triple, _Triple, mx.array, mx.array]:
            if c.keys is None or c.values is None:
                Bc = c.offset.shape[0]
                k = _tmap(lambda t: mx.zeros((Bc, t.shape[1], 0, t.shape[3]), t.dtype), tk)
                v = _tmap(lambda t: mx.zeros((Bc, t.shape[1], 0, t.shape[3]), t.dtype), tv)
            else:
                k, v = c.keys, c.values
            left = max_idx - c.used
            right = max_size - k[0].shape[2] - left
            if right < 0:
                k = _tmap(lambda x: x[..., :right, :], k)
                v = _tmap(lambda x: x[..., :right, :], v)
                right = 0
            if left or right:
                widths = [(0, 0), (0, 0), (left, right), (0, 0)]
                k = _tmap(lambda x: mx.pad(x, widths), k)
                v = _tmap(lambda x: mx.pad(x, widths), v)
            return k, v, c.offset, c.left_padding + left

        (ka, va, oa, la), (kb, vb, ob, lb) = pad(self), pad(other)
        self.keys = tuple(mx.concatenate([a, b]) for a, b in zip(ka, kb))  # type: ignore[assignment]
        self.values = tuple(mx.concatenate([a, b]) for a, b in zip(va, vb))  # type: ignore[assignment]
        self.offset = mx.concatenate([oa, ob])
        self.left_padding = mx.concatenate([la, lb])
        self.used = max_idx

    def extract(self, idx: int) -> KvdQuantizedKVCache:
        cache = KvdQuantizedKVCache(group_size=self.group_size, bits=self.bits)
        if self.keys is None or self.values is None:
            return cache
        mx.eval(self.left_padding)
        padding = _ints(self.left_padding)[idx]
        if padding >= self.used:
            return cache
        end = self.used
        cache.keys = _tmap(lambda x: mx.contiguous(x[idx:idx + 1, :, padding:end]), self.keys)
        cache.values = _tmap(lambda x: mx.contiguous(x[idx:idx + 1, :, padding:end]), self.values)
        cache.offset = end - padding
        return cache

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchQuantizedKVCache:
        first = caches[0]
        group_size, bits = first.group_size, first.bits
        for c in caches:
            if (c.group_size, c.bits) != (group_size, bits):
                raise ValueError(
                    f"cannot batch quantized caches of group_size/bits {c.group_size}/{c.bits} "
                    f"and {group_size}/{bits}")
        lengths = [c.offset if c.keys is not None else 0 for c in caches]
        max_length = max(lengths)
        if max_length == 0:
            return cls([0] * len(caches), group_size, bits)
        padding = [max_length - n for n in lengths]
        B = len(caches)
        tk = next(c.keys for c in caches if c.keys is not None)
        tv = next(c.values for c in caches if c.values is not None)
        keys = _tmap(lambda t: mx.zeros((B, t.shape[1], max_length, t.shape[3]), t.dtype), tk)
        values = _tmap(lambda t: mx.zeros((B, t.shape[1], max_length, t.shape[3]), t.dtype), tv)
        for i, (p, c) in enumerate(zip(padding, caches)):
            if c.keys is None:
                continue
            for j in range(3):
                keys[j][i:i + 1, :, p:p + c.offset] = c.keys[j][..., :c.offset, :]
                values[j][i:i + 1, :, p:p + c.offset] = c.values[j][..., :c.offset, :]
        cache = cls(padding, group_size, bits)
        cache.keys, cache.values = keys, values
        cache.offset = cache.offset + max_length
        cache.used = max_length
        return cache

    # -- bookkeeping -------------------------------------------------------------

    @property
    def state(self) -> Any:
        return self.keys, self.values, self.offset, self.left_padding, self.used

    @state.setter
    def state(self, v: Any) -> None:
        self.keys, self.values, self.offset, self.left_padding, self.used = v

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.used, n)
        self.used -= n
        self.offset = self.offset - n
        return n

    def size(self) -> int:
        return self.used

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        return sum(x.nbytes for x in (*self.keys, *self.values))


def as_batchable(cache: list[Any]) -> list[Any]:
    """Re-class plain ``QuantizedKVCache`` layers (from ``snapshot.restore``) in place.

    ``KvdQuantizedKVCache`` adds no state, so changing the class is safe; the
    layers can then enter the decode batch (``Decoder.step``).
    """
    for c in cache:
        if type(c) is QuantizedKVCache:
            c.__class__ = KvdQuantizedKVCache
    return cache


def _head_dim(model: Any) -> int | None:
    args = getattr(model, "args", None)
    for obj in (args, model):
        hd = getattr(obj, "head_dim", None)
        if isinstance(hd, int) and hd > 0:
            return hd
    hidden = getattr(args, "hidden_size", None)
    heads = getattr(args, "num_attention_heads", None)
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return hidden // heads
    return None


def pick_group_size(model: Any, group_size: int = 64) -> int:
    """``group_size``, or the largest smaller supported size dividing the head_dim."""
    hd = _head_dim(model)
    if hd is None:
        return group_size
    for g in (128, 64, 32):
        if g <= group_size and hd % g == 0:
            return g
    raise ValueError(f"head_dim {hd} is not a multiple of 32: cannot quantize the KV cache")


def make_cache(model: Any, kv_bits: int | None, group_size: int = 64) -> list[Any]:
    """``make_prompt_cache(model)``, with plain KVCache layers quantized to ``kv_bits``.

    Rotating (sliding-window) and other layers are left as they are: mlx-lm has
    no quantized rotating cache.
    """
    cache = make_prompt_cache(model)
    if not kv_bits:
        return cache
    g = pick_group_size(model, group_size)
    return [KvdQuantizedKVCache(group_size=g, bits=kv_bits) if type(c) is KVCache else c
            for c in cache]
