"""An answer rendered as Markdown while it streams.

Rich renders Markdown as a whole, and a `Live` region that grows past the
screen height can no longer be redrawn: the terminal has scrolled its top away,
so each refresh would print it again. So the answer is split into top-level
Markdown blocks as it arrives; a block that nothing later can change is printed
once, for good, and only the unfinished tail is live (cropped to a quarter of
the screen, so a resize cannot push it out of reach: see live.py). A long plain
paragraph (no inline markup) is printed line by line as it settles: greedy
wrapping never changes a line once another follows it.

Code blocks are printed from column 0 (no label indent, no padding), so code
copied from the screen runs.

The pieces add up to exactly what rendering the whole answer at once gives.
Rich renders top-level blocks one after another, and the only state one passes
to the next is whether a blank line goes before it: none after a rule, one
after anything else (a container's own items can decide it for themselves).
So each block is rendered behind a one-line stand-in for the block before it
("---" after a rule, a word otherwise), and the lines past the stand-in's are
printed. The stand-in keeps that cheap however long the previous block was.

The live tail is a preview: past a few thousand characters only its end is
rendered (a code fence keeps its opening line, so it stays code), because
rendering a long code block with highlighting takes long enough to starve
the refresh. What is printed for good is always rendered in full.

A block is finished when a later block has begun, or when it cannot grow: a
heading, a rule, a closed code fence, or a paragraph, table or quote followed
by a blank line. Lists and indented code wait for the next block (a blank line
does not end them). Only complete lines are considered. (One thing cannot
stream: a link reference definition that comes after the link it defines; the
link is printed before the definition arrives, as plain text.)
"""

from __future__ import annotations

import re
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

from markdown_it import MarkdownIt
from markdown_it.token import Token
from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
from rich.markdown import CodeBlock, Markdown
from rich.segment import Segment
from rich.style import Style
from rich.syntax import Syntax
from rich.text import Text

from .estimate import PrefillClock
from .live import AnswerLive, live_rows
from .sanitize import StreamSanitizer

CODE_THEME = "monokai"
MIN_WIDTH = 10
REFRESH_PER_SECOND = 10
PREVIEW_CHARS = 4000  # past this, the live tail renders only its end

Lines = list[list[Segment]]

KEEP_LIVE = 2  # lines of an unfinished plain paragraph kept live (its last one can still change)
# Plain paragraph text: no character that starts inline markup, every line beginning with a letter.
_PLAIN = re.compile(r"\n*[^\W\d_](?:[^*_`\[\]~<>\\&#|=+{}\n]|\n(?=[^\W\d_]))*", re.DOTALL)
_WORD = re.compile(r"\S+")

# The parser rich.markdown.Markdown uses, so blocks split where Rich's would.
_PARSER = MarkdownIt().enable("strikethrough").enable("table")
_OPENING_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_CLOSING_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*$")
_GROWS_UNTIL_BLANK = {"paragraph_open", "table_open", "blockquote_open"}
_CANNOT_GROW = {"heading_open", "hr"}


@dataclass(frozen=True)
class MarkdownBlock:
    source: str  # the block's own lines
    kind: str  # its first markdown-it token's type: "paragraph_open", "fence", "hr", …


# Marks the first segment of a top-level code block's lines: Labelled prints them from column 0.
CODE_LINE = Style(meta={"kvchat": "code"})


class _CodeBlock(CodeBlock):
    """A code block without Rich's padding, each line marked, so it is printed without indent:
    copied from the screen, it runs (no label indent, no padding column, no blank padding rows)."""

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        syntax = Syntax(str(self.text).rstrip(), self.lexer_name, theme=self.theme, word_wrap=True, padding=0)
        for line in console.render_lines(syntax, options, pad=False):
            yield Segment("", CODE_LINE)
            yield from line
            yield Segment.line()


