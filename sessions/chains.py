"""Every session's conversation as a hash chain, so a stateless request finds its session in O(its length).

An API client sends its whole conversation each time. Which stored session
it continues was found by loading the transcripts of the sessions that
share its first message and comparing them message by message, on the
event loop: a 401-message conversation stalled other clients for up to
1.6 s. Here each session is the chain of its said messages (those with text
or tool calls, what a client could have been shown): link k hashes link k-1
with message k, and the chain is rooted in the system prompt. A request's
chain is computed once, off the loop (`chain`); then the session it
extends is one dictionary look-up per prefix length, longest first
(`Chains.longest`), and a pinned session's agreement is a comparison of
digests (`Chains.agree`). No transcript is read.

Pure and synchronous: the turn core, which alone writes transcripts, keeps
it up to date as it writes (the daemon's event loop only), and builds it at
start from the store's rows (`build`, on the writer thread).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

DIGEST = 16


def _call_key(call: Mapping[str, str]) -> list[str]:
    """A tool call as it compares: its arguments as canonical JSON (a client may re-serialize them)."""
    try:
        arguments = json.dumps(json.loads(call["arguments"]), sort_keys=True, separators=(",", ":"))
    except ValueError:
        arguments = call["arguments"]
    return [call["id"], call["name"], arguments]


def said(content: str, tool_calls: Sequence[Mapping[str, str]] | None, status: str = "complete") -> bool:
    """Whether a client could have been shown the message: one with text or calls, or a finished
    one (an answer that ended at once is an empty answer the client got); not an answer still
    streaming, or cut before any text or call (a client that hung up never saw it)."""
    return bool(content or tool_calls) or status == "complete"


def root(system: str | None) -> bytes:
    text = b"\x00none" if system is None else b"\x01" + system.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(text, digest_size=DIGEST, person=b"kvd-root").digest()


def link(prev: bytes, role: str, content: str, tool_calls: Sequence[Mapping[str, str]] | None,
         tool_call_id: str | None, reasoning: str | None = None) -> bytes:
    """The link after `prev`. A plain message (most of them) is hashed as its role, its length and its
    text; one with tool calls, a call id or reasoning as JSON, tagged apart (the JSON costs 3x the hash)."""
    h = hashlib.blake2b(prev, digest_size=DIGEST, person=b"kvd-link")
    if reasoning:  # a template renders it: a message with other reasoning is another message
        h.update(b"\x03" + json.dumps([role, content, [_call_key(c) for c in tool_calls or ()], tool_call_id,
                                       reasoning], ensure_ascii=False, separators=(",", ":"))
                 .encode("utf-8", "surrogatepass"))
    elif tool_calls or tool_call_id is not None:
        h.update(b"\x02" + json.dumps([role, content, [_call_key(c) for c in tool_calls or ()], tool_call_id],
                                      ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass"))
    else:
        text = content.encode("utf-8", "surrogatepass")
        h.update(b"\x01%s\x00%d\x00" % (role.encode("utf-8", "surrogatepass"), len(text)))
        h.update(text)
    return h.digest()


def chain(system: str | None, messages: Iterable[Mapping[str, Any]]) -> list[bytes]:
    """The links of `messages` (each with role, content, tool_calls, tool_call_id, reasoning), all of them
    said."""
    out: list[bytes] = []
    prev = root(system)
    for m in messages:
        prev = link(prev, m["role"], m["content"], m.get("tool_calls"), m.get("tool_call_id"), m.get("reasoning"))
        out.append(prev)
    return out


@dataclass
class _Session:
    system: str | None
    links: list[bytes] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)  # each said message's index in the transcript
    used: int = 0  # recency: the most recently used of equal matches wins


class Chains:
    """Each session's chain of said messages, and which sessions end at each link."""

    def __init__(self) -> None:
        self._sessions: dict[str, _Session] = {}
        self._ends: dict[bytes, set[str]] = {}
        self._clock = 0

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def __len__(self) -> int:
        return len(self._sessions)

    # --- what the turn core tells it ---

    def put(self, session_id: str, system: str | None, messages: Iterable[Mapping[str, Any]]) -> None:
        """The session as a whole (messages with their "index"; unsaid ones are skipped)."""
        self.remove(session_id)
        s = _Session(system)
        prev = root(system)
        for m in messages:
            if said(m["content"], m.get("tool_calls"), m.get("status", "complete")):
                prev = link(prev, m["role"], m["content"], m.get("tool_calls"), m.get("tool_call_id"),
                            m.get("reasoning"))
                s.links.append(prev)
                s.indices.append(int(m["index"]))
        self._sessions[session_id] = s
        self._end(session_id, s, add=True)
        self.touch(session_id)

    def remove(self, session_id: str) -> None:
        s = self._sessions.pop(session_id, None)
        if s is not None:
            self._end(session_id, s, add=False)

    def touch(self, session_id: str) -> None:
        if (s := self._sessions.get(session_id)) is not None:
            self._clock += 1
            s.used = self._clock

    def message(self, session_id: str, index: int, role: str, content: str,
                tool_calls: Sequence[Mapping[str, str]] | None, tool_call_id: str | None,
                status: str = "complete", reasoning: str | None = None) -> bool:
        """Message `index` is now this (appended, or the last one changed); False when the chain
        cannot follow without the whole transcript (an earlier message changed): call `put`."""
        s = self._sessions.get(session_id)
        if s is None:
            return False
        if s.indices and index < s.indices[-1]:
            return False
        self._end(session_id, s, add=False)
        if s.indices and s.indices[-1] == index:
            s.links.pop()
            s.indices.pop()
        if said(content, tool_calls, status):
            prev = s.links[-1] if s.links else root(s.system)
            s.links.append(link(prev, role, content, tool_calls, tool_call_id, reasoning))
            s.indices.append(index)
        self._end(session_id, s, add=True)
        self.touch(session_id)
        return True

    def extend(self, session_id: str, links: Sequence[bytes], indices: Sequence[int]) -> None:
        """Said messages appended at `indices`, their links already made (by `chain`, off the loop,
        continuing this session's chain: the caller's promise)."""
        s = self._sessions[session_id]
        self._end(session_id, s, add=False)
        s.links += links
        s.indices += indices
        self._end(session_id, s, add=True)
        self.touch(session_id)

    def truncate(self, session_id: str, from_index: int) -> None:
        s = self._sessions.get(session_id)
        if s is None:
            return
        self._end(session_id, s, add=False)
        while s.indices and s.indices[-1] >= from_index:
            s.indices.pop()
            s.links.pop()
        self._end(session_id, s, add=True)

    # --- what placement asks ---

    def longest(self, links: Sequence[bytes], skip: Container[str] = ()) -> tuple[str, int] | None:
        """The session whose whole chain is the longest proper prefix of `links` (at least one
        message, at least one new), and that prefix's length; the most recently used of equals."""
        for k in range(len(links) - 1, 0, -1):
            ids = self._ends.get(links[k - 1])
            if ids:
                free = [sid for sid in ids if sid not in skip]
                if free:
                    return max(free, key=lambda sid: self._sessions[sid].used), k
        return None

    def agree(self, session_id: str, links: Sequence[bytes]) -> int:
        """How many leading said messages the session and `links` share (same system prompt assumed)."""
        s = self._sessions[session_id]
        n = 0
        for a, b in zip(s.links, links):
            if a != b:
                break
            n += 1
        return n

    def system_of(self, session_id: str) -> str | None:
        return self._sessions[session_id].system

    def said_count(self, session_id: str) -> int:
        return len(self._sessions[session_id].links)

    def index_of(self, session_id: str, k: int) -> int:
        """The transcript index of the session's k-th said message (0-based)."""
        return self._sessions[session_id].indices[k]

    def _end(self, session_id: str, s: _Session, *, add: bool) -> None:
        if not s.links:
            return
        end = s.links[-1]
        if add:
            self._ends.setdefault(end, set()).add(session_id)
        elif (ids := self._ends.get(end)) is not None:
            ids.discard(session_id)
            if not ids:
                del self._ends[end]


def build(rows: Iterable[tuple[str, str | None, int, str, str, Any, str | None, str, str | None]]) -> Chains:
    """A Chains from (session_id, system, index, role, content, tool_calls, tool_call_id, status, reasoning) rows,
    ordered by session recency (least recent first) then index; a session with no messages has
    one row with index -1."""
    chains = Chains()
    current: str | None = None
    system: str | None = None
    messages: list[dict[str, Any]] = []
    for sid, sys_prompt, index, role, content, tool_calls, tool_call_id, status, reasoning in rows:
        if sid != current:
            if current is not None:
                chains.put(current, system, messages)
            current, system, messages = sid, sys_prompt, []
        if index >= 0:
            calls = json.loads(tool_calls) if isinstance(tool_calls, str) else tool_calls
            messages.append({"index": index, "role": role, "content": content, "tool_calls": calls,
                             "tool_call_id": tool_call_id, "status": status, "reasoning": reasoning})
    if current is not None:
        chains.put(current, system, messages)
    return chains
