"""Where a stateless request's turn goes: which session continues it, or a new one.

An OpenAI-style request carries the whole conversation every time. Its
token ids are the conversation rendered and tokenized whole, exactly as a
fresh daemon would feed it (so a greedy answer equals a fresh prefill's).

- The request extends a stored session's transcript (same system prompt,
  its messages, then new ones) and that session is idle: the new messages
  become the session's next turn. Candidates are the most recent sessions
  with the request's system prompt and first message (Store.continuable).
- Anything else (an edited message, a retry, an unrelated conversation with
  the same system prompt): a new session holds the request's conversation.
  The stored sessions are not touched.

Where the turn's cache comes from is not decided here: cachestore's
checkout restores the longest prefix of the ids that anything holds (the
session's own cache, another session's, blocks on disk), so a new session
that shares a long system prompt or a branched conversation's beginning
starts from it, also after a restart.

A client may pin its session (the `X-Kvd-Session` header): then the request
continues that session. A pinned request whose messages differ from what the
session holds (another system prompt, an edited or missing message) would
erase the stored messages from there on, so it is refused (`Diverged`, a 409)
unless the client asks for it (`X-Kvd-Rewind: true`): that is how a pinned
client edits or regenerates, on purpose.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import protocol as p
from protocol import DEFAULT_TITLE
from protocol.requests import RequestError
from sessions import Message, Store

from ..turns import Turns

TITLE_CHARS = 60

Kind = Literal["continued", "new", "pinned"]


class Diverged(Exception):
    """A pinned request differs from its session's transcript, and the client did not ask to rewind."""

    def __init__(self, session_id: str, index: int, what: str):
        super().__init__(f"the request differs from session {session_id} at {what}; that session holds "
                         f"more or other messages from there on. Send the header X-Kvd-Rewind: true to "
                         "rewind it to this request (its later messages are deleted), or leave out "
                         "X-Kvd-Session to continue in a new session (GET /v1/kvd/sessions/"
                         f"{session_id} shows what it holds)")
        self.session_id = session_id
        self.index = index


@dataclass(frozen=True)
class Said:
    """One message of a conversation as the transcript keeps it: role and text, an assistant's
    tool calls ({"id", "name", "arguments"}) and the call a tool message answers."""

    role: str
    content: str
    tool_calls: tuple[Mapping[str, str], ...] = ()
    tool_call_id: str | None = None

    @classmethod
    def of(cls, m: Mapping[str, Any]) -> Said:
        """A stored message (sessions.Message)."""
        return cls(m["role"], m["content"], tuple(m.get("tool_calls") or ()), m.get("tool_call_id"))

    def same(self, other: Said) -> bool:
        """The same message; a call's arguments compare as JSON (a client may re-serialize them)."""
        return ((self.role, self.content, self.tool_call_id) == (other.role, other.content, other.tool_call_id)
                and [_call_key(c) for c in self.tool_calls] == [_call_key(c) for c in other.tool_calls])

    def for_template(self) -> dict[str, Any]:
        """As prompt.template_message takes it."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [dict(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _call_key(call: Mapping[str, str]) -> tuple[str, str, str]:
    try:
        arguments = json.dumps(json.loads(call["arguments"]), sort_keys=True, separators=(",", ":"))
    except ValueError:
        arguments = call["arguments"]
    return call["id"], call["name"], arguments


@dataclass(frozen=True)
class Placement:
    session_id: str
    first_new: int  # the first message this turn added
    kind: Kind


def _said(messages: list[Message]) -> list[Message]:
    """The messages a client could have been shown (an answer cancelled before any text or call is not)."""
    return [m for m in messages if m["content"] or m.get("tool_calls")]


def divergence(stored: Sequence[Said], request: Sequence[Said]) -> int:
    """How many leading messages the stored transcript and the request agree on."""
    n = 0
    for a, b in zip(stored, request):
        if not a.same(b):
            break
        n += 1
    return n


def title_for(messages: Sequence[Said]) -> str:
    first = next((m.content for m in messages if m.role == "user" and m.content.strip()), "")
    line = first.strip().splitlines()[0] if first.strip() else ""
    if not line:
        return DEFAULT_TITLE
    return line if len(line) <= TITLE_CHARS else line[:TITLE_CHARS - 1] + "…"


def place(store: Store, turns: Turns, system: str | None,
          messages: Sequence[Said], pinned: str | None = None, *, rewind: bool = False,
          origin: str = "api") -> Placement:
    """Decide where the request's turn goes and commit its messages there.

    `messages` are the conversation's user, assistant and tool messages; `system`
    the request's system prompt. Synchronous on the event loop: nothing else
    can start a turn between the decision and the caller's `turns.start`.
    """
    if pinned is not None:
        return _pinned(store, turns, system, messages, pinned, rewind=rewind)
    if messages:
        first = messages[0]
        for sid in store.continuable(system, first.role, first.content):
            said = [Said.of(m) for m in _said(store.messages(sid))]
            if sid not in turns.active and len(messages) > len(said) and divergence(said, messages) == len(said):
                first_new = _append(store, sid, messages[len(said):])
                return Placement(sid, first_new, "continued")
    return _new(store, system, messages, origin)


def _new(store: Store, system: str | None, messages: Sequence[Said], origin: str) -> Placement:
    session = store.create_session(title=title_for(messages), system=system, origin=origin)
    first_new = _append(store, session["id"], messages)
    return Placement(session["id"], first_new, "new")


def _append(store: Store, session_id: str, messages: Sequence[Said]) -> int:
    """Commit `messages` to the session; the index of the first (or of the answer to come)."""
    first = None
    for m in messages:
        index = store.append_message(session_id, m.role, m.content, tool_calls=m.tool_calls or None,
                                     tool_call_id=m.tool_call_id)
        first = index if first is None else first
    if first is None:
        first = len(store.messages(session_id))
    return first


def _pinned(store: Store, turns: Turns, system: str | None, messages: Sequence[Said],
            session_id: str, *, rewind: bool) -> Placement:
    session = store.get_session(session_id)
    if session is None:
        raise RequestError(p.UNKNOWN_SESSION, f"no session {session_id!r} (deleted?); "
                           "send the request without pinning a session to start a new one")
    if session_id in turns.active:
        raise RequestError(p.BUSY, f"session {session_id} is answering another request; "
                           "wait for it to finish or cancel it")
    stored = _said(store.messages(session_id))
    agree = divergence([Said.of(m) for m in stored], messages)
    if not rewind:
        offset = 1 if system is not None else 0  # the request's messages[] count its system message
        if session["system"] != system:
            raise Diverged(session_id, 0, "its system prompt (messages[0])" if system is not None
                           else "its system prompt (the session has one; the request has none)")
        if agree < len(stored):
            raise Diverged(session_id, agree + offset, f"messages[{agree + offset}]" if agree < len(messages)
                           else f"the end of its messages (the session holds {len(stored)}, the request "
                           f"{len(messages)})")
    if session["system"] != system:
        store.update_session(session_id, system=system)
        turns.system_changed(session_id, session["message_count"])
    if agree < len(stored):
        # The request says something else from here on: the pinned session is rewound, like chat.edit.
        turns.rewind(session_id, stored[agree]["index"])
    first_new = _append(store, session_id, messages[agree:])
    return Placement(session_id, first_new, "pinned")