class _Markdown(Markdown):
    """Rich's Markdown, but a single newline stays a line break: models mean one (a poem's lines, an
    address, JSON outside a fence), where CommonMark would join the lines with a space.

    And no text is hidden: Rich drops HTML (an inline tag renders as nothing, an HTML block as an empty
    element), so an answer of `</strong>` 197 times showed an empty `kvd>` for 80 s. Inline HTML is
    shown as the text it is, an HTML block as code (it is markup the model wrote, not a paragraph).
    """

    elements = {**Markdown.elements, "fence": _CodeBlock, "code_block": _CodeBlock}

    def __init__(self, markup: str, **options: Any) -> None:
        super().__init__(markup, **options)
        for block in self.parsed:
            if block.type == "html_block":
                block.type = "code_block"
            for token in block.children or ():
                if token.type == "softbreak":
                    token.type = "hardbreak"
                elif token.type == "html_inline":
                    token.type = "text"


def markdown(source: str) -> Markdown:
    """How kvchat renders model text. Links show their address: a model cannot disguise one."""
    return _Markdown(source, code_theme=CODE_THEME, hyperlinks=False)


def is_code(line: list[Segment]) -> bool:
    return bool(line) and line[0].style is CODE_LINE


def split_finished(text: str) -> tuple[list[MarkdownBlock], str]:
    """The finished top-level blocks at the start of `text`, and the rest (unfinished)."""
    end = text.rfind("\n")
    if end < 0:
        return [], text
    lines = text[:end].split("\n")  # the complete lines
    starts = [t for t in _PARSER.parse(text[: end + 1]) if t.level == 0 and t.nesting >= 0 and t.map]
    finished: list[MarkdownBlock] = []
    cut = 0  # lines consumed by finished blocks
    for i, token in enumerate(starts):
        assert token.map is not None
        first, last = token.map
        if i + 1 == len(starts) and not _cannot_grow(token, lines):
            break
        finished.append(MarkdownBlock("\n".join(lines[first:last]), token.type))
        cut = last
    if not finished:
        return [], text
    return finished, "".join(line + "\n" for line in lines[cut:]) + text[end + 1:]


def _cannot_grow(token: Token, lines: list[str]) -> bool:
    assert token.map is not None
    first, last = token.map
    if token.type in _CANNOT_GROW:
        return True
    if token.type == "fence":
        return last - first >= 2 and bool(_CLOSING_FENCE.match(lines[last - 1]))
    if token.type in _GROWS_UNTIL_BLANK:
        return any(not line.strip() for line in lines[last:])
    return False


def stand_in(kind: str | None) -> str:
    """One line that leaves Rich in the state a block of this kind leaves it in ("" for none)."""
    if kind is None:
        return ""
    return "---" if kind == "hr" else "x"


def after(console: Console, kind: str | None, source: str, width: int) -> Lines:
    """The lines `source` renders to when it follows a block of `kind` (None: it comes first)."""
    context = stand_in(kind)
    if not context:
        return render_lines(console, source, width)
    skip = len(render_lines(console, context, width))
    return render_lines(console, context + "\n\n" + source, width)[skip:]


def preview(source: str, room: int) -> str:
    """The end of a long unfinished tail, enough to fill `room` lines (exact when short)."""
    if len(source) <= PREVIEW_CHARS:
        return source
    lines = source.split("\n")
    first = next((line for line in lines if line.strip()), "")
    fence = _OPENING_FENCE.match(first)
    kept = lines[-room:]
    text = "\n".join(kept)
    if len(text) > PREVIEW_CHARS:  # a long paragraph: its last words, from a word boundary
        text = text[-PREVIEW_CHARS:]
        text = text[text.find(" ") + 1 :] if " " in text else text
    if fence and (len(kept) < len(lines) or len(text) < len("\n".join(kept))):
        text = first + "\n" + text
    return text


class Labelled:
    """Lines indented by the label's width, the label on the first line of the answer.

    Blank lines stay empty (no indent), so nothing ends in stray spaces. A
    top-level code block's lines start at column 0 (the label, if the answer
    starts with one, gets a line of its own).
    """

    def __init__(self, lines: Lines, label: Text | None, indent: int) -> None:
        self.lines = lines
        self.label = label
        self.indent = indent

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        for i, line in enumerate(self.lines):
            code = is_code(line)
            if i == 0 and self.label is not None:
                label = self.label.copy()
                if code or not Segment.get_line_length(line):
                    label.rstrip()
                yield from label.render(console)
                if code:
                    yield Segment.line()
            elif Segment.get_line_length(line) and not code:
                yield Segment(" " * self.indent)
            yield from line
            yield Segment.line()


