"""A Responses API response: the response object, and a turn's typed events as OpenAI's stream events.

Pure: no I/O, no turn core. `Encoder` takes the turn core's events
(daemon/events.py) and returns the stream's events in OpenAI's order, each
with its `sequence_number`:

    response.created, response.in_progress (again while a long prompt is read)
    response.output_item.added (message), response.content_part.added,
    response.output_text.delta ..., response.output_text.done, response.content_part.done,
    response.output_item.done
    for each call: response.output_item.added (function_call),
    response.function_call_arguments.delta, .done, response.output_item.done
    response.completed | response.incomplete (incomplete_details.reason) | response.failed

An answer's calls come from the turn core once it kept them (AnswerDone), so
an item's id and text are the same in the stream, in the final object and in
GET /v1/responses/{id} (`output_of`): message `msg_<hex>`, calls `fc_<hex>_<i>`,
from the response's own id. What the message shows once done is the text the
transcript keeps (without the calls' text), so a client that sends its output
items back matches the stored conversation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..events import AnswerDelta, AnswerDone, AnswerError, AnswerProgress, AnswerQueued, TurnEvent, cache_figures
from .httpdoor import api_error

RESPONSE_PREFIX = "resp_"


@dataclass(frozen=True)
class ResponseShape:
    """What a response object shows besides its outcome: its id, when, the model, what the request asked."""

    id: str
    created_at: int
    model: str
    request: Mapping[str, Any]  # instructions, max_output_tokens, tools, metadata... (responses.py's `asked`)
    kvd: Mapping[str, Any] = field(default_factory=dict)  # kvd's own figures: the session, where the cache came from


def item_ids(response_id: str) -> tuple[str, str]:
    """The message item's id and the calls' prefix, from the response's id."""
    tail = response_id.removeprefix(RESPONSE_PREFIX)
    return f"msg_{tail}", f"fc_{tail}_"


def message_item(item_id: str, text: str, status: str, logprobs: Sequence[Any] = ()) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs)}]}


def call_item(item_id: str, call: Mapping[str, str], status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": call["name"],
            "arguments": call["arguments"], "status": status}


def output_of(response_id: str, content: str, calls: Sequence[Mapping[str, str]], *,
              status: str = "completed", message: bool = False, logprobs: Sequence[Any] = ()) -> list[dict[str, Any]]:
    """A finished answer's output items: its text (left out when it only called, unless `message`: the
    stream showed one), then its calls. `logprobs`: its tokens' (top_logprobs asked for them)."""
    message_id, call_prefix = item_ids(response_id)
    out = [message_item(message_id, content, status, logprobs)] if content or message or not calls else []
    return out + [call_item(f"{call_prefix}{i}", c, status) for i, c in enumerate(calls)]


