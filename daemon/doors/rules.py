"""The door rules: what every HTTP door does with a request it cannot honour as sent, in one place.

docs/doors.md is their table (each request field, for each door), and
tests/test_door_rules.py runs its rows against every door:

- **Clamped**: an output limit (`max_tokens`, `max_completion_tokens`,
  `max_output_tokens`) is a ceiling. Above `limits.max_tokens_limit` it is
  lowered to it, and above the room the model's context leaves after the
  prompt, to that room (the turn core does it, `Turns._fit`: only it knows the
  prompt's length). The answer's usage says so in its `kvd` object
  (`max_tokens` and `max_tokens_asked`), and the log's turn line. It is
  refused only when the room left is no answer at all (under MIN_ANSWER
  tokens): `context_length_exceeded`.
- **Dropped**: tools offered to a model whose chat template calls none. The
  model is shown none and answers in text, and the log says so (coding agents
  offer their tools with every request, also for a question a model without
  tools can answer).
- **Ignored**: fields kvd does not know (every door's schema ignores them, as
  the vendors' clients add new ones often).
- **Refused**, in the same words at every door (a 400 naming the field): what
  is not text (images, audio, files, documents: kvd serves text models).
- **Forced**: a tool call a request forces (OpenAI's "required" or a named
  function, Anthropic's "any" or "tool") is made: the answer is held by the
  grammar path to one call of the tools (forcedcall.py), on any model.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Annotated

from pydantic import Field

from .httpdoor import ApiError

log = logging.getLogger("kvd.api")

#: An output limit as every HTTP door takes it: any count from 1 (the websocket's `MaxTokens` refuses one above
#: limits.max_tokens_limit; here it is lowered).
OutputLimit = Annotated[int, Field(ge=1, strict=True)]

#: Every HTTP door's output limit is a ceiling (TurnSpec.fit): lowered to what fits, never refused for it.
OUTPUT_LIMIT_FITS = True


def without_tools(model: str, door: str, offered: int) -> None:
    """Tools offered to a model that calls none: dropped (the answer is asked for without them), and logged."""
    log.info("the model %s calls no tools: answering a %s request that offered %d without them", model, door,
             offered)


#: Content kinds that are not text, by each vendor's name: Anthropic's blocks, OpenAI's chat parts and Responses'.
NOT_TEXT = frozenset({"image", "document", "image_url", "input_audio", "file", "input_image", "input_file",
                      "audio"})


def text_only(items: object, listed: str) -> None:
    """Refuse the first part of `items` (a body's messages or input, named `listed`) that is not text: in a
    message's `content` or a tool result's (`output`, or a part's own `content`: Anthropic's tool_result).
    Run before validation, whose words for such a part would be a list of the kinds it expected."""
    for i, item in enumerate(items if isinstance(items, list) else ()):
        for key in ("content", "output"):
            parts = item.get(key) if isinstance(item, dict) else None
            for j, part in enumerate(parts if isinstance(parts, list) else ()):
                where = f"{listed}[{i}].{key}[{j}]"
                _text_part(part, where)
                inner = part.get("content") if isinstance(part, dict) else None
                for k, nested in enumerate(inner if isinstance(inner, list) else ()):
                    _text_part(nested, f"{where}.content[{k}]")


def _text_part(part: object, where: str) -> None:
    kind = part.get("type") if isinstance(part, dict) else None
    if isinstance(kind, str) and kind in NOT_TEXT:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"{where} is {kind!r} content; kvd serves text models and reads "
                       "text only: send it as text, or leave it out", param=where, code="unsupported_content")
