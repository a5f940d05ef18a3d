"""A stored response as the Responses API shows it again: GET /v1/responses/{id} and its input_items.

Read on the store's writer thread (the door hands these to
`transcripts.read`), so they see every write queued before them. The
response row says what was asked and which answer it is; the answer's text,
calls, status and usage are the transcript's, as the turn core kept them.
"""

from __future__ import annotations

import re
from collections.abc import Container, Iterable, Iterator
from typing import Any

from sessions import Message, Store
from sessions.chains import said
from sessions.responses import answer_of, get_response, holding, input_of

from .responses_events import RESPONSE_PREFIX, ResponseShape, outcome, output_of, response_object

# The item ids kvd issues: a response's output (msg_<its id's tail>, fc_<tail>_<i>) and input_items'
# (msg_ / fco_ <session><message index:06d>[g<gen>], fc_<session><index>[g<gen>]_<i>: the session whose id
# names them, the message's index, and how many cuts of that session came before it was written, when any).
_OUTPUT_ID = re.compile(r"(msg|fc)_([0-9a-f]{24})(?:_(\d+))?")
_INPUT_ID = re.compile(r"(msg|fco|fc)_([0-9a-f]{16})(\d{6})(?:g([1-9]\d*))?(?:_(\d+))?")

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
    shape = ResponseShape(row.id, int(row.created_at), model, row.request, {"session": row.session_id})
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
    name = f"{session_id}{m['index']:06d}" + (f"g{m['gen']}" if m.get("gen") else "")
    item_id = f"msg_{name}"
    if m["role"] == "tool":
        yield {"type": "function_call_output", "id": f"fco_{name}",
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
        yield {"type": "function_call", "id": f"fc_{name}_{i}", "call_id": call["id"],
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


def referenced(store: Store, ids: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The items kvd issued under `ids`, as input items (an `item_reference` replaced by what it names): a
    stored response's message or call, or a message, call or call output input_items listed. An id kvd did
    not issue, or whose response or message is gone, is left out."""
    out = {}
    for item_id in ids:
        if (item := _output_item(store, item_id) or _input_item(store, item_id)) is not None:
            out[item_id] = item
    return out


def _output_item(store: Store, item_id: str) -> dict[str, Any] | None:
    m = _OUTPUT_ID.fullmatch(item_id)
    if m is None or (m[1] == "msg") != (m[3] is None):
        return None
    row = get_response(store, f"{RESPONSE_PREFIX}{m[2]}")
    answer = answer_of(store, row) if row is not None else None
    if answer is None or answer["status"] == "streaming":
        return None
    return _as_input(answer, None if m[3] is None else int(m[3]))


def _input_item(store: Store, item_id: str) -> dict[str, Any] | None:
    m = _INPUT_ID.fullmatch(item_id)
    if m is None or (m[1] == "fc") != (m[5] is not None):
        return None
    index = int(m[3])
    held = holding(store, m[2], index, int(m[4] or 0))
    found = store.messages(held, first=index, end=index + 1) if held is not None else []
    if not found or found[0]["status"] == "streaming":
        return None
    message = found[0]
    if (m[1] == "fco") != (message["role"] == "tool"):
        return None
    return _as_input(message, None if m[5] is None else int(m[5]))


def _as_input(m: Message, call: int | None) -> dict[str, Any] | None:
    """A stored message as the input item it was issued as: its text (`call` None) or its call `call`."""
    if m["role"] == "tool":
        return {"type": "function_call_output", "call_id": m["tool_call_id"], "output": m["content"]}
    if call is None:
        return {"type": "message", "role": m["role"], "content": m["content"]}
    calls = m["tool_calls"] or []
    if not 0 <= call < len(calls):
        return None
    c = calls[call]
    return {"type": "function_call", "call_id": c["id"], "name": c["name"], "arguments": c["arguments"]}
