"""kvd's batched decode step: the sessions decoding together, one forward of the model per step.

The engine (thread.py) prefills each session alone (prefill.py); the session
then joins this batch with the first token its prefill chose. The batch is
built on mlx-lm's public surfaces only: the model called as a function,
mlx-lm's batch cache classes (`BatchKVCache`, `BatchRotatingKVCache`, and
kvd's `BatchQuantizedKVCache`) through their public `merge`, `extend`,
`filter`, `extract` and `trim`, and `apply_top_p` (draws.py).
Rows of different lengths share one forward through the batch caches' left
padding, exactly as mlx-lm's own batching does. A row that decodes alone
keeps its own plain cache and steps as mlx-lm's `generate_step` does (no
padding, no mask, MLX's fused causal attention on a GPU): its cache is merged
into a batch cache only when a second row joins (or it drafts on a rotating
layer, which only a batch cache takes back), and taken back out when it is
alone again. On the CPU the batch of one's step cost its thread 1.06 ms
against 0.64 alone (builtin micro model, bench/hostcost.py's).

What the step owns, per row: the ids its cache holds, its pending token
(drawn, not yet fed), how it draws (draws.py: its own key per answer
position, so a seeded answer is the same alone or batched), its grammar
(grammar.py, applied to its logits before the draw), its stop tokens, its
max_tokens, and its speculation (speculate.py: drafts verified in the batch's
own forward, rejected positions rolled back row by row).

The order of work is mlx-lm's `BatchGenerator`'s, kept so answers stay
exactly what they were: a new row (one that holds its own `cache` and its
`first` token) enters at the next step it is handed to; that step first
moves the batch, then feeds the row's first token in a forward of its own
(its cache merged into a batch of one, or its own if it is alone) and appends the row to the batch (a
cancel before then finds its cache holding just the prompt); each
step feeds every row's pending token, draws the next one and starts
computing it (`mx.async_eval`) before reporting the fed tokens, so the
bookkeeping and the events overlap the next forward. Every reported
token is in the cache: a finished row's cache holds its stop token too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from . import speculate
from .draws import Draws
from .logprobs import Picked, pick
from .verify import verify

if TYPE_CHECKING:
    from .grammar import Constraint
    from .processing import Processing
    from .profile import StepProfile
    from .speculate import Speculation

CLEAR_EVERY = 512  # steps between returns of MLX's buffer cache to the allocator (as mlx-lm's generator does)


@dataclass(eq=False)
class Row:
    """One answer's sequence in the decode batch (and, until it enters, what it enters with)."""

    key: str  # the session
    tokens: list[int]  # the ids its cache holds
    draws: Draws
    max_tokens: int  # the tokens this batch may report for it (its first token is not one)
    stops: frozenset[int]  # tokens that end the answer (reported, fed, and then the row leaves)
    constraint: Constraint | None = None
    spec: Speculation | None = None
    reported: int = 0
    # Until it enters the batch (the next `step` it is handed to): its own cache, holding `tokens`,
    # and its first answer token, fed then. Both None once it is in.
    cache: list[Any] | None = None
    first: int | None = None
    # Log-probabilities asked for: this many alternatives per token (None: none), and those of its pending
    # token, read when that token is reported (logprobs.py).
    logprobs: int | None = None
    picked: Picked | None = None
    processing: Processing | None = None  # its logits processors (its sampling's knobs): processing.py

    @property
    def entering(self) -> bool:
        return self.first is not None


@dataclass(frozen=True)
class Out:
    """A token the step fed for a row; `finish` set on its last, with the row's cache and ids."""

    key: str
    token: int
    finish: str | None = None
    cache: list[Any] | None = None
    tokens: list[int] | None = None
    picked: Picked | None = None  # its log-probabilities, where its row asked for them


