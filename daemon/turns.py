"""The turn core: one turn's life, the same for every front door.

A turn is a session's next answer: its messages are added to the session the
turn core holds in memory and queued to the transcript's writer, the engine
is handed the answer at once, the answer's events (typed values, events.py) go to
whoever listens (websocket connections, an HTTP response: each door encodes
them in its own shape) while its text is written behind
as it grows, and it ends committed as complete, cancelled or failed, which
is announced only once that commit is back. No turn reads its transcript
or waits on the disk before its first token (transcripts.py). The websocket protocol
and the OpenAI-compatible API both drive turns through `Turns` and know
nothing of each other.

The fed-token rule lives here too. A session keeps the exact token ids it
fed (prompt.py says why), and `covers` (how many leading messages they stand
for) plus each answer's `fed_end` say whether the next turn may append to
them. Every change of that bookkeeping is a method below: a finished turn
records its ids; a rewind (regenerate, edit) cuts them at the last answer
boundary still known; a new system prompt or a retokenized turn forgets the
old boundaries, so the next turn retokenizes and the cache keeps whatever
prefix still matches.

Turns belong to the daemon's task group, not to a connection: a client that
goes away does not stop its answer from being generated and kept (the HTTP
door cancels explicitly, because an API client that hangs up wants no more).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, Protocol

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream
from jinja2 import TemplateError

import protocol as p
from protocol.requests import RequestError, RequestId
from protocol.shapes import Sampling, resolve
from sessions import Session, Store, is_disk_full, new_session_id
from sessions.chains import said

from .config import Config
from .engine.jobs import Done, EngineEvent
from .engine.registry import Engines, ModelRefused
from .engine.running import MIN_ANSWER, Answer
from .engine.thread import Engine
from .events import (
    AnswerDone,
    AnswerError,
    AnswerStarted,
    AnswerToolCall,
)
from .feed import End, Feed
from .prompt import prompt_tokens
from .renders import Renders
from .transcripts import HeldSession, Transcripts, Write
from .turn import ASKED_NOTHING, Listener, StopScan, Turn, TurnSpec

log = logging.getLogger("kvd.turns")


def _nowhere(event: EngineEvent) -> None:
    """An answer's sink until its feed is made (a moment later, in `Turns.start`)."""

PromptIds = Callable[[Any], tuple[list[int], bool]]  # a turn's ids from a tokenizer, and whether they were rebuilt
DISK_FULL_MESSAGE = ("the disk holding kvd's data directory is full, so this was not saved; "
                     "free some space and send it again (nothing saved before is lost)")
DISK_FULL_KEPT = ("the disk holding kvd's data directory is full, so the answer was cut here: what was written "
                  "of it is kept, marked failed; free some space, then send it again (nothing saved before is lost)")


class TurnWatcher(Protocol):
    """Told of every turn's end, whatever its door (the metrics: doors/metrics.py); must not block."""

    def done(self, turn: Turn, usage: Mapping[str, Any], reason: str) -> None: ...

    def failed(self, turn: Turn, code: str) -> None: ...


