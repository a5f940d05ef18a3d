"""Everything kvchat shows, drawn on a given Rich console.

No I/O of its own beyond the console, so tests render on a capture console of
fixed width. Text from the wire (answers, titles, error messages) is
untrusted: it goes through :func:`sanitize` and is printed as ``Text``, never
as markup, so a model can neither drive the terminal nor style itself.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from rich.cells import cell_len
from rich.console import Console
from rich.text import Text

YOU = "you> "
KVD = "kvd> "
CONTINUE = "...> "
YOU_STYLE = "bold green"
KVD_STYLE = "bold cyan"
DIM = "dim"
ERROR_STYLE = "bold red"
TAB = 8

# Terminal escape sequences: CSI, OSC/DCS/SOS/PM/APC strings, two-character escapes.
_ESCAPE = re.compile(
    r"""
      \x1b\[[0-?]*[ -/]*[@-~]                  # CSI: cursor, colours, clear screen
    | \x1b[\]PX^_][^\x07\x1b]*(?:\x07|\x1b\\)  # OSC & co: titles, hyperlinks, clipboard
    | \x1b[ -/]*[0-~]                          # ESC c (reset), ESC 7, charset selection
    | \x9b[0-?]*[ -/]*[@-~]                    # the same as C1 controls
    | [\x90\x98\x9d-\x9f][^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)
    """,
    re.VERBOSE,
)
# What survives is stripped one character at a time: C0 controls but \t and \n,
# DEL, and the C1 controls (U+0080-U+009F; some terminals act on U+009B as CSI).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
# An escape sequence that may still be completed by the next delta.
_UNFINISHED = re.compile(r"\x1b(?:\[[0-?]*[ -/]*|[\]PX^_][^\x07\x1b]*|[ -/]*)?\Z")
_MAX_HELD = 64


def sanitize(text: str) -> str:
    """Model or server text, minus anything a terminal would act on (keeps \\n, \\t)."""
    return _CONTROL.sub("", _ESCAPE.sub("", text))


class StreamSanitizer:
    """:func:`sanitize` for text that arrives in pieces.

    An escape sequence split across two deltas would otherwise lose its ESC in
    the first and leave its tail ("[2J") printed in the second; so an
    unfinished sequence at the end of a piece is held back (a few bytes at
    most) until the next one completes or disproves it.
    """

    def __init__(self) -> None:
        self._held = ""

    def feed(self, piece: str) -> str:
        text = self._held + piece
        self._held = ""
        start = text.rfind("\x1b")
        if start != -1 and len(text) - start <= _MAX_HELD and _UNFINISHED.match(text, start):
            text, self._held = text[:start], text[start:]
        return sanitize(text)

    def flush(self) -> str:
        text, self._held = self._held, ""
        return sanitize(text)


class MessagePrinter:
    """Prints one message after its ``you> ``/``kvd> `` label as it streams in.

    Rich wraps whole renderables, not text that arrives a token at a time, and
    the terminal would break words anywhere; so this keeps its own column and
    breaks lines between words. The word being spelled is held back until it
    is complete (about one token of delay). Leading and trailing blank space
    is dropped; indentation after a newline is kept.
    """

    def __init__(self, console: Console, label: str = KVD, style: str = KVD_STYLE) -> None:
        self._console = console
        self._label = label
        self._style = style
        self._sanitizer = StreamSanitizer()
        self._column = 0
        self._word = ""
        self._spaces = 0
        self._newlines = 0
        self._seen_text = False  # seen anything but blank space yet
        self._out: list[str] = []
        self.started = False

    def start(self) -> None:
        self._console.print(Text(self._label, style=self._style), end="", soft_wrap=True)
        self._column = cell_len(self._label)
        self.started = True

    def feed(self, piece: str) -> None:
        if not self.started:
            self.start()
        for char in self._sanitizer.feed(piece):
            self._take(char)
        self._flush_out()

    def finish(self) -> None:
        """Ends the message with a newline; what was held back is printed.
        Does nothing for a message that never started."""
        if not self.started:
            return
        for char in self._sanitizer.flush():
            self._take(char)
        self._place_word()
        self._out.append("\n")
        self._flush_out()
        self._column = 0

    def _take(self, char: str) -> None:
        if char == "\n":
            self._place_word()
            if self._seen_text:
                self._newlines += 1
            self._spaces = 0
        elif char == " " or char == "\t":
            self._place_word()
            if self._seen_text:
                column = (0 if self._newlines else self._column) + self._spaces
                self._spaces += TAB - column % TAB if char == "\t" else 1
        else:
            self._word += char
            self._seen_text = True
            if cell_len(self._word) > self._width():
                self._place_word()  # wider than the screen: break it, don't wait for its end

    def _place_word(self) -> None:
        if not self._word:
            return
        width = self._width()
        if self._newlines:
            self._out.append("\n" * self._newlines)
            self._newlines = 0
            self._column = 0
        word, self._word = self._word, ""
        fits_a_line = cell_len(word) <= width
        if self._column > 0 and self._column + self._spaces + cell_len(word) > width and fits_a_line:
            self._out.append("\n")
            self._column = 0
        else:
            self._out.append(" " * self._spaces)
            self._column += self._spaces
        self._spaces = 0
        while self._column + cell_len(word) > width:
            head, word = _split_cells(word, width - self._column)
            self._out.append(head + "\n")
            self._column = 0
        self._out.append(word)
        self._column += cell_len(word)

    def _width(self) -> int:
        return max(self._console.width, 8)

    def _flush_out(self) -> None:
        if self._out:
            self._console.print(Text("".join(self._out)), end="", soft_wrap=True)
            self._out.clear()


def _split_cells(word: str, cells: int) -> tuple[str, str]:
    """The longest head of ``word`` that fits in ``cells`` columns (at least one char)."""
    used = 0
    for i, char in enumerate(word):
        used += cell_len(char)
        if used > cells:
            return (word[:i], word[i:]) if i else (word[:1], word[1:])
    return word, ""


def print_message(console: Console, role: str, content: str, status: str = "complete") -> None:
    """One message of a transcript, with a dim note if it did not complete."""
    you = role == "user"
    printer = MessagePrinter(console, YOU if you else KVD, YOU_STYLE if you else KVD_STYLE)
    printer.start()
    printer.feed(content)
    printer.finish()
    if status != "complete":
        console.print(Text(f"({sanitize(status)})", style=DIM), soft_wrap=True)


def print_history(console: Console, messages: Iterable[Mapping[str, Any]]) -> None:
    """A resumed session's transcript, a blank line after each answer as in a live chat."""
    for message in messages:
        role = str(message.get("role", ""))
        print_message(console, role, str(message.get("content", "")), str(message.get("status", "complete")))
        if role != "user":
            console.print()


