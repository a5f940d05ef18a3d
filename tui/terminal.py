"""kvchat's line editor at a terminal: prompt_toolkit, bound to kvchat's keys.

The buffer holds the whole message, so a paste, a backslash's next line and
a block are edited as one text and drawn again at every key; a message
taller than the terminal scrolls inside the window instead of being spliced
(readline's fate). Imported only when a person is at a terminal: one-shot
and piped kvchat do not pay for it.
"""

from __future__ import annotations

import shutil
import sys
import textwrap
from collections.abc import Callable, Iterable, Sequence

from prompt_toolkit import PromptSession
from prompt_toolkit.application.current import get_app
from prompt_toolkit.buffer import Buffer
from prompt_toolkit.completion import CompleteEvent, Completion
from prompt_toolkit.completion import Completer as Base
from prompt_toolkit.document import Document
from prompt_toolkit.formatted_text import ANSI
from prompt_toolkit.history import History as Remembered
from prompt_toolkit.key_binding import KeyBindings, KeyPressEvent
from prompt_toolkit.shortcuts import CompleteStyle

from .history import History
from .lineinput import BLOCK, INTERRUPTED, Completer, ToEditor
from .sanitize import sanitize


def opened_block(text: str) -> bool:
    """The text starts with a \"\"\" line that no later \"\"\" line has closed."""
    lines = text.split("\n")
    return lines[0].strip() == BLOCK and (len(lines) == 1 or lines[-1].strip() != BLOCK)


def continues(text: str) -> bool:
    """Enter at the end of this text starts a new line instead of sending it."""
    return opened_block(text) or text.endswith("\\")


def finished(text: str) -> str:
    """The message an edited buffer holds: a block without its \"\"\" lines."""
    lines = text.split("\n")
    if lines[0].strip() != BLOCK:
        return text
    lines = lines[1:]
    if lines and lines[-1].strip() == BLOCK:
        lines = lines[:-1]
    return "\n".join(lines)


class Terminal:
    """prompt_toolkit's line editor, for a person at a terminal.

    The buffer holds the whole message, so a paste, a backslash's next line
    and a block are edited as one text, drawn again at every key (the window
    scrolls when it is taller than the terminal). Enter sends unless the text
    continues (:func:`continues`); Alt-Enter starts a new line; Ctrl-O raises
    ToEditor; Ctrl-D on an empty line raises EOFError and on the last line of
    a longer message sends it; Ctrl-C leaves the dropped text on the screen
    marked ^C and raises KeyboardInterrupt.
    """

    def __init__(self, commands: Sequence[str], history: History | None) -> None:
        self._left = ""  # the message as the editor let go of it (sent, dropped with ^C, or to the editor)
        self._messages: PromptSession[str] = PromptSession(
            history=_Shared(history) if history is not None else None, completer=_Commands(commands),
            complete_while_typing=False, complete_style=CompleteStyle.READLINE_LIKE,
            key_bindings=_bindings(self._letting_go), multiline=True, enable_suspend=True, prompt_continuation="")
        self._answers: PromptSession[str] = PromptSession(enable_suspend=True, key_bindings=_bindings())

    def message(self, prompt: str, prefill: str | None = None) -> str:
        """The message, left on the screen once and whole.

        The editor shows a window of a message taller than the terminal, and
        its last drawing (prompt_toolkit's "done" render) would leave that
        window on the screen, to be pushed into the scrollback above the
        message written whole: a 60-line paste left two partial copies. So the
        keys that end the editing empty its buffer first (the last drawing is
        the prompt alone, erasing the window) and the prompt and message are
        written here in its place, every line of them.
        """
        self._left = ""
        try:
            self._messages.prompt(ANSI(prompt), default=prefill or "")
        finally:
            _leave(prompt, self._left)
        return finished(self._left)

    def _letting_go(self, text: str) -> None:
        self._left = text

    def ask(self, prompt: str) -> str:
        return self._answers.prompt(ANSI(wrapped(prompt, shutil.get_terminal_size().columns)))


def _blank_drawing() -> None:
    """Blank the rows the editor drew, one erase-line each, before its last drawing erases them itself.

    That last drawing erases from the top of what it drew to the end of the
    screen; when that top is the screen's first row (a message as tall as the
    terminal), tmux takes the erase for a clear screen and keeps the rows in
    its scrollback (scroll-on-clear), a partial copy of the message. Rows
    already blank are not kept. The cursor is saved and restored around it,
    so the editor's idea of where it is stays true.
    """
    app = get_app()
    screen = app.renderer.last_rendered_screen
    if screen is None:
        return
    height = min(screen.height, app.output.get_size().rows)
    row = min(screen.get_cursor_position(app.layout.current_window).y, height - 1)
    rows = ["\r\x1b[2K"] * height
    app.output.write_raw("\x1b7" + (f"\x1b[{row}A" if row else "") + "\x1b[B".join(rows) + "\x1b8")
    app.output.flush()


def wrapped(prompt: str, width: int) -> str:
    """A question (`delete 'Lisbon trip'? [y/N] `) broken between words to fit `width`: prompt_toolkit
    breaks a prompt wherever the row ends, mid-word. A prompt with escapes (a coloured label) is left as is."""
    if "\x1b" in prompt or len(prompt) < width or width < 10:
        return prompt
    lines = textwrap.wrap(prompt, width=width - 1, break_long_words=False, break_on_hyphens=False)
    return "\n".join(lines) + (" " if prompt.endswith(" ") else "")


