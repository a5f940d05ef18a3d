"""Stored responses of the Responses API: which point of which session a response id names.

A response is one answer of a session (its assistant message, `answer_idx`);
its input is the session's messages before it, from `first_input` on the
ones its own request added. The row is written behind the turn's own rows,
by the same writer, and the turn core acknowledges the answer only once the
row is committed with it (daemon/doors/responses.py), so a response whose
completion a client saw survives kill -9. Plain functions over a Store, run
on the writer thread like every store operation.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, NamedTuple

from .rows import Message
from .store import Store


class StoredResponse(NamedTuple):
    id: str
    session_id: str
    answer_idx: int
    first_input: int
    previous_response_id: str | None
    created_at: float
    request: dict[str, Any]  # what the request asked for, as the response object shows it


def put_response(store: Store, response: StoredResponse) -> None:
    store.db.execute(
        "INSERT INTO responses (id, session_id, answer_idx, first_input, previous_response_id, created_at, request) "
        "VALUES (?, ?, ?, ?, ?, ?, ?)",
        [response.id, response.session_id, response.answer_idx, response.first_input,
         response.previous_response_id, response.created_at, json.dumps(response.request, ensure_ascii=False)])


def get_response(store: Store, response_id: str) -> StoredResponse | None:
    row = store.db.execute(
        "SELECT id, session_id, answer_idx, first_input, previous_response_id, created_at, request "
        "FROM responses WHERE id = ?", [response_id]).fetchone()
    if row is None:
        return None
    return StoredResponse(row[0], row[1], int(row[2]), int(row[3]), row[4], float(row[5]), _request(row[6]))


def delete_response(store: Store, response_id: str) -> bool:
    """Forget the response; the conversation it answered stays (other responses may continue it)."""
    return store.db.execute("DELETE FROM responses WHERE id = ?", [response_id]).rowcount > 0


def _request(text: str) -> dict[str, Any]:
    value = json.loads(text)
    return dict(value) if isinstance(value, Mapping) else {}



def answer_of(store: Store, response: StoredResponse) -> Message | None:
    """The response's answer as the session keeps it now (None if the session was cut back before it)."""
    found = store.messages(response.session_id, first=response.answer_idx, end=response.answer_idx + 1)
    return found[0] if found and found[0]["role"] == "assistant" else None


def input_of(store: Store, response: StoredResponse) -> list[Message]:
    """The messages before the response's answer: its whole conversation's input, in order."""
    return store.messages(response.session_id, end=response.answer_idx)