def status_line(usage: Mapping[str, Any], finish_reason: str | None = None) -> str:
    """``12 tokens · TTFT 35 ms · 210.4 tok/s · 28 cached``, parts the daemon left out omitted."""
    parts = []
    completion = usage.get("completion_tokens")
    if isinstance(completion, int):
        parts.append(f"{completion} token" + ("" if completion == 1 else "s"))
    ttft = usage.get("ttft_ms")
    if isinstance(ttft, (int, float)):
        parts.append(f"TTFT {ttft:.0f} ms")
    tps = usage.get("decode_tps")
    if isinstance(tps, (int, float)):
        parts.append(f"{tps:.1f} tok/s")
    cached = usage.get("cached_tokens")
    if isinstance(cached, int):
        parts.append(f"{cached} cached")
    line = " · ".join(parts)
    if finish_reason in ("cancelled", "length"):
        line = f"{line} ({finish_reason})" if line else f"({finish_reason})"
    return line


def print_status(console: Console, done: Mapping[str, Any]) -> None:
    """The dim line under an answer, from its ``chat.done`` event."""
    usage = done.get("usage")
    reason = done.get("finish_reason")
    line = status_line(usage if isinstance(usage, Mapping) else {}, reason if isinstance(reason, str) else None)
    console.print(Text(line, style=DIM), soft_wrap=True)
    console.print()


def print_header(
    console: Console,
    session: Mapping[str, Any],
    hello: Mapping[str, Any],
    *,
    resumed: bool = False,
) -> None:
    """Title, then session id, model and server, so the id to resume is on screen."""
    title = sanitize(str(session.get("title") or "New chat"))
    console.print(Text(title, style="bold"), soft_wrap=True)
    details = [f"session {sanitize(str(session.get('id', '?')))}"]
    model = hello.get("model")
    if model:
        details.append(f"model {sanitize(str(model))}" + ("" if hello.get("ready", True) else " (loading)"))
    if resumed:
        count = session.get("message_count")
        if isinstance(count, int):
            details.append(f"{count} message" + ("" if count == 1 else "s"))
    server = hello.get("server")
    if server:
        details.append(sanitize(str(server)))
    console.print(Text(" · ".join(details), style=DIM), soft_wrap=True)
    system = session.get("system")
    if system:
        console.print(Text(f"system: {sanitize(str(system))}", style=DIM), soft_wrap=True)
    console.print(Text("/help for commands · Ctrl-C stops an answer · Ctrl-D quits", style=DIM), soft_wrap=True)
    console.print()


def print_error(console: Console, message: str) -> None:
    """One red line; the message itself says what to do."""
    console.print(Text(f"error: {sanitize(message)}", style=ERROR_STYLE), soft_wrap=True)


def print_note(console: Console, message: str) -> None:
    console.print(Text(sanitize(message), style=DIM), soft_wrap=True)


HELP = """\
/help          this list
/quit, /exit   leave (Ctrl-D at an empty prompt too)
Ctrl-C         stop the answer being written; at the prompt, clear the line
\\ at line end  continue the message on the next line
//text         send a message that starts with "/"\
"""


def print_help(console: Console) -> None:
    console.print(Text(HELP), soft_wrap=True)


def prompt(console: Console, label: str, style: str) -> str:
    """The label as a string for input(): styled if the console has colour,
    with readline's \\001/\\002 around escapes so it counts the width right."""
    with console.capture() as capture:
        console.print(Text(label, style=style), end="", soft_wrap=True)
    return re.sub(r"(\x1b\[[0-9;]*m)", "\x01\\1\x02", capture.get())
