"""A turn's typed events (daemon/events.py) in Anthropic's Messages shape: pure encoders, no I/O.

`whole` makes the JSON body of a non-streamed answer from its `AnswerDone`;
`MessageStream` makes the server-sent events of a streamed one, in
Anthropic's order: ``message_start`` once the engine has taken the prompt
(an `AnswerReading`), with the prompt's input figures, as Anthropic's
carries them; per content block
``content_block_start``, its ``content_block_delta``s (``text_delta``,
``input_json_delta``) and ``content_block_stop``; ``message_delta`` with the
stop reason and the whole usage; ``message_stop``. ``ping`` while a long prompt
is read (an `AnswerProgress`, always after `AnswerReading`), so that no client
times out before the first token.

Usage in Anthropic's terms: ``input_tokens`` are the prompt tokens kvd did
not restore (Anthropic's uncached input), ``cache_read_input_tokens`` those it
restored instead of prefilling, so their sum is the whole prompt;
``cache_creation_input_tokens`` is 0 (kvd keeps every prompt's cache, at no
extra charge).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ..events import (
    AnswerDelta,
    AnswerDone,
    AnswerProgress,
    AnswerQueued,
    AnswerReading,
    AnswerToolCall,
    TurnEvent,
    cache_figures,
)

Sse = tuple[str, dict[str, Any]]  # (event name, data)


def input_usage(prompt: int, cached: int) -> dict[str, int]:
    """A prompt's figures in Anthropic's terms: what was read, what was restored (nothing is "created")."""
    return {"input_tokens": max(0, prompt - cached), "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached}


def usage_of(u: Mapping[str, Any]) -> dict[str, Any]:
    return {**_input_of(u), "output_tokens": int(u.get("completion_tokens") or 0)}


def _input_of(u: Mapping[str, Any]) -> dict[str, int]:
    return input_usage(int(u.get("prompt_tokens") or 0), int(u.get("cached_tokens") or 0))


def stop_reason_of(done: AnswerDone, stop_sequence: str | None) -> str:
    """Anthropic's stop_reason. An answer cut short (kvd stopping, a cancel from kvchat on the same
    session) says "max_tokens", Anthropic's value for an answer that ended before the model ended it (as
    the chat door says "length"), so a client never takes it for a whole one; one that filled the room
    the model's context left (less than it asked for: the door rules) says so."""
    if done.finish_reason == "length" and done.usage.get("context_full"):
        return "model_context_window_exceeded"  # what fits was less than asked, and the answer filled it
    if done.finish_reason in ("length", "cancelled"):
        return "max_tokens"
    if done.calls:
        return "tool_use"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments (JSON text, as kept) as Anthropic's `input` object."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def _message(message_id: str, model: str, content: list[dict[str, Any]], stop_reason: str | None,
             stop_sequence: str | None, usage: dict[str, Any], kvd: dict[str, Any] | None = None) -> dict[str, Any]:
    message = {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
               "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}
    return {**message, "kvd": kvd} if kvd is not None else message


def whole(message_id: str, model: str, done: AnswerDone, stop_sequence: str | None = None) -> dict[str, Any]:
    """The non-streamed answer: its text (without its calls' text), then its calls as tool_use blocks."""
    content: list[dict[str, Any]] = [{"type": "text", "text": done.content}] if done.content else []
    content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": tool_input(c.arguments)}
                for c in done.calls]
    if not content:
        content = [{"type": "text", "text": ""}]
    return _message(message_id, model, content, stop_reason_of(done, stop_sequence),
                    stop_sequence if not done.calls else None, usage_of(done.usage),
                    cache_figures(done.usage))


class MessageStream:
    """One streamed answer's events, as Anthropic sends them. `begin` once, then `feed` each turn event;
    a call's text never arrives as a delta (the turn core parses calls), only as an `AnswerToolCall`."""

    def __init__(self, message_id: str, model: str):
        self.message_id, self.model = message_id, model
        self.begun = False
        self.blocks = 0  # content blocks opened so far
        self.open: str | None = None  # the open block's type
        self.input = input_usage(0, 0)  # the prompt's figures, once the engine has taken it

    def begin(self) -> list[Sse]:
        if self.begun:
            return []
        self.begun = True
        start = _message(self.message_id, self.model, [], None, None, {**self.input, "output_tokens": 0})
        return [("message_start", {"type": "message_start", "message": start})]

    def feed(self, event: TurnEvent, stop_sequence: str | None = None) -> list[Sse]:
        """The events `event` makes (an `AnswerDone` needs the stop sequence that ended the answer, if one did)."""
        if isinstance(event, AnswerReading):
            self.input = input_usage(event.prompt_tokens, event.cached_tokens)
            return self.begin()
        if isinstance(event, (AnswerProgress, AnswerQueued)):
            return [*self.begin(), ("ping", {"type": "ping"})]
        if isinstance(event, AnswerDelta):
            out = [*self.begin(), *self._open("text", {"type": "text", "text": ""})]
            return [*out, self._delta({"type": "text_delta", "text": event.text})]
        if isinstance(event, AnswerToolCall):
            out = [*self.begin(), *self._close(),
                   *self._open("tool_use", {"type": "tool_use", "id": event.id, "name": event.name, "input": {}})]
            return [*out, self._delta({"type": "input_json_delta", "partial_json": event.arguments}), *self._close()]
        if isinstance(event, AnswerDone):
            if not self.begun:  # no AnswerReading seen: the prompt's figures are the usage's
                self.input = _input_of(event.usage)
            out = [*self.begin()]
            if self.blocks == 0:  # an empty answer still has its one (empty) text block
                out += self._open("text", {"type": "text", "text": ""})
            out += self._close()
            reason = stop_reason_of(event, stop_sequence)
            out.append(("message_delta", {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": stop_sequence if reason == "stop_sequence" else None},
                "usage": usage_of(event.usage), "kvd": cache_figures(event.usage)}))
            return [*out, ("message_stop", {"type": "message_stop"})]
        return []  # AnswerStarted: nothing to say yet; an AnswerError: the door words it (`error`)

    def error(self, body: dict[str, Any]) -> list[Sse]:
        """An error once the stream has begun (its HTTP status is sent already), in Anthropic's error shape."""
        return [*self.begin(), ("error", body)]

    def _open(self, kind: str, block: dict[str, Any]) -> list[Sse]:
        if self.open == kind:
            return []
        out = self._close()
        self.open = kind
        out.append(("content_block_start", {"type": "content_block_start", "index": self.blocks,
                                            "content_block": block}))
        self.blocks += 1
        return out

    def _delta(self, delta: dict[str, Any]) -> Sse:
        return "content_block_delta", {"type": "content_block_delta", "index": self.blocks - 1, "delta": delta}

    def _close(self) -> list[Sse]:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.blocks - 1})]


def sse(event: Sse) -> bytes:
    name, data = event
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()
