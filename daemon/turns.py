"""The turn core: one turn's life, the same for every front door.

A turn is a session's next answer: its messages are committed, the engine is
handed a job, the answer's events stream to whoever listens (websocket
connections, an HTTP response) while its text is committed as it grows, and
it ends committed as complete, cancelled or failed. The websocket protocol
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
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream

import protocol as p
from protocol.requests import RequestError, RequestId
from protocol.shapes import resolve
from sessions import DamagedFedIds, Message, Store, is_disk_full

from .config import Config
from .engine.jobs import Delta, Done, EngineEvent, Failed, Progress, Queued, Started, TurnJob
from .engine.thread import Engine
from .prompt import Continuation, Prompt, Tokenizing, Tokens, template_message

log = logging.getLogger("kvd.turns")

COMMIT_INTERVAL = 0.25  # seconds between commits of a streaming answer
DISK_FULL_MESSAGE = ("the disk holding kvd's data directory is full, so this was not saved; "
                     "free some space and send it again (nothing saved before is lost)")


class Listener(Protocol):
    """Whoever wants a turn's events (a websocket connection, an HTTP response); must not block."""

    def publish(self, event: dict[str, Any]) -> None: ...


# --- stop sequences -------------------------------------------------------


class StopScan:
    """Finds the first stop sequence in streamed text without ever showing a piece of one.

    Text that could be the start of a stop sequence is held back until the
    next delta settles it; `feed` returns what may be shown now.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.longest = max((len(s) for s in self.stops), default=0)
        self.text = ""  # everything fed, up to (not including) a stop once one is found
        self.shown = 0
        self.hit = False

    def feed(self, delta: str) -> str:
        """Work per delta grows with the delta and the stops' lengths, never with the answer so far."""
        if self.hit:
            return ""
        since = max(0, len(self.text) - self.longest + 1)  # a stop starting earlier was found before
        self.text += delta
        at = min((i for s in self.stops if (i := self.text.find(s, since)) >= 0), default=-1)
        if at >= 0:
            self.hit = True
            self.text = self.text[:at]
            return self._release(len(self.text))
        return self._release(len(self.text) - self._held())

    def _held(self) -> int:
        """How long an end of the text is that begins some stop sequence (shown once settled)."""
        held = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text)), held, -1):
                if self.text.endswith(s[:k]):
                    held = k
                    break
        return held

    def flush(self) -> str:
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        out = self.text[self.shown:upto]
        self.shown = max(self.shown, upto)
        return out


# --- one turn -------------------------------------------------------------


@dataclass
class Turn:
    request_id: Any
    session_id: str
    message_index: int
    first_new: int  # the first message this turn added (taken back if it can never fit)
    subscribers: set[Listener] = field(default_factory=set)
    text: str = ""
    seq: int = 0
    deltas: list[str] = field(default_factory=list)  # each published delta's text, by seq
    stop: StopScan | None = None
    finished: anyio.Event = field(default_factory=anyio.Event)  # the answer is committed, whatever its end
    cancelled: bool = False  # a cancel arrived (perhaps before the engine had the job)
    door: str = "websocket"  # which front door asked for it (the log's turn line says)

    def publish(self, event: dict[str, Any]) -> None:
        event = {"id": self.request_id, "session": self.session_id, **event}
        for listener in list(self.subscribers):
            listener.publish(event)

    def attach(self, listener: Listener, after_seq: int) -> None:
        """Re-send the deltas `listener` has not seen, as first published, then subscribe it.

        One synchronous step on the event loop: no delta can be published
        between the replay and the subscription, so there is no gap and no
        duplicate.
        """
        for seq in range(after_seq + 1, len(self.deltas)):
            listener.publish({"type": p.CHAT_DELTA, "id": self.request_id, "session": self.session_id,
                              "seq": seq, "text": self.deltas[seq]})
        self.subscribers.add(listener)


