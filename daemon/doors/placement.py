"""Where a stateless request's turn goes: which session continues it, or a new one.

An OpenAI-style request carries the whole conversation every time. Its
token ids are the conversation rendered and tokenized whole, exactly as a
fresh daemon would feed it (so a greedy answer equals a fresh prefill's).

- The request extends a stored session's transcript (same system prompt,
  its messages, then new ones) and that session is idle: the new messages
  become the session's next turn. Of several, the longest wins, then the
  most recently used.
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

No transcript is read to decide. The request's messages are hashed into a
chain off the event loop (`links`); `plan` compares that chain with the
turn core's index of every session's chain (sessions/chains.py), a
dictionary look-up per prefix length, and returns a plan: continue a
session, continue a pinned one (rewinding it, or changing its system
prompt), or a new session. The turn core applies the plan (`Turns.apply`)
and alone writes the transcript.
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import anyio.to_thread

import protocol as p
from protocol import DEFAULT_TITLE
from protocol.requests import RequestError
from sessions import new_session_id
from sessions.chains import Chains, chain

from ..transcripts import HeldSession, prepared
from ..turns import Turns

#: A conversation this short is hashed on the event loop (~2 µs a message), not on a worker thread,
#: whose round trip costs more (the same rule as the doors' bodies: apiturns.INLINE_BYTES).
INLINE_MESSAGES = 64

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


class Said(NamedTuple):
    """One message of a conversation as the transcript keeps it: role and text, an assistant's
    tool calls ({"id", "name", "arguments"}), the call a tool message answers, and an assistant's
    reasoning as the client sent it (None: none). A named tuple: a request makes one per message,
    and it is made in half a frozen dataclass's time."""

    role: str
    content: str
    tool_calls: tuple[Mapping[str, str], ...] = ()
    tool_call_id: str | None = None
    reasoning: str | None = None

    def for_template(self) -> dict[str, Any]:
        """As prompt.template_message takes it."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [dict(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning:
            out["reasoning"] = self.reasoning
        return out


@dataclass(frozen=True)
class Plan:
    """Where a request's turn goes; applied by the turn core (Turns.apply)."""

    kind: Kind
    session_id: str | None  # None: a new session
    agree: int = 0  # how many of the request's messages the session holds already
    rewind_from: int | None = None  # a pinned session's transcript is cut here first
    new_system: bool = False  # a pinned session takes the request's system prompt


@dataclass(frozen=True)
class Placement:
    session_id: str
    first_new: int  # the first message this turn added
    kind: Kind
    chain: Sequence[bytes] | None = None  # the request's chain, rooted in its system prompt (renders.py)


def links(system: str | None, messages: Sequence[Said]) -> list[bytes]:
    """The request's chain (sessions/chains.py): its cost grows with the conversation, so it runs
    on a worker thread past INLINE_MESSAGES."""
    return chain(system, ({"role": m.role, "content": m.content, "tool_calls": m.tool_calls,
                           "tool_call_id": m.tool_call_id, "reasoning": m.reasoning} for m in messages))


def plan(chains: Chains, active: Container[str], system: str | None, count: int, request: Sequence[bytes],
         pinned: str | None = None, *, rewind: bool = False) -> Plan:
    """Decide where a request of `count` messages, whose chain is `request`, goes. Pure.

    For a pinned session, `request` is rooted in that session's system prompt
    (so a new prompt does not hide which messages still agree).
    """
    if pinned is not None:
        return _pinned(chains, active, system, count, request, pinned, rewind=rewind)
    if (found := chains.longest(request, skip=active)) is not None:
        return Plan("continued", found[0], agree=found[1])
    return Plan("new", None)


def _pinned(chains: Chains, active: Container[str], system: str | None, count: int, request: Sequence[bytes],
            session_id: str, *, rewind: bool) -> Plan:
    if session_id not in chains:
        raise RequestError(p.UNKNOWN_SESSION, f"no session {session_id!r} (deleted?); "
                           "send the request without pinning a session to start a new one")
    if session_id in active:
        raise RequestError(p.BUSY, f"session {session_id} is answering another request; "
                           "wait for it to finish or cancel it")
    stored = chains.said_count(session_id)
    agree = chains.agree(session_id, request)
    new_system = chains.system_of(session_id) != system
    if not rewind:
        offset = 1 if system is not None else 0  # the request's messages[] count its system message
        if new_system:
            raise Diverged(session_id, 0, "its system prompt (messages[0])" if system is not None
                           else "its system prompt (the session has one; the request has none)")
        if agree < stored:
            raise Diverged(session_id, agree + offset, f"messages[{agree + offset}]" if agree < count
                           else f"the end of its messages (the session holds {stored}, the request "
                           f"{count})")
    # A pinned request that says something else from `agree` on rewinds the session, like chat.edit.
    return Plan("pinned", session_id, agree=agree,
                rewind_from=chains.index_of(session_id, agree) if agree < stored else None,
                new_system=new_system)


async def place(turns: Turns, system: str | None, messages: Sequence[Said], pinned: str | None = None, *,
                rewind: bool = False, origin: str = "api", title: str = DEFAULT_TITLE) -> Placement:
    """Place the request and have the turn core write its messages there.

    `messages` are the conversation's user, assistant and tool messages;
    `system` the request's system prompt; `origin` and `title` are a new session's (titles.py). A
    session the plan names that the turn core does not hold yet is loaded first, and the plan made
    again (something may have changed meanwhile); the plan and its application then run in one step
    of the event loop, so nothing can start a turn in between.
    """
    chains = turns.transcripts.chains
    root = chains.system_of(pinned) if pinned is not None and pinned in chains else system
    if len(messages) <= INLINE_MESSAGES:
        request = links(root, messages)
    else:
        request = await anyio.to_thread.run_sync(links, root, messages)
    while True:
        decision = plan(turns.transcripts.chains, turns.active, system, len(messages), request, pinned,
                        rewind=rewind)
        if decision.session_id is None or turns.transcripts.get(decision.session_id) is not None:
            break
        await turns.hold(decision.session_id)
    new = await _prepared(system, messages) if decision.session_id is None else None
    session_id, first_new = turns.apply(
        decision.session_id, system=system,
        messages=[] if new is not None else [m.for_template() for m in messages[decision.agree:]],
        rewind_from=decision.rewind_from, new_system=decision.new_system,
        title=title, origin=origin,
        links=None if decision.new_system or root != system else request[decision.agree:], prepared=new)
    return Placement(session_id, first_new, decision.kind, chain=request if root == system else None)


async def _prepared(system: str | None, messages: Sequence[Said]) -> HeldSession | None:
    """A new session holding a long conversation, built off the loop (None: one message, made in place)."""
    if len(messages) <= 1:
        return None
    session_id = new_session_id()
    return await anyio.to_thread.run_sync(lambda: prepared(session_id, system, [m.for_template() for m in messages]))


async def branch(turns: Turns, system: str | None, messages: Sequence[Said], *, chain: Sequence[bytes] | None,
                 origin: str, title: str) -> Placement:
    """A new session holding the request's conversation, beside the one `place` chose: another of the request's
    choices (n > 1) is kept there, a branch of the conversation (sessions/branches.py), which placement finds when
    the client goes on from that choice. `chain`: the request's, rooted in `system` (placement's), if known."""
    new = await _prepared(system, messages)
    session_id, first_new = turns.apply(None, system=system, messages=[] if new is not None else [
        m.for_template() for m in messages], title=title, origin=origin, links=chain, prepared=new)
    return Placement(session_id, first_new, "new", chain=chain)