class _Answer:
    """A whole answer at once: what a streamed one adds up to."""

    def __init__(self, text: str, label: Text) -> None:
        self.text = text
        self.label = label

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        lines = render_lines(console, self.text, options.max_width - self.label.cell_len) or [[]]
        yield Labelled(lines, self.label, self.label.cell_len)


def render_answer(text: str, label: Text) -> RenderableType:
    return _Answer(text, label)


def render_lines(console: Console, source: str, width: int) -> Lines:
    options = console.options.update(width=max(width, MIN_WIDTH), height=None)
    return [_rstrip(line) for line in console.render_lines(markdown(source), options, pad=False)]


def _rstrip(line: list[Segment]) -> list[Segment]:
    """Drop the spaces Rich pads a line with, unless they paint a background (code blocks)."""
    line = list(line)
    while line:
        text, style, control = line[-1]
        if control or (style is not None and style.bgcolor is not None):
            break
        stripped = text.rstrip(" ")
        if stripped:
            line[-1] = Segment(stripped, style)
            break
        line.pop()
    return line


class _Tail:
    """The live part: a preview of the unfinished text, cropped to its last screenful."""

    def __init__(self, printer: AnswerPrinter) -> None:
        self.printer = printer

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        room = live_rows(console.size.height)
        if self.printer.reading is not None and not self.printer.text:
            line = [Segment(self.printer.reading, console.get_style("dim"))]
            yield Labelled([line], self.printer.label, self.printer.label.cell_len)
            return
        waiting = self.printer.waiting
        lines = self.printer.tail_lines(room=room - (waiting is not None))
        cropped = len(lines) > room or self.printer.previewing
        if len(lines) > room:
            lines = lines[-room:]
        if cropped and lines:
            lines[0] = [Segment("…", console.get_style("dim"))]
        yield Labelled(lines, self.printer.label if self.printer.lines_printed == 0 else None,
                       self.printer.label.cell_len)
        if waiting is not None:  # below the text, never inside it, at the margin as kvchat's notes are
            yield Text(waiting, style="dim")


