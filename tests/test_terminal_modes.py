"""kvchat's terminal modes, on a real pseudo-terminal: what a Ctrl-C mid-answer does to the screen."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import select
import sys
import termios
import time
from collections.abc import Iterator

import pytest
from rich.console import Console

from tui.lineinput import Input, echo_off, quiet_terminal

HELD_READ = 4096  # what the terminal's side of a pty holds ready to read; the rest waits in a queue
READ_TIMEOUT = 5.0


@pytest.fixture
def terminal(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[int, int]]:
    """A pty whose slave is kvchat's stdin (not this process's controlling terminal: no SIGINT comes)."""
    master, slave = pty.openpty()
    stdin = open(slave, closefd=False)  # noqa: SIM115  # closed below, with the fds
    monkeypatch.setattr(sys, "stdin", stdin)
    try:
        yield master, slave
    finally:
        stdin.close()
        os.close(master)
        os.close(slave)


def fill(fd: int) -> int:
    """Write to the terminal until it takes no more (nobody reads it); how many bytes it took."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_NONBLOCK)
    written = 0
    try:
        while True:
            written += os.write(fd, b"x" * 1024)
    except BlockingIOError:
        return written
    finally:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)


def read_all(fd: int, want: int) -> bytes:
    """What the terminal gets to read, up to `want` bytes (less if the rest never comes)."""
    got = b""
    deadline = time.monotonic() + READ_TIMEOUT
    while len(got) < want and (left := deadline - time.monotonic()) > 0:
        if select.select([fd], [], [], left)[0]:
            got += os.read(fd, 65536)
    return got


def test_ctrl_c_while_an_answer_streams_keeps_what_was_printed(terminal: tuple[int, int]) -> None:
    """Ctrl-C flushes the terminal's queues unless NOFLSH: the answer's unread lines would vanish."""
    master, slave = terminal
    before = termios.tcgetattr(slave)
    with echo_off():
        lflag = termios.tcgetattr(slave)[3]
        assert lflag & termios.NOFLSH and not lflag & termios.ECHO
        written = fill(slave)  # an answer printed faster than the terminal reads it
        assert written > HELD_READ  # some of it still in the kernel's queue, not yet the terminal's to read
        os.write(master, b"\x03next\n")  # Ctrl-C, then a line: read back, it says the Ctrl-C was taken
        assert os.read(slave, 100) == b"next\n"
        assert read_all(master, written) == b"x" * written
    assert termios.tcgetattr(slave) == before


def test_between_prompts_nothing_is_flushed_and_a_prompt_is_as_the_terminal_was(terminal: tuple[int, int]) -> None:
    """Between prompts echo is off and NOFLSH on; reading a line turns echo on and NOFLSH off."""
    _, slave = terminal
    before = termios.tcgetattr(slave)
    seen: list[int] = []

    def read_line(prompt: str) -> str:
        seen.append(termios.tcgetattr(slave)[3])
        return "hello"

    with quiet_terminal():
        assert termios.tcgetattr(slave)[3] & termios.NOFLSH
        assert Input(Console(file=io.StringIO()), read_line=read_line).message("you> ", "...> ") == "hello"
        assert termios.tcgetattr(slave)[3] & termios.NOFLSH
    assert seen and seen[0] & termios.ECHO and not seen[0] & termios.NOFLSH
    assert termios.tcgetattr(slave) == before
