"""kvchat's line editor at a terminal: prompt_toolkit, bound to kvchat's keys.

The buffer holds the whole message, so a paste, a backslash's next line and
a block are edited as one text and drawn again at every key; a message
taller than the terminal scrolls inside the window instead of being spliced
(readline's fate). Imported only when a person is at a terminal: one-shot
and piped kvchat do not pay for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prompt_toolkit import PromptSession
from prompt_toolkit.completion import CompleteEvent, Completion
from prompt_toolkit.completion import Completer as Base
from prompt_toolkit.document import Document
from prompt_toolkit.formatted_text import ANSI
from prompt_toolkit.history import History as Remembered
from prompt_toolkit.key_binding import KeyBindings, KeyPressEvent
from prompt_toolkit.shortcuts import CompleteStyle

from .history import History
from .lineinput import BLOCK, INTERRUPTED, Completer, ToEditor


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
        self._messages: PromptSession[str] = PromptSession(
            history=_Shared(history) if history is not None else None, completer=_Commands(commands),
            complete_while_typing=False, complete_style=CompleteStyle.READLINE_LIKE, key_bindings=_bindings(),
            multiline=True, enable_suspend=True, prompt_continuation="")
        self._answers: PromptSession[str] = PromptSession(enable_suspend=True, key_bindings=_bindings())

    def message(self, prompt: str, prefill: str | None = None) -> str:
        return finished(self._messages.prompt(ANSI(prompt), default=prefill or ""))

    def ask(self, prompt: str) -> str:
        return self._answers.prompt(ANSI(prompt))


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


def _bindings() -> KeyBindings:
    keys = KeyBindings()

    @keys.add("enter")
    def _enter(event: KeyPressEvent) -> None:
        buffer = event.current_buffer
        if not buffer.multiline() or not continues(buffer.text):
            buffer.validate_and_handle()
            return
        if buffer.text.endswith("\\") and buffer.cursor_position == len(buffer.text):
            buffer.delete_before_cursor(1)  # the backslash only asked for the next line
        buffer.newline(copy_margin=False)

    @keys.add("escape", "enter")
    def _newline(event: KeyPressEvent) -> None:
        if event.current_buffer.multiline():
            event.current_buffer.newline(copy_margin=False)

    @keys.add("c-o")
    def _editor(event: KeyPressEvent) -> None:
        if event.current_buffer.multiline():
            event.app.exit(exception=ToEditor(finished(event.current_buffer.text)))

    @keys.add("c-d")
    def _end(event: KeyPressEvent) -> None:
        buffer = event.current_buffer
        if not buffer.text:
            event.app.exit(exception=EOFError)
        elif buffer.multiline() and "\n" in buffer.text and buffer.cursor_position == len(buffer.text):
            buffer.validate_and_handle()  # as a terminal's Ctrl-D ends what is typed
        else:
            buffer.delete()

    @keys.add("c-c")
    def _drop(event: KeyPressEvent) -> None:
        buffer = event.current_buffer
        buffer.cursor_position = len(buffer.text)
        buffer.insert_text(INTERRUPTED)  # drawn once more, then dropped with the rest
        event.app.exit(exception=KeyboardInterrupt)

    return keys