class AnswerPrinter:
    """Prints one streamed answer after its label: finished blocks once, the tail live.

    `start()` (on chat.start; not before, so a refused request shows only its
    error), `feed()` each delta, `finish()` at the end, in a `finally`: it
    prints the tail for good and gives the terminal back. On a console that is
    not a terminal there is no live region; the tail is printed at the end.
    """

    def __init__(self, console: Console, label: str, style: str) -> None:
        self.console = console
        self.label = Text(label, style=style)
        self.started = False
        self.text = ""  # everything received so far, sanitized
        self.lines_printed = 0
        self.previewing = False  # the live tail shows only the end of a long unfinished block
        self._sanitizer = StreamSanitizer()
        self._pending = ""  # the text after the last printed block
        self._last: str | None = None  # the kind of the last printed block
        self._continued = False  # _pending is the rest of a paragraph whose first lines are printed
        self._live: AnswerLive | None = None
        self.reading: str | None = None  # how far kvd has read the prompt, until the answer begins
        self.waiting: str | None = None  # a state shown below the live text while it lasts ("reconnecting…")
        self.clock = PrefillClock()  # kvchat hands each answer the same one: earlier reads inform the estimate
        self._reading = False

    @property
    def width(self) -> int:
        return self.console.width - self.label.cell_len

    def start(self) -> None:
        if self.started:
            return
        self.started = True
        if self.console.is_terminal:
            self._live = AnswerLive(_Tail(self), self.console, refresh_per_second=REFRESH_PER_SECOND)
            self._live.start()

    def feed(self, piece: str) -> None:
        self.start()
        with self._drawing():
            self._take(piece)

    def _drawing(self) -> AbstractContextManager[object]:
        """Held while the printer prints or changes what the live tail shows: no redraw comes between."""
        return self._live.lock if self._live is not None else nullcontext()

    def _take(self, piece: str) -> None:
        clean = self._sanitizer.feed(piece)
        if not clean:
            return
        self.text += clean
        pending = self._pending + clean
        if "\n" not in clean:
            self._pending = pending
            self._print_stable_lines()
            return
        blocks, rest = split_finished(pending)
        for block in blocks:
            self._print(self._render(block.source))
            self._last, self._continued = block.kind, False
        self._pending = rest
        self._print_stable_lines()

    def _render(self, source: str) -> Lines:
        if self._continued:
            return render_lines(self.console, source, self.width)
        return after(self.console, self._last, source, self.width)

    def _print_stable_lines(self) -> None:
        """Print the first lines of a long unfinished plain paragraph for good, keeping KEEP_LIVE live.

        Word wrapping is greedy, so a plain paragraph's lines but its last
        never change as words are added, and the rest, rendered from a line
        start, wraps as it would have. Plain means nothing inline that a
        later character could restyle (emphasis, code, links, escapes) and
        every line starting with a letter (no list or heading can begin).
        This keeps the live region a few rows high, so a terminal resized
        mid-answer can still erase it.
        """
        pending = self._pending
        if len(pending) < 2 * self.width or not _PLAIN.fullmatch(pending):
            return
        words = list(_WORD.finditer(pending))
        if any(len(w.group()) >= self.width for w in words):
            return
        lines = self._render(pending)
        stable = len(lines) - KEEP_LIVE
        if stable <= 0:
            return
        shown = " ".join("".join(seg.text for seg in line) for line in lines[:stable]).split()
        if not shown or len(shown) >= len(words) or words[len(shown) - 1].group() != shown[-1]:
            return  # not the words as written: keep it live
        rest = pending[words[len(shown) - 1].end():].lstrip()
        if not rest[:1].isalpha():
            return
        self._print(lines[:stable])
        self._pending, self._continued = rest, True

    def progress(self, fed: int, total: int, now: float) -> None:
        """kvd is reading a long prompt (chat.progress): shown where the answer will begin.

        The estimate is estimate.py's: this read's chunks so far, and the
        last reads', with a token's cost growing with its position. A console
        that is not a terminal says it once.
        """
        if not self._reading:
            self._reading = True
            self.clock.start()
            if self._live is None:
                self.note(f"(kvd is reading {total} tokens of history…)")
        self.clock.observe(fed, now)
        text = f"reading {fed}/{total} tokens"
        left = self.clock.seconds_left(fed, total)
        if left is not None:
            text += f", about {left:.0f} s left" if left >= 1 else ", almost done"
        self.reading = text

    def note(self, message: str) -> None:
        """A dim line above the live tail, kept. Once text shows it lands inside the answer: `wait` then."""
        with self._drawing():
            self.console.print(Text(message, style="dim"), soft_wrap=True)

    def wait(self, state: str | None) -> None:
        """`state` below the live text while it lasts (None: over); not a terminal: nothing (said after)."""
        with self._drawing():
            self.waiting = state

    def finish(self, *, label: bool = True) -> None:
        """Print what is left and end the live region; nothing for an answer that never started, and
        without `label` nothing for one that got no text (a refusal after chat.start: its error says it)."""
        if not self.started:
            return
        held = self._sanitizer.flush()
        self.text += held
        self._pending += held
        self.waiting = None
        if self._live is not None:
            self._live.stop()
            self._live = None
        lines = self.tail_lines()
        if self.lines_printed == 0 and not lines and label:
            lines = [[]]  # an empty answer still shows its label
        self._print(lines)
        self._pending, self._continued = "", False
        self.started = False

    def tail_lines(self, *, room: int | None = None) -> Lines:
        """The lines the unfinished text adds after what was printed (a preview, given the room)."""
        pending = self._pending
        if room is not None:
            shown = preview(pending, room)
            self.previewing = shown is not pending
            pending = shown
        if (self._last is not None or self._continued) and not pending.strip():
            return []
        return self._render(pending)

    def _print(self, lines: Lines) -> None:
        if not lines:
            return
        label = self.label if self.lines_printed == 0 else None
        self.console.print(Labelled(lines, label, self.label.cell_len), soft_wrap=True)
        self.lines_printed += len(lines)
