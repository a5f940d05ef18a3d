"""Streaming Markdown: finished blocks printed once, the tail live, and it all adds up to the whole."""

from __future__ import annotations

import io
import random
from typing import Any

import pytest
from rich.console import Console, NewLine
from rich.control import Control
from rich.text import Text

from tui import render
from tui.answer import AnswerPrinter, render_answer, split_finished

CODE = "\n".join(f"    total += step({i})  # line {i}" for i in range(30))
ANSWER = f"""# Caches

A KV cache keeps the keys and values of every token the model has read, so the
next turn only reads **what is new**. Here is how `kvd` does it, step by step.

1. keep the cache resident
2. page it out when idle

   with a second paragraph in the item

- warm snapshots
- disk segments

```python
def restore(session):
    total = 0
{CODE}
    return total
```
Right after the fence, a line that wraps because it is long enough to wrap.

---

| tier | cost |
|------|------|
| resident | none |
| disk | a read |

> A quote
> on two lines.

    an indented block

    that continues after a blank line

Setext heading
--------------

The end, with a [link](https://example.com/kvd) and ~~strikethrough~~."""


def whole(text: str, width: int = 60) -> str:
    console = Console(width=width, record=True, color_system=None, file=io.StringIO())
    console.print(render_answer(text, Text(render.KVD, style=render.KVD_STYLE)))
    return console.export_text()


def stream(text: str, sizes: random.Random, console: Console) -> AnswerPrinter:
    printer = render.answer_printer(console)
    printer.start()
    i = 0
    while i < len(text):
        n = sizes.randint(1, 9)
        printer.feed(text[i : i + n])
        i += n
    printer.finish()
    return printer


@pytest.mark.parametrize("seed", range(8))
def test_streamed_answer_equals_the_whole_rendered_at_once(seed: int) -> None:
    console = Console(width=60, record=True, color_system=None, file=io.StringIO())
    printer = stream(ANSWER, random.Random(seed), console)
    assert console.export_text() == whole(ANSWER)
    assert printer.text == ANSWER


class PermanentOnly(Console):
    """A terminal console that also keeps, apart, only what was printed for good (not the live region)."""

    def __init__(self) -> None:
        super().__init__(width=60, height=12, force_terminal=True, color_system=None, file=io.StringIO())
        self.kept = Console(width=60, record=True, color_system=None, file=io.StringIO())
        self.prints = 0

    def print(self, *objects: Any, **kwargs: Any) -> None:
        # Live prints Control() to refresh and a NewLine that a transient Live takes back on stop.
        if objects and not isinstance(objects[0], (Control, NewLine)):
            self.prints += 1
            self.kept.print(*objects, **kwargs)
        super().print(*objects, **kwargs)


def test_on_a_terminal_each_block_is_printed_once_and_the_live_tail_fits_the_screen() -> None:
    console = PermanentOnly()
    printer = render.answer_printer(console)
    printer.start()
    tallest = 0
    for i in range(0, len(ANSWER), 5):
        printer.feed(ANSWER[i : i + 5])
        # What the live region shows now: never taller than the screen.
        live = console.render_lines(printer._live.renderable, pad=False) if printer._live else []
        tallest = max(tallest, len(live))
    printer.finish()
    assert printer._live is None  # the terminal is given back
    assert 12 < len(whole(ANSWER).splitlines())  # the answer is taller than the screen...
    assert 0 < tallest <= 11  # ...its live tail never is (the long code block is cropped to its end)
    assert console.kept.export_text() == whole(ANSWER)
    # Printed block by block as they finished, not all at the end.
    assert console.prints > 10


@pytest.mark.parametrize(
    "text, finished, rest",
    [
        ("Para", [], "Para"),
        ("Para\n", [], "Para\n"),  # the next line may continue it
        ("Para\n\nNext", ["Para"], "\nNext"),
        ("# Head\nx", ["# Head"], "x"),  # a heading cannot grow
        ("```py\ncode\n", [], "```py\ncode\n"),  # an open fence waits
        ("```py\ncode\n```\nafter", ["```py\ncode\n```"], "after"),
        ("- a\n\n", [], "- a\n\n"),  # a list may go on after a blank line
        ("- a\n\n- b\n\nText\n", ["- a\n\n- b\n"], "Text\n"),  # (a list's lines include the blank after it)
        ("---\n", ["---"], ""),
    ],
)
def test_blocks_are_finished_when_nothing_later_can_change_them(text: str, finished: list[str], rest: str) -> None:
    blocks, left = split_finished(text)
    assert [b.source for b in blocks] == finished
    assert left == rest


def test_a_rule_after_a_paragraph_is_not_taken_for_a_heading() -> None:
    """A block is rendered with the text that was between it and the block before."""
    text = "Para\n\n---\n\nMore"
    console = Console(width=60, record=True, color_system=None, file=io.StringIO())
    stream(text, random.Random(1), console)
    shown = console.export_text()
    assert shown == whole(text)
    assert "-----" in shown


def test_code_is_highlighted_on_a_colour_terminal() -> None:
    console = Console(width=60, force_terminal=True, color_system="truecolor", file=io.StringIO())
    printer = render.answer_printer(console)
    printer.start()
    printer.feed("```python\ndef f():\n    return 1\n```\n")
    printer.finish()
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert "\x1b[38;2;" in out  # the lexer's colours (monokai), not plain text


