"""Drafts for speculative decoding: guesses for a session's next tokens, and how many to guess.

No MLX here: a drafter sees token ids and proposes ids; the verifier
(speculate.py) decides what is kept. Exactness never depends on a draft, only
speed does, so a drafter may be as cheap and as wrong as it likes.

`PromptLookup` is prompt-lookup decoding (llama.cpp's lookup decoding, vLLM's
n-gram speculator): the longest recent n-gram ending the session's ids (the
fed ids plus the answer so far) that occurred earlier is looked up, and the
tokens that followed it then are proposed. Chat answers repeat their context
(edited code, quoted text, a regenerated answer), and there it needs no draft
model at all. A draft model of the same vocabulary would be another `Drafter`.

`DraftBudget` sizes a session's drafts from its recent acceptance (k grows
while drafts are taken whole, shrinks when they are cut short) and turns
drafting off for a while when it does not pay, so an answer that does not
repeat its context decodes as it would without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..device import SpeculationLimits

MIN_NGRAM = 3  # a repeated pair ("of the") predicts too little: in open chat such drafts were mostly refused
MAX_NGRAM = 4
# Draft tokens per step at most: on the loaded 2-core CPU a 9-token forward cost 1.7x a 1-token one, 5 tokens 1.13x.
MAX_K = 6
START_K = 2
WINDOW = 24  # drafted tokens over which the acceptance rate is judged
MIN_RATE = 0.3  # below this acceptance a draft costs more compute than it saves
PAUSE_STEPS = 16  # decode steps without drafting after a window below MIN_RATE; doubles each time
MISS_PAUSE = 2  # decode steps without drafting after a draft refused whole


class Drafter(Protocol):
    """Proposes up to `k` tokens to follow a session's ids."""

    def extend(self, ids: Sequence[int]) -> None:
        """The session's ids grew by `ids` (fed or generated, in order)."""
        ...

    def propose(self, k: int, after: Sequence[int] = ()) -> list[int]:
        """Up to `k` guesses for the tokens after the ids so far and then `after` (maybe none).

        `after`: tokens already chosen but not yet fed (the pending sampled token).
        """
        ...

    def may_propose(self) -> bool:
        """Whether `propose(k, after=[t])` can return anything for some token t.

        Cheap, and asked before the pending token is known: knowing it costs the
        decode loop its overlap of one step's bookkeeping with the next step's compute.
        """
        ...


