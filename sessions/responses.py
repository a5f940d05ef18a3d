"""Stored responses of the Responses API: which point of which session a response id names.

A response is one answer of a session (its assistant message, `answer_idx`);
its input is the session's messages before it, from `first_input` on the
ones its own request added. The row is written behind the turn's own rows,
by the same writer, and the turn core acknowledges the answer only once the
row is committed with it (daemon/doors/responses.py), so a response whose
completion a client saw survives kill -9. Plain functions over a Store, run
on the writer thread like every store operation.

A response id names one answer forever. A session rewritten in place
(kvchat's regenerate and edit, a pinned request's rewind) would otherwise
change what its responses return and continue, so the rewrite first
branches the old conversation away (`branch_away`): a new session holding
the messages up to the last response the rewrite would touch, its fed ids
cut at an answer boundary, and those responses moved onto it, in the same
transaction as the cut. Their answers, input items (ids included:
`items_session`) and continuations are what they were; the rewritten
session goes on without them.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
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
    items_session: str | None = None  # whose id names its input items, when not its session's (branch_away)

    @property
    def items_of(self) -> str:
        """The session id its input items are named by (`msg_<session><idx>`)."""
        return self.items_session or self.session_id


def put_response(store: Store, response: StoredResponse) -> None:
    store.db.execute(
        "INSERT INTO responses (id, session_id, answer_idx, first_input, previous_response_id, created_at, request, "
        "items_session) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        [response.id, response.session_id, response.answer_idx, response.first_input,
         response.previous_response_id, response.created_at, json.dumps(response.request, ensure_ascii=False),
         response.items_session])


def get_response(store: Store, response_id: str) -> StoredResponse | None:
    row = store.db.execute(
        "SELECT id, session_id, answer_idx, first_input, previous_response_id, created_at, request, items_session "
        "FROM responses WHERE id = ?", [response_id]).fetchone()
    if row is None:
        return None
    return StoredResponse(row[0], row[1], int(row[2]), int(row[3]), row[4], float(row[5]), _request(row[6]), row[7])


def delete_response(store: Store, response_id: str) -> tuple[str, int] | None:
    """Forget the response; the conversation it answered stays (other responses may continue it).
    Returns the point it named (its session and answer index), None if there was no such response."""
    with store.db.atomic():  # RETURNING: its rows are read inside the transaction
        row = store.db.execute("DELETE FROM responses WHERE id = ? RETURNING session_id, answer_idx",
                               [response_id]).fetchone()
    return (str(row[0]), int(row[1])) if row is not None else None


def holding(store: Store, session_id: str, index: int, gen: int) -> str | None:
    """The session that holds the message written as message `index` of session `session_id` under `gen`
    (how its items were named): that session itself, or one it was branched away to with a response that
    names its items so (`items_session`) and has it in its input. None when no session holds it any more.

    Only such a response's input is the message it named: a branch goes on after it was made, and a cut of
    the branch counts its own cuts from the count it was made with, so the branch may hold another message
    under the same index and count (sessions/migrations.py, m013)."""
    row = store.db.execute("SELECT 1 FROM messages WHERE session_id = ? AND idx = ? AND gen = ?",
                           [session_id, index, gen]).fetchone()
    if row is not None:
        return session_id
    row = store.db.execute(
        "SELECT r.session_id FROM responses r JOIN messages m ON m.session_id = r.session_id AND m.idx = ? "
        "WHERE r.items_session = ? AND r.answer_idx > ? AND m.gen = ? LIMIT 1",
        [index, session_id, index, gen]).fetchone()
    return str(row[0]) if row is not None else None


def answered_at(store: Store, session_id: str) -> list[int]:
    """The answer indices of the session's stored responses, in order (what a rewrite must keep)."""
    rows = store.db.execute("SELECT answer_idx FROM responses WHERE session_id = ? ORDER BY answer_idx",
                            [session_id])
    return [int(r[0]) for r in rows]


def branch_away(store: Store, *, session_id: str, new_id: str, end: int, moving_from: int,
                tokens: Sequence[int], covers: int, model: str | None) -> int:
    """Before session `session_id` is rewritten from message `moving_from` on: a new session `new_id` holding
    its messages before `end` (its title, system prompt, params, origin and model; `tokens`, the fed ids cut
    at an answer boundary, standing for its first `covers` messages), and every stored response whose answer
    is at `moving_from` or later moved onto it. Returns how many moved. All or nothing."""
    with store.db.atomic():
        store.db.execute(
            "INSERT INTO sessions (id, title, system, created_at, updated_at, params, origin, model, gen) "
            "SELECT ?, title, system, ?, updated_at, params, origin, model, gen FROM sessions WHERE id = ?",
            [new_id, time.time(), session_id])
        store.db.execute(
            "INSERT INTO messages (session_id, idx, role, content, status, finish_reason, usage, fed_end, "
            "created_at, updated_at, tool_calls, tool_call_id, reasoning, gen) SELECT ?, idx, role, content, status, "
            "finish_reason, usage, fed_end, created_at, updated_at, tool_calls, tool_call_id, reasoning, gen "
            "FROM messages "
            "WHERE session_id = ? AND idx < ?", [new_id, session_id, end])
        store.set_tokens(new_id, tokens, covers=covers, model=model)
        return int(store.db.execute(
            "UPDATE responses SET items_session = coalesce(items_session, session_id), session_id = ? "
            "WHERE session_id = ? AND answer_idx >= ?", [new_id, session_id, moving_from]).rowcount)


class Points:
    """The points (session, answer index) of the response ids used lately, so that continuing one reads no
    row: event-loop memory, at most `size` of them. A rewrite drops the points it moves (`moved`): the next
    use reads the row, behind the rewrite's own write."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self._points: OrderedDict[str, tuple[str, int]] = OrderedDict()

    def remember(self, response_id: str, session_id: str, index: int) -> None:
        self._points[response_id] = (session_id, index)
        self._points.move_to_end(response_id)
        while len(self._points) > self.size:
            self._points.popitem(last=False)

    def get(self, response_id: str) -> tuple[str, int] | None:
        return self._points.get(response_id)

    def drop(self, response_id: str) -> None:
        self._points.pop(response_id, None)

    def moved(self, session_id: str, moving_from: int) -> None:
        """The session's responses from answer `moving_from` on were branched away (a rare event: a scan)."""
        for rid in [r for r, (s, i) in self._points.items() if s == session_id and i >= moving_from]:
            del self._points[rid]


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