class Turns:
    """Every running turn, by session; starts, streams, commits, cancels.

    The turn core alone writes transcripts, through `transcripts` (memory
    now, the rows behind on the store's writer thread): a turn reads no
    transcript and waits for no commit until it acknowledges its answer.
    """

    def __init__(self, config: Config, store: Store, engine: Engine, engines: Engines | None = None):
        """`engine`: the default model's; `engines`: every loaded model's (made here around `engine` if
        not given)."""
        self.config = config
        self.active: dict[str, Turn] = {}
        self.engines = engines or Engines(config, engine, busy=self.answering)
        self._first = engine
        self.transcripts = Transcripts(store, busy=self.active.__contains__)
        self.tg: TaskGroup | None = None  # the daemon's; set while it serves
        self._unstored: dict[str, Callable[[], Write]] = {}  # new sessions' rows, queued with their first turn's
        self._renders: dict[str, Renders] = {}  # stateless requests' last renders, per model (tokenizer stage)
        self.watchers: list[TurnWatcher] = []  # told of every turn's end

    @property
    def engine(self) -> Engine:
        """The default model's engine (the one kvd started with, while it is loaded)."""
        return self.engines.default_engine or self._first

    def answering(self, model: str) -> bool:
        """Whether a turn runs on `model` now (the registry never unloads such a model)."""
        return any(t.model == model for t in self.active.values())

    @property
    def renders(self) -> Renders:
        """The default model's renders (stateless requests' last renders)."""
        return self.renders_for(self.engines.default)

    def renders_for(self, model: str) -> Renders:
        """A model's renders: ids are its tokenizer's, so each model remembers its own."""
        return self._renders.setdefault(model, Renders())

    # --- sessions ---

    async def hold(self, session_id: str, rid: RequestId = None) -> HeldSession:
        """The session as the turn core holds it (loaded through the writer the first time)."""
        held = await self.transcripts.hold(session_id)
        if held is None:
            raise RequestError(p.UNKNOWN_SESSION,
                               f"no session {session_id!r}; list sessions with session.list", rid)
        return held

    async def session(self, session_id: str, rid: RequestId = None) -> Session:
        """The protocol's session object as stored (every write queued before is in it)."""
        session = await self.transcripts.read(lambda store: store.get_session(session_id))
        if session is None:
            raise RequestError(p.UNKNOWN_SESSION,
                               f"no session {session_id!r}; list sessions with session.list", rid)
        return session

    def check_idle(self, session_id: str, rid: RequestId = None) -> None:
        if session_id in self.active:
            raise RequestError(p.BUSY, "this session is already generating; "
                               "send chat.cancel or wait for chat.done", rid)

    async def delete_session(self, session_id: str, rid: RequestId = None) -> None:
        self.check_idle(session_id, rid)
        if not await self.transcripts.delete_session(session_id):
            raise RequestError(p.UNKNOWN_SESSION,
                               f"no session {session_id!r}; list sessions with session.list", rid)
        for engine in self.engines.engines():  # each model's cache of it; queued behind any turn keeping one
            engine.forget(session_id)

    # --- the fed-token rule ---

    def rewind(self, held: HeldSession, index: int) -> None:
        """Drop messages from `index` on, and the fed token ids with them.

        The ids are cut at the end of the last earlier turn whose boundary is
        known, so the next turn appends to exactly what was fed; the engine
        then rewinds the session's cache to the longest prefix it still shares.
        """
        keep, covers = held.fed_cut(index)
        self.transcripts.truncate(held, index)
        self.transcripts.set_tokens(held, held.fed[:keep], covers=covers)

    def _continuation(self, held: HeldSession, index: int) -> PromptIds:
        """The session's prompt from memory, under the fed-token rule (`prompt_tokens`, run in the tokenizer
        stage): the templated messages are kept between turns, not rebuilt."""
        n = held.said_before(index)
        return partial(prompt_tokens, messages=held.said_template[:n], system=held.system, fed=held.fed,
                       fed_covers=held.said_before(held.covers))

    def _record(self, turn: Turn, held: HeldSession, tokens: list[int] | None, *, exact: bool) -> int | None:
        """A finished turn's fed ids; returns the answer's fed_end.

        `exact` is False when the stored text is not all the ids hold (a stop
        sequence cut it): the ids stay for the cache, but the next turn must
        retokenize rather than append.
        """
        if tokens is None:
            return None
        turn.writes.append(self.transcripts.set_tokens(held, tokens,
                                                       covers=turn.message_index + 1 if exact else 0))
        return len(tokens) if exact else None

    # --- what a client asks for: a new message, an answer again, an edited message ---

    async def send(self, listener: Listener | None, rid: RequestId, session_id: str, text: str,
                   sampling: Sampling = ASKED_NOTHING, model: str | None = None) -> Turn:
        """The user's message and its answer (written together: a full disk stores neither).
        `model`: the model to answer it from now on (resolved by the registry); None: the session's."""
        held = await self.hold(session_id, rid)
        self.check_idle(session_id, rid)
        first_new = self.transcripts.append(held, "user", text)
        return self.start(listener, TurnSpec(rid, session_id, first_new, sampling=sampling, model=model))

    async def regenerate(self, listener: Listener | None, rid: RequestId, session_id: str,
                         sampling: Sampling = ASKED_NOTHING) -> Turn:
        """Answer the last message again: the old answer and its fed ids go, the cache is rewound."""
        held = await self.hold(session_id, rid)
        self.check_idle(session_id, rid)
        if not held.messages or held.messages[-1]["role"] != "assistant":
            raise RequestError(p.BAD_REQUEST, "the session's last message is not an answer; "
                               "there is nothing to regenerate", rid)
        last = held.messages[-1]["index"]
        self.rewind(held, last)
        return self.start(listener, TurnSpec(rid, session_id, last, sampling=sampling))

    async def edit(self, listener: Listener | None, rid: RequestId, session_id: str, index: int, text: str,
                   sampling: Sampling = ASKED_NOTHING) -> Turn:
        """Replace user message `index` (and everything after it) with `text`, and answer it."""
        held = await self.hold(session_id, rid)
        self.check_idle(session_id, rid)
        target = held.messages[index] if 0 <= index < len(held.messages) else None
        if target is None or target["role"] != "user":
            raise RequestError(p.BAD_REQUEST, f"message {index} is not a user message "
                               "of this session; session.get lists them", rid)
        self.rewind(held, index)
        first_new = self.transcripts.append(held, "user", text)
        return self.start(listener, TurnSpec(rid, session_id, first_new, sampling=sampling))

    def apply(self, session_id: str | None, *, system: str | None, messages: Sequence[Mapping[str, Any]],
              rewind_from: int | None = None, new_system: bool = False, title: str, origin: str,
              links: Sequence[bytes] | None = None, prepared: HeldSession | None = None) -> tuple[str, int]:
        """A stateless request's placement (daemon/doors/placement.py's plan), applied to a held session
        or a new one; returns the session and the index of its first new message (or of the answer to come).

        `links`, when given, are the new messages' links in the session's chain (sessions/chains.py),
        made off the loop; `prepared`, a new session already holding `messages` (transcripts.prepared,
        made off the loop too): then nothing here grows with a long conversation.
        Nothing is waited for: the rows follow on the writer, with the turn's; a new session's
        are queued only once the engine takes its turn (a refused first turn stores nothing).
        """
        if prepared is not None:
            session_id = prepared.session_id
            held, self._unstored[session_id] = self.transcripts.create(session_id, title=title, system=system,
                                                                        origin=origin, held=prepared)
            if links is not None and len(links) == len(held.messages) and all(
                    said(m["content"], m["tool_calls"], m["status"]) for m in held.messages):
                self.transcripts.chains.extend(session_id, links, range(len(links)))
            else:
                self.transcripts.chains.put(session_id, system, held.messages)
            return session_id, 0
        if session_id is None:
            session_id = new_session_id()
            held, self._unstored[session_id] = self.transcripts.create(session_id, title=title, system=system,
                                                                        origin=origin)
        else:
            found = self.transcripts.get(session_id)
            assert found is not None, "placement holds the session before it applies its plan"
            held = found
            if rewind_from is not None:  # first: stored responses it branches away keep the old system prompt
                self.rewind(held, rewind_from)
            if new_system:
                self.transcripts.system_changed(held, system)
        first_new = len(held.messages)
        chained = links is None or len(links) != len(messages) or not all(
            said(m["content"], m.get("tool_calls")) for m in messages)
        for m in messages:
            self.transcripts.append(held, m["role"], m["content"], tool_calls=m.get("tool_calls"),
                                    tool_call_id=m.get("tool_call_id"), chained=chained, reasoning=m.get("reasoning"))
        if not chained and links:
            self.transcripts.chains.extend(session_id, links, range(first_new, len(held.messages)))
        return session_id, first_new

    # --- a turn's life ---

    def start(self, listener: Listener | None, spec: TurnSpec, choices: Sequence[TurnSpec] = ()) -> Turn:
        """Generate an answer to the session as held (its new messages, from `spec.first_new`, are in memory).

        The new messages and the answer's placeholder are queued to the writer
        as one operation; the answer goes to the engine without waiting for it.
        The prompt defaults to the transcript under the fed-token rule. The
        cache comes from wherever the longest prefix of its ids is held: the
        session's own or any other's (cachestore's checkout). `spec.tools` (from a
        door whose request offered tools) takes the answer's calls out of its
        text: they are published once the answer ends, and kept as its calls. `spec.model`
        (resolved by the registry): the model that answers, from now on, for the
        session; None: the session's own (the default for a session that has none).

        `choices`: the request's other choices (n > 1), each a turn of its own in a session holding the same
        conversation (a new one, placed by the door): their answers ride on this one's, whose prompt is read
        once, and each draws from there with its own seed (engine/steps.py). Each is committed, published
        (to `listener` too, as `Turn.choice`) and kept as any turn is; this one lists them (`Turn.choices`).
        """
        turn, answer, ids = self._begin(listener, spec)
        for i, other in enumerate(choices, start=1):
            chosen, drawn, _ = self._begin(listener, other, choice=i)
            drawn.handed = None  # the engine waits for the first choice's first token only
            drawn.fed_before, drawn.history = answer.fed_before, answer.history
            turn.choices.append(chosen)
            answer.choices.append(drawn)
        assert self.tg is not None
        self.tg.start_soon(self._submit, turn, ids, answer)
        return turn

    def _begin(self, listener: Listener | None, spec: TurnSpec, *, choice: int = 0) -> tuple[Turn, Answer, PromptIds]:
        """A turn, its answer and what makes its ids: everything `start` does but hand the answer to its engine."""
        assert self.tg is not None, "the daemon is not serving"
        rid, session_id, first_new, prompt = spec.request_id, spec.session_id, spec.first_new, spec.prompt
        held = self.transcripts.get(session_id)
        if held is None:
            raise RequestError(p.UNKNOWN_SESSION, f"no session {session_id!r}; list sessions with "
                               "session.list", rid)
        resolved = resolve(spec.sampling.given(), held.params, self.config.sampling(),
                           max_tokens_limit=self.config.max_tokens_limit, knobs=spec.sampling.knobs())
        previous = (held.model, held.fed_model)
        switched = self._serve_with(held, spec.model)
        serving = held.model or self.engines.default
        index = self.transcripts.append(held, "assistant", "", status="streaming")
        ids, fed_before = (self._continuation(held, index), len(held.fed)) if prompt is None else (
            prompt.ids, prompt.fed_before)
        turn = Turn(rid, session_id, index, first_new, {listener} if listener is not None else set(),
                    stop=StopScan(spec.stop) if spec.stop else None, door=spec.door, held=held, tools=spec.tools,
                    model=serving, switched_from=previous if switched else None, fit=spec.fit,
                    max_tokens_asked=spec.sampling.max_tokens, context=spec.context, choice=choice)
        turn.writes += switched
        write_new = partial(self.transcripts.write_new, held, first_new)
        if (new := self._unstored.pop(session_id, None)) is not None:
            turn.unstored = [new, write_new]  # a new session: stored once the engine takes its turn
        else:
            turn.writes.append(write_new())
        self.active[session_id] = turn
        end, ended = anyio.create_memory_object_stream[End](math.inf)
        answer = Answer(session_id=session_id, tokens=[], seed=spec.seed, fed_before=fed_before,
                        history=first_new > 1 if spec.history is None else spec.history,
                        sampling=resolved, emit=_nowhere, grammar=spec.grammar, handed=turn.handed, raw=spec.raw,
                        logprobs=spec.logprobs, prompt_logprobs=spec.prompt_logprobs)
        # Its events, heard on this loop a step at a time (feed.py; the engine's hand-off calls it)
        feed = Feed(asyncio.get_running_loop(), turn, answer, self.transcripts,
                    cancel=partial(self.cancel, session_id, turn), end=end)
        answer.emit = feed
        self.tg.start_soon(self._pump, turn, feed, ended)
        turn.publish(AnswerStarted(index))
        return turn, answer, ids

    def _serve_with(self, held: HeldSession, model: str | None) -> list[Write]:
        """The turn's model: the one the request chose (recorded as the session's), else the session's, else
        the default. Its fed ids, when another model's tokens, are put aside for that model and the turn's
        model's own come back (transcripts.feed_for)."""
        writes = []
        if model is not None and model != held.model:
            if held.session_id in self._unstored:  # a new session not stored yet: its row carries the model
                held.model = model
            else:
                writes.append(self.transcripts.choose_model(held, model))
        serving = held.model or self.engines.default
        if held.fed_model is None:  # no ids, or ids from before models were recorded: the serving model's
            held.fed_model = serving
        elif held.fed_model != serving and held.session_id not in self._unstored:
            log.info("session %s is answered by %s (its fed ids were %s's)", held.session_id, serving,
                     held.fed_model)
            writes += self.transcripts.feed_for(held, serving)
        return writes

    async def _submit(self, turn: Turn, ids: PromptIds, answer: Answer) -> None:
        """Load the turn's model if it must be, make the turn's ids in its tokenizer stage, then hand the
        answer (and the choices riding on it) to its engine."""
        try:
            engine = turn.engine = await self.engines.engine(turn.model)
        except ModelRefused as e:  # nothing was generated: the turn's messages are taken back
            if turn.switched_from is not None and turn.held is not None:  # the session stays as it was
                chosen, fed_by = turn.switched_from
                if chosen != turn.held.model:
                    turn.writes.append(self.transcripts.choose_model(turn.held, chosen))
                if fed_by is not None and fed_by != turn.held.fed_model:
                    turn.writes += self.transcripts.feed_for(turn.held, fed_by)
            answer.refuse(AnswerError(e.code, str(e)))
            return
        for other in turn.choices:
            other.engine = engine
        while not engine.ready.is_set():  # the tokenizer comes with the model
            await anyio.sleep(0.05)  # a threading.Event the engine thread sets; clients get `loading` meanwhile
        if engine.load_error is not None:
            engine.submit(answer)  # no tokenizer: the engine answers with why the model did not load
            return
        try:
            answer.tokens, answer.retokenized = await engine.tokenize(ids)
        except TemplateError as e:  # the model's chat template refuses the conversation (raise_exception)
            log.info("the chat template of %s refused session %s's conversation: %s", turn.model, turn.session_id, e)
            answer.refuse(AnswerError(p.BAD_REQUEST, f"the model's chat template refuses this conversation: {e}; "
                                      "send one it takes (docs/openai.md)"))
            return
        except Exception as e:
            log.exception("tokenizing the prompt of session %s failed", turn.session_id)
            answer.refuse(AnswerError(p.INTERNAL, f"the prompt could not be tokenized: {e}"))
            return
        if turn.fit:
            contexts = [c for c in (engine.max_context, turn.context) if c]
            turn.context_bound = self._fit(answer, min(contexts) if contexts else None)
        turn.max_tokens = answer.max_tokens
        if answer.choices and engine.lockstep is not None:  # (rank 0 would fork what its followers do not)
            answer.refuse(AnswerError(p.BAD_REQUEST, "n > 1 is not served while the model is sharded across "
                                      "ranks; send n = 1 (several requests draw several answers)"))
            return
        for other, drawn in zip(turn.choices, answer.choices):  # the first choice's prompt and limit
            drawn.tokens, drawn.retokenized, drawn.sampling = answer.tokens, answer.retokenized, answer.sampling
            other.max_tokens, other.context_bound = turn.max_tokens, turn.context_bound
        engine.submit(answer)
        for t in (turn, *turn.choices):
            if t.cancelled:  # cancelled while tokenizing: the engine cancels it as it arrives
                engine.cancel(t.session_id)

    def write_with(self, turn: Turn, fn: Callable[[Store], Any], *, label: str) -> None:
        """Queue `fn(store)` with the turn's own writes (a Responses API row naming its answer): committed
        behind the session's rows, before the turn acknowledges its answer; for a new session, only once
        the engine takes the turn (a refused first turn stores nothing, this row neither)."""
        write = partial(self.transcripts.writer.submit, fn, label=label)
        if turn.unstored:
            turn.unstored.append(write)
        else:
            turn.writes.append(write())

    @staticmethod
    def _fit(answer: Answer, context: int | None) -> bool:
        """Lower a ceiling max_tokens to the room the model's context leaves after the prompt, where that
        room is still an answer (MIN_ANSWER): an agent that asks for 64k tokens, or names no limit, wants
        as much as fits, not a refusal. Less room than that: the engine refuses, with its advice. Returns
        whether the context's room is now the answer's limit."""
        room = context - len(answer.tokens) if context else None
        if room is not None and answer.max_tokens > room >= MIN_ANSWER:
            answer.sampling = answer.sampling.model_copy(update={"max_tokens": room})
            return True
        return False

    def cancel(self, session_id: str, turn: Turn | None = None) -> None:
        """Stop the session's answer (only if it is still `turn`, when given); what was generated is kept."""
        if turn is None or self.active.get(session_id) is turn:
            current = self.active.get(session_id)
            if current is not None:
                current.cancelled = True
                if current.engine is not None:  # else it has not reached an engine: _submit cancels it there
                    current.engine.cancel(session_id)

    async def _committed(self, turn: Turn) -> None:
        """Wait until the turn's writes are committed; raise the first that failed."""
        waited = [asyncio.wrap_future(w) for w in turn.writes]
        turn.writes.clear()
        if waited:
            await asyncio.wait(waited)
        errors = [e for f in waited if (e := f.exception()) is not None]  # each one read, none left unseen
        if errors:
            raise errors[0]

    async def _pump(self, turn: Turn, feed: Feed, ended: MemoryObjectReceiveStream[End]) -> None:
        """Wait for the answer's end (its events until then are heard by `feed`, a step at a time), commit
        it and publish it once committed (fsynced). A failure while hearing them ends it here too."""
        sid = turn.session_id
        try:
            async with ended:
                end = await ended.receive()
            if isinstance(end, Exception):
                raise end
            if isinstance(end, Done):
                await self._done(turn, feed, end)
            else:
                await self._failed(turn, end)
        except Exception as e:
            await self._cut(turn, e)
        finally:
            if self.active.get(sid) is turn:
                del self.active[sid]
            self.engines.used(turn.model)  # its idle time (keep_alive) counts from here
            turn.finished.set()

    async def _cut(self, turn: Turn, e: Exception) -> None:
        """The answer could not go on (a write failed: a full disk; or a bug): what was committed of it is
        kept, marked cut, and the client is told which: kept, or not saved at all (read back from the store)."""
        sid, held, t = turn.session_id, turn.held, self.transcripts
        assert held is not None
        if turn.engine is not None:
            turn.engine.cancel(sid)  # nobody is left to keep what it generates
        full = is_disk_full(e)
        if full:
            log.warning("answer for session %s cut: the disk is full (%s)", sid, e)
        else:
            log.exception("answer for session %s failed", sid, exc_info=e)
        if not turn.writes and not turn.unstored:  # they all committed: keep what was generated, marked cut
            turn.writes.append(t.update(held, turn.message_index, durable=True, content=turn.text,
                                        status="error", finish_reason="error"))
            try:
                await self._committed(turn)
            except Exception as again:  # the answer keeps what was committed before; recovered at start
                log.warning("could not mark the answer of %s as cut: %s", sid, again)
        if full:
            kept = not turn.unstored and await self._kept(sid, turn.message_index)
            error = AnswerError(p.DISK_FULL, DISK_FULL_KEPT if kept else DISK_FULL_MESSAGE, answered=turn.seq > 0)
        else:
            error = AnswerError(p.INTERNAL, "kvd hit an internal error; it is logged", answered=turn.seq > 0)
        self._tell(lambda w: w.failed(turn, error.code))
        t.forget(sid)  # memory may hold what the store does not: the next turn reloads it
        if self.active.get(sid) is turn:  # ended before it is said: a retry finds the session idle
            del self.active[sid]
        turn.show("", now=True)
        turn.publish(error)

    async def _kept(self, session_id: str, index: int) -> bool:
        """Whether the store holds the answer at `index` (what a client is told of an answer a full disk cut)."""
        try:
            return bool(await self.transcripts.read(lambda s: s.messages(session_id, first=index, end=index + 1)))
        except Exception:  # the store cannot say: as if nothing were kept
            return False

    def _tell(self, what: Callable[[TurnWatcher], None]) -> None:
        for watcher in self.watchers:
            try:
                what(watcher)
            except Exception:  # a watcher's fault is never the turn's
                log.exception("a turn watcher failed")

    async def _failed(self, turn: Turn, ev: AnswerError) -> None:
        self._tell(lambda w: w.failed(turn, ev.code))
        t, held = self.transcripts, turn.held
        assert held is not None
        if turn.unstored:  # refused before the engine took it: a new session, never stored
            t.forget(turn.session_id)
        elif ev.code in (p.TOO_LARGE, p.UNKNOWN_MODEL, p.BAD_REQUEST) and not turn.text:
            # Nothing was generated and the turn can never be answered as it is (too long, no such
            # model, a conversation the template refuses): take it back, so the session stays usable
            # (the client still has the text).
            turn.writes.append(t.truncate(held, turn.first_new, taken_back=True))
        else:
            turn.writes.append(t.update(held, turn.message_index, durable=True, content=turn.text,
                                        status="error", finish_reason="error"))
        await self._committed(turn)
        turn.show("", now=True)
        turn.publish(AnswerError(ev.code, ev.message, answered=turn.seq > 0))

    def _usage(self, turn: Turn, usage: dict[str, Any], reason: str) -> dict[str, Any]:
        """The answer's usage, plus the model that answered, its output limit (`max_tokens_asked`: what the
        request said, when the door rules lowered it; `context_full`: cut at the room the model's context
        left), and, when it had no cache of the session, the other
        models that keep one: said, never restored from. Those are the loaded models whose cache stores
        hold one (written in this run too) and those disk keeps one for (the cache store's `kept_for`)."""
        usage = {**usage, "model": turn.model, "max_tokens": turn.max_tokens}
        asked, fitted = turn.max_tokens_asked, turn.max_tokens
        if asked is not None and fitted is not None and asked > fitted:
            usage["max_tokens_asked"] = asked
        if turn.context_bound and reason == "length":  # cut there: it filled the model's context
            usage["context_full"] = True
        if usage.get("restored_from") == p.NO_CACHE and turn.engine is not None:
            others = [e.config.model for e in self.engines.engines()
                      if e is not turn.engine and turn.session_id in e.stats.get("locations", {})]
            others += [m for m in turn.engine.stats.get("kept_for", {}).get(turn.session_id, ()) if m not in others]
            if others:
                usage["kept_for"] = others
        return usage

    async def _done(self, turn: Turn, feed: Feed, ev: Done) -> None:
        reason = ev.finish_reason
        stopped = turn.stop is not None and turn.stop.hit
        if turn.stop is not None:
            feed.say(turn.stop.flush())
            if stopped:
                reason = "stop"  # cancelled by the stop sequence, as far as the client is concerned
        status = "cancelled" if reason == "cancelled" else "complete"
        u = ev.usage = self._usage(turn, ev.usage, ev.finish_reason)
        log.info("turn in session %s (%s): cache %s, %s tok restored, %s prefilled, TTFT %s ms, %s tok, %s%s",
                 turn.session_id, turn.door,
                 f"{u.get('restored_from')} (prefetched from disk)" if u.get("prefetched") else
                 f"none for {turn.model} (kept for {', '.join(u['kept_for'])})" if u.get("kept_for") else
                 u.get("restored_from"),
                 u.get("cached_tokens"),
                 u.get("prefill_tokens"), u.get("ttft_ms"), u.get("completion_tokens"), reason,
                 f" (max_tokens {u['max_tokens_asked']} lowered to {u['max_tokens']}, "
                 f"{'the room the context left' if turn.context_bound else 'limits.max_tokens_limit'})"
                 if "max_tokens_asked" in u else "")
        self._tell(lambda w: w.done(turn, u, reason))
        content, calls = turn.text, list[dict[str, str]]()
        if turn.tools is not None:  # the calls are parsed once, here: what the doors show is what is kept
            rest, calls = turn.tools.finish()
            turn.show(rest)
            content = turn.tools.content if calls else turn.text
        turn.show("", now=True)  # whatever waited for a slow reader, before the end
        held = turn.held
        assert held is not None
        fed_end = self._record(turn, held, ev.tokens, exact=not stopped)
        turn.writes.append(self.transcripts.update(
            held, turn.message_index, durable=True, content=content, status=status,
            finish_reason=reason, usage=ev.usage, fed_end=fed_end, tool_calls=calls or None))
        await self._committed(turn)  # acknowledged only once it is durable
        made = tuple(AnswerToolCall(i, c["id"], c["name"], c["arguments"]) for i, c in enumerate(calls))
        for call in made:
            turn.publish(call)
        turn.publish(AnswerDone(turn.message_index, reason, ev.usage, content, made, logprobs=ev.logprobs,
                                prompt_logprobs=ev.prompt_logprobs))
