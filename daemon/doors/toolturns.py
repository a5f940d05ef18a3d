"""Tool calls and their results in a request, checked as OpenAI checks them.

A ``tool`` message answers one call of the assistant message it follows (a
run of tool messages follows one assistant message with ``tool_calls``); a
call's ``function.arguments`` is JSON text. OpenAI refuses a request that
breaks either with a 400, and so does kvd, before anything is stored: a
result for a call never made, or made-up arguments, would otherwise become
part of the session's transcript and of the prompt the model is fed.

Separate from the request's shape (openai_schema.py), so whichever code
validates requests calls it once the shape is known.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from http import HTTPStatus

from .openai_schema import ApiError, ChatMessage

__all__ = ["check_tool_turns"]


def check_tool_turns(messages: Sequence[ChatMessage]) -> None:
    """ApiError (400) for a tool message that answers no call of the assistant message before it, or a
    call whose arguments are not JSON text."""
    issued: set[str] | None = None  # the call ids of the assistant message the current tool run follows
    for i, m in enumerate(messages):
        if m.role == "assistant":
            issued = {call.id for call in m.tool_calls or ()}
            for j, call in enumerate(m.tool_calls or ()):
                if not _is_json(call.function.arguments):
                    raise ApiError(HTTPStatus.BAD_REQUEST, f"messages[{i}].tool_calls[{j}].function.arguments is "
                                   "not JSON text; send the arguments as the call gave them (a JSON object as "
                                   "a string)", param=f"messages[{i}].tool_calls[{j}].function.arguments")
        elif m.role == "tool":
            if not issued:
                raise ApiError(HTTPStatus.BAD_REQUEST, f"messages[{i}] is a tool result, but the message before "
                               "it is not an assistant message with tool_calls; a tool message must answer a "
                               "call of the assistant message it follows", param=f"messages[{i}].role")
            if m.tool_call_id not in issued:
                shown = repr(m.tool_call_id)[:80]
                raise ApiError(HTTPStatus.BAD_REQUEST, f"messages[{i}].tool_call_id {shown} answers no call of "
                               f"the assistant message before it (its calls: {', '.join(sorted(issued))[:200]})",
                               param=f"messages[{i}].tool_call_id")
        else:
            issued = None


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True
