"""Tool calls in an answer: found in the model's own format, parsed by mlx-lm's parser for it.

mlx-lm's tokenizer wrapper knows, from the chat template, how a model writes
a call (Qwen's ``<tool_call>{json}</tool_call>``, Mistral's ``[TOOL_CALLS]``,
and a dozen more) and has a parser for each (``mlx_lm.tool_parsers``). The
model writes its calls as text; this module takes them out of the answer's
text and returns them in OpenAI's shape, the rest staying the answer's
content. A call that does not parse (cut by max_tokens, or not JSON) stays
in the content as the model wrote it: nothing generated is dropped.

While streaming, text before a call streams as it comes; from the start of
a call on it is held back, and the calls go out once the answer ends.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("kvd.api")


@dataclass(frozen=True)
class ToolFormat:
    start: str
    end: str
    parse: Callable[[str, Any], Any]
    tools: list[dict[str, Any]]

    @classmethod
    def of(cls, tokenizer: Any, tools: Sequence[Mapping[str, Any]] | None) -> ToolFormat | None:
        """The model's call format, when the request offered tools and the model can call them."""
        if not tools or not getattr(tokenizer, "has_tool_calling", False):
            return None
        return cls(tokenizer.tool_call_start, tokenizer.tool_call_end, tokenizer.tool_parser,
                   [dict(t) for t in tools])


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def _calls(fmt: ToolFormat, body: str) -> list[dict[str, str]] | None:
    """One call's text as calls {"id", "name", "arguments"} (arguments: JSON text); None if it does not parse."""
    try:
        parsed = fmt.parse(body, fmt.tools)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        log.info("an answer's tool call did not parse (%s: %s); it stays in the answer's text", type(e).__name__, e)
        return None
    out = []
    for call in parsed if isinstance(parsed, list) else [parsed]:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            log.info("an answer's tool call names no function; it stays in the answer's text")
            return None
        arguments = call.get("arguments", {})
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        out.append({"id": str(call.get("id") or new_call_id()), "name": call["name"], "arguments": text})
    return out


def split(fmt: ToolFormat, text: str) -> tuple[str, list[dict[str, str]]]:
    """The answer's content without its calls, and the calls."""
    content, calls = _parts(fmt, text)
    return (content.strip() if calls else content), calls


def _parts(fmt: ToolFormat, text: str) -> tuple[str, list[dict[str, str]]]:
    """The text without its calls (not stripped), and the calls."""
    content: list[str] = []
    calls: list[dict[str, str]] = []
    rest = text
    while (at := rest.find(fmt.start)) >= 0:
        content.append(rest[:at])
        end = rest.find(fmt.end, at + len(fmt.start)) if fmt.end else -1
        stop = end if end >= 0 else len(rest)
        body = rest[at + len(fmt.start):stop]
        after = stop + len(fmt.end) if end >= 0 else len(rest)
        found = _calls(fmt, body)
        if found is None:
            content.append(rest[at:after])
        else:
            calls += found
        rest = rest[after:]
    content.append(rest)
    return "".join(content), calls


@dataclass
class StreamSplit:
    """Streams an answer's content while holding back everything from a call's start on.

    The turn core feeds it the answer's text and parses the calls once, in
    `finish`; `content` is then the answer's content as `split` gives it.
    """

    fmt: ToolFormat
    # The id of the answer's k-th call, where the door gives them (Ollama's clients send no id back:
    # ollama_schema.call_id); None: the model's own, else a new one.
    ids: Callable[[int], str] | None = None
    content: str = ""  # set by `finish`
    _held: str = ""
    _in_call: bool = False
    _sent: list[str] = field(default_factory=list)

    def feed(self, delta: str) -> str:
        """The content that may stream now."""
        if self._in_call:
            self._held += delta
            return ""
        text = self._held + delta
        if (at := text.find(self.fmt.start)) >= 0:
            self._in_call, self._held = True, text[at:]
            return self._out(text[:at])
        keep = _partial_start(text, self.fmt.start)  # the start of a marker may be on its way
        self._held = text[len(text) - keep:] if keep else ""
        return self._out(text[:len(text) - keep])

    def finish(self) -> tuple[str, list[dict[str, str]]]:
        """What is left to stream as content once the answer ended, and the calls (parsed here, once)."""
        rest, calls = _parts(self.fmt, self._held)
        if self.ids is not None:
            calls = [{**call, "id": self.ids(k)} for k, call in enumerate(calls)]
        whole = "".join(self._sent) + rest
        self.content = whole.strip() if calls else whole
        return (rest.strip() if calls else rest), calls

    def _out(self, text: str) -> str:
        self._sent.append(text)
        return text


def _partial_start(text: str, marker: str) -> int:
    """How many trailing characters of `text` are a proper beginning of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def openai_calls(calls: Sequence[Mapping[str, str]], *, streaming: bool = False) -> list[dict[str, Any]]:
    """Calls as OpenAI's message.tool_calls (with each one's index in a stream's delta)."""
    out = []
    for i, call in enumerate(calls):
        item: dict[str, Any] = {"id": call["id"], "type": "function",
                                "function": {"name": call["name"], "arguments": call["arguments"]}}
        if streaming:
            item = {"index": i, **item}
        out.append(item)
    return out