class _Ngrams:
    """Where each n-gram of a growing id list last ended (and where it ended the time before)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.ids: list[int] = []
        self.last: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.prev: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}

    def extend(self, ids: Sequence[int]) -> None:
        for t in ids:
            self.ids.append(t)
            end = len(self.ids)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                gram = tuple(self.ids[end - n:end])
                last = self.last[n]
                if gram in last:
                    self.prev[n][gram] = last[gram]
                last[gram] = end


class PromptLookup:
    """Prompt-lookup drafting over one session's ids, indexed as they grow.

    For every n in [MIN_NGRAM, MAX_NGRAM] the index maps each n-gram to where
    it last ended, so a proposal is a few dict lookups, not a scan of the
    history (a 4k-token conversation would cost milliseconds a step).
    `prior`: ids the session held before this turn but no longer does (the
    answer a regenerate replaces), looked up when the ids themselves have no match.
    """

    def __init__(self, ids: Sequence[int] = (), *, prior: Sequence[int] = (),
                 min_n: int = MIN_NGRAM, max_n: int = MAX_NGRAM):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        # Grams one shorter than min_n are indexed too: `may_propose` looks them up.
        self._own = _Ngrams(max(min_n - 1, 1), max_n)
        self._prior = _Ngrams(max(min_n - 1, 1), max_n)
        self._prior.extend(prior)
        self.extend(ids)

    @property
    def ids(self) -> list[int]:
        return self._own.ids

    def extend(self, ids: Sequence[int]) -> None:
        self._own.extend(ids)

    def may_propose(self) -> bool:
        # A match of n >= min_n tokens ending in the pending token needs the last min_n - 1 ids seen before.
        n = self.min_n - 1
        if n == 0:
            return bool(self.ids)
        ids = self._own.ids
        if len(ids) < n:
            return False
        gram = tuple(ids[len(ids) - n:])
        return gram in self._own.prev[n] or gram in self._prior.last[n]

    def propose(self, k: int, after: Sequence[int] = ()) -> list[int]:
        if k <= 0:
            return []
        own = self._own
        whole = [*own.ids, *after] if after else own.ids
        end = len(whole)
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            gram = tuple(whole[end - n:])
            # Without `after` the suffix is indexed and is its own latest occurrence: the match is the
            # one before it. With `after` the suffix is not indexed: the latest occurrence is the match.
            at = (own.last if after else own.prev)[n].get(gram)
            if at is not None and at < end:
                return whole[at:min(at + k, end)]
            at = self._prior.last[n].get(gram)
            if at is not None:
                return self._prior.ids[at:at + k]
        return []


@dataclass
class DraftBudget:
    """How many tokens a session drafts next, from how its recent drafts fared."""

    k: int = START_K
    max_k: int = MAX_K
    min_rate: float = MIN_RATE
    pause_steps: int = PAUSE_STEPS
    drafted: int = 0  # over the whole turn: the wire's drafted_tokens
    accepted: int = 0  # the wire's accepted_tokens
    _window_drafted: int = 0
    _window_accepted: int = 0
    _paused: int = 0  # decode steps left without drafting
    _pause_len: int = 0  # the next pause's length: pause_steps, doubling while drafts keep failing

    def __post_init__(self) -> None:
        self._pause_len = self._pause_len or self.pause_steps

    @classmethod
    def within(cls, limits: SpeculationLimits) -> DraftBudget:
        """A budget on the device's limits (daemon/device.py; the CPU's are this module's constants)."""
        return cls(k=limits.start_k, max_k=limits.max_k, min_rate=limits.min_rate, pause_steps=limits.pause_steps)

    def wanted(self) -> int:
        """Tokens to draft this step (0: decode plainly); counts a paused step down."""
        if self._paused > 0:
            self._paused -= 1
            return 0
        return self.k

    def record(self, drafted: int, accepted: int) -> None:
        """One verified draft: `accepted` of its `drafted` tokens were kept."""
        if drafted <= 0:
            return
        self.drafted += drafted
        self.accepted += accepted
        self._window_drafted += drafted
        self._window_accepted += accepted
        if accepted == drafted:
            self.k = min(self.k * 2, self.max_k)
        elif accepted < drafted // 2:
            self.k = max(self.k // 2, 1)
        if accepted == 0:
            self._paused = max(self._paused, MISS_PAUSE)
        if self._window_drafted >= WINDOW:
            if self._window_accepted < self.min_rate * self._window_drafted:
                self._paused = self._pause_len
                self._pause_len *= 2
            else:
                self._pause_len = self.pause_steps
            self._window_drafted = self._window_accepted = 0


PRIOR_SESSIONS = 64  # sessions whose last answer the engine remembers for a regenerate's drafts


class Answers:
    """The last answer of recent sessions (ids), for drafting the answer that replaces it.

    In memory only, bounded, least recently finished dropped first: a hint for
    the drafter, never state anything depends on.
    """

    def __init__(self, size: int = PRIOR_SESSIONS):
        self.size = size
        self._ids: dict[str, list[int]] = {}

    def keep(self, session_id: str, ids: Sequence[int]) -> None:
        self._ids.pop(session_id, None)
        if ids:
            self._ids[session_id] = list(ids)
        while len(self._ids) > self.size:
            del self._ids[next(iter(self._ids))]

    def get(self, session_id: str) -> list[int]:
        return self._ids.get(session_id, [])
