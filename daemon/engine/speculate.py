"""Speculative decoding inside mlx-lm's BatchGenerator: drafts verified in the batch's own forward.

One speculative step replaces one `GenerationBatch.next()`: every sequence in
the batch feeds its pending token followed by its draft (none for some), all
in one forward of width 1 + K (K the longest draft; shorter ones are padded
and the padding is never accepted). The weights are read once for the lot,
which is the point: on the CPU backend a forward is memory-bound, so the
tokens it accepts beyond the first are nearly free.

Verification is exact (verify.py): at temperature 0 a sequence keeps the
longest prefix of its draft equal to the target's greedy choices plus the
target's own next token; at temperature > 0 standard speculative sampling
keeps the target's distribution. The answer is the one plain decoding gives.

Rollback. Every sequence fed 1 + K positions and keeps 1 + a_i of them (a_i:
its accepted draft tokens, cut at a stop token or max_tokens). The batch is
trimmed by the positions no one keeps; a sequence that keeps fewer than the
most is rolled right by the difference, its rejected positions becoming left
padding (exactly how mlx-lm's batch caches absorb right-padded prompts in
`finalize`). That is one rule for plain, quantized (kvd's
`BatchQuantizedKVCache`) and rotating layers: a multi-token forward leaves a
rotating layer in temporal order with its whole window plus the new
positions (mlx-lm's `_update_concat` copies the ring into a new array rather
than writing into it), so its rejected positions are the array's tail, cut
like the others, even after the window wrapped; nothing needs a snapshot.
Array (recurrent) layers cannot drop positions: a batch holding one is never
speculated (`supported`).

Concurrency: sequences that draft nothing ride along in the wider forward.
`width` keeps the forward small enough that their step does not get slower
(a measured position budget, see bench/speculate.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache, dynamic_roll

from ..device import SpeculationLimits
from .draft import DraftBudget, Drafter, PromptLookup
from .quantized import BatchQuantizedKVCache, KvdQuantizedKVCache
from .verify import Target, verify

# Positions (batch rows x (1 + K)) one forward may hold before its compute starts to show
# beside the weight reads on the CPU backend: measured in bench/speculate.py. Each device's
# budget is its policy's (daemon/device.py); this is the CPU's.
POSITION_BUDGET = 12


def _limits() -> SpeculationLimits:
    """This device's speculation limits (daemon/device.py)."""
    from ..device import current

    return current().speculation


@dataclass
class Speculation:
    """One decoding sequence's speculation: its drafter, its budget, how its tokens are chosen."""

    target: Target
    drafter: Drafter = field(default_factory=PromptLookup)
    budget: DraftBudget = field(default_factory=lambda: DraftBudget.within(_limits()))
    steps: int = 0  # speculative steps this sequence took part in with a draft
    k_sum: int = 0  # the drafts' lengths summed: the mean k

    def sync(self, ids: Sequence[int]) -> None:
        """Let the drafter see `ids`, the sequence's tokens in the cache (a prefix grows)."""
        seen = _seen(self.drafter)
        if len(ids) > seen:
            self.drafter.extend(ids[seen:])

    def usage(self) -> dict[str, Any]:
        """The Done event's speculation figures."""
        return {"drafted_tokens": self.budget.drafted, "accepted_tokens": self.budget.accepted}

    @property
    def mean_k(self) -> float | None:
        """The drafts' mean length, over the steps that drafted."""
        return self.k_sum / self.steps if self.steps else None


def _seen(drafter: Drafter) -> int:
    ids = getattr(drafter, "ids", None)
    return len(ids) if isinstance(ids, list) else 0


def speculable(cache: Sequence[Any]) -> bool:
    """Whether a session's cache (one sequence) can be speculated on: every layer can roll back in a batch."""
    return all(type(c) in (KVCache, RotatingKVCache, KvdQuantizedKVCache) for c in cache)


def supported(cache: Sequence[Any]) -> bool:
    """Whether every layer of a batch cache can take back the positions of a rejected draft."""
    return all(type(c) in (BatchKVCache, BatchRotatingKVCache, BatchQuantizedKVCache) for c in cache)


