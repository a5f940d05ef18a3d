"""A forced tool call (tool_choice "required", or a named function): the answer held by the grammar path to
one call, and read as that call.

The answer's grammar (jsonoutput.py compiles it, the engine holds the answer to it: engine/grammar.py) is
a JSON object `{"name": ..., "arguments": ...}` whose name is one of the offered functions (or the named
one) and whose arguments follow that function's parameters schema. So every answer is a call, whatever
the model, also one whose chat template has no tool calling (the default model's): the model may write
nothing else. The answer's text is then read as its call once, when it ends (`ForcedCall`, the turn
core's CallSplit): it streams nothing as content, and is kept as an assistant message with that call.
An answer cut short (max_tokens) is no whole object: it stays the answer's text, with no call.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .toolcalls import new_call_id

log = logging.getLogger("kvd.api")


def call_schema(tools: Sequence[Mapping[str, Any]], name: str | None = None) -> dict[str, Any]:
    """The JSON schema of one call of `tools` (OpenAI's function tools), or of the function `name`."""
    options = []
    for tool in tools:
        function = tool.get("function") or {}
        if name is not None and function.get("name") != name:
            continue
        parameters = _closed(function.get("parameters") or {"type": "object", "properties": {}})
        options.append({"type": "object", "properties": {"name": {"const": function["name"]},
                                                         "arguments": parameters},
                        "required": ["name", "arguments"], "additionalProperties": False})
    return options[0] if len(options) == 1 else {"anyOf": options}


def _closed(schema: Any, depth: int = 0) -> Any:
    """`schema` with its objects closed (no properties it does not list, unless it says otherwise), as OpenAI's
    strict function calling closes them: else a model may go on adding arguments until max_tokens."""
    if not isinstance(schema, dict) or depth > 32:
        return schema
    out = {k: _closed(v, depth + 1) if k in ("items", "additionalProperties") else v for k, v in schema.items()}
    if isinstance(schema.get("properties"), dict):
        out["properties"] = {k: _closed(v, depth + 1) for k, v in schema["properties"].items()}
        out.setdefault("additionalProperties", False)
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list):
            out[key] = [_closed(v, depth + 1) for v in schema[key]]
    return out


@dataclass
class ForcedCall:
    """The turn core's CallSplit for a forced call: nothing streams; the whole answer is read as one call."""

    ids: Callable[[int], str] | None = None  # the call's id, where the door gives it (Ollama's, none here yet)
    content: str = ""  # set by `finish`: "" when the answer was a call
    _text: list[str] = field(default_factory=list)

    def feed(self, delta: str) -> str:
        self._text.append(delta)
        return ""

    def finish(self) -> tuple[str, list[dict[str, str]]]:
        text = "".join(self._text)
        try:
            call = json.loads(text)
            name, arguments = call["name"], call["arguments"]
        except (ValueError, KeyError, TypeError):
            log.info("a forced tool call was cut short (no whole object); it stays the answer's text")
            self.content = text
            return text, []
        self.content = ""
        return "", [{"id": self.ids(0) if self.ids is not None else new_call_id(), "name": str(name),
                     "arguments": json.dumps(arguments, ensure_ascii=False)}]
