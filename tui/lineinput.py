"""Reading what the user types, on the main thread.

At a terminal kvchat edits with prompt_toolkit (terminal.py): a message
of any height is drawn again exactly as it is edited (readline splices a
paste taller than the terminal), keys are bound in Python, and Ctrl-C is a
key that drops the message rather than a signal. Piped input, and the tests
that script kvchat, read line by line with :func:`read_message`. The network
runs on its own thread meanwhile (see loop_thread.py).

A message may span lines: a paste is one message, newlines kept (bracketed
paste: the terminal marks what is pasted, so its newlines do not send); a
line ending in a backslash continues on the next one, and a line that is just
three double quotes opens a block that the next such line closes. At a
terminal Alt-Enter also starts a new line.

Ctrl-O hands the message being typed to $VISUAL/$EDITOR (editor.py). Read
line by line, a line ending in a ^O character means the same.

Tab completes /commands (and the words after /set and /copy). Pasted tabs are
text: a bracketed paste is inserted as it is, never completed.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from rich.console import Console
from rich.text import Text

from .history import History

try:
    import termios
except ImportError:  # not a POSIX terminal
    termios = None  # type: ignore[assignment]

BLOCK = '"""'
EDITOR_MARK = "\x0f"  # read line by line, a line ending in ^O asks for the editor
INTERRUPTED = "^C"  # said after a message Ctrl-C dropped
# Words completed after a command (its first argument).
ARGUMENTS = {"/set": ("system", "parameter"), "/copy": ("code",)}


class Completer:
    """/command names at the start of the line, then their first word."""

    def __init__(self, commands: Sequence[str]) -> None:
        self.commands = sorted(commands)

    def candidates(self, line: str, word: str) -> list[str]:
        head, space, rest = line.partition(" ")
        if not space:
            return [c + " " for c in self.commands if c.startswith(word)] if word.startswith("/") else []
        if " " in rest.strip() or head not in ARGUMENTS:
            return []
        return [a + " " for a in ARGUMENTS[head] if a.startswith(word)]


class Editor(Protocol):
    """A line editor at a terminal (terminal.Terminal): a whole message, or one line of an answer."""

    def message(self, prompt: str, prefill: str | None = None) -> str: ...

    def ask(self, prompt: str) -> str: ...


class ToEditor(Exception):
    """Ctrl-O: the message typed so far goes to the editor."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text


def read_message(
    prompt: str,
    continuation: str,
    read_line: Callable[[str], str] = input,
) -> str:
    """One message: a paste as it is; a backslash at a line's end continues it; a \"\"\" line opens
    or closes a block.

    Ctrl-D on the first line raises EOFError (leave); on a later line it ends
    the message. Ctrl-C raises KeyboardInterrupt and drops every line typed so
    far. Ctrl-O raises ToEditor with the text typed so far.
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
        if line.endswith(EDITOR_MARK):
            raise ToEditor("\n".join([*lines, line[: -len(EDITOR_MARK)]]))
        if "\n" in line and not block:  # a bracketed paste: its newlines are the message's
            line = line.rstrip("\n")
            if not line.endswith("\\"):  # a backslash typed after it continues, as on any line
                return "\n".join([*lines, line])
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