def width(rows: int, wanted: int) -> int:
    """The draft length K the batch's forward may carry: every row pays for the padding."""
    if rows <= 0 or wanted <= 0:
        return 0
    return max(0, min(wanted, _limits().position_budget // rows - 1)) if rows > 1 else wanted


def step(generator: Any, rows: Mapping[int, Speculation]) -> list[Any] | None:
    """One speculative decode step over the generator's batch; None: nothing to speculate this step.

    `rows`: the speculating sequences by uid (a uid absent decodes plainly in the
    same forward). Declines (None) while sequences wait to join the batch, when a
    layer cannot roll back, or when no sequence has a draft; the caller then
    runs `generator.next()` as usual. Returns responses shaped like
    `GenerationBatch.next()`'s, possibly several per uid, in order.
    """
    if generator._unprocessed_sequences or len(generator._prompt_batch) > 0:
        return None
    batch = generator._generation_batch
    if len(batch) == 0 or not supported(batch.prompt_cache) or any(batch.logits_processors):
        return None
    with mx.stream(generator.stream):
        return _step(batch, rows)


def _step(batch: Any, rows: Mapping[int, Speculation]) -> list[Any] | None:  # noqa: C901 - 20: draft, verify,
    # roll back and commit every row of one batch, phases sharing the rows' locals (issue 31 rewrites it)
    n = len(batch.uids)
    wanted: dict[int, int] = {}
    for i, u in enumerate(batch.uids):
        if (spec := rows.get(u)) is not None and (k := spec.budget.wanted()) > 0:
            spec.sync(batch.tokens[i])
            if spec.drafter.may_propose():
                wanted[i] = k
    k_max = width(n, max(wanted.values(), default=0))
    if k_max == 0:
        return None
    pending: list[int] = _ints(batch._next_tokens)
    before = list(batch._next_logprobs)  # the pending tokens' log-probabilities
    drafts: list[list[int]] = [[] for _ in range(n)]
    for i, k in wanted.items():
        spec = rows[batch.uids[i]]
        room = batch.max_tokens[i] - batch._num_tokens[i] - 1  # tokens this sequence may still take
        k = min(k, k_max, room)
        if k > 0:
            drafts[i] = spec.drafter.propose(k, after=[pending[i]])
    K = max(len(d) for d in drafts)
    if K == 0:
        return None
    for c in batch.prompt_cache:
        if isinstance(c, BatchRotatingKVCache) and c.rotated:
            # mlx-lm masks a multi-token forward by the ring's pre-update index; a ring written
            # in place has to be put in temporal order first, or a left-padded row's mask is off by one.
            c._temporal_order()
    inputs = mx.array([[p, *d, *[p] * (K - len(d))] for p, d in zip(pending, drafts)], dtype=mx.uint32)
    logits = batch.model(inputs, cache=batch.prompt_cache)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    targets = [rows[u].target if u in rows else Target(0.0, 1.0) for u in batch.uids]
    verdicts = verify(logprobs, drafts, targets, plain=[_sampler_of(batch, i) for i in range(n)])

    emitted: list[list[int]] = []
    finish: list[str | None] = []
    for i, v in enumerate(verdicts):
        toks = [pending[i], *drafts[i][:v.accepted]]
        reason = None
        for j, t in enumerate(toks):
            batch._num_tokens[i] += 1
            if batch._num_tokens[i] >= batch.max_tokens[i]:
                reason = "length"
            if batch._matchers[i].advance(t):
                reason = "stop"
            if reason is not None:
                toks = toks[:j + 1]
                break
        emitted.append(toks)
        finish.append(reason)
        if (taken := rows.get(batch.uids[i])) is not None and drafts[i]:
            spec = taken
            spec.budget.record(len(drafts[i]), len(toks) - 1)
            spec.steps += 1
            spec.k_sum += len(drafts[i])
    rollback(batch.prompt_cache, fed=1 + K, keep=[len(t) for t in emitted])

    nexts = [v.token for v in verdicts]
    lp_rows = [logprobs[i, v.accepted] for i, v in enumerate(verdicts)]
    responses: list[Any] = []
    keep: list[int] = []
    Response = type(batch).Response
    for i, toks in enumerate(emitted):
        batch.tokens[i].extend(toks)
        for j, t in enumerate(toks):
            last = j == len(toks) - 1
            reason = finish[i] if last else None
            responses.append(Response(
                uid=batch.uids[i], token=t, logprobs=logprobs[i, j - 1] if j else before[i],
                finish_reason=reason,
                prompt_cache=batch.extract_cache(i) if reason is not None else None,
                all_tokens=batch.tokens[i] if reason is not None else None))
        if finish[i] is None:
            keep.append(i)
    batch._current_tokens = mx.array([e[-1] for e in emitted], dtype=mx.uint32)
    batch._current_logprobs = []
    batch._next_tokens = mx.array(nexts, dtype=mx.uint32)
    batch._next_logprobs = lp_rows
    if len(keep) < n:
        batch.filter(keep)
    return responses


def _sampler_of(batch: Any, i: int) -> Any:
    samplers = batch.samplers or []
    s = samplers[i] if i < len(samplers) else None
    return s if s is not None else batch.fallback_sampler


def _ints(a: mx.array) -> list[int]:
    out: Any = a.tolist()
    return [int(x) for x in out]


def rollback(cache: Sequence[Any], *, fed: int, keep: Sequence[int]) -> None:
    """Take back, in every layer of a batch cache, the positions each row did not keep.

    Each row was just fed `fed` positions; row i keeps the first `keep[i]`.
    """
    most = max(keep)
    cut = fed - most
    shifts = [most - k for k in keep]
    rolled = any(shifts)
    shift = mx.array(shifts)[:, None]
    for c in cache:
        if cut:
            c.trim(cut)
        if type(c) is BatchRotatingKVCache:
            _drop_tail(c)
        if rolled:
            _roll(c, shift)


def _drop_tail(c: Any) -> None:
    """A rotating layer is in temporal order after a multi-token forward: cut the trimmed tail for good,
    so a later in-place write never mistakes it for part of the window."""
    c.keys = c.keys[..., :c._idx, :]
    c.values = c.values[..., :c._idx, :]


def _roll(c: Any, shift: mx.array) -> None:
    """Row i's last shift[i] positions become its leftmost padding (mlx-lm's `finalize` does the same)."""
    if isinstance(c.keys, tuple):  # kvd's BatchQuantizedKVCache: (packed, scales, biases)
        c.keys = tuple(dynamic_roll(x, shift, axis=2) for x in c.keys)
        c.values = tuple(dynamic_roll(x, shift, axis=2) for x in c.values)
    else:
        c.keys = dynamic_roll(c.keys, shift, axis=2)
        c.values = dynamic_roll(c.values, shift, axis=2)
    c.left_padding = c.left_padding + shift[:, 0]
    c.offset = c.offset - shift[:, 0]
