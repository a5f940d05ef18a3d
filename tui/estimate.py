"""How long kvd will still read a long prompt: `reading 4632/7414 tokens, about 52 s left`.

A token read late in a long prompt costs more than one read early: attention
looks back over everything before it. Averaging the rate since the read began
therefore promises too much (a user saw "about 37 s left" 87 s before the
first token). So the time a token at position p takes is taken as
``a + b * p``, fitted (least squares, neither term negative) to the chunks
this read has reported so far, updated at every `chat.progress`, and to
those of the last few reads of this kvchat, which count less; they give the
first estimate its shape before this read has two chunks of its own. The
position is the token's place in what this read feeds (a restored cache
before it is not known to kvchat), so the estimate stays an estimate.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

KEEP_READS = 3  # earlier reads whose chunks still count
EARLIER_WEIGHT = 0.25  # how much an earlier read's chunk counts beside one of this read


@dataclass(frozen=True)
class Chunk:
    """`tokens` tokens, from position `start`, read in `seconds`."""

    start: int
    tokens: int
    seconds: float

    @property
    def x(self) -> tuple[float, float]:
        """The chunk's cost in units of a and of b: its tokens, and the sum of their positions."""
        end = self.start + self.tokens
        return float(self.tokens), (end * end - self.start * self.start) / 2.0


def fit(weighted: list[tuple[Chunk, float]]) -> tuple[float, float] | None:
    """(a, b) minimising the weighted squared error of every chunk's seconds, a, b >= 0."""
    s11 = s12 = s22 = t1 = t2 = 0.0
    for chunk, w in weighted:
        x1, x2 = chunk.x
        s11 += w * x1 * x1
        s12 += w * x1 * x2
        s22 += w * x2 * x2
        t1 += w * x1 * chunk.seconds
        t2 += w * x2 * chunk.seconds
    if s11 <= 0:
        return None
    det = s11 * s22 - s12 * s12
    if det > 1e-9 * s11 * s22:
        a, b = (t1 * s22 - t2 * s12) / det, (t2 * s11 - t1 * s12) / det
        if a >= 0 and b >= 0:
            return a, b
    # One term only: the better of a alone (a flat rate) and b alone (cost growing with position).
    flat = (t1 / s11, 0.0)
    growing = (0.0, t2 / s22) if s22 > 0 else flat

    def error(ab: tuple[float, float]) -> float:
        return sum(w * (ab[0] * c.x[0] + ab[1] * c.x[1] - c.seconds) ** 2 for c, w in weighted)

    return min((flat, growing), key=error)


@dataclass
class PrefillClock:
    """The chunks of this read and of the last few, for :meth:`seconds_left`."""

    earlier: deque[list[Chunk]] = field(default_factory=lambda: deque(maxlen=KEEP_READS))
    chunks: list[Chunk] = field(default_factory=list)
    _last: tuple[int, float] | None = None  # (fed, time) of the last progress

    def start(self) -> None:
        """A new read begins: the one before becomes an earlier read."""
        if self.chunks:
            self.earlier.append(self.chunks)
        self.chunks = []
        self._last = None

    def observe(self, fed: int, now: float) -> None:
        if self._last is not None and fed > self._last[0] and now > self._last[1]:
            self.chunks.append(Chunk(self._last[0], fed - self._last[0], now - self._last[1]))
        if self._last is None or fed > self._last[0]:
            self._last = (fed, now)

    def seconds_left(self, fed: int, total: int) -> float | None:
        """None until some chunk, of this read or an earlier one, has been timed."""
        weighted = [(c, 1.0) for c in self.chunks]
        weighted += [(c, EARLIER_WEIGHT) for read in self.earlier for c in read]
        ab = fit(weighted)
        if ab is None or fed >= total:
            return None
        a, b = ab
        rest = Chunk(fed, total - fed, 0.0).x
        return a * rest[0] + b * rest[1]
