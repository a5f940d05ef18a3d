"""A prompt's last chunk through the model's twin that computes its last position's logits only.

`prefill.last_position` builds the twin and checks it at load; a prefill with
it must give the very first token and the very cache a prefill without it
gives, over a cache and from nothing, on both built-in models (a sliding
window among them); a model of another structure keeps its whole head. And a window's prefill
reports every block end it reaches, the prompt's own end included.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

from daemon.engine.prefill import Prefill, last_position
from daemon.engine.quantized import make_cache

PROMPT = [(7 * i + 3) % 200 + 5 for i in range(150)]  # longer than tiny-swa's 64-token window


@pytest.mark.parametrize("name", ["builtin:tiny", "builtin:tiny-swa"])
@pytest.mark.parametrize("fed", [0, 100])
def test_the_last_chunk_through_the_twin_gives_the_same_logits_and_cache(models: dict[str, Any], name: str,
                                                                        fed: int) -> None:
    model = models[name]
    twin = last_position(model, lambda: make_cache(model, None))
    assert twin is not None and twin is not model
    results = []
    for last in (None, twin):
        cache = make_cache(model, None)
        if fed:
            Prefill(model, cache, PROMPT[:fed + 1], 0, step=64).advance(fed)  # a cache of `fed` ids
        pre = Prefill(model, cache, PROMPT, fed, step=16, last=last)
        while (logprobs := pre.advance()) is None:
            pass
        mx.eval(logprobs)
        results.append((logprobs, [c.state for c in cache]))
    (whole, cache_a), (ours, cache_b) = results
    assert ours.shape == whole.shape == (1, model.args.vocab_size)
    # on a GPU CUDA's matmuls round differently by chunk shape (3e-3 on an H100, docs/benchmarks.md)
    assert float(mx.max(mx.abs(ours - whole))) <= (1e-4 if mx.default_device() == mx.cpu else 1e-2)
    assert mx.array_equal(mx.argmax(ours), mx.argmax(whole))
    for a, b in zip(cache_a, cache_b, strict=True):
        for x, y in zip(a, b, strict=True):
            assert mx.array_equal(x, y)  # the layers ran the same: only the head's rows differ


@pytest.mark.parametrize("fed", [0, 100])
def test_a_windows_block_ends_are_each_reported_the_prompts_own_end_included(models: dict[str, Any],
                                                                            fed: int) -> None:
    """A sliding window's block is taken where the prefill reaches its end (`at_boundary`): a prompt
    that ends on one reports it too, after its last chunk (issue 51: that block was lost)."""
    model = models["builtin:tiny-swa"]
    cache = make_cache(model, None)
    if fed:
        Prefill(model, cache, PROMPT[:fed + 1], 0, step=64).advance(fed)  # a cache of `fed` ids
    seen: list[tuple[int, int, bool]] = []
    pre = Prefill(model, cache, PROMPT[:128], fed, step=48, boundary=32,
                  at_boundary=lambda c, ids, last=False: seen.append((len(ids), c[0].offset, last)))
    while pre.advance() is None:
        pass
    # each block's end, the prompt's last id but one (a checkpoint: `last`), and the prompt's own end
    assert seen == [*((n, n, False) for n in (32, 64, 96) if n > fed), (127, 127, True), (128, 128, False)]


def test_the_twin_shares_the_weights_and_leaves_the_model_alone(models: dict[str, Any]) -> None:
    model = models["builtin:tiny"]
    twin = last_position(model, lambda: make_cache(model, None))
    assert twin is not None
    assert type(model.model).__name__ != "_LastOnly"  # the model itself still computes every position
    out = model(mx.array([[5, 6, 7]]), cache=make_cache(model, None))
    assert out.shape[1] == 3
    assert twin.model.inner is model.model and twin.model.embed_tokens is model.model.embed_tokens


class _Net(dict[str, Any]):
    """What `last_position` relies on in an `mlx.nn.Module`: its children are its dict's entries."""

    def __getattr__(self, name: str) -> Any:
        return self[name]


TABLE = mx.arange(64, dtype=mx.float32).reshape(16, 4) / 64


class _Elsewhere(_Net):
    """A model whose network is not `model`: mlx-lm's multimodal wrappers call theirs `language_model`."""

    def __init__(self) -> None:
        super().__init__(language_model=lambda x: TABLE[x])

    def __call__(self, x: mx.array, cache: Any = None) -> mx.array:
        out: mx.array = self.language_model(x) @ mx.ones((4, 8))
        return out


class _Mixing(_Net):
    """A model whose head mixes positions (its last logits depend on the others): the check refuses it."""

    def __init__(self) -> None:
        super().__init__(model=lambda x: TABLE[x])

    def __call__(self, x: mx.array, cache: Any = None) -> mx.array:
        return mx.cumsum(self.model(x), axis=1) @ mx.ones((4, 8))


class _Pair(_Net):
    """A model whose network returns more than its hidden states: slicing them fails, the check refuses."""

    def __init__(self) -> None:
        super().__init__(model=lambda x: (TABLE[x], mx.zeros((1,))))

    def __call__(self, x: mx.array, cache: Any = None) -> mx.array:
        h, _ = self.model(x)
        out: mx.array = h @ mx.ones((4, 8))
        return out


@pytest.mark.parametrize("model", [_Elsewhere(), _Mixing(), _Pair()], ids=["elsewhere", "mixing", "pair"])
def test_a_model_of_another_structure_keeps_its_whole_head(model: _Net) -> None:
    assert last_position(model, list) is None
