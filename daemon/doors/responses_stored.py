"""A stored response as the Responses API shows it again: GET /v1/responses/{id} and its input_items.

Read on the store's writer thread (the door hands these to
`transcripts.read`), so they see every write queued before them. The
response row says what was asked and which answer it is; the answer's text,
calls, status and usage are the transcript's, as the turn core kept them.
"""

from __future__ import annotations

from collections.abc import Container, Iterator
from typing import Any

from sessions import Message, Store
from sessions.chains import said
from sessions.responses import answer_of, get_response, input_of

from .responses_events import Shape, outcome, output_of, response_object

FAILED = "the answer failed; kvd's log says why"
CUT = ("the answer was cut short: kvd could not write the rest of it (its disk was full) or stopped (a crash); "
       "what was written of it is kept")


def stored_object(store: Store, response_id: str, model: str,
                  answering: Container[str] = ()) -> dict[str, Any] | None:
    """The stored response as GET shows it; `answering`: the sessions whose answer is under way now (a
    'streaming' answer of any other was cut by a write that failed, its end never written)."""
    row = get_response(store, response_id)
    if row is None:
        return None
    answer = answer_of(store, row)
    if answer is None:
        return None
    shape = Shape(row.id, int(row.created_at), model, row.request, {"session": row.session_id})
    calls = answer["tool_calls"] or []
    if answer["status"] == "streaming" and row.session_id in answering:
        return response_object(shape, status="in_progress", output=[])
    if answer["status"] in ("streaming", "error"):  # as the client was told live: response.failed
        why = FAILED if answer["finish_reason"] == "error" else CUT
        return response_object(shape, status="failed", output=output_of(row.id, answer["content"], calls),
                               usage=answer["usage"], error={"code": "server_error", "message": why})
    status, incomplete = outcome(answer["finish_reason"] or "stop")
    item_status = "completed" if status == "completed" else "incomplete"
    return response_object(shape, status=status, output=output_of(row.id, answer["content"], calls,
                                                                  status=item_status),
                           usage=answer["usage"], incomplete=incomplete)


def _items(session_id: str, m: Message) -> Iterator[dict[str, Any]]:
    """One stored message as input items (an answer: its text, then its calls)."""
    item_id = f"msg_{session_id}{m['index']:06d}"
    if m["role"] == "tool":
        yield {"type": "function_call_output", "id": f"fco_{session_id}{m['index']:06d}",
               "call_id": m["tool_call_id"], "output": m["content"], "status": "completed"}
        return
    if m["role"] == "user":
        yield {"type": "message", "id": item_id, "role": "user", "status": "completed",
               "content": [{"type": "input_text", "text": m["content"]}]}
        return
    if m["content"] or not m["tool_calls"]:
        yield {"type": "message", "id": item_id, "role": "assistant", "status": "completed",
               "content": [{"type": "output_text", "text": m["content"], "annotations": []}]}
    for i, call in enumerate(m["tool_calls"] or ()):
        yield {"type": "function_call", "id": f"fc_{session_id}{m['index']:06d}_{i}", "call_id": call["id"],
               "name": call["name"], "arguments": call["arguments"], "status": "completed"}


def input_items(store: Store, response_id: str, *, order: str, limit: int,
                after: str | None) -> dict[str, Any] | None:
    """The response's input items (its whole conversation before its answer), a page of them."""
    row = get_response(store, response_id)
    if row is None or answer_of(store, row) is None:
        return None
    items = [item for m in input_of(store, row) if said(m["content"], m["tool_calls"], m["status"])
             for item in _items(row.items_of, m)]
    if order == "desc":
        items.reverse()
    if after is not None:
        at = next((i for i, item in enumerate(items) if item["id"] == after), None)
        items = items[at + 1:] if at is not None else []
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}
