"""Reading what the user types, on the main thread.

input() runs on the main thread on purpose: only there does readline give
line editing and history *and* turn Ctrl-C into a KeyboardInterrupt that
clears the line it was editing. (input() on a worker thread leaves readline
holding the half-typed line when Ctrl-C arrives.) The network runs on its own
thread meanwhile (see loop_thread.py).

A message may span lines: a paste is one message, newlines kept (readline's
bracketed paste: the terminal marks what is pasted, so its newlines do not
send); a line ending in a backslash continues on the next one, and a line
that is just three double quotes opens a block that the next such line closes.
Plain readline has no portable Alt-Enter, so these are the conventions.

Ctrl-O hands the message being typed to $VISUAL/$EDITOR (editor.py). Python's
readline cannot call back into Python on a key, so Ctrl-O is a readline macro
that ends the line with a ^O character and accepts it; :func:`read_message`
sees the mark and opens the editor.

Tab completes /commands (and the words after /set and /copy). Pasted tabs are
text: a bracketed paste is inserted as it is, never completed.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence

from rich.cells import cell_len
from rich.console import Console
from rich.text import Text

from .history import History

try:
    import termios
except ImportError:  # not a POSIX terminal
    termios = None  # type: ignore[assignment]

BLOCK = '"""'
EDITOR_MARK = "\x0f"  # what the Ctrl-O macro puts at the end of the line (a ^O)
# Words completed after a command (its first argument).
ARGUMENTS = {"/set": ("system", "parameter"), "/copy": ("code",)}


def enable_line_editing(commands: Sequence[str] = ()) -> None:
    """Arrow keys, history, paste, Ctrl-O and Tab for input() when a person is typing."""
    if not sys.stdin.isatty():
        return
    try:
        import readline
    except ImportError:
        return
    # CPython turns bracketed paste off (its REPL runs each pasted line); kvchat wants it on.
    readline.parse_and_bind("set enable-bracketed-paste on")
    readline.parse_and_bind(r'"\C-o": "\C-e\C-v\C-o\C-m"')  # end of line, a literal ^O, Enter
    readline.parse_and_bind("tab: complete")
    readline.set_completer_delims(" \t\n")
    complete = Completer(commands, readline.get_line_buffer)
    readline.set_completer(complete)


class Completer:
    """readline's completer: /command names at the start of the line, then their first word."""

    def __init__(self, commands: Sequence[str], line: Callable[[], str]) -> None:
        self.commands = sorted(commands)
        self.line = line
        self._matches: list[str] = []

    def candidates(self, line: str, word: str) -> list[str]:
        head, space, rest = line.partition(" ")
        if not space:
            return [c + " " for c in self.commands if c.startswith(word)] if word.startswith("/") else []
        if " " in rest.strip() or head not in ARGUMENTS:
            return []
        return [a + " " for a in ARGUMENTS[head] if a.startswith(word)]

    def __call__(self, word: str, state: int) -> str | None:
        if state == 0:
            self._matches = self.candidates(self.line().lstrip(), word)
        return self._matches[state] if state < len(self._matches) else None


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
        self.shown_prompt = ""  # the last prompt input() showed

    def _read(self, prompt: str, keep: bool) -> str:
        self.shown_prompt = prompt.replace("\x01", "").replace("\x02", "")  # as the terminal shows it
        with _echo(True):  # readline echoes only if the terminal does (else it reads a password)
            line = self._read_line(prompt)
        if "\n" in line and not self.echo:
            self._repaint_if_tall(line)
        if self.echo:
            self.console.print(Text(line.removesuffix(EDITOR_MARK)), soft_wrap=True)
        if keep and self.history is not None:
            self.history.add(line.removesuffix(EDITOR_MARK))
        return line

    def _repaint_if_tall(self, pasted: str) -> None:
        """A paste taller than the terminal: readline cannot redraw what scrolled off, so its echo
        splices lines (the message itself is exact). Once the paste is accepted, the screen (all paste
        by then) is cleared and the message's prompt and text are written again as they are."""
        if not self.console.is_terminal:
            return
        width, height = self.console.size
        text = self.shown_prompt + pasted
        rows = sum(max(1, -(-cell_len(line.expandtabs()) // max(width, 1))) for line in text.split("\n"))
        if rows < height:
            return
        self.console.file.write("\x1b[H\x1b[2J")  # home, clear the screen (the scrollback keeps the rest)
        self.console.print(Text(text), soft_wrap=True)

    def message(self, prompt: str, continuation: str, *, prefill: str | None = None,
                draft: str | None = None) -> str:
        """A message as typed, or as saved from the editor after Ctrl-O ("" if the editor left it empty).

        `draft` is what the editor starts with when nothing was typed (e.g. /edit's old text).
        """
        try:
            with prefilled(prefill):
                return read_message(prompt, continuation, lambda p: self._read(p, True))
        except ToEditor as typed:
            return self.compose(typed.text or draft or "")

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
        return self._read(prompt, False)


@contextlib.contextmanager
def quiet_terminal() -> Iterator[None]:
    """No echo for the whole chat but while reading a line (Input turns it on around input()).

    Keys typed while a command or an answer runs wait in the terminal's buffer
    and appear once, at the next prompt; with echo on the terminal would show
    them where they were typed, and readline again at the prompt.
    """
    with _echo(False):
        yield


def echo_off() -> contextlib.AbstractContextManager[None]:
    """Keys typed while an answer streams are not echoed into it.

    They stay in the terminal's buffer and show up at the next prompt, and
    Ctrl-C is not echoed as "^C" in the middle of the answer.
    """
    return _echo(False)


@contextlib.contextmanager
def _echo(on: bool) -> Iterator[None]:
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
    changed[3] = changed[3] | termios.ECHO if on else changed[3] & ~termios.ECHO
    termios.tcsetattr(fd, termios.TCSANOW, changed)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, saved)