class Input:
    """What the chat reads: messages (kept in the history) and answers to questions (not kept).

    With a `terminal` (a person at a terminal) it edits; otherwise it reads
    lines with `read_line`, and `echo` prints each line after its prompt, for
    input that is piped in and so not echoed by a terminal.
    """

    def __init__(
        self,
        console: Console,
        *,
        read_line: Callable[[str], str] = input,
        echo: bool = False,
        history: History | None = None,
        terminal: Editor | None = None,
    ) -> None:
        self.console = console
        self._read_line = read_line
        self.echo = echo
        self.history = history
        self.terminal = terminal
        self._interrupt_shown = False  # the editor marked the message Ctrl-C dropped

    def _read(self, prompt: str) -> str:
        with _echo(True):  # kvchat keeps echo off between prompts (quiet_terminal)
            line = self._read_line(prompt)
        if self.echo:
            self.console.print(Text(line.removesuffix(EDITOR_MARK)), soft_wrap=True)
        return line

    def message(self, prompt: str, continuation: str, *, prefill: str | None = None,
                draft: str | None = None) -> str:
        """A message as typed, or as saved from the editor after Ctrl-O ("" if the editor left it empty).

        `prefill` is already typed when the editor starts (at a terminal only);
        `draft` is what the editor starts with when nothing was typed (e.g. /edit's old text).
        """
        try:
            if self.terminal is None:
                text = read_message(prompt, continuation, self._read)
                if self.history is not None:
                    self.history.add(text)  # one entry per message, as the terminal's editor keeps it
                return text
            with self._marking_interrupts():
                return self.terminal.message(prompt, prefill)
        except ToEditor as typed:
            return self.compose(typed.text or draft or "")

    def interrupted(self) -> None:
        """Ctrl-C dropped what was being read: say so, unless the editor has shown it already."""
        if self._interrupt_shown:
            self._interrupt_shown = False
            return
        self.console.print(Text(INTERRUPTED, style="dim"), soft_wrap=True)

    def compose(self, text: str) -> str:
        """The editor on `text`; what it saved is the message, shown as sent."""
        from . import editor

        written = editor.edit(text)
        if written.strip():
            self.console.print(Text("(from the editor)", style="dim"), soft_wrap=True)
            self.console.print(Text(written), soft_wrap=True)
        else:
            self.console.print(Text("(the editor left it empty; nothing sent)", style="dim"), soft_wrap=True)
        return written

    def ask(self, prompt: str) -> str:
        """One line, e.g. y/N; EOFError if input ended."""
        if self.terminal is None:
            return self._read(prompt)
        with self._marking_interrupts():
            return self.terminal.ask(prompt)

    @contextlib.contextmanager
    def _marking_interrupts(self) -> Iterator[None]:
        """Around the editor: a Ctrl-C there is already marked on the screen."""
        try:
            yield
        except KeyboardInterrupt:
            self._interrupt_shown = True
            raise


@contextlib.contextmanager
def quiet_terminal() -> Iterator[None]:
    """No echo for the whole chat but while reading a line (Input turns it on around input()).

    Keys typed while a command or an answer runs wait in the terminal's buffer
    and appear once, at the next prompt; with echo on the terminal would show
    them where they were typed, and the editor again at the prompt.
    """
    with _echo(False):
        yield


def echo_off() -> contextlib.AbstractContextManager[None]:
    """Keys typed while an answer streams are not echoed into it, and Ctrl-C keeps what was printed.

    They stay in the terminal's buffer and show up at the next prompt, and
    Ctrl-C is not echoed as "^C" in the middle of the answer. A Ctrl-C also
    makes the kernel flush the terminal's queues unless NOFLSH is set: the
    output kvchat wrote that the terminal had not read yet (the answer's last
    lines, a redraw's erase) would be thrown away, and the screen would lose
    lines of the answer (a CI run in tmux under load lost the "kvd>" line).
    So NOFLSH is set whenever echo is off (tests/test_terminal_modes.py
    shows the flush on a real pty).
    """
    return _echo(False)


@contextlib.contextmanager
def _echo(on: bool) -> Iterator[None]:
    """Echo on (reading a line) or off (anything else, with NOFLSH: see echo_off)."""
    fd = sys.stdin.fileno() if sys.stdin is not None and sys.stdin.isatty() else -1
    if termios is None or fd < 0:
        yield
        return
    try:
        saved = termios.tcgetattr(fd)
    except termios.error:
        yield
        return
    changed = list(saved)
    if on:
        changed[3] = (changed[3] | termios.ECHO) & ~termios.NOFLSH
    else:
        changed[3] = (changed[3] & ~termios.ECHO) | termios.NOFLSH
    termios.tcsetattr(fd, termios.TCSANOW, changed)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, saved)
