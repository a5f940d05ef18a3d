"""The chat loop: read a message, stream the answer, show the status line.

Threads: this runs on the main thread (prompt, Ctrl-C, printing); the client
runs on the network thread. A turn's events cross over through a plain
queue, so all printing happens here and never races the prompt.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

import anyio
from rich.console import Console
from rich.text import Text

from daemon import protocol

from . import render
from .client import Client
from .errors import ConnectionLost, KvchatError, ServerError
from .lineinput import echo_off, read_message
from .loop_thread import LoopThread

_END = object()  # the network thread is done with this turn
PATIENCE = 1.0  # seconds after a cancel before another Ctrl-C gives up on the answer


class StopWaiting(Exception):
    """A later Ctrl-C on the same answer: give up on it without the daemon."""


class Interrupts:
    """What Ctrl-C means depends on where the user is.

    At the prompt it is an ordinary KeyboardInterrupt, which readline turns
    into a cleared line. While an answer streams, the first one asks the
    daemon to cancel (the answer then ends with chat.done "cancelled"); one
    pressed again after a moment (the daemon should have stopped by then)
    stops waiting for it, and presses in quick succession count as one.
    One handler for the whole run, switched by state, so there is no window
    in which the wrong one is installed.
    """

    def __init__(self) -> None:
        self._cancel: Callable[[], None] | None = None
        self._cancelled_at: float | None = None

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        previous = signal.signal(signal.SIGINT, self._handle)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    @contextlib.contextmanager
    def streaming(self, cancel: Callable[[], None]) -> Iterator[None]:
        self._cancel, self._cancelled_at = cancel, None
        try:
            yield
        finally:
            self._cancel = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._cancel is None:
            raise KeyboardInterrupt
        if self._cancelled_at is None:
            self._cancelled_at = time.monotonic()
            self._cancel()  # only queues a call on the network loop
        elif time.monotonic() - self._cancelled_at >= PATIENCE:
            raise StopWaiting


@dataclass(frozen=True)
class ChatOptions:
    max_tokens: int | None = None
    temperature: float | None = None

    def fields(self) -> dict[str, Any]:
        return {k: v for k, v in (("max_tokens", self.max_tokens), ("temperature", self.temperature)) if v is not None}


class Chat:
    """One session's conversation in the terminal."""

    def __init__(
        self,
        console: Console,
        net: LoopThread,
        client: Client,
        session_id: str,
        options: ChatOptions,
        interrupts: Interrupts,
    ) -> None:
        self.console = console
        self.net = net
        self.client = client
        self.session_id = session_id
        self.options = options
        self.interrupts = interrupts
        self._prompt = render.prompt(console, render.YOU, render.YOU_STYLE)
        self._continuation = render.prompt(console, render.CONTINUE, render.DIM)
        self._echo = not sys.stdin.isatty()  # a terminal echoes what is typed; a pipe does not

    def run(self) -> int:
        """Until /quit or Ctrl-D (0), or until the daemon goes away (1)."""
        while True:
            try:
                text = read_message(self._prompt, self._continuation, echo=self._echo).strip()
                if not text:
                    continue
                if text.startswith("/") and not text.startswith("//"):
                    if self._command(text):
                        return 0
                    continue
                self.turn(text[1:] if text.startswith("//") else text)
            except KeyboardInterrupt:
                # readline has dropped the line; say so and prompt afresh
                self.console.print(Text("^C", style=render.DIM), soft_wrap=True)
            except EOFError:
                self.console.print()
                return 0
            except ConnectionLost as exc:
                render.print_error(
                    self.console,
                    f"{exc}, then resume this chat with: kvchat --session {self.session_id}",
                )
                return 1
            except KvchatError as exc:  # ServerError: this request failed, the chat goes on
                render.print_error(self.console, str(exc))

    def _command(self, text: str) -> bool:
        """Runs a /command; True means leave."""
        name = text.split()[0].lower()
        if name in ("/quit", "/exit"):
            return True
        if name == "/help":
            render.print_help(self.console)
        else:
            render.print_note(self.console, f"unknown command {name}; /help lists them (// sends text that starts with /)")
        return False

    def turn(self, text: str) -> None:
        """Send one message and print the answer as it streams."""
        events: queue.Queue[Any] = queue.Queue()
        cancel = asyncio.Event()  # set on the network loop; binds to it on first wait
        printer = render.MessagePrinter(self.console)
        future = self.net.submit(self._pump(text, events, cancel))
        done: dict[str, Any] | None = None
        failure: Exception | None = None
        try:
            with echo_off(), self.interrupts.streaming(lambda: self.net.call_soon(cancel.set)):
                while (item := events.get()) is not _END:
                    if isinstance(item, Exception):
                        failure = item
                    elif item.get("type") == protocol.CHAT_START:
                        printer.start()  # not before: a refused request shows only its error
                    elif item.get("type") == protocol.CHAT_DELTA:
                        printer.feed(str(item.get("text", "")))
                    elif item.get("type") == protocol.CHAT_DONE:
                        done = item
        except StopWaiting:
            future.cancel()
            printer.finish()
            render.print_note(self.console, "(stopped waiting; kvd may still be finishing this answer)")
            return
        printer.finish()
        if failure is not None:
            raise failure
        if done is not None:
            render.print_status(self.console, done)

    async def _pump(self, text: str, events: queue.Queue[Any], cancel: asyncio.Event) -> None:
        """Network side of a turn: events into the queue, chat.cancel when asked."""

        async def cancel_when_asked() -> None:
            await cancel.wait()
            with contextlib.suppress(KvchatError):  # a lost connection ends the stream too
                await self.client.request(protocol.CHAT_CANCEL, session=self.session_id)

        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(cancel_when_asked)
                try:
                    stream = self.client.stream(
                        protocol.CHAT_SEND, session=self.session_id, text=text, **self.options.fields()
                    )
                    async with contextlib.aclosing(stream):
                        async for event in stream:
                            events.put(event)
                except Exception as exc:  # the main thread reports it (or raises, if a bug)
                    events.put(exc)
                finally:
                    tasks.cancel_scope.cancel()
        finally:
            events.put(_END)
