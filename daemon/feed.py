"""One answer's events from its engine, heard on the event loop a step at a time.

The engine hands the loop one batch per step (engine/handoff.py); a turn's
`Feed` is where its share of a batch lands: called on the loop, once per step,
with that step's events in order. What it does with them needs no task and no
await: the step's text is joined and passes the stop scan and the tool-call
split once, is shown (turn.py, `Turn.show`: one delta per step, bigger ones for
a slow reader), and is committed behind, at most every COMMIT_INTERVAL, by
appending what came since the last commit (never the whole answer again).
The end (`Done` or an error) goes to the turn core's task for the turn
(turns.py, `_pump`), which commits it and says so; so does anything this
raises. Event loop only.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from anyio.streams.memory import MemoryObjectSendStream

from .engine.jobs import Done, EngineEvent
from .events import AnswerDelta, AnswerError, AnswerProgress, AnswerQueued, AnswerReading

if TYPE_CHECKING:
    from .engine.running import Answer
    from .transcripts import Transcripts
    from .turn import Turn

COMMIT_INTERVAL = 0.25  # seconds between commits of a streaming answer

End = Done | AnswerError | Exception


class Feed:
    """A turn's sink for its answer's events (the engine's hand-off calls `many` on `loop`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, turn: Turn, answer: Answer, transcripts: Transcripts, *,
                 cancel: Callable[[], None], end: MemoryObjectSendStream[End]):
        """`cancel`: stop the answer (a stop sequence was found); `end`: where its end goes (`_pump`)."""
        self.loop = loop
        self.turn, self.answer, self.transcripts = turn, answer, transcripts
        self._cancel = cancel
        self._end = end
        self.taken = False  # the engine has taken the answer (it said more than its queue position)
        self.said = False  # some text came from the engine
        self.uncommitted: list[str] = []  # kept text since the last commit
        self.last_commit = -math.inf  # the first text is committed at once

    def __call__(self, event: EngineEvent) -> None:
        self.many([event])

    def many(self, events: list[EngineEvent]) -> None:
        """One step's events, in order; an end (or a failure here) goes to the turn's task."""
        try:
            text: list[str] = []
            for ev in events:
                if not self.taken and isinstance(ev, AnswerProgress | AnswerDelta | Done):
                    self._took()
                if isinstance(ev, AnswerDelta):
                    text.append(ev.text)
                    continue
                if text:
                    self._heard("".join(text))
                    text = []
                if isinstance(ev, AnswerQueued | AnswerProgress):
                    self.turn.publish(ev)
                else:
                    self._end.send_nowait(ev)
            if text:
                self._heard("".join(text))
        except Exception as e:
            self._end.send_nowait(e)

    def _took(self) -> None:
        """The engine took the answer: a new session's rows are queued now, and the input figures published."""
        turn, answer = self.turn, self.answer
        self.taken = True
        turn.writes += [write() for write in turn.unstored]
        turn.unstored.clear()
        # The input figures, before the first token (Anthropic's message_start): the engine set them on
        # the answer before the event that says it took it.
        turn.publish(AnswerReading(len(answer.tokens), answer.cached_len))
        if answer.retokenized:
            assert turn.held is not None
            turn.writes.append(self.transcripts.forget_fed_ends(turn.held, turn.message_index))

    def _heard(self, text: str) -> None:
        """Text from the engine: past the stop scan, said, committed behind at most every COMMIT_INTERVAL."""
        turn = self.turn
        if turn.stop is not None:
            stopped = turn.stop.hit
            text = turn.stop.feed(text)
            if turn.stop.hit and not stopped:
                self._cancel()  # the rest would be cut anyway
        self.say(text)
        if self.uncommitted and (now := time.monotonic()) - self.last_commit >= COMMIT_INTERVAL:
            assert turn.held is not None
            turn.writes.append(self.transcripts.append_text(turn.held, turn.message_index, "".join(self.uncommitted)))
            self.uncommitted.clear()
            self.last_commit = now

    def say(self, text: str, *, now: bool = False) -> None:
        """Add `text` to the answer and show what of it may be shown (not a tool call's text); `now`: the
        answer's end, so whatever waits is published at once.

        The engine waits after the answer's first token until it is written
        (Answer.handed): the listener that writes it sets that, or this does
        when there is nothing to write.
        """
        turn = self.turn
        first, self.said = not self.said, True
        if text:
            turn.pieces.append(text)
            self.uncommitted.append(text)
        shown = turn.tools.feed(text) if turn.tools is not None else text
        if first and not shown:
            turn.handed.set()
        turn.show(shown, now=now)