# kvd's default limits.max_text_chars: a message longer than this is refused unless the limit was raised,
# and writing it back whole first buried the refusal under it.
ECHOED_CHARS = 32_000
ECHOED_LINES = 6


def echoed(text: str) -> str:
    """The message as written back once sent: whole, or a very long one's first lines and its size."""
    text = sanitize(text.rstrip("\n"))
    if len(text) <= ECHOED_CHARS:
        return text
    lines = text.split("\n")
    head = "\n".join(lines[:ECHOED_LINES])[:ECHOED_LINES * 200]
    size = f"{len(text):,} characters" + (f", {len(lines):,} lines" if len(lines) > 1 else "")
    return head + f"\n\x1b[2m… ({size} in all; Up recalls it whole)\x1b[0m"


def _leave(prompt: str, text: str) -> None:
    """Over the prompt the editor drew last (one row: its buffer was emptied), the prompt and the text."""
    sys.stdout.write("\x1b[A\r\x1b[2K" + prompt + echoed(text) + "\n")
    sys.stdout.flush()


class _Shared(Remembered):
    """prompt_toolkit's view of kvchat's history: it loads newest first and appends what it sends."""

    def __init__(self, history: History) -> None:
        super().__init__()
        self.history = history

    def load_history_strings(self) -> Iterable[str]:
        return list(reversed(self.history.entries))

    def store_string(self, string: str) -> None:
        self.history.add(string)


class _Commands(Base):
    """Tab: /command names at the start of a message, then their first word."""

    def __init__(self, commands: Sequence[str]) -> None:
        self.words = Completer(commands)

    def get_completions(self, document: Document, complete_event: CompleteEvent) -> Iterable[Completion]:
        if document.cursor_position_row:  # only on a message's first line
            return
        line = document.current_line_before_cursor
        word = line.rsplit(" ", 1)[-1]
        for found in self.words.candidates(line.lstrip(), word):
            yield Completion(found, start_position=-len(word))


def _bindings(letting_go: Callable[[str], None] | None = None) -> KeyBindings:  # noqa: C901 - a table of keys:
    # McCabe counts the nested handlers' branches into this one; each handler is a few lines.
    """kvchat's keys; with `letting_go`, each key that ends the editing hands it the text and empties
    the buffer, so that the editor's last drawing is its prompt alone (Terminal.message)."""
    keys = KeyBindings()

    def let_go(buffer: Buffer) -> None:
        if letting_go is not None:
            letting_go(buffer.text)
            buffer.reset()
            _blank_drawing()

    def accept(buffer: Buffer) -> None:
        text = buffer.text
        buffer.validate_and_handle()  # the result and the history entry: the text
        if letting_go is not None:
            letting_go(text)
            buffer.reset()
            _blank_drawing()

    @keys.add("enter")
    def _enter(event: KeyPressEvent) -> None:
        buffer = event.current_buffer
        if not buffer.multiline() or not continues(buffer.text):
            accept(buffer)
            return
        if buffer.text.endswith("\\") and buffer.cursor_position == len(buffer.text):
            buffer.delete_before_cursor(1)  # the backslash only asked for the next line
        buffer.newline(copy_margin=False)

    @keys.add("escape", "enter")
    def _newline(event: KeyPressEvent) -> None:
        if event.current_buffer.multiline():
            event.current_buffer.newline(copy_margin=False)

    @keys.add("up")
    def _up(event: KeyPressEvent) -> None:
        """On the first line: the older message, its cursor on its first line, so that Up goes on
        through the history instead of through the lines of a tall message (IPython does the same)."""
        buffer = event.current_buffer
        if buffer.document.cursor_position_row > 0:
            buffer.cursor_up(count=event.arg)
            return
        before = buffer.working_index
        buffer.history_backward(count=event.arg)
        if buffer.working_index != before:
            buffer.cursor_position = len(buffer.document.lines[0])

    @keys.add("down")
    def _down(event: KeyPressEvent) -> None:
        """On the last line: the newer message, its cursor at its end, so that Down goes on."""
        buffer = event.current_buffer
        if buffer.document.cursor_position_row < buffer.document.line_count - 1:
            buffer.cursor_down(count=event.arg)
            return
        buffer.history_forward(count=event.arg)
        buffer.cursor_position = len(buffer.text)

    @keys.add("c-o")
    def _editor(event: KeyPressEvent) -> None:
        buffer = event.current_buffer
        if buffer.multiline():
            text = finished(buffer.text)
            let_go(buffer)
            event.app.exit(exception=ToEditor(text))

    @keys.add("c-d")
    def _end(event: KeyPressEvent) -> None:
        buffer = event.current_buffer
        if not buffer.text:
            event.app.exit(exception=EOFError)
        elif buffer.multiline() and "\n" in buffer.text and buffer.cursor_position == len(buffer.text):
            accept(buffer)  # as a terminal's Ctrl-D ends what is typed
        else:
            buffer.delete()

    @keys.add("c-c")
    def _drop(event: KeyPressEvent) -> None:
        buffer = event.current_buffer
        buffer.cursor_position = len(buffer.text)
        buffer.insert_text(INTERRUPTED)  # drawn once more, then dropped with the rest
        let_go(buffer)
        event.app.exit(exception=KeyboardInterrupt)

    return keys