def usage_of(u: Mapping[str, Any]) -> dict[str, Any]:
    """The turn's usage in the Responses shape; cached_tokens means what the chat door's does (the prompt
    tokens kvd restored instead of reading)."""
    prompt, completion = int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": int(u.get("cached_tokens") or 0)},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def outcome(finish_reason: str) -> tuple[str, dict[str, str] | None]:
    """A kept answer's finish as the response's status and incomplete_details."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason in ("cancelled", "interrupted", "error"):
        return "incomplete", {"reason": finish_reason}
    return "completed", None


def response_object(shape: ResponseShape, *, status: str, output: list[dict[str, Any]],
                    usage: Mapping[str, Any] | None = None, error: Mapping[str, Any] | None = None,
                    incomplete: Mapping[str, Any] | None = None) -> dict[str, Any]:
    asked = shape.request
    return {
        "id": shape.id, "object": "response", "created_at": shape.created_at, "status": status,
        "background": False, "error": dict(error) if error else None,
        "incomplete_details": dict(incomplete) if incomplete else None,
        "instructions": asked.get("instructions"), "max_output_tokens": asked.get("max_output_tokens"),
        "model": shape.model, "output": output,
        "parallel_tool_calls": asked.get("parallel_tool_calls", True),
        "previous_response_id": asked.get("previous_response_id"),
        "reasoning": {"effort": None, "summary": None}, "store": asked.get("store", True),
        "temperature": asked.get("temperature"), "text": asked.get("text") or {"format": {"type": "text"}},
        "tool_choice": asked.get("tool_choice") or "auto", "tools": list(asked.get("tools") or []),
        "top_p": asked.get("top_p"), "truncation": "disabled",
        "usage": usage_of(usage) if usage is not None else None,
        "user": None, "metadata": dict(asked.get("metadata") or {}),
        "kvd": {**shape.kvd, **(cache_figures(usage) if usage is not None else {})}}


class Encoder:
    """One response's stream: typed events in, OpenAI's stream events out (each a dict with its `type`)."""

    def __init__(self, shape: ResponseShape):
        self.shape = shape
        self.seq = 0
        self.began = False
        self.text = ""  # the deltas so far
        self.message_open = False
        self.message_id, self.call_prefix = item_ids(shape.id)
        self.logprobs: list[dict[str, Any]] = []  # the answer's tokens', set before its end is encoded

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def _lifecycle(self, kind: str, status: str, **outcome: Any) -> dict[str, Any]:
        return self._event(kind, response=response_object(self.shape, status=status, **outcome))

    def begin(self) -> list[dict[str, Any]]:
        """response.created and response.in_progress, once."""
        if self.began:
            return []
        self.began = True
        return [self._lifecycle("response.created", "in_progress", output=[]),
                self._lifecycle("response.in_progress", "in_progress", output=[])]

    def encode(self, event: TurnEvent) -> list[dict[str, Any]]:
        if isinstance(event, (AnswerQueued, AnswerProgress)):
            # While a long prompt is read or the turn waits: a sign of life, so no client times out.
            return self.begin() or [self._lifecycle("response.in_progress", "in_progress", output=[])]
        if isinstance(event, AnswerDelta):
            self.text += event.text
            return [*self.begin(), *self._open_message(), self._event(
                "response.output_text.delta", item_id=self.message_id, output_index=0, content_index=0,
                delta=event.text, logprobs=[])]
        if isinstance(event, AnswerDone):
            return [*self.begin(), *self._done(event)]
        if isinstance(event, AnswerError):
            # OpenAI's code for kvd's (context_length_exceeded, ...), as the HTTP error would carry it.
            code = api_error(event.code, event.message).code or "server_error"
            return [*self.begin(), self._lifecycle("response.failed", "failed", output=[], error={
                "code": code, "message": event.message})]
        return []  # AnswerStarted; AnswerToolCall: the calls go out with AnswerDone, as kept

    def _open_message(self) -> list[dict[str, Any]]:
        if self.message_open:
            return []
        self.message_open = True
        return [self._event("response.output_item.added", output_index=0,
                            item=message_item(self.message_id, "", "in_progress") | {"content": []}),
                self._event("response.content_part.added", item_id=self.message_id, output_index=0, content_index=0,
                            part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]

    def _done(self, done: AnswerDone) -> list[dict[str, Any]]:
        calls = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in done.calls]
        status, incomplete = outcome(done.finish_reason)
        item_status = "completed" if status == "completed" else "incomplete"
        text = done.content if calls else self.text
        out: list[dict[str, Any]] = []
        if self.message_open or text or not calls:
            item = message_item(self.message_id, text, item_status, self.logprobs)
            out += self._open_message()
            out += [self._event("response.output_text.done", item_id=self.message_id, output_index=0,
                                content_index=0, text=text, logprobs=self.logprobs),
                    self._event("response.content_part.done", item_id=self.message_id, output_index=0,
                                content_index=0, part=item["content"][0]),
                    self._event("response.output_item.done", output_index=0, item=item)]
        showed = bool(out)  # the stream showed a message item
        first = 1 if showed else 0
        for i, call in enumerate(calls):
            item_id, index = f"{self.call_prefix}{i}", first + i
            out += [self._event("response.output_item.added", output_index=index,
                                item=call_item(item_id, call, "in_progress") | {"arguments": ""}),
                    self._event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                                delta=call["arguments"]),
                    self._event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                                name=call["name"], arguments=call["arguments"]),
                    self._event("response.output_item.done", output_index=index,
                                item=call_item(item_id, call, "completed"))]
        final = output_of(self.shape.id, text, calls, status=item_status, message=showed, logprobs=self.logprobs)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        out.append(self._lifecycle(kind, status, output=final, usage=done.usage, incomplete=incomplete))
        return out
