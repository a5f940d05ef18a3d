"""Tool calls and their results in a request, checked as OpenAI checks them.

A ``tool`` message answers one call of the assistant message it follows (a
run of tool messages follows one assistant message with ``tool_calls``); a
call's ``function.arguments`` is JSON text. OpenAI refuses a request that
breaks either with a 400, and so does kvd, before anything is stored: a
result for a call never made, or made-up arguments, would otherwise become
part of the session's transcript and of the prompt the model is fed.

Separate from the request's shape (openai_schema.py), so whichever code
validates requests calls it once the shape is known; `stray_result` is the
rule itself, which the Anthropic door (anthropic_schema.py) checks too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from http import HTTPStatus

from common import jsondepth

from .httpdoor import ApiError
from .openai_schema import ChatMessage
from .placement import Said

__all__ = ["Stray", "check_tool_turns", "stray_result"]


@dataclass(frozen=True)
class Stray:
    """A tool message that answers no call of the assistant message its run of tool messages follows."""

    index: int  # in the messages checked
    call_id: str | None
    issued: frozenset[str]  # the calls of the assistant message before it (empty: it is no such message)


def stray_result(messages: Sequence[Said]) -> Stray | None:
    """The rule every door checks, once: a tool message answers a call of the assistant message before its
    run of tool messages (what OpenAI and Anthropic both refuse with a 400)."""
    issued: frozenset[str] = frozenset()
    for i, m in enumerate(messages):
        if m.role == "assistant":
            issued = frozenset(call["id"] for call in m.tool_calls)
        elif m.role == "tool":
            if m.tool_call_id not in issued:
                return Stray(i, m.tool_call_id, issued)
        else:
            issued = frozenset()
    return None


def check_tool_turns(messages: Sequence[ChatMessage]) -> None:
    """ApiError (400) for a tool message that answers no call of the assistant message before it, or a
    call whose arguments are not JSON text."""
    for i, m in enumerate(messages):
        for j, call in enumerate(m.tool_calls or ()):
            if m.role == "assistant" and not _is_json(call.function.arguments):
                raise ApiError(HTTPStatus.BAD_REQUEST, f"messages[{i}].tool_calls[{j}].function.arguments is "
                               "not JSON text; send the arguments as the call gave them (a JSON object as "
                               "a string)", param=f"messages[{i}].tool_calls[{j}].function.arguments")
    stray = stray_result([Said(m.role, "", tuple(c.stored() for c in m.tool_calls or ()), m.tool_call_id)
                          for m in messages])
    if stray is None:
        return
    i = stray.index
    if not stray.issued:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"messages[{i}] is a tool result, but the message before "
                       "it is not an assistant message with tool_calls; a tool message must answer a "
                       "call of the assistant message it follows", param=f"messages[{i}].role")
    raise ApiError(HTTPStatus.BAD_REQUEST, f"messages[{i}].tool_call_id {repr(stray.call_id)[:80]} answers no call "
                   f"of the assistant message before it (its calls: {', '.join(sorted(stray.issued))[:200]})",
                   param=f"messages[{i}].tool_call_id")


def _is_json(text: str) -> bool:
    try:
        jsondepth.loads(text)
    except (ValueError, RecursionError):
        return False
    return True
