"""Reading what the user types, on the main thread.

input() runs on the main thread on purpose: only there does readline give
line editing and history *and* turn Ctrl-C into a KeyboardInterrupt that
clears the line it was editing. (input() on a worker thread leaves readline
holding the half-typed line when Ctrl-C arrives.) The network runs on its own
thread meanwhile (see loop_thread.py).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

try:
    import termios
except ImportError:  # not a POSIX terminal
    termios = None  # type: ignore[assignment]


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
    *,
    echo: bool = False,
) -> str:
    """One message; a line ending in a backslash continues onto the next.

    Ctrl-D on the first line raises EOFError (leave); on a continuation line
    it ends the message. Ctrl-C raises KeyboardInterrupt and drops every line
    typed so far. ``echo`` prints each line after its prompt, for input that
    is piped in and so not echoed by a terminal.
    """
    lines: list[str] = []
    while True:
        try:
            line = read_line(continuation if lines else prompt)
            if echo:
                print(line)
        except EOFError:
            if not lines:
                raise
            print()
            return "\n".join(lines)
        if line.endswith("\\"):
            lines.append(line[:-1])
            continue
        lines.append(line)
        return "\n".join(lines)


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
