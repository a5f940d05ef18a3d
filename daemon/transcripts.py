"""The transcripts as the turn core holds them: in memory, written behind by the store's one writer.

A turn used to reload and JSON-decode its session's whole transcript and
fed ids from SQLite (`Store.messages`), and commit each change with an
fsync, on the event loop: work that grew with the conversation, and disk
between a request and its first token. Here the turn core keeps what it
needs of a session (`HeldSession`: its messages, the templated messages a prompt
is rendered from, its fed ids and what they cover), loaded once through the
writer (sessions/writer.py), and every change is made to that memory at
once and queued to the writer as the few rows it changes. Nothing here
waits for the disk; the turn core waits for a commit only where it
acknowledges one (`chat.done`).

The same writes keep `chains` (sessions/chains.py), the index placement
reads, so a stateless request is placed without reading any transcript.

Event-loop only, like the turn core: no locks.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from sessions import DamagedFedIds, Message, Session, Store, new_session_id, stash
from sessions.chains import Chains, build, said
from sessions.responses import Points, answered_at, branch_away
from sessions.writer import Writer

from .prompt import template_message

T = TypeVar("T")

HELD = 256  # sessions held in memory at most (the least recently used idle ones are let go)

Write = concurrent.futures.Future[Any]


@dataclass
class HeldSession:
    """One session as the turn core holds it between turns."""

    session_id: str
    system: str | None
    params: dict[str, Any]
    messages: list[Message]  # message i at position i (indices are contiguous)
    fed: list[int]
    covers: int  # how many leading messages `fed` stands for
    model: str | None = None  # the model a client chose for it; None: the daemon's default, whichever it is
    fed_model: str | None = None  # whose tokens `fed` are (None: not recorded, ids from before)
    # Other models' fed ids and what they covered (sessions/stash.py): a switch back appends to them.
    stashed: dict[str, tuple[list[int], int]] = field(default_factory=dict)
    said_index: list[int] = field(default_factory=list)  # said messages (chains.said), as a prompt renders them
    said_template: list[dict[str, Any]] = field(default_factory=list)
    responses: list[int] = field(default_factory=list)  # the answer indices of its stored responses, in order

    def __post_init__(self) -> None:
        self.resay()

    def fed_cut(self, index: int) -> tuple[int, int]:
        """How many fed ids stand for messages before `index`, and for how many messages: the end of the
        last earlier turn whose boundary is known (the next turn appends to exactly what was fed)."""
        keep, covers = 0, 0
        for m in self.messages[:index]:
            if m["fed_end"] is not None and m["fed_end"] <= len(self.fed):
                keep, covers = m["fed_end"], m["index"] + 1
        return keep, covers

    def resay(self) -> None:
        # An answer that ended empty is said: its fed ids hold it, and the API door keeps it too.
        said_ones = [m for m in self.messages if said(m["content"], m["tool_calls"], m["status"])]
        self.said_index = [m["index"] for m in said_ones]
        self.said_template = [template_message(m) for m in said_ones]

    def said_before(self, index: int) -> int:
        """How many said messages come before message `index`."""
        return bisect.bisect_left(self.said_index, index)

    def said_changed(self, m: Message) -> None:
        """Message `m` was appended or changed: keep the templated list in step (appending, usually)."""
        i = m["index"]
        last = self.said_index[-1] if self.said_index else -1
        if i > last:
            if said(m["content"], m["tool_calls"], m["status"]):
                self.said_index.append(i)
                self.said_template.append(template_message(m))
        elif i == last:
            if said(m["content"], m["tool_calls"], m["status"]):
                self.said_template[-1] = template_message(m)
            else:
                self.said_index.pop()
                self.said_template.pop()
        else:
            self.resay()  # an earlier message changed (rare: a fed_end after a retokenized turn does not)


def _message(index: int, role: str, content: str, status: str, now: float,
             tool_calls: Sequence[Mapping[str, str]] | None, tool_call_id: str | None,
             reasoning: str | None = None) -> Message:
    return Message(index=index, role=role,  # type: ignore[typeddict-item]
                   content=content, status=status,  # type: ignore[typeddict-item]
                   finish_reason=None, usage=None, fed_end=None, created_at=now, updated_at=now,
                   tool_calls=[dict(c) for c in tool_calls] if tool_calls else None,
                   tool_call_id=tool_call_id, reasoning=reasoning or None)


def prepared(session_id: str, system: str | None, messages: Sequence[Mapping[str, Any]]) -> HeldSession:
    """A new session holding `messages` (as template_message takes them), made on a worker
    thread: a stateless request may carry thousands, and the event loop then only adopts it."""
    now = time.time()
    held = [_message(i, m["role"], m["content"], "complete", now, m.get("tool_calls"), m.get("tool_call_id"),
                     m.get("reasoning")) for i, m in enumerate(messages)]
    return HeldSession(session_id, system, {}, held, [], 0)


log = logging.getLogger("kvd.turns")


def _fed(store: Store, session_id: str) -> tuple[list[int], int]:
    """The session's fed ids and what they cover, verified by their checksum (on the writer thread).

    Ids that fail it are dropped, so the turn renders the transcript afresh
    (the answer is a fresh prefill's) and stores new ids after it.
    """
    try:
        return store.fed(session_id)
    except DamagedFedIds as e:
        log.warning("%s; rebuilding them from the transcript", e)
        store.drop_fed(session_id)
        return [], 0


def _load(session_id: str) -> Callable[[Store], HeldSession | None]:
    def load(store: Store) -> HeldSession | None:
        session = store.get_session(session_id)
        if session is None:
            return None
        fed, covers = _fed(store, session_id)
        return HeldSession(session_id, session["system"], session["params"], store.messages(session_id), fed, covers,
                    model=session["model"], fed_model=stash.fed_model(store, session_id) if fed else None,
                    stashed=stash.stashed(store, session_id), responses=answered_at(store, session_id))

    return load


class Transcripts:
    """Held sessions (an LRU), the chains index, and the writer behind them."""

    def __init__(self, store: Store, *, busy: Callable[[str], bool] = lambda session_id: False) -> None:
        """`busy` says which sessions must stay held (a running turn's) when the least used are let go."""
        self.writer = Writer(store)
        self._busy = busy
        self.chains = Chains()
        self._held: OrderedDict[str, HeldSession] = OrderedDict()
        self._clock = time.time  # the memory's timestamps; the rows get the store's own
        self.points = Points()  # the Responses API's ids used lately: their session and answer

    async def start(self) -> None:
        """Start the writer and build the chains index from the store (on the writer thread)."""
        self.writer.start()
        self.chains = await self.writer.run(lambda store: build(store.chain_rows()), durable=False)

    def close(self) -> None:
        """Commit what is queued and stop the writer (after the last turn finished)."""
        self.writer.close()

    async def read(self, fn: Callable[[Store], T]) -> T:
        """`fn(store)` on the writer: it sees every write queued before it."""
        return await self.writer.run(fn, durable=False)

    async def write(self, fn: Callable[[Store], T]) -> T:
        """`fn(store)` on the writer, committed (fsynced) before this returns: a write of a row the turn
        core does not hold in memory (a stored response's, sessions/responses.py)."""
        return await self.writer.run(fn, durable=True)

    async def hold(self, session_id: str) -> HeldSession | None:
        """The session in memory, loaded if need be; None if there is no such session."""
        held = self._held.get(session_id)
        if held is None:
            loaded = await self.writer.run(_load(session_id), durable=False)
            held = self._held.get(session_id)  # another request may have loaded it meanwhile: that one is newer
            if held is None:
                if loaded is None:
                    return None
                held = self._held[session_id] = loaded
                if session_id not in self.chains:  # let go after a failed write (forget)
                    self.chains.put(session_id, held.system, held.messages)
                self._let_go()
        self._held.move_to_end(session_id)
        return held

    def get(self, session_id: str) -> HeldSession | None:
        return self._held.get(session_id)

    def forget(self, session_id: str) -> None:
        """A write of the session failed: memory may hold what the store does not; reload it when next used."""
        self._held.pop(session_id, None)
        self.chains.remove(session_id)

    def _let_go(self) -> None:
        for sid in list(self._held):
            if len(self._held) <= HELD:
                return
            if not self._busy(sid):
                del self._held[sid]  # its queued writes stay queued; a later load comes after them

    # --- writes: memory now, the rows behind ---

    def _write(self, fn: Callable[[Store], Any], *, durable: bool, label: str = "") -> Write:
        return self.writer.submit(fn, durable=durable, label=label)

    def create(self, session_id: str, *, title: str, system: str | None, origin: str | None,
               held: HeldSession | None = None) -> tuple[HeldSession, Callable[[], Write]]:
        """A new session, held at once (`held`: made by `prepared`, its messages chained by the
        caller); its row is queued when the returned function is called (the turn core calls it once
        the engine has taken the session's first turn: a first turn refused before stores nothing)."""
        held = self._held[session_id] = held or HeldSession(session_id, system, {}, [], [], 0)
        self.chains.put(session_id, system, [])
        self._let_go()
        # The model is read when the row is written: the turn core sets it on `held` before that.
        return held, lambda: self._write(lambda s: s.create_session(title=title, system=system, origin=origin,
                                                                    session_id=session_id, model=held.model),
                                         durable=False)

    def append(self, held: HeldSession, role: str, content: str, *, status: str = "complete",
               tool_calls: Sequence[Mapping[str, str]] | None = None, tool_call_id: str | None = None,
               chained: bool = True, reasoning: str | None = None) -> int:
        """Append a message in memory; `write_new` writes it (with the others of its turn).

        `chained=False`: the caller extends the chains index itself (`chains.extend`), with links it made off the loop.
        """
        index = len(held.messages)
        m = _message(index, role, content, status, self._clock(), tool_calls, tool_call_id, reasoning)
        held.messages.append(m)
        held.said_changed(m)
        if chained:
            self._chain(held, m)
        return index

    def write_new(self, held: HeldSession, first: int, *, durable: bool = False) -> Write:
        """Write messages `first`.. of the session in one operation: all of them or none."""
        # Earlier messages do not change while their row is written; the last (an answer) may.
        rows = [*held.messages[first:-1], *(m.copy() for m in held.messages[-1:])] if first < len(held.messages) else []
        sid = held.session_id

        def write(store: Store) -> None:
            for m in rows:
                store.append_message(sid, m["role"], m["content"], status=m["status"], tool_calls=m["tool_calls"],
                                     tool_call_id=m["tool_call_id"], index=m["index"], reasoning=m.get("reasoning"))

        return self._write(write, durable=durable, label="messages")

    def update(self, held: HeldSession, index: int, *, durable: bool, **fields: Any) -> Write:
        """Change message `index` (fields as Store.update_message takes them; None leaves one as is)."""
        m = held.messages[index]
        for key, value in fields.items():
            if value is not None:
                m[key] = [dict(c) for c in value] if key == "tool_calls" else value  # type: ignore[literal-required]
        m["updated_at"] = self._clock()
        if "content" in fields or "tool_calls" in fields or "status" in fields:
            held.said_changed(m)
            self._chain(held, m)
        sid = held.session_id
        return self._write(lambda s: s.update_message(sid, index, **fields), durable=durable,
                           label="answer" if fields.get("status") else "")

    def append_text(self, held: HeldSession, index: int, text: str) -> Write:
        """A streaming answer's commit: `text` appended to message `index` in the store (not durable: the
        answer's end is). Memory is left as it is until the answer's end sets its whole text (`update`)."""
        sid = held.session_id
        return self._write(lambda s: s.update_message(sid, index, append=text), durable=False)

    def truncate(self, held: HeldSession, from_index: int, *, taken_back: bool = False) -> Write:
        """Cut the session back to its first `from_index` messages; stored responses that named what is cut
        keep it, in a new session (`_branch`), in the same write. `taken_back`: a refused turn's own messages,
        which no response names but its own (forgotten by its door)."""
        branch = None if taken_back else self._branch(held, from_index)
        if held.stashed:  # other models' ids may stand for messages cut here: their next turn renders afresh
            held.stashed.clear()
            self._write(partial(stash.drop_stash, session_id=held.session_id), durable=False)
        del held.messages[from_index:]
        if held.said_index and held.said_index[-1] >= from_index:
            held.resay()
        self.chains.truncate(held.session_id, from_index)
        sid = held.session_id

        def cut(store: Store) -> int:
            if branch is not None:
                branch(store)
            return store.truncate_messages(sid, from_index)

        return self._write(cut, durable=True)

    def _branch(self, held: HeldSession, from_index: int) -> Callable[[Store], int] | None:
        """What keeps the answers of the session's stored responses at `from_index` or later when the session
        is cut there (sessions/responses.py's `branch_away`): a response id names one answer forever. The new
        session is not held nor chained here: continuing a response holds it (and so chains it)."""
        moving = [i for i in held.responses if i >= from_index]
        if not moving:
            return None
        end = moving[-1] + 1
        keep, covers = held.fed_cut(end)
        new_id = new_session_id()
        held.responses = [i for i in held.responses if i < from_index]
        self.points.moved(held.session_id, from_index)
        log.info("session %s is rewritten from message %d: %d stored response(s) keep their conversation "
                 "(messages 0-%d) in a new session %s", held.session_id, from_index, len(moving), end - 1, new_id)
        return partial(branch_away, session_id=held.session_id, new_id=new_id, end=end, moving_from=from_index,
                       tokens=held.fed[:keep], covers=covers, model=held.fed_model if keep else None)

    def responded(self, held: HeldSession, index: int) -> None:
        """A stored response names answer `index` of the session (its row is queued by the Responses door)."""
        bisect.insort(held.responses, index)

    def unresponded(self, session_id: str, index: int) -> None:
        """A stored response of the session was deleted (or refused): a rewrite need not keep its answer."""
        if (held := self._held.get(session_id)) is not None and index in held.responses:
            held.responses.remove(index)

    def set_tokens(self, held: HeldSession, tokens: Sequence[int], *, covers: int) -> Write:
        held.fed, held.covers = list(tokens), covers
        sid, ids, model = held.session_id, held.fed, held.fed_model
        return self._write(lambda s: s.set_tokens(sid, ids, covers=covers, model=model), durable=True)

    def forget_fed_ends(self, held: HeldSession, before_index: int) -> Write:
        for m in held.messages[:before_index]:
            if m["fed_end"] is not None:
                m["fed_end"] = None
        sid = held.session_id
        return self._write(lambda s: s.forget_fed_ends(sid, before_index), durable=False)

    def _chain(self, held: HeldSession, m: Message) -> None:
        if not self.chains.message(held.session_id, m["index"], m["role"], m["content"], m["tool_calls"],
                                   m["tool_call_id"], m["status"], m.get("reasoning")):
            self.chains.put(held.session_id, held.system, held.messages)

    # --- session-level changes, acknowledged to whoever asked: waited for ---

    async def create_session(self, *, title: str, system: str | None, origin: str | None,
                             model: str | None = None, messages: Sequence[tuple[str, str]] = ()) -> Session:
        """A new session, written at once; `messages` (role, content): earlier turns it starts with,
        stored unanswered in the same transaction (its first turn renders them: no fed ids yet)."""
        def create(store: Store) -> tuple[Session, list[Message]]:
            made = store.create_session(title=title, system=system, origin=origin, model=model, messages=messages)
            return made, store.messages(made["id"]) if messages else []

        session, held = await self.writer.run(create)
        self.chains.put(session["id"], system, held)
        # its first turn loads nothing
        self._held[session["id"]] = HeldSession(session["id"], system, {}, held, [], 0, model=model)
        self._let_go()
        return session

    async def update_session(self, session_id: str, *, fields: Mapping[str, Any], new_system: bool) -> None:
        """Store.update_session's `fields`; a new system prompt also forgets the fed ids' answer boundaries
        (the ids begin with the old prompt: the next turn retokenizes, the cache keeps what still matches)."""
        def update(store: Store) -> list[Message] | None:
            store.update_session(session_id, **fields)
            if not new_system:
                return None
            fed, _ = _fed(store, session_id)
            store.set_tokens(session_id, fed, covers=0, model=stash.fed_model(store, session_id))
            stash.drop_stash(store, session_id)  # every model's ids began with the old prompt
            messages = store.messages(session_id)
            store.forget_fed_ends(session_id, len(messages))
            return messages

        messages = await self.writer.run(update)
        if (held := self._held.get(session_id)) is not None:  # memory follows what was written
            if "params" in fields:
                held.params = dict(fields["params"])
            if new_system:
                held.system, held.covers = fields["system"], 0
                held.stashed.clear()
                for m in held.messages:
                    m["fed_end"] = None
        if messages is not None:
            self.chains.put(session_id, fields["system"], messages)

    async def delete_session(self, session_id: str) -> bool:
        self._held.pop(session_id, None)
        self.chains.remove(session_id)
        return await self.writer.run(lambda s: s.delete_session(session_id))

    def choose_model(self, held: HeldSession, model: str | None) -> Write:
        """The model a client chose for the session (None: the daemon's default, whichever it is)."""
        held.model = model
        sid = held.session_id
        return self._write(lambda s: s.update_session(sid, model=model), durable=False)

    def feed_for(self, held: HeldSession, model: str) -> list[Write]:
        """The session's next turn is `model`'s: the fed ids, another model's tokens, are put aside under
        that model, and `model`'s own from before come back (none: the turn renders the transcript with its
        tokenizer). The answers' boundaries are forgotten (positions in whichever model's ids fed them)."""
        writes = []
        sid, previous = held.session_id, held.fed_model
        if previous is not None and held.fed:
            held.stashed[previous] = (held.fed, held.covers)
            writes.append(self._write(partial(stash.stash, session_id=sid, model=previous, tokens=list(held.fed),
                                              covers=held.covers), durable=False))
        fed, covers = held.stashed.pop(model, ([], 0))
        writes.append(self._write(partial(stash.unstash, session_id=sid, model=model), durable=False))
        held.fed_model = model
        return [*writes, self.set_tokens(held, fed, covers=covers), self.forget_fed_ends(held, len(held.messages))]

    def system_changed(self, held: HeldSession, system: str | None) -> list[Write]:
        """A pinned request's new system prompt (placement): as update_session's, not waited for."""
        held.system = system
        held.stashed.clear()  # every model's ids began with the old prompt
        self.chains.put(held.session_id, system, held.messages)
        sid = held.session_id
        return [self._write(lambda s: s.update_session(sid, system=system), durable=False),
                self.set_tokens(held, held.fed, covers=0),
                self.forget_fed_ends(held, len(held.messages))]
