"""Speculative decoding: drafts, the exact accept rules, and rollback in mlx-lm's batch, on the built-in models."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator

from cachestore.snapshot import restore, snapshot
from daemon.engine import speculate
from daemon.engine.draft import MISS_PAUSE, PAUSE_STEPS, WINDOW, Answers, DraftBudget, PromptLookup
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
           n: int = N) -> tuple[list[list[int]], list[tuple[list[Any], list[int]]], list[Speculation]]:
    """Greedy decoding in one BatchGenerator: each prompt's tokens, its final cache and ids, its speculation."""
    gen = BatchGenerator(model)
    uids = gen.insert(prompts, max_tokens=[n] * len(prompts),
                      caches=caches or [make_cache(model, bits) for _ in prompts], all_tokens=all_tokens)
    rows = {u: Speculation(Target(0.0, 1.0)) for u in uids} if spec else {}
    toks: dict[int, list[int]] = {u: [] for u in uids}
    done: dict[int, tuple[list[Any], list[int]]] = {}
    while len(done) < len(uids):
        responses = speculate.step(gen, rows) if rows else None
        if responses is None:
            _, responses = gen.next()
        for r in responses:
            toks[r.uid].append(int(r.token))
            if r.finish_reason is not None:
                done[r.uid] = (r.prompt_cache, list(r.all_tokens))
    return [toks[u] for u in uids], [done[u] for u in uids], list(rows.values())


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
            (v,) = verify(both, [[draft]], [target], plain=[lambda x: x])
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
