"""Speculative decoding in kvd's decode batch (decode.py): drafts verified in the batch's own forward.

One speculative step replaces one plain decode step: every sequence in
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
positions (mlx-lm's rotating batch cache concatenates a multi-token update
onto the ring rather than writing into it), so its rejected positions are the
array's tail, cut like the others, even after the window wrapped; nothing
needs a snapshot. A wrapped ring is put in temporal order, and a rotating
layer's cut tail dropped, by rebuilding the layer from its rows with the
batch cache's public `extract` and `merge` (`_remade`).
Array (recurrent) layers cannot drop positions: a batch holding one is never
speculated (`supported`).

Concurrency: sequences that draft nothing ride along in the wider forward.
`width` keeps the forward small enough that their step does not get slower
(a measured position budget, see bench/speculate.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache, dynamic_roll

from ..device import SpeculationLimits
from .draft import DraftBudget, Drafter, PromptLookup
from .quantized import BatchQuantizedKVCache, KvdQuantizedKVCache

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
    """One decoding sequence's speculation: its drafter and its budget (its draws are its row's)."""

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


def rollback(cache: Sequence[Any], *, fed: int, keep: Sequence[int]) -> list[Any]:
    """Take back, in every layer of a batch cache, the positions each row did not keep: the layers after.

    Each row was just fed `fed` positions; row i keeps the first `keep[i]`.
    """
    most = max(keep)
    cut = fed - most
    shifts = [most - k for k in keep]
    rolled = any(shifts)
    shift = mx.array(shifts)[:, None]
    out: list[Any] = []
    for c in cache:
        if cut:
            c.trim(cut)
        if rolled:
            _roll(c, shift)
        # A rotating layer is in temporal order after a multi-token forward: its trimmed tail
        # is cut for good, so a later in-place write never mistakes it for part of the window.
        out.append(_remade(c) if type(c) is BatchRotatingKVCache and (cut or rolled) else c)
    return out


def in_temporal_order(cache: Sequence[Any]) -> list[Any]:
    """The layers, every wrapped rotating ring put in temporal order, for a multi-token forward.

    mlx-lm masks a multi-token forward by the ring's pre-update index; a ring written
    in place has to be in temporal order first, or a left-padded row's mask is off by one.
    """
    return [_remade(c) if type(c) is BatchRotatingKVCache and c.rotated else c for c in cache]


def _remade(c: Any) -> Any:
    """A rotating batch layer rebuilt from its rows (public `extract` and `merge`): in temporal
    order, each row's window right-aligned, nothing past the last position kept."""
    rows = c.offset.shape[0]
    return type(c).merge([c.extract(i) for i in range(rows)])


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
