"""Speculative decoding: drafts, the exact accept rules, and rollback in kvd's decode batch, on the built-in models."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from cachestore.snapshot import restore, snapshot
from daemon.engine import speculate
from daemon.engine.decode import Decoder, Row
from daemon.engine.draft import MISS_PAUSE, PAUSE_STEPS, WINDOW, Answers, DraftBudget, PromptLookup
from daemon.engine.draws import Draws
from daemon.engine.prefill import Prefill, first_token
from daemon.engine.quantized import as_batchable, make_cache
from daemon.engine.speculate import Speculation
from daemon.engine.verify import Target, target_logits, verify

# --- drafting -----------------------------------------------------------------


def test_prompt_lookup_proposes_what_followed_the_longest_latest_match() -> None:
    d = PromptLookup([1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 8, 3, 4], min_n=2)
    # "3 4" ended earlier at 4 (then 5) and at 9 (then 6): the latest wins. "8 3 4"? never before.
    assert d.propose(3) == [6, 7, 8]
    d.extend([6])
    assert d.propose(2) == [7, 8]  # "3 4 6" is the longer match
    assert d.propose(0) == []
    assert PromptLookup([1, 2, 3]).propose(4) == []  # nothing repeats
    assert PromptLookup([1, 2, 3, 4, 5, 9, 2, 3, 4]).propose(2) == [5, 9]  # the default: 3 tokens at least


def test_prompt_lookup_with_a_pending_token_and_a_prior_answer() -> None:
    d = PromptLookup([5, 6, 7, 8, 1, 5, 6])
    assert d.may_propose()  # "5 6" came before: the pending token may complete a 3-gram
    assert d.propose(2, after=[7]) == [8, 1]
    assert d.propose(2, after=[9]) == []
    assert d.ids == [5, 6, 7, 8, 1, 5, 6]  # proposing never feeds it
    assert not PromptLookup([5, 6, 7, 8]).may_propose()  # no way to match: the step is not held up
    regen = PromptLookup([39, 40, 41], prior=[40, 41, 42, 43, 44])
    assert regen.may_propose() and regen.propose(3, after=[42]) == [43, 44]  # only the old answer has it


def test_draft_budget_grows_shrinks_and_pauses() -> None:
    b = DraftBudget()
    k = b.wanted()
    b.record(k, k)
    assert b.wanted() == 2 * k
    b.record(8, 1)
    assert b.wanted() == k
    b.record(2, 0)  # refused whole: a short pause
    assert [b.wanted() for _ in range(MISS_PAUSE + 1)] == [0] * MISS_PAUSE + [1]
    for _ in range(WINDOW):  # a window of drafts the model mostly refuses: drafting stops for a while
        b.record(1, 0)
    assert all(b.wanted() == 0 for _ in range(PAUSE_STEPS))
    assert b.drafted == k + 8 + 2 + WINDOW and b.accepted == k + 1


def test_answers_remember_recent_sessions_only() -> None:
    a = Answers(size=2)
    a.keep("a", [1])
    a.keep("b", [2])
    a.keep("c", [3])
    assert (a.get("a"), a.get("b"), a.get("c")) == ([], [2], [3])


# --- the batch: speculation versus plain decoding ---------------------------------

N = 80
PROMPTS = [
    [(7 * i + 3) % 200 + 5 for i in range(40)],
    [(11 * i + 1) % 150 + 9 for i in range(9)] * 3,
    list(range(20, 60)) * 2,  # longer than tiny-swa's 64-token window: it wraps during the prefill
]


def decode(model: Any, prompts: list[list[int]], *, spec: bool, bits: int | None,
           caches: list[list[Any]] | None = None, all_tokens: list[list[int]] | None = None,
           n: int = N, temperature: float = 0.0, seeds: list[int] | None = None,
           ) -> tuple[list[list[int]], list[tuple[list[Any], list[int]]], list[Speculation]]:
    """Decoding in one batch, the way the engine runs it (each prompt prefilled alone, then joined):
    each prompt's tokens, its final cache and ids, its speculation."""
    dec = Decoder(model)
    specs: list[Speculation] = []
    toks: dict[str, list[int]] = {}
    done: dict[str, tuple[list[Any], list[int]]] = {}
    entering: list[Row] = []
    for i, prompt in enumerate(prompts):
        cache = caches[i] if caches else make_cache(model, bits)
        before = all_tokens[i] if all_tokens else []
        ids = [*before, *prompt]
        pre = Prefill(model, cache, ids, len(before), step=4096)
        logprobs = pre.advance()
        assert logprobs is not None
        draws = Draws(temperature, 1.0, seed=seeds[i] if seeds else None, size=n + 16)
        first = first_token(logprobs, draws.take)
        sp = Speculation() if spec else None
        if sp is not None:
            specs.append(sp)
        entering.append(Row(str(i), ids, draws, n - 1, frozenset(), spec=sp, cache=cache, first=first))
        toks[str(i)] = [first]
    while len(done) < len(prompts):
        for r in dec.step(entering):
            toks[r.key].append(r.token)
            if r.finish is not None:
                assert r.cache is not None and r.tokens is not None
                done[r.key] = (r.cache, list(r.tokens))
        entering = []
    keys = [str(i) for i in range(len(prompts))]
    return [toks[k] for k in keys], [done[k] for k in keys], specs


CASES = [("builtin:tiny", None), ("builtin:tiny", 8), ("builtin:tiny-swa", None), ("builtin:tiny-swa", 8)]


