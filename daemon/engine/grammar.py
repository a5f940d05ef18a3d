"""JSON output: an answer held to a grammar (the API's response_format) by llguidance's token masks.

llguidance (the constraint engine vLLM, SGLang and llama.cpp use) compiles a
JSON schema into a grammar over the model's own tokens and, before each
token, says which tokens may come next: a bitmask over the vocabulary,
computed in Rust in tens of microseconds, with no precomputed index per
schema. kvd applies it to the logits, so any sampler (greedy or not) picks
only tokens that keep the answer valid; once the value is whole, only an
end-of-turn token is allowed and the answer ends.

The first token is sampled from the prefill's last logits (`Constraint.mask`);
every later one inside the decode batch's step (decode.py), which first
hands the matcher the token just fed (`Constraint.take`), then masks that
row's logits. Only the rows that carry a constraint pay for it. A batch with
a constrained row does not speculate, so the matcher sees every token once.

Engine thread only: the tokenizer view and the matchers are used there.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import numpy as np

log = logging.getLogger("kvd.engine")


def tokenizer_view(tokenizer: Any, vocab_size: int) -> Any:
    """llguidance's view of the model's tokenizer (built once per model: ~20 ms for 2k tokens, ~1 s for 150k).

    `vocab_size` is the logits' width, which may exceed the tokenizer's (padded
    embeddings): the extra ids are never allowed. The ends are the engine's
    end-of-turn ids, so a finished value ends the answer as the model would.
    """
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer._tokenizer, n_vocab=vocab_size,
                                        eos_token=sorted(tokenizer.eos_token_ids))


class Constraint:
    """One answer's matcher: masks logits to what the grammar allows next."""

    def __init__(self, view: Any, grammar: str, vocab_size: int):
        from llguidance import LLMatcher

        self.matcher = LLMatcher(view, grammar, log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"the response_format's grammar does not compile: {self.matcher.get_error()}")
        self.vocab_size = vocab_size
        self.ends = sorted(view.eos_token) if isinstance(view.eos_token, list) else [view.eos_token]
        #: Why the answer left its grammar (the matcher's error), once it has: the engine then reports the
        #: answer as failed, never as a normal finish.
        self.failure: str | None = None

    def mask(self, logits: mx.array) -> mx.array:
        """`logits` (1 x vocab) with every token the grammar does not allow next at -inf."""
        if self.matcher.is_error():  # the door's dry run did not foresee it (a parser limit deeper in)
            if self.failure is None:
                self.failure = (self.matcher.get_error().strip().splitlines() or ["?"])[0][:300]
                log.warning("a JSON-constrained answer left its grammar (%s); ending it as failed", self.failure)
            allowed = np.zeros(self.vocab_size, dtype=bool)
            allowed[self.ends] = True
        else:
            bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
            allowed = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)
        width = logits.shape[-1]
        if width > self.vocab_size:  # never allow an id the matcher does not know
            allowed = np.concatenate([allowed, np.zeros(width - self.vocab_size, dtype=bool)])
        return mx.where(mx.array(allowed[:width]), logits, mx.array(-mx.inf, dtype=logits.dtype))

    def take(self, token: int) -> None:
        """The token the answer continued with (one the mask allowed)."""
        self.matcher.consume_token(token)

    def accepting(self) -> bool:
        return bool(self.matcher.is_accepting())
