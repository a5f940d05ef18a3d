"""Reading what the user types, on the main thread.

input() runs on the main thread on purpose: only there does readline give
line editing and history *and* turn Ctrl-C into a KeyboardInterrupt that
clears the line it was editing. (input() on a worker thread leaves readline
holding the half-typed line when Ctrl-C arrives.) The network runs on its own
thread meanwhile (see loop_thread.py).

A message may span lines: a line ending in a backslash continues on the next
one, and a line that is just three double quotes opens a block that the next
such line closes (for pasting code). Plain readline has no portable
Alt-Enter, so these are the conventions.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.text import Text

from .history import History

try:
    import termios
except ImportError:  # not a POSIX terminal
    termios = None  # type: ignore[assignment]

BLOCK = '"""'


def enable_line_editing() -> None:
    """Arrow keys and history for input() when a person is typing."""
    if not sys.stdin.isatty():
        return
    try:
        import readline
    except ImportError:
        return
    readline.parse_and_bind("tab: tab-insert")  # a Tab is text here, not completion


def read_message(
    prompt: str,
    continuation: str,
    read_line: Callable[[str], str] = input,
) -> str:
    """One message: a backslash at a line's end continues it; a \"\"\" line opens or closes a block.

    Ctrl-D on the first line raises EOFError (leave); on a later line it ends
    the message. Ctrl-C raises KeyboardInterrupt and drops every line typed so
    far.
    """
    lines: list[str] = []
    block = False
    while True:
        try:
            line = read_line(continuation if lines or block else prompt)
        except EOFError:
            if not lines and not block:
                raise
            print()
            return "\n".join(lines)
        if block:
            if line.strip() == BLOCK:
                return "\n".join(lines)
            lines.append(line)
            continue
        if not lines and line.strip() == BLOCK:
            block = True
            continue
        if line.endswith("\\"):
            lines.append(line[:-1])
            continue
        lines.append(line)
        return "\n".join(lines)


@contextlib.contextmanager
def prefilled(text: str | None) -> Iterator[None]:
    """The next input() starts with `text` already typed, when readline can do that."""
    try:
        import readline
    except ImportError:
        readline = None  # type: ignore[assignment]
    if text is None or readline is None or not sys.stdin.isatty():
        yield
        return
    readline.set_startup_hook(lambda: readline.insert_text(text))
    try:
        yield
    finally:
        readline.set_startup_hook(None)


class Input:
    """What the chat reads: messages (kept in the history) and answers to questions (not kept).

    `echo` prints each line after its prompt, for input that is piped in and
    so not echoed by a terminal.
    """

    def __init__(
        self,
        console: Console,
        *,
        read_line: Callable[[str], str] = input,
        echo: bool = False,
        history: History | None = None,
    ) -> None:
        self.console = console
        self._read_line = read_line
        self.echo = echo
        self.history = history

    def _read(self, prompt: str, keep: bool) -> str:
        line = self._read_line(prompt)
        if self.echo:
            self.console.print(Text(line), soft_wrap=True)
        if keep and self.history is not None:
            self.history.add(line)
        return line

    def message(self, prompt: str, continuation: str, *, prefill: str | None = None) -> str:
        with prefilled(prefill):
            return read_message(prompt, continuation, lambda p: self._read(p, True))

    def ask(self, prompt: str) -> str:
        """One line, e.g. y/N; EOFError if input ended."""
        return self._read(prompt, False)


@contextlib.contextmanager
def echo_off() -> Iterator[None]:
    """Keys typed while an answer streams are not echoed into it.

    They stay in the terminal's buffer and show up at the next prompt, and
    Ctrl-C is not echoed as "^C" in the middle of the answer.
    """
    fd = sys.stdin.fileno() if sys.stdin is not None and sys.stdin.isatty() else -1
    if termios is None or fd < 0:
        yield
        return
    try:
        saved = termios.tcgetattr(fd)
    except termios.error:
        yield
        return
    quiet = list(saved)
    quiet[3] &= ~termios.ECHO
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, saved)