@pytest.mark.parametrize(("name", "bits"), CASES)
def test_batched_speculation_is_token_for_token_plain_decoding(models: dict[str, Any], name: str,
                                                               bits: int | None) -> None:
    model = models[name]
    plain, plain_caches, _ = decode(model, PROMPTS, spec=False, bits=bits)
    fast, fast_caches, specs = decode(model, PROMPTS, spec=True, bits=bits)
    assert fast == plain
    assert [ids for _, ids in fast_caches] == [ids for _, ids in plain_caches]
    # Speculation ran, and the rows kept different numbers of draft tokens (rolled back row by row).
    accepted = [s.budget.accepted for s in specs]
    assert all(s.budget.drafted > 0 for s in specs) and len(set(accepted)) > 1
    if name == "builtin:tiny-swa":
        assert all(len(p) + N > 64 for p in PROMPTS)  # every window wrapped before the answer ended


@pytest.mark.parametrize(("name", "bits"), CASES)
def test_after_a_speculative_turn_the_next_turn_equals_a_fresh_prefill(models: dict[str, Any], name: str,
                                                                       bits: int | None) -> None:
    """The cache a speculative turn leaves, kept (live or snapshot, as the tiers keep it), continues exactly."""
    model = models[name]
    _, ends, specs = decode(model, PROMPTS, spec=True, bits=bits)
    assert all(s.budget.drafted > 0 for s in specs)
    suffix = [31, 32, 33, 34, 35]
    for cache, ids in ends:
        (fresh,), _, _ = decode(model, [ids + suffix], spec=False, bits=bits, n=12)
        for kept in (cache, as_batchable(restore(snapshot(cache)))):
            (got,), _, _ = decode(model, [suffix], spec=False, bits=bits, caches=[kept], all_tokens=[ids], n=12)
            assert got == fresh


@pytest.mark.parametrize(("name", "bits"), [("builtin:tiny", None), ("builtin:tiny-swa", 8)])
def test_a_seeded_sampled_answer_is_the_same_alone_batched_and_speculated(models: dict[str, Any], name: str,
                                                                          bits: int | None) -> None:
    """Each draw uses the turn's own key for its answer position: nothing else moves it."""
    model = models[name]
    seeds = [11, 22, 33]
    (alone,), _, _ = decode(model, PROMPTS[:1], spec=False, bits=bits, temperature=0.5, seeds=seeds[:1])
    batched, _, _ = decode(model, PROMPTS, spec=False, bits=bits, temperature=0.5, seeds=seeds)
    fast, _, specs = decode(model, PROMPTS, spec=True, bits=bits, temperature=0.5, seeds=seeds)
    assert batched[0] == alone and fast == batched
    assert any(s.budget.accepted > 0 for s in specs)  # drafts were kept, so verification drew the tokens
    (other,), _, _ = decode(model, PROMPTS[:1], spec=False, bits=bits, temperature=0.5, seeds=[12])
    assert other != alone  # the test can fail: another seed draws another answer


# --- sampling: the target's distribution, whatever the draft -------------------------

SAMPLES = 3000


def chi_square_critical(df: int, z: float = 3.09) -> float:
    """The chi-square value a p of 0.001 lies beyond (Wilson-Hilferty)."""
    return float(df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3)


def chi_square(counts: dict[int, int], probs: list[float], n: int) -> tuple[float, int]:
    """Against `probs` over the tokens expected 10+ times, the rest pooled in one bin."""
    big = [t for t, p in enumerate(probs) if p * n >= 10]
    stat, rest_p, rest_c = 0.0, 1.0 - sum(probs[t] for t in big), n - sum(counts.get(t, 0) for t in big)
    for t in big:
        e = probs[t] * n
        stat += (counts.get(t, 0) - e) ** 2 / e
    if rest_p * n >= 1:
        stat += (rest_c - rest_p * n) ** 2 / (rest_p * n)
    return stat, len(big)


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_speculative_sampling_keeps_the_target_distribution(models: dict[str, Any], top_p: float) -> None:
    model = models["builtin:tiny"]
    target = Target(temperature=0.7, top_p=top_p)
    context = [(5 * i + 2) % 300 + 3 for i in range(24)]
    logits = model(mx.array([context]))[:, -1:, :]
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    p: list[float] = mx.softmax(target_logits(lp[0, 0], target), axis=-1).tolist()  # type: ignore[assignment]
    ranked = sorted(range(len(p)), key=lambda t: -p[t])
    mx.random.seed(1234)
    # Drafts the target likes most, a middling one, and one top_p cuts away (when it cuts).
    for draft in (ranked[0], ranked[3], ranked[-1]):
        # The draft's verdict reads position 0 only: the draft was fed at 1, whose logits decide the bonus.
        both = mx.concatenate([lp, lp], axis=1)
        counts: dict[int, int] = {}
        for _ in range(SAMPLES):
            (v,) = verify(both, [[draft]], [Draws(target.temperature, target.top_p, seed=None, size=2)])
            first = draft if v.accepted else v.token
            counts[first] = counts.get(first, 0) + 1
        stat, bins = chi_square(counts, p, SAMPLES)
        assert bins >= 3
        assert stat < chi_square_critical(bins), (draft, stat, bins)
        if p[draft] == 0:
            assert draft not in counts
    # The test can fail: always keeping a middling draft is far from the target.
    wrong = {ranked[3]: SAMPLES}
    stat, bins = chi_square(wrong, p, SAMPLES)
    assert stat > chi_square_critical(bins)


def test_unsupported_layers_are_never_speculated(tmp_path: Path) -> None:
    from mlx_lm.models.cache import ArraysCache, KVCache

    assert speculate.speculable([KVCache()])
    assert not speculate.speculable([KVCache(), ArraysCache(2)])
    assert speculate.width(1, 8) == 8 and speculate.width(4, 8) == speculate.POSITION_BUDGET // 4 - 1
    assert speculate.width(3, 0) == 0