def test_a_long_unfinished_code_block_is_previewed_by_its_end() -> None:
    """Highlighting hundreds of lines ten times a second would starve the screen: the live tail shows the end."""
    code = "```python\n" + "\n".join(f"x{i} = compute({i})" for i in range(400)) + "\n"
    console = PermanentOnly()
    printer = render.answer_printer(console)
    printer.start()
    printer.feed("Here it is:\n\n")
    printer.feed(code)
    assert printer._live is not None
    live = ["".join(seg.text for seg in line).rstrip()
            for line in console.render_lines(printer._live.renderable, pad=False)]
    assert printer.previewing and len(live) <= 11
    assert live[0].strip() == "…" and "x399 = compute(399)" in live[-1]  # code blocks have no padding rows
    printer.feed("```\n\nDone.")
    printer.finish()
    assert console.kept.export_text() == whole("Here it is:\n\n" + code + "```\n\nDone.")


PLAIN = ("A paragraph with no markup at all runs on and on, as a small model's answers do; "
         "its words wrap greedily, so every line but the last two is printed for good while it streams. " * 12)


@pytest.mark.parametrize("seed", range(4))
def test_a_long_plain_paragraph_is_printed_as_it_streams_with_a_short_live_region(seed: int) -> None:
    text = "First, a short one.\n\n" + PLAIN.strip() + "\n\nThen **bold** text\n\n" + PLAIN.strip() + " The end."
    console = PermanentOnly()
    printer = render.answer_printer(console)
    printer.start()
    sizes = random.Random(seed)
    tallest = printed_while_streaming = 0
    i = 0
    while i < len(text):
        n = sizes.randint(1, 9)
        printer.feed(text[i : i + n])
        i += n
        live = console.render_lines(printer._live.renderable, pad=False) if printer._live else []
        if i > len(text) // 2:
            tallest = max(tallest, len(live))
        printed_while_streaming = console.prints
    printer.finish()
    assert console.kept.export_text() == whole(text)  # exactly what rendering it whole gives
    assert tallest <= 3  # the long paragraph's live part: its last lines only
    assert printed_while_streaming > 20  # its lines were printed as it went, not at its end


def test_a_long_prefill_shows_its_progress_where_the_answer_begins() -> None:
    console = PermanentOnly()
    printer = render.answer_printer(console)
    printer.start()

    def live() -> list[str]:
        assert printer._live is not None
        return ["".join(seg.text for seg in line).rstrip()
                for line in console.render_lines(printer._live.renderable, pad=False)]

    printer.progress(512, 5120, now=100.0)
    assert live() == ["kvd> reading 512/5120 tokens"]
    printer.progress(1536, 5120, now=101.0)  # 1024 tokens a second: 3.5 s to go
    assert live() == ["kvd> reading 1536/5120 tokens, about 4 s left"]
    printer.progress(5000, 5120, now=104.4)
    assert live() == ["kvd> reading 5000/5120 tokens, almost done"]
    printer.feed("The answer")
    assert live() == ["kvd> The answer"]  # the first delta takes its place
    printer.finish()
    assert console.kept.export_text() == whole("The answer")


def test_the_live_region_is_erased_by_the_rows_the_terminal_rewrapped_it_into() -> None:
    from tui.live import ReflowingRender, terminal_reflows

    console = Console(width=120, height=40, force_terminal=True, color_system=None, file=io.StringIO())
    lines = Text("\n".join(["x" * 119, "y" * 80, "z" * 10]))
    reflowing = ReflowingRender(lines, console, reflow=True)
    cutting = ReflowingRender(lines, console, reflow=False)
    for live in (reflowing, cutting):
        list(console.render(live))
    assert reflowing.rows() == cutting.rows() == 3
    console.size = (80, 24)  # narrowed: 119 columns take two rows, 80 and 10 one each
    assert reflowing.rows() == 4 and cutting.rows() == 3
    assert reflowing.position_cursor().segment.text == "\r\x1b[2K" + "\x1b[1A\x1b[2K" * 3
    assert terminal_reflows({"TMUX": "/tmp/tmux-0/default,1,0", "TERM": "screen"})
    assert terminal_reflows({"TERM": "xterm-256color", "VTE_VERSION": "7600"})
    assert not terminal_reflows({"TERM": "xterm", "XTERM_VERSION": "XTerm(379)"})
    assert not terminal_reflows({"TERM": "linux"})


def test_a_redraw_never_comes_between_what_the_printer_prints_and_its_erase(monkeypatch: pytest.MonkeyPatch) -> None:
    # Rich redraws the live tail from its own thread. A print above it (here a
    # finished paragraph) collects its erase, renders, then writes; a redraw
    # written in between made that erase count rows that were no longer the
    # region: a line shown twice or one written over (tmux under load).
    import threading

    from tui import answer

    out = io.StringIO()
    console = Console(width=60, height=20, force_terminal=True, color_system=None, file=out)
    printer = AnswerPrinter(console, "kvd> ", "bold")
    printer.feed("The first")
    printing, go_on = threading.Event(), threading.Event()
    feeding = threading.Thread(target=printer.feed, args=(" paragraph.\n\nThe second",))
    render = answer.Labelled.__rich_console__

    def held_mid_print(self: answer.Labelled, console: Console, options: Any) -> Any:
        if threading.current_thread() is feeding:  # the print, not the redraw
            printing.set()
            assert go_on.wait(30)
        return render(self, console, options)

    monkeypatch.setattr(answer.Labelled, "__rich_console__", held_mid_print)
    feeding.start()
    assert printing.wait(30)
    assert printer._live is not None
    redraw = threading.Thread(target=printer._live.refresh)
    redraw.start()
    redraw.join(timeout=1)
    still_waiting = redraw.is_alive()
    go_on.set()
    feeding.join(30)
    redraw.join(30)
    printer.finish()
    assert still_waiting, "a redraw ran while the printer was printing"