class Turns:
    """Every running turn, by session; starts, streams, commits, cancels."""

    def __init__(self, config: Config, store: Store, engine: Engine):
        self.config = config
        self.store = store
        self.engine = engine
        self.active: dict[str, Turn] = {}
        self.tg: TaskGroup | None = None  # the daemon's; set while it serves
        self._tokenizing: Tokenizing | None = None

    @property
    def tokenizing(self) -> Tokenizing:
        """The tokenizer stage (the model must be loaded: the stage copies its tokenizer)."""
        if self._tokenizing is None:
            self._tokenizing = Tokenizing(self.engine.tokenizer)
        return self._tokenizing

    # --- checks ---

    def session(self, session_id: str, rid: RequestId = None) -> Any:
        session = self.store.get_session(session_id)
        if session is None:
            raise RequestError(p.UNKNOWN_SESSION,
                               f"no session {session_id!r}; list sessions with session.list", rid)
        return session

    def check_idle(self, session_id: str, rid: RequestId = None) -> None:
        self.session(session_id, rid)
        if session_id in self.active:
            raise RequestError(p.BUSY, "this session is already generating; "
                               "send chat.cancel or wait for chat.done", rid)

    # --- the fed-token rule ---

    def fed(self, session_id: str) -> tuple[list[int], int]:
        """The session's fed ids and what they cover, verified by their checksum.

        Ids that fail it are dropped, so the turn renders the transcript
        afresh (the answer is a fresh prefill's) and stores new ids after it.
        """
        try:
            return self.store.fed(session_id)
        except DamagedFedIds as e:
            log.warning("%s; rebuilding them from the transcript", e)
            self.store.drop_fed(session_id)
            return [], 0

    def rewind(self, session_id: str, index: int, messages: list[Message] | None = None) -> None:
        """Drop messages from `index` on, and the fed token ids with them.

        The ids are cut at the end of the last earlier turn whose boundary is
        known, so the next turn appends to exactly what was fed; the engine
        then rewinds the session's cache to the longest prefix it still shares.
        """
        if messages is None:
            messages = self.store.messages(session_id)
        fed, _ = self.fed(session_id)
        keep, covers = 0, 0
        for m in messages:
            if m["index"] < index and m["fed_end"] is not None and m["fed_end"] <= len(fed):
                keep, covers = m["fed_end"], m["index"] + 1
        self.store.truncate_messages(session_id, index)
        self.store.set_tokens(session_id, fed[:keep], covers=covers)

    def system_changed(self, session_id: str, message_count: int) -> None:
        """The fed ids begin with the old system prompt, so the next turn must not append to them.

        It retokenizes, and the cache keeps what still matches (the template's head).
        """
        fed, _ = self.fed(session_id)
        self.store.set_tokens(session_id, fed, covers=0)
        self.store.forget_fed_ends(session_id, message_count)

    def _continuation(self, session_id: str, index: int, system: str | None) -> Continuation:
        earlier = [m for m in self.store.messages(session_id) if m["index"] < index and m["content"]]
        fed, covers = self.fed(session_id)
        return Continuation(messages=[template_message(m) for m in earlier],
                            system=system, fed=fed,
                            fed_covers=sum(1 for m in earlier if m["index"] < covers))

    def _record(self, turn: Turn, tokens: list[int] | None, *, exact: bool) -> int | None:
        """A finished turn's fed ids; returns the answer's fed_end.

        `exact` is False when the stored text is not all the ids hold (a stop
        sequence cut it): the ids stay for the cache, but the next turn must
        retokenize rather than append.
        """
        if tokens is None:
            return None
        self.store.set_tokens(turn.session_id, tokens, covers=turn.message_index + 1 if exact else 0)
        return len(tokens) if exact else None

    # --- what a client asks for: a new message, an answer again, an edited message ---

    def send(self, listener: Listener | None, rid: RequestId, session_id: str, text: str,
             **sampling: Any) -> Turn:
        """Commit the user's message, then answer it; a full disk stores neither."""
        self.check_idle(session_id, rid)
        first_new = self.store.append_message(session_id, "user", text)  # committed before anything is generated
        try:
            return self.start(listener, rid, session_id, first_new, **sampling)
        except Exception as e:
            if not is_disk_full(e):
                raise
            try:  # so that "not saved" stays true
                self.store.truncate_messages(session_id, first_new)
            except Exception:
                raise RequestError(p.DISK_FULL, "the disk holding kvd's data directory is full: your "
                                   "message was saved but no answer could be started; free some space "
                                   "and send chat.regenerate", rid) from None
            raise

    def regenerate(self, listener: Listener | None, rid: RequestId, session_id: str, **sampling: Any) -> Turn:
        """Answer the last message again: the old answer and its fed ids go, the cache is rewound."""
        self.check_idle(session_id, rid)
        messages = self.store.messages(session_id)
        if not messages or messages[-1]["role"] != "assistant":
            raise RequestError(p.BAD_REQUEST, "the session's last message is not an answer; "
                               "there is nothing to regenerate", rid)
        last = messages[-1]["index"]
        self.rewind(session_id, last, messages)
        return self.start(listener, rid, session_id, last, **sampling)

    def edit(self, listener: Listener | None, rid: RequestId, session_id: str, index: int, text: str,
             **sampling: Any) -> Turn:
        """Replace user message `index` (and everything after it) with `text`, and answer it."""
        self.check_idle(session_id, rid)
        messages = self.store.messages(session_id)
        target = next((m for m in messages if m["index"] == index), None)
        if target is None or target["role"] != "user":
            raise RequestError(p.BAD_REQUEST, f"message {index} is not a user message "
                               "of this session; session.get lists them", rid)
        self.rewind(session_id, index, messages)
        first_new = self.store.append_message(session_id, "user", text)
        return self.start(listener, rid, session_id, first_new, **sampling)

    # --- a turn's life ---

    def start(self, listener: Listener | None, rid: RequestId, session_id: str, first_new: int, *,
              max_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None,
              prompt: Prompt | None = None, stop: Sequence[str] = (),
              seed: int | None = None, door: str = "websocket", history: bool | None = None,
              grammar: str | None = None) -> Turn:
        """Generate an answer to the transcript as it stands (its new messages are committed).

        `prompt` defaults to the transcript under the fed-token rule. The
        cache comes from wherever the longest prefix of its ids is held: the
        session's own or any other's (cachestore's checkout).
        """
        assert self.tg is not None, "the daemon is not serving"
        session = self.session(session_id, rid)
        sampling = resolve({"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p}, session["params"],
                           self.config.sampling(), max_tokens_limit=self.config.max_tokens_limit)
        index = self.store.append_message(session_id, "assistant", "", status="streaming")
        if prompt is None:
            prompt = self._continuation(session_id, index, session["system"])
        turn = Turn(rid, session_id, index, first_new, {listener} if listener is not None else set(),
                    stop=StopScan(stop) if stop else None, door=door)
        self.active[session_id] = turn
        send, receive = anyio.create_memory_object_stream[EngineEvent](math.inf)
        loop = asyncio.get_running_loop()

        def emit(event: EngineEvent) -> None:  # engine thread
            loop.call_soon_threadsafe(_deliver, event)

        def _deliver(event: EngineEvent) -> None:  # event loop
            try:
                send.send_nowait(event)
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                pass

        job = TurnJob(session_id=session_id, tokens=[], seed=seed, fed_before=prompt.fed_before,
                      history=first_new > 1 if history is None else history,
                      max_tokens=sampling.max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
                      emit=emit, grammar=grammar)
        self.tg.start_soon(self._submit, turn, prompt, job, send)
        self.tg.start_soon(self._pump, turn, receive)
        turn.publish({"type": p.CHAT_START, "message_index": index})
        return turn

    async def _submit(self, turn: Turn, prompt: Prompt, job: TurnJob, events: Any) -> None:
        """Make the turn's ids in the tokenizer stage, then hand the job to the engine."""
        while not self.engine.ready.is_set():  # the tokenizer comes with the model
            await anyio.sleep(0.05)  # a threading.Event the engine thread sets; clients get `loading` meanwhile
        if self.engine.load_error is not None:
            self.engine.submit(job)  # no tokenizer: the engine answers with why the model did not load
            return
        try:
            if isinstance(prompt, Tokens):
                job.tokens, job.retokenized = list(prompt.tokens), True
            else:
                job.tokens, job.retokenized = await self.tokenizing.run(prompt.ids)
        except Exception as e:
            log.exception("tokenizing the prompt of session %s failed", turn.session_id)
            events.send_nowait(Failed(p.INTERNAL, f"the prompt could not be tokenized: {e}"))
            return
        self.engine.submit(job)
        if turn.cancelled:  # cancelled while tokenizing: the engine cancels it as it arrives
            self.engine.cancel(turn.session_id)

    def cancel(self, session_id: str, turn: Turn | None = None) -> None:
        """Stop the session's answer (only if it is still `turn`, when given); what was generated is kept."""
        if turn is None or self.active.get(session_id) is turn:
            current = self.active.get(session_id)
            if current is not None:
                current.cancelled = True
            self.engine.cancel(session_id)

    async def _pump(self, turn: Turn, events: MemoryObjectReceiveStream[EngineEvent]) -> None:  # noqa: C901 - 18:
        # one branch per engine event kind, all sharing the answer's commit clock and stop scan
        """Commit and publish one answer's events until it is done.

        The first delta is committed at once, later ones at most every
        COMMIT_INTERVAL: a crash loses at most that much of an answer.
        """
        last_commit = -math.inf
        sid = turn.session_id
        try:
            async with events:
                async for ev in events:
                    if isinstance(ev, Queued):
                        turn.publish({"type": p.CHAT_QUEUED, "position": ev.position})
                    elif isinstance(ev, Progress):
                        turn.publish({"type": p.CHAT_PROGRESS, "fed": ev.fed, "total": ev.total})
                    elif isinstance(ev, Started):
                        if ev.retokenized:
                            self.store.forget_fed_ends(sid, turn.message_index)
                    elif isinstance(ev, Delta):
                        text = ev.text
                        if turn.stop is not None:
                            stopped = turn.stop.hit
                            text = turn.stop.feed(text)
                            if turn.stop.hit and not stopped:
                                self.cancel(sid, turn)  # the rest would be cut anyway
                        if text:
                            self._delta(turn, text)
                        if time.monotonic() - last_commit >= COMMIT_INTERVAL:
                            self.store.update_message(sid, turn.message_index, content=turn.text)
                            last_commit = time.monotonic()
                    elif isinstance(ev, Done):
                        self._done(turn, ev)
                        return
                    elif isinstance(ev, Failed):
                        if ev.code == p.TOO_LARGE and not turn.text:
                            # Nothing was generated and the turn can never fit: take it back,
                            # so the session stays usable (the client still has the text).
                            self.store.truncate_messages(sid, turn.first_new)
                        else:
                            self.store.update_message(sid, turn.message_index, content=turn.text,
                                                      status="error", finish_reason="error")
                        turn.publish({"type": p.ERROR, "code": ev.code, "message": ev.message})
                        return
        except Exception as e:
            self.engine.cancel(sid)  # nobody is left to keep what it generates
            if is_disk_full(e):
                log.warning("answer for session %s cut: the disk is full (%s)", sid, e)
                turn.publish({"type": p.ERROR, "code": p.DISK_FULL, "message": DISK_FULL_MESSAGE})
            else:
                log.exception("answer for session %s failed", sid)
                turn.publish({"type": p.ERROR, "code": p.INTERNAL,
                              "message": "kvd hit an internal error; it is logged"})
            try:
                self.store.update_message(sid, turn.message_index, content=turn.text,
                                          status="error", finish_reason="error")
            except Exception as again:  # the answer keeps what was committed before; recovered at start
                log.warning("could not mark the answer of %s as cut: %s", sid, again)
        finally:
            if self.active.get(sid) is turn:
                del self.active[sid]
            turn.finished.set()

    def _delta(self, turn: Turn, text: str) -> None:
        turn.text += text
        turn.deltas.append(text)
        turn.publish({"type": p.CHAT_DELTA, "seq": turn.seq, "text": text})
        turn.seq += 1

    def _done(self, turn: Turn, ev: Done) -> None:
        reason = ev.finish_reason
        stopped = turn.stop is not None and turn.stop.hit
        if turn.stop is not None:
            if rest := turn.stop.flush():
                self._delta(turn, rest)
            if stopped:
                reason = "stop"  # cancelled by the stop sequence, as far as the client is concerned
        status = "cancelled" if reason == "cancelled" else "complete"
        u = ev.usage
        log.info("turn in session %s (%s): cache %s, %s tok restored, %s prefilled, TTFT %s ms, %s tok, %s",
                 turn.session_id, turn.door,
                 f"{u.get('restored_from')} (prefetched from disk)" if u.get("prefetched") else u.get("restored_from"),
                 u.get("cached_tokens"),
                 u.get("prefill_tokens"), u.get("ttft_ms"), u.get("completion_tokens"), reason)
        fed_end = self._record(turn, ev.tokens, exact=not stopped)
        self.store.update_message(turn.session_id, turn.message_index, content=turn.text,
                                  status=status, finish_reason=reason, usage=ev.usage, fed_end=fed_end)
        turn.publish({"type": p.CHAT_DONE, "message_index": turn.message_index,
                      "finish_reason": reason, "usage": ev.usage})
