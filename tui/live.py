"""The live part of a streamed answer, kept erasable when the terminal is resized.

A region drawn in place (Rich's Live) is erased by moving the cursor up as
many rows as it took. Two things break that when the terminal shrinks
mid-answer: rows pushed off the top into the scrollback can no longer be
reached, and a terminal that reflows (tmux, VTE, iTerm2, kitty, Windows
Terminal) rewraps each line that is now too wide into several rows. What is
left behind stays in the scrollback as stale lines. So the region is kept
small (:func:`live_rows`; answer.py prints finished blocks and the settled
lines of a plain paragraph for good) and erased counting rewrapped rows
(:class:`ReflowingRender`). Measured in tmux, 120x40 to 80x24 mid-answer:
stale lines when erasing by Rich's count, none with this one
(tests/test_kvchat_daily_tmux.py fails with ``reflow=False``).

Rich redraws the region from a thread of its own while the printer prints
above it from the main thread: :class:`AnswerLive` makes them take turns.

One race is the terminal's: a redraw written but not yet read when the
terminal reflows is drawn at the new width with its erase counted at the old
one. tmux reflows at once and tells the program (SIGWINCH) a moment later, so
a resize on a machine under heavy load can still leave a stale row.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from threading import RLock

from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
from rich.control import Control
from rich.live import Live
from rich.live_render import LiveRender
from rich.segment import ControlType, Segment


def terminal_reflows(env: Mapping[str, str]) -> bool:
    """Whether the terminal rewraps lines when it narrows (most do), from what it puts in the environment.

    Inside tmux, tmux is the terminal (it reflows). xterm (XTERM_VERSION), the
    Linux console, st, rxvt and GNU screen cut lines instead; counting rows
    for those as if rewrapped would erase lines above the live region.
    """
    if env.get("TMUX"):
        return True
    term = env.get("TERM", "")
    cuts = term == "linux" or term == "st" or term.startswith(("st-", "rxvt"))
    return not (env.get("XTERM_VERSION") or env.get("STY") or cuts)


def live_rows(height: int) -> int:
    """Rows the live tail may take: a quarter of the screen.

    Not more, so that the terminal shrinking mid-answer (120x40 to 80x24:
    each row may wrap into two, and the top rows go to the scrollback) keeps
    the whole live region on screen, where it can still be erased; rows
    pushed into the scrollback could not be, and would stay there as stale
    lines. Finished blocks are printed for good as they end, so only an
    unfinished block is cropped to this.
    """
    return max(height // 4, 3)


class ReflowingRender(LiveRender):
    """Rich's live region, erased right after the terminal narrowed.

    Rich moves the cursor up as many rows as it drew. A terminal that
    reflows on resize (tmux, VTE, iTerm2, kitty, Windows Terminal) has
    rewrapped each drawn line that is now too wide into several rows, so
    that count would leave the rest on screen, and later in the scrollback.
    This counts the rows each drawn line takes at the terminal's width when
    the erase is rendered (not when it is asked for: a resize can come in
    between).
    """

    def __init__(self, renderable: RenderableType, console: Console, *, reflow: bool | None = None) -> None:
        super().__init__(renderable)
        self.console = console
        self.reflow = terminal_reflows(os.environ) if reflow is None else reflow
        self._widths: list[int] = []

    def rows(self) -> int:
        if not self.reflow:  # narrowed lines were cut, not rewrapped: one row each, as Rich counts
            return len(self._widths)
        width = max(self.console.size.width, 1)
        return sum(max(1, -(-w // width)) for w in self._widths)

    def position_cursor(self) -> Control:
        return _Erase(self, keep_line=True) if self._shape is not None else Control()

    def restore_cursor(self) -> Control:
        return _Erase(self, keep_line=False) if self._shape is not None else Control()

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        segments = [s for s in super().__rich_console__(console, options) if isinstance(s, Segment)]
        self._widths = [Segment.get_line_length(line) for line in Segment.split_lines(segments)] or [0]
        yield from segments


class _Erase(Control):
    """The cursor moved to the live region's start, its rows erased: counted when it is rendered."""

    def __init__(self, live: ReflowingRender, *, keep_line: bool) -> None:
        # Control.__init__ would render the codes now; they are made in `segment`, when needed.
        self.live = live
        self.keep_line = keep_line  # position_cursor stays on the region's first row; restore_cursor goes above it

    @property
    def segment(self) -> Segment:  # type: ignore[override]  # Control sets it in __init__; here it is computed
        rows = self.live.rows()
        up = ((ControlType.CURSOR_UP, 1), (ControlType.ERASE_IN_LINE, 2))
        if self.keep_line:
            return Control(ControlType.CARRIAGE_RETURN, (ControlType.ERASE_IN_LINE, 2), *up * (rows - 1)).segment
        return Control(ControlType.CARRIAGE_RETURN, *up * rows).segment


class AnswerLive(Live):
    """Rich's Live drawn by a :class:`ReflowingRender`, with the lock its redraws take.

    Rich's refresh thread redraws the region holding the Live's lock. A
    ``console.print`` from another thread takes that lock only to collect the
    erase, then renders and writes without it, so a redraw written in between
    leaves the print erasing rows that are no longer the region: a line shown
    twice, or one written over (seen in tmux under load, no resize needed).
    Whoever prints above the region, or changes what the region shows, holds
    :attr:`lock` for the whole of it.
    """

    def __init__(self, renderable: RenderableType, console: Console, *, refresh_per_second: float) -> None:
        super().__init__(renderable, console=console, transient=True, auto_refresh=True,
                         refresh_per_second=refresh_per_second, redirect_stdout=False, redirect_stderr=False)
        # Rich keeps no public door for this; Live reads the attribute on every refresh.
        self._live_render = ReflowingRender(self.get_renderable(), console)

    @property
    def lock(self) -> RLock:
        return self._lock
