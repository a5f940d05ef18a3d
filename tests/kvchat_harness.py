"""Run the real kvchat (tui.cli.run) in a worker thread against an in-process daemon.

Input is a script of lines, typed as a person would; each item may instead be
a callable that runs at that moment (in kvchat's thread) and returns the line.
Everything kvchat prints, prompts included, lands on one recording console of
fixed width, so a test reads the screen as a whole.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
from rich.console import Console
from rich.text import Text

from conftest import RunningDaemon
from daemon.doors.connection import Connection
from daemon.service.control import write_daemon_file
from tui.cli import build_parser, run

Step = str | Callable[[], str]


@dataclass
class Screen:
    code: int
    text: str
    lines: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.lines = [line.rstrip() for line in self.text.splitlines()]

    def after(self, line: str) -> list[str]:
        """The lines after the first one equal to `line`."""
        return self.lines[self.lines.index(line) + 1 :]


class Script:
    def __init__(self, console: Console, steps: Iterable[Step]) -> None:
        self.console = console
        self.steps = list(steps)
        self.prompts: list[str] = []

    def __call__(self, prompt: str) -> str:
        plain = re.sub(r"\x01|\x02|\x1b\[[0-9;]*m", "", prompt)
        self.prompts.append(plain)
        self.console.print(Text(plain), end="", soft_wrap=True)  # as input() shows it
        if not self.steps:
            raise EOFError
        step = self.steps.pop(0)
        return step() if callable(step) else step


async def kvchat(d: RunningDaemon, *flags: str, script: Iterable[Step], width: int = 80) -> Screen:
    """Run kvchat with `flags` (and --data-dir) until the script ends; return what it showed."""
    # As `kvd serve` does: kvchat finds the daemon there.
    write_daemon_file(Path(d.config.data_dir), d.url, d.config.log_path)
    console = Console(width=width, record=True, color_system=None, file=io.StringIO(), highlight=False)
    args = build_parser().parse_args(["--data-dir", str(d.config.data_dir), *flags])
    typed = Script(console, script)
    code = await anyio.to_thread.run_sync(
        lambda: run(args, console, console, read_line=typed, echo=True, signals=False))
    return Screen(code, console.export_text())


def in_loop(fn: Callable[[], Any]) -> Any:
    """From kvchat's thread, run `fn` on the test's event loop (where the daemon lives)."""
    return anyio.from_thread.run_sync(fn)


def newest_connection(d: RunningDaemon, known: set[Connection]) -> Connection:
    (conn,) = [c for c in d.daemon.websocket.connections if c not in known]
    return conn


def tap(conn: Connection, on_event: Callable[[dict[str, Any]], None]) -> None:
    """Call `on_event` with each event the daemon sends on `conn`, after queueing it."""
    conn.watch(on_event)


def data_file(d: RunningDaemon, name: str) -> Path:
    return Path(d.config.data_dir) / name
