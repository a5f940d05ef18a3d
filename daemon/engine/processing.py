"""The logits processors a turn's sampling asks for: logit_bias and the repetition, presence and frequency
penalties, made by mlx-lm's own `make_logits_processors` and applied where kvd draws a token.

mlx-lm's `generate_step` hands each processor the tokens so far (the prompt's and the answer's) and the raw
logits of the next position, before the log-softmax; so does kvd, for the first token from the prompt's
last logits (steps.py: its prefill returns them raw) and for every later one in the decode step (decode.py),
each row with its own. A row with processors is never speculated: each drafted position would need its own.
top_k and min_p are not processors but filters of the draw (draws.py, mlx-lm's `apply_top_k` and
`apply_min_p`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors

from protocol.shapes import Sampling

WINDOW = 20  # recent tokens the penalties look at when the request names none (mlx-lm's default)


class Processing:
    """One answer's logits processors and the window of recent tokens they read."""

    def __init__(self, processors: Sequence[Any], window: int):
        self.processors = list(processors)
        self.window = window

    def apply(self, tokens: Sequence[int], logits: mx.array) -> mx.array:
        """`logits` (1 x vocab, raw) as the processors leave them, `tokens` the ids so far."""
        if not tokens:
            return logits
        recent = mx.array(list(tokens[-self.window:]))
        for processor in self.processors:
            logits = processor(recent, logits)
        return logits


def processing(sampling: Sampling) -> Processing | None:
    """The processors `sampling` asks for, or None (a turn without knobs costs nothing)."""
    window = sampling.penalty_window or WINDOW
    repetition = sampling.repetition_penalty
    processors = make_logits_processors(
        logit_bias=dict(sampling.logit_bias) if sampling.logit_bias else None,
        repetition_penalty=repetition if repetition not in (None, 1.0) else None,
        repetition_context_size=window, presence_penalty=sampling.presence_penalty or None,
        presence_context_size=window, frequency_penalty=sampling.frequency_penalty or None,
        frequency_context_size=window)
    return Processing(processors, window) if processors else None