class Decoder:
    """The batch: its rows, their batch cache and their pending tokens. Engine thread only."""

    def __init__(self, model: Any, stream: Any = None):
        """`stream`: the MLX stream it runs on, the engine's (Steps.stream); None: a new one."""
        self.model = model
        self.stream = stream if stream is not None else mx.new_stream(mx.default_device())
        self.rows: list[Row] = []  # in the batch, in its order
        # One cache per layer: a batch cache of the rows, or, while one row decodes alone, that row's own
        # plain cache (mlx-lm's single-sequence path: no padding, no mask); empty while no row decodes.
        self.cache: list[Any] = []
        self.batched = False  # whether `cache` is a batch cache
        self.pending: mx.array | None = None  # (rows,): each row's next token, drawn, not yet fed
        self.steps = 0
        self.prof: StepProfile | None = None  # the step profiler (profile.py), when it is on

    def __len__(self) -> int:
        return len(self.rows)

    def _enter(self, row: Row) -> None:
        """Feed the row's first token, then add it: alone, its own cache is the decoder's (mlx-lm's
        single-sequence step); beside others, merged into a batch of one first, then appended."""
        from .quantized import as_batchable

        cache, first = row.cache, row.first
        assert cache is not None and first is not None
        alone = not self.rows
        cache = as_batchable(cache) if alone else [c.merge([c]) for c in as_batchable(cache)]
        logits = self.model(mx.array([[first]]), cache=cache)[:, -1, :]
        if row.processing is not None:
            logits = row.processing.apply([*row.tokens, first], logits)
        if row.constraint is not None:
            row.constraint.take(first)
            logits = row.constraint.mask(logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        nxt = row.draws.take(logprobs)
        if row.logprobs is not None:
            row.picked = pick(logprobs, nxt, row.logprobs)
        self._lap("graph")
        mx.async_eval(nxt, *(row.picked.arrays() if row.picked is not None else ()))
        self._lap("launch")
        row.tokens.append(first)
        if alone:
            self.cache, self.pending, self.batched = cache, nxt, False
        else:
            assert self.pending is not None
            self._batch()
            for mine, theirs in zip(self.cache, cache):
                mine.extend(theirs)
            self.pending = mx.concatenate([self.pending, nxt])
        self.rows.append(row)
        row.cache, row.first = None, None

    def _batch(self) -> None:
        """A lone row's own cache becomes a batch cache of one (a second row joins, or it drafts on a layer
        only a batch cache can take back)."""
        if not self.batched:
            self.cache, self.batched = [c.merge([c]) for c in self.cache], True

    def _own(self, i: int) -> list[Any]:
        """Row i's cache, out of the batch (a copy) or its own."""
        return [c.extract(i) for c in self.cache] if self.batched else self.cache

    def remove(self, row: Row) -> tuple[list[Any], list[int], list[int]]:
        """Take a row out (a cancel): its cache, the ids it holds, and its first token if never fed."""
        if row.entering:
            assert row.cache is not None and row.first is not None
            return row.cache, row.tokens, [row.first]
        i = next(i for i, r in enumerate(self.rows) if r is row)
        with mx.stream(self.stream):
            cache = self._own(i)
            self._keep([j for j in range(len(self.rows)) if j != i])
        return cache, row.tokens, []

    def reset(self) -> None:
        """Drop every row (after a failed step, the batch's state is unknown)."""
        self.rows, self.cache, self.pending, self.batched = [], [], None, False

    def step(self, entering: Sequence[Row] = ()) -> list[Out]:
        """One step of the batch (a speculative one where some row has a draft), then the `entering`
        rows enter, in their order (should one fail, the caller fails every row)."""
        out: list[Out] = []
        if (prof := self.prof) is not None:
            prof.begin(len(self.rows) + len(entering))
        with mx.stream(self.stream):
            if self.rows:
                spec = self._speculative() if any(r.spec is not None for r in self.rows) else None
                out = spec if spec is not None else self._plain()
            for row in entering:
                self._enter(row)
        self.steps += 1
        if self.steps % CLEAR_EVERY == 0:
            mx.clear_cache()
        return out

    # --- a plain step ---

    def _plain(self) -> list[Out]:
        assert self.pending is not None
        inputs = self.pending
        picked = [r.picked for r in self.rows]  # the pending tokens' log-probabilities, where asked for
        logits = self.model(inputs[:, None], cache=self.cache)[:, -1, :]
        shaped = [i for i, r in enumerate(self.rows) if r.constraint is not None or r.processing is not None]
        fed: list[int] | None = None
        if shaped:  # rows whose logits their processors and grammar change, each on its own
            self._lap("graph")
            fed = _ints(inputs)
            self._lap("device")
            parts = [logits[i:i + 1] for i in range(len(self.rows))]
            for i in shaped:
                r = self.rows[i]
                if r.processing is not None:
                    parts[i] = r.processing.apply([*r.tokens, fed[i]], parts[i])
                if (c := r.constraint) is not None:
                    c.take(fed[i])
                    parts[i] = c.mask(parts[i])
            logits = mx.concatenate(parts, axis=0)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if all(r.draws.greedy for r in self.rows):
            nxt = mx.argmax(logprobs, axis=-1)
            for r in self.rows:
                r.draws.drawn += 1
        else:
            nxt = mx.concatenate([r.draws.take(logprobs[i:i + 1]) for i, r in enumerate(self.rows)])
        self.pending = nxt
        for i, r in enumerate(self.rows):
            if r.logprobs is not None:
                r.picked = pick(logprobs[i:i + 1], nxt[i:i + 1], r.logprobs)
        self._lap("graph")
        mx.async_eval(nxt, *(a for r in self.rows if r.picked is not None for a in r.picked.arrays()))
        self._lap("launch")
        if fed is None:
            fed = _ints(inputs)
        self._lap("device")
        out = self._report([[t] for t in fed], picked)
        self._lap("books")
        return out

    # --- a speculative step ---

    def _speculative(self) -> list[Out] | None:
        """Feed each row's pending token and its draft (if any) in one forward; None: no row drafts.

        The step waits for the device once: the drafts are looked up in the ids the rows have fed
        (the lookup's first token is its guess at the pending token, still being computed, and the
        rest is the draft), the pending tokens join the forward's input on the device, and the
        verdicts' evaluation is the one wait. A wrong guess costs its draft (verification is exact
        whatever the draft). Declines when a layer cannot roll back or a row is held to a grammar
        (its matcher must see every token once, in order).
        """
        rows = self.rows
        if any(r.constraint is not None or r.logprobs is not None or r.processing is not None for r in rows):
            return None
        if not (speculate.supported(self.cache) or speculate.speculable(self.cache) and not self.batched):
            return None
        n = len(rows)
        wanted: dict[int, int] = {}
        for i, r in enumerate(rows):
            if (spec := r.spec) is not None and (k := spec.budget.wanted()) > 0:
                spec.sync(r.tokens)
                if spec.drafter.may_propose():
                    wanted[i] = k
        k_max = speculate.width(n, max(wanted.values(), default=0))
        if k_max == 0:
            return None
        drafts: list[list[int]] = [[] for _ in range(n)]
        for i, k in wanted.items():
            spec = rows[i].spec
            assert spec is not None
            room = rows[i].max_tokens - rows[i].reported - 1  # tokens this row may still take
            k = min(k, k_max, room)
            if k > 0:
                drafts[i] = spec.drafter.propose(k + 1)[1:]  # (its first: the guess at the pending token)
        K = max(len(d) for d in drafts)
        if K == 0:
            return None
        if not speculate.supported(self.cache):  # a lone row's rotating layer: only a batch cache takes it back
            self._batch()
        assert self.pending is not None
        self.cache = speculate.in_temporal_order(self.cache)
        drafted = mx.array([[*d, *[0] * (K - len(d))] for d in drafts], dtype=mx.uint32)
        inputs = mx.concatenate([self.pending.astype(mx.uint32)[:, None], drafted], axis=1)
        self._lap("books")
        logits = self.model(inputs, cache=self.cache)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        self._lap("graph")
        verdicts = verify(logprobs, drafts, [r.draws for r in rows], also=self.pending)
        pending = _ints(self.pending)  # (evaluated with the verdicts: no second wait)
        self._lap("device")

        fed: list[list[int]] = []
        for i, v in enumerate(verdicts):
            rows[i].draws.drawn += v.accepted + 1
            toks = [pending[i], *drafts[i][:v.accepted]]
            fed.append(_cut(rows[i], toks))
            if (spec := rows[i].spec) is not None and drafts[i]:
                spec.budget.record(len(drafts[i]), len(fed[-1]) - 1)
                spec.steps += 1
                spec.k_sum += len(drafts[i])
        self.cache = speculate.rollback(self.cache, fed=1 + K, keep=[len(t) for t in fed])
        self.pending = mx.array([v.token for v in verdicts], dtype=mx.uint32)
        out = self._report(fed)
        self._lap("books")
        return out

    # --- both ---

    def _lap(self, section: str) -> None:
        if self.prof is not None:
            self.prof.lap(section)

    def _report(self, fed: Sequence[Sequence[int]], picked: Sequence[Picked | None] | None = None) -> list[Out]:
        """Record what each row was fed (already cut at its end), finish the rows that ended. `picked`: the
        log-probabilities of each row's one fed token (a plain step), where asked for."""
        out: list[Out] = []
        keep: list[int] = []
        for i, (r, toks) in enumerate(zip(self.rows, fed)):
            r.tokens.extend(toks)
            finish = _finish(r, toks)
            out.extend(Out(r.key, t, picked=picked[i] if picked is not None else None) for t in toks)
            if finish is None:
                keep.append(i)
            else:
                last = out[-1]
                out[-1] = Out(last.key, last.token, finish, self._own(i), r.tokens, last.picked)
        if len(keep) < len(self.rows):
            self._keep(keep)
        return out

    def _keep(self, keep: list[int]) -> None:
        """Keep rows `keep`; one left decodes on its own cache again (out of the batch: a copy, once)."""
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.cache, self.pending, self.batched = [], None, False
            return
        assert self.pending is not None and self.batched
        if len(keep) == 1:
            self.cache, self.batched = [c.extract(keep[0]) for c in self.cache], False
        else:
            for c in self.cache:
                c.filter(keep)
        self.pending = self.pending[mx.array(keep)]


def _cut(row: Row, toks: list[int]) -> list[int]:
    """`toks` up to the first that ends the row (a stop token, or its max_tokens reached)."""
    room = row.max_tokens - row.reported
    for j, t in enumerate(toks):
        if j + 1 >= room or t in row.stops:
            return toks[:j + 1]
    return toks


def _finish(row: Row, toks: Sequence[int]) -> str | None:
    """Count the fed tokens; why the row ends with them, if it does (a stop token wins)."""
    row.reported += len(toks)
    if toks and toks[-1] in row.stops:
        return "stop"
    if row.reported >= row.max_tokens:
        return "length"
    return None


def _ints(a: mx.array) -> list[int]:
    out: Any = a.tolist()
    return [int(x) for x in out]
