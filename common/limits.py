"""The ranges a value may take, stated once for config.toml, the websocket parser and the OpenAI schema.

Each door turns a value out of range into its own error shape (a `bad_request`
event, an OpenAI 400, a config line); what the range *is* lives only here.
Defaults stay in `daemon/config.py` (they are configuration, not rules).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Range:
    """A closed or half-open interval of numbers."""

    low: float
    high: float
    low_open: bool = False

    def __contains__(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        v = float(value)
        if math.isnan(v) or v > self.high or v < self.low:
            return False
        return not (self.low_open and v == self.low)

    def describe(self) -> str:
        """`[0, 2]` or `(0, 1]`: what an error message says the value must be in."""
        return f"{'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"


# Sampling, per request or per session (params) or as the daemon's default.
TEMPERATURE = Range(0.0, 2.0)
TOP_P = Range(0.0, 1.0, low_open=True)


def top_p_filters(top_p: float) -> bool:
    """Whether top_p drops any token: 1, the top of its range, keeps every one, so it means "off"."""
    return top_p in TOP_P and top_p < TOP_P.high


# What one OpenAI request may carry, beyond the sizes config.toml sets ([limits]). Each bounds
# work done per request (stop sequences are scanned against every streamed delta; every message
# is validated, compared with the stored transcript and rendered), so no request stalls others.
MAX_STOPS = 4  # stop sequences per request, as OpenAI
MAX_STOP_CHARS = 256  # characters per stop sequence
MAX_MESSAGES = 2048  # messages per request
MAX_TOOLS = 128  # tools per request, as OpenAI
SEED_MAX = 2**64 - 1  # a seed is 0 to this: MLX's sampler seed is an unsigned 64-bit integer
