"""A request's choices (OpenAI's `n`) as one response: each choice's end, and their usage counted once.

The turn core answers `n` > 1 as n turns over one prompt, read once (turns.py,
`Turns.start`): choice 0 in the session the request was placed in, each other
in a session of its own, its answer drawn from choice 0's prompt with seed + i
(engine/steps.py). The chat and text-completions doors hear them together
(turn.py's `ChoiceStream`) and answer once every choice has ended, or stream
each choice's chunks under its index. The usage counts the prompt once, as
it was read once: its figures are choice 0's (its prompt, what its cache gave,
what was prefilled); the answers' own figures (their tokens, drafted and
accepted) are summed. With `n` > 1 each choice carries a `kvd` object of its own:
its session (where a client that goes on from it is placed), kvd's finish
reason, what it prefilled (0: it read nothing, its prompt came from choice 0's)
and its tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..events import AnswerDone
from ..turn import Turn

SUMMED = ("completion_tokens", "drafted_tokens", "accepted_tokens")  # each choice's own, added up


class Ends:
    """The choices' ends (their AnswerDone) as they come, by index."""

    def __init__(self, turn: Turn):
        self.turns = [turn, *turn.choices]
        self.done: dict[int, AnswerDone] = {}

    @property
    def n(self) -> int:
        return len(self.turns)

    def end(self, choice: int, done: AnswerDone) -> bool:
        """Choice `choice` ended; whether every one has."""
        self.done[choice] = done
        return len(self.done) == self.n

    def ordered(self) -> list[tuple[int, AnswerDone]]:
        return sorted(self.done.items())

    def usage(self) -> Mapping[str, Any]:
        """The request's usage: choice 0's (its prompt read once), the answers' tokens summed over the choices."""
        first = self.done[0].usage
        if self.n == 1:
            return first
        return {**first, **{key: sum(int(d.usage.get(key) or 0) for d in self.done.values()) for key in SUMMED}}

    def kvd(self) -> dict[str, Any]:
        """Beside the door's `kvd` object (its session and finish reason are choice 0's): how many choices."""
        return {"choices": self.n} if self.n > 1 else {}

    def kvd_of(self, choice: int, done: AnswerDone) -> dict[str, Any] | None:
        """A choice's own `kvd` object, where there are several (None: one)."""
        if self.n == 1:
            return None
        u = done.usage
        return {"session": self.turns[choice].session_id, "finish_reason": done.finish_reason,
                "prefill_tokens": u.get("prefill_tokens"), "cached_tokens": u.get("cached_tokens"),
                "completion_tokens": u.get("completion_tokens")}
