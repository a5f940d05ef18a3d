"""One answer in the terminal: asked for, streamed, cancelled, followed across a dropped connection.

Threads: the main thread prints (and owns Ctrl-C); the network thread talks to
kvd. The network side puts what happens into a plain queue, the main side
takes it out and prints it, so printing never races the prompt.

If the connection drops mid-answer, the daemon keeps generating; the network
side reconnects (daemon.json is read again: a restarted daemon may have a new
port) and sends ``chat.attach`` with the last ``seq`` it saw, so the answer
continues on screen with no gap and no duplicate. If the answer has ended in
the meantime, ``chat.attached`` carries the message as the transcript holds
it; its content is every delta joined, so what is missing is its tail.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import anyio
from rich.console import Console

import protocol

from . import render
from .client import Client
from .errors import ConnectionLost, KvchatError, ServerError
from .estimate import PrefillClock
from .interrupts import Interrupts, StopWaiting
from .lineinput import echo_off
from .link import Link
from .loop_thread import LoopThread

_END = object()  # the network side is done with this turn
_MORE, _OVER, _RESEND = object(), object(), object()
RECONNECTING = "connection lost; reconnecting…"
RECONNECTED = "reconnected"  # after an event: go on, the answer is over, send again
DROPPED = "the connection to kvd dropped mid-answer; kvchat reconnected"


@dataclass(frozen=True)
class Reconnecting:
    pass


@dataclass(frozen=True)
class Reconnected:
    pass


@dataclass(frozen=True)
class Note:
    """Said after the answer and its status line."""

    text: str


@dataclass
class Followed:
    """What this client knows of the answer it follows."""

    request: Any = None  # the id of the request that started it
    index: int | None = None  # its message index
    seq: int = -1  # the last delta seen
    text: str = ""  # every delta seen, joined


class TurnRunner:
    """``run()`` one request that produces an answer (chat.send, chat.regenerate,
    chat.edit), or follows one already running (chat.attach)."""

    def __init__(
        self,
        console: Console,
        net: LoopThread,
        link: Link,
        interrupts: Interrupts,
        session: str,
        kind: str,
        fields: Mapping[str, Any],
        *,
        last_index: int = -1,
        clock: PrefillClock | None = None,
    ) -> None:
        self.console = console
        self.net = net
        self.link = link
        self.interrupts = interrupts
        self.session = session
        self.kind = kind
        self.fields = dict(fields)
        self.last_index = last_index  # the session's last message before this turn
        self.clock = clock  # the kvchat's prefill clock: earlier reads inform this one's estimate
        self.followed = Followed()
        self._events: queue.Queue[Any] = queue.Queue()
        self._cancel = asyncio.Event()  # set on the network loop; binds to it on first wait

    # -- the main thread ---------------------------------------------------------

    def run(self) -> dict[str, Any] | None:
        """Print the answer as it comes; return its chat.done (None if there was none)."""
        printer = render.answer_printer(self.console)
        if self.clock is not None:
            printer.clock = self.clock
        future = self.net.submit(self._pump())
        done: dict[str, Any] | None = None
        failure: Exception | None = None
        notes: list[str] = []
        try:
            with echo_off(), self.interrupts.streaming(lambda: self.net.call_soon(self._cancel.set)):
                while (item := self._events.get()) is not _END:
                    if isinstance(item, Exception):
                        failure = item
                    elif isinstance(item, (Reconnecting, Reconnected)):
                        dropped = _reconnecting(printer, isinstance(item, Reconnecting))
                        if dropped and DROPPED not in notes:
                            notes.insert(0, DROPPED)
                    elif isinstance(item, Note):
                        notes.append(item.text)
                    else:
                        done = show(printer, item) or done
        except StopWaiting:
            future.cancel()
            printer.finish()
            render.print_note(self.console,
                              "(stopped waiting; kvd may still be finishing this answer: /attach shows it)")
            return None
        finally:
            # A refusal after chat.start (the conversation does not fit, a full disk) shows only its
            # error: no empty `kvd>` label before it.
            printer.finish(label=failure is None or bool(printer.text))
        if failure is not None:
            raise _friendly(failure, self.kind)
        if done is not None:
            render.print_status(self.console, done, blank=False)
        for text in notes:
            render.print_note(self.console, text)
        if done is not None or notes:
            self.console.print()
        return done

    # -- the network thread --------------------------------------------------------

    async def _pump(self) -> None:
        try:
            lost = self.link.client.lost
            client = await self.link.ensure(on_retry=lambda: self._events.put(Reconnecting()))
            if lost:
                self._events.put(Reconnected())
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(self._cancel_when_asked)
                try:
                    await self._follow(client)
                except Exception as exc:  # caught here, not wrapped in the task group's ExceptionGroup
                    self._events.put(exc)
                finally:
                    tasks.cancel_scope.cancel()
        except Exception as exc:  # the main thread reports it (or raises it, if it is a bug)
            self._events.put(exc)
        finally:
            self._events.put(_END)

    async def _cancel_when_asked(self) -> None:
        await self._cancel.wait()
        await self._send_cancel(self.link.client)

    async def _send_cancel(self, client: Client) -> None:
        with contextlib.suppress(KvchatError):  # a lost connection: sent again once reconnected
            await client.request(protocol.CHAT_CANCEL, session=self.session)

    async def _follow(self, client: Client) -> None:
        if self.kind == protocol.CHAT_ATTACH:
            stream = client.attach(self.session, -1)
        else:
            stream = client.stream(self.kind, session=self.session, **self.fields)
        resent = False
        while True:
            try:
                async with contextlib.aclosing(stream):
                    async for event in stream:
                        if (verdict := await self._take(client, event)) is _MORE:
                            continue
                        if verdict is _RESEND and not resent:
                            break
                        return
                    else:
                        return
                # The message never reached kvd (the connection had dropped unseen): send it once more.
                resent = True
                stream = client.stream(self.kind, session=self.session, **self.fields)
            except ConnectionLost:
                self._events.put(Reconnecting())
                client = await self.link.reconnect()
                self._events.put(Reconnected())
                if self._cancel.is_set():
                    await self._send_cancel(client)
                stream = client.attach(self.session, self.followed.seq)

    async def _take(self, client: Client, event: dict[str, Any]) -> object:
        """Track and pass on one event: _MORE to come, _OVER, or _RESEND the request."""
        f = self.followed
        kind = event.get("type")
        if kind == protocol.CHAT_START:
            f.request, f.index = event.get("id"), event.get("message_index")
        elif kind == protocol.CHAT_DELTA:
            seq = event.get("seq")
            if isinstance(seq, int):
                if seq <= f.seq:
                    return _MORE  # seen already
                f.seq = seq
            f.text += str(event.get("text", ""))
        elif kind == protocol.CHAT_ATTACHED:
            if not event.get("generating"):
                return await self._settle(client, event.get("message"))
            if f.request is not None and event.get("request") != f.request:
                # The session is writing another answer (asked for elsewhere): ours is over.
                return await self._settle(client, None)
            f.request, f.index = event.get("request"), event.get("message_index")
        self._events.put(event)
        return _OVER if kind == protocol.CHAT_DONE else _MORE

    async def _settle(self, client: Client, message: Mapping[str, Any] | None) -> object:
        """The answer ended while we were away: show its tail and status from the transcript."""
        f = self.followed
        if f.request is None and self.kind == protocol.CHAT_ATTACH:
            self._events.put(Note("nothing is being written in this session right now"))
            return _OVER
        if f.index is not None and (message is None or message.get("index") != f.index):
            got = await client.request(protocol.SESSION_GET, session=self.session)
            message = next((m for m in got.get("messages") or [] if m.get("index") == f.index), None)
        elif f.index is None and message is not None:
            newer = isinstance(message.get("index"), int) and int(message["index"]) > self.last_index
            message = message if newer and message.get("role") == "assistant" else None
        if message is None:
            if self.kind == protocol.CHAT_SEND:
                return _RESEND  # a new answer would have a new index: none means kvd never got it
            self._events.put(Note("the connection dropped before kvd confirmed this; if the answer above "
                                  "is the old one, ask again"))
            return _OVER
        content = str(message.get("content", ""))
        self._events.put({"type": protocol.CHAT_START, "message_index": message.get("index")})
        if content.startswith(f.text):
            if rest := content[len(f.text):]:
                self._events.put({"type": protocol.CHAT_DELTA, "text": rest})
        else:
            self._events.put(Note("kvd kept less of this answer than was shown: it stopped before saving the rest"))
        status, reason = message.get("status"), message.get("finish_reason")
        usage = message.get("usage")
        if usage is not None or status == "complete":
            self._events.put({"type": protocol.CHAT_DONE, "message_index": message.get("index"),
                              "finish_reason": reason, "usage": usage or {}})
        cancelled_by_us = self._cancel.is_set()
        if status == "error" or (status == "cancelled" and not cancelled_by_us):
            self._events.put(Note("kvd stopped while writing this answer (it was restarted?), so it is cut off; "
                                  "/regen writes it again"))
        return _OVER


def _reconnecting(printer: render.AnswerPrinter, lost: bool) -> bool:
    """Say that the connection is being made again (`lost`) or is back. Before the answer's text, as a
    line of its own; once text is shown, below the live text while it lasts, never printed inside the
    answer: True then, and the turn says it after the answer (DROPPED)."""
    if not printer.text:
        printer.note(RECONNECTING if lost else RECONNECTED)
        return False
    printer.wait(RECONNECTING if lost else None)
    return True


def show(printer: render.AnswerPrinter, event: dict[str, Any]) -> dict[str, Any] | None:
    """Print one event of the answer; return it if it is the chat.done. Unknown types are ignored."""
    kind = event.get("type")
    if kind == protocol.CHAT_START or (kind == protocol.CHAT_ATTACHED and event.get("generating")):
        printer.start()  # not before: a refused request shows only its error
    elif kind == protocol.CHAT_DELTA:
        printer.feed(str(event.get("text", "")))
    elif kind == protocol.CHAT_PROGRESS:
        fed, total = event.get("fed"), event.get("total")
        if isinstance(fed, int) and isinstance(total, int):
            printer.progress(fed, total, time.monotonic())
    elif kind == protocol.CHAT_DONE:
        return event
    elif kind == protocol.CHAT_QUEUED:
        position = event.get("position")
        printer.note(f"waiting for the daemon: {position} ahead of you")
    return None


def _friendly(failure: Exception, kind: str) -> Exception:
    if isinstance(failure, ServerError) and failure.code == protocol.BUSY and kind != protocol.CHAT_ATTACH:
        return KvchatError("this session is answering in another window; /attach to watch that answer, "
                           "or wait for it to finish")
    return failure
