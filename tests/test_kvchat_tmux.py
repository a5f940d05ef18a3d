"""The real kvchat against a real `kvd serve`: in tmux, as a person uses it.

A module-scoped daemon subprocess serves builtin:tiny on port 0. Each tmux
test runs kvchat on its own tmux server and reads the screen with
capture-pane, polling for a condition under a deadline (never sleeping for
it). Without tmux these tests fail: `make test` installs it.
"""

from __future__ import annotations

import asyncio
import os
import queue
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from daemonproc import DaemonProcess
from tui.client import Client, ServerError
from tui.discover import locate

REPO = Path(__file__).resolve().parent.parent
START_TIMEOUT = 60.0  # the daemon's first start writes builtin:tiny
SCREEN_TIMEOUT = 30.0
EXITED_TEXT = "[kvchat exited with status "
EXITED = re.compile(re.escape(EXITED_TEXT) + r"(\d+)\]$")
STATUS = re.compile(r"^\d+ tokens? · TTFT \d+ ms · [\d.]+ tok/s · (draft \d+/\d+ kept · )?"
                    r"cache: (resident|warm|disk|none)")


@dataclass
class Kvd:
    url: str
    data_dir: Path
    process: subprocess.Popen[str]
    stderr: list[str] = field(default_factory=list)


def _drain(stream: Iterable[str], lines: queue.Queue[str | None], keep: list[str]) -> None:
    """Read the daemon's stderr to the end, so it never blocks on a full pipe."""
    for line in stream:
        keep.append(line)
        lines.put(line)
    lines.put(None)


@pytest.fixture(scope="module")
def kvd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kvd]:
    data_dir = tmp_path_factory.mktemp("kvd")
    process = subprocess.Popen(
        [sys.executable, "-m", "daemon.cli", "serve", "--port", "0", "--data-dir", str(data_dir),
         "--model", "builtin:tiny"],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()
    stderr: list[str] = []
    reader = threading.Thread(target=_drain, args=(process.stderr, lines, stderr), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + START_TIMEOUT
        url = None
        while url is None:
            remaining = deadline - time.monotonic()
            try:
                line = lines.get(timeout=max(remaining, 0))
            except queue.Empty:
                pytest.fail(f"kvd serve did not say 'listening on' within {START_TIMEOUT:.0f} s:\n{''.join(stderr)}")
            if line is None:
                pytest.fail(f"kvd serve exited with {process.wait()} before listening:\n{''.join(stderr)}")
            if "listening on" in line and (match := re.search(r"ws://\S+", line)):
                url = match.group(0)
        yield Kvd(url=url, data_dir=data_dir, process=process, stderr=stderr)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        reader.join(timeout=10)


def kvchat_command() -> list[str]:
    """The installed console script next to this interpreter, as a user runs it."""
    script = Path(sys.executable).parent / "kvchat"
    return [str(script)] if script.exists() else [sys.executable, "-m", "tui.cli"]


# -- tmux ----------------------------------------------------------------------

# kvchat in a pane gets the terminal's size from the terminal, as at a person's
# shell. pytest imports readline at start, and GNU readline then sets COLUMNS=80
# and LINES=24 in this process's C environment, which a child inherits (not in
# os.environ); Rich takes those as a fixed size, so kvchat would draw 80x24 in
# any pane and never see a resize. The tmux server gets os.environ without them.
TERMINAL_ENV = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}


class Pane:
    """kvchat in a detached tmux session on a private tmux server."""

    def __init__(self, command: list[str], workdir: Path, *, options: str = "",
                 size: tuple[int, int] = (100, 30)) -> None:
        if shutil.which("tmux") is None:
            pytest.fail("tmux is not installed; `make test` installs it (scripts/sysdeps.sh), or: apt-get install tmux")
        self.socket = f"kvchat-test-{uuid.uuid4().hex[:12]}"
        config = workdir / f"{self.socket}.conf"
        config.write_text("set -g remain-on-exit on\nset -g history-limit 10000\n" + options)
        # The exit status comes from a wrapper shell, not from #{pane_dead_status}:
        # tmux 3.3a sometimes leaves the exited pane process unreaped, status unknown.
        # The wrapper ignores SIGINT so Ctrl-C reaches kvchat alone (kvchat
        # installs its own handler, which replaces the inherited "ignore").
        wrapper = f'trap "" INT; "$@"; echo "{EXITED_TEXT}$?]"'
        self._tmux(
            "-f", str(config), "new-session", "-d", "-x", str(size[0]), "-y", str(size[1]), "-s", "kvchat",
            shlex.join(["sh", "-c", wrapper, "sh", *command]),
        )

    def tmux(self, *args: str) -> str:
        """Any tmux command on this pane's server (paste-buffer, resize-window, show-buffer)."""
        return self._tmux(*args)

    def _tmux(self, *args: str) -> str:
        result = subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, timeout=10,
                                env=TERMINAL_ENV)
        assert result.returncode == 0, f"tmux {' '.join(args)}: {result.stderr}"
        return result.stdout

    def screen(self) -> list[str]:
        """Every line kvchat printed so far, scrollback included, right-trimmed."""
        text = self._tmux("capture-pane", "-p", "-J", "-S", "-", "-t", "kvchat")
        lines = [line.rstrip() for line in text.splitlines()]
        while lines and not lines[-1]:
            lines.pop()
        return lines

    def type(self, text: str, *, enter: bool = True) -> None:
        self._tmux("send-keys", "-t", "kvchat", "-l", text)
        if enter:
            self.keys("Enter")

    def keys(self, *keys: str) -> None:
        self._tmux("send-keys", "-t", "kvchat", *keys)

    def wait_for(self, what: str, check: Callable[[list[str]], bool], timeout: float = SCREEN_TIMEOUT) -> list[str]:
        """Poll the screen until ``check`` holds; fail with the screen if it never does."""
        deadline = time.monotonic() + timeout
        while True:
            lines = self.screen()
            if check(lines):
                return lines
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}; the screen:\n" + "\n".join(lines))
            time.sleep(0.05)  # poll interval, not synchronisation: the deadline bounds the wait

    def wait_for_prompt(self) -> list[str]:
        return self.wait_for("the prompt", lambda lines: lines[-1:] == ["you>"])

    def wait_for_exit(self) -> int:
        """kvchat's exit status, as the wrapper shell printed it."""
        lines = self.wait_for("kvchat to exit", lambda lines: any(EXITED.match(line) for line in lines))
        return next(int(m.group(1)) for line in lines if (m := EXITED.match(line)))

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=10)


@pytest.fixture
def open_pane(tmp_path: Path) -> Iterator[Callable[..., Pane]]:
    panes: list[Pane] = []

    def open_(*args: str) -> Pane:
        pane = Pane([*kvchat_command(), *args], tmp_path)
        panes.append(pane)
        return pane

    yield open_
    for pane in panes:
        pane.close()


def is_status(line: str) -> bool:
    return bool(re.match(r"^\d+ tokens?( · |$)", line))


def answer_to(lines: list[str], question: str) -> tuple[str, str]:
    """The answer printed after ``you> question`` and the status line under it."""
    asked = max(i for i, line in enumerate(lines) if line == f"you> {question}")
    assert lines[asked + 1].startswith("kvd> "), lines[asked:]
    status = next(i for i in range(asked + 1, len(lines)) if is_status(lines[i]))
    answer = "\n".join([lines[asked + 1][len("kvd> ") :], *lines[asked + 2 : status]])
    return answer, status_at(lines, status)


STATUS_PART = re.compile(r"(TTFT \d|[\d.]+ tok/s|draft \d|cache: |re-read \d|\d+(/\d+)? ctx|\((cancelled|length)\))")


def status_at(lines: list[str], i: int) -> str:
    """The status line starting at lines[i], whole: kvchat breaks a long one between its parts."""
    end = i + 1
    while end < len(lines) and STATUS_PART.match(lines[end]):
        end += 1
    return " · ".join(lines[i:end])


def answer_started(question: str) -> Callable[[list[str]], bool]:
    def check(lines: list[str]) -> bool:
        asked = [i for i, line in enumerate(lines) if line == f"you> {question}"]
        return bool(asked) and any(re.match(r"kvd> \S", line) for line in lines[asked[-1] :])

    return check


def has_status_after(question: str) -> Callable[[list[str]], bool]:
    def check(lines: list[str]) -> bool:
        asked = [i for i, line in enumerate(lines) if line == f"you> {question}"]
        return bool(asked) and any(is_status(line) for line in lines[asked[-1] :])

    return check


# -- tmux tests ----------------------------------------------------------------


@pytest.mark.tmux
def test_chat_in_tmux(kvd: Kvd, open_pane: Callable[..., Pane]) -> None:
    pane = open_pane("--data-dir", str(kvd.data_dir), "--title", "tmux chat")
    lines = pane.wait_for_prompt()
    assert lines[0] == "tmux chat"
    assert re.match(r"session [0-9a-f]{16} · model builtin:tiny", lines[1]), lines

    pane.type("Tell me about the sea")
    lines = pane.wait_for("the status line", has_status_after("Tell me about the sea"))
    answer, status = answer_to(lines, "Tell me about the sea")
    assert re.search(r"\w", answer), lines
    assert STATUS.match(status), status
    pane.wait_for_prompt()

    # Ctrl-C at the prompt drops the half-typed line; the next command runs alone.
    pane.type("half typed", enter=False)
    pane.wait_for("the typed text", lambda lines: lines[-1:] == ["you> half typed"])  # read: ^C would flush it
    pane.keys("C-c")
    pane.wait_for("the line cleared", lambda lines: lines[-2:] == ["you> half typed^C", "you>"])
    pane.type("/nonsense")
    pane.wait_for("a hint", lambda lines: any(line.startswith("unknown command /nonsense") for line in lines))
    pane.type("/help")
    pane.wait_for("the help", lambda lines: any(line.startswith("/quit, /exit") for line in lines))
    pane.type("/quit")
    assert pane.wait_for_exit() == 0


@pytest.mark.tmux
def test_ctrl_c_cancels_the_answer_and_kvchat_goes_on(kvd: Kvd, open_pane: Callable[..., Pane]) -> None:
    # Greedy "tell me a story" on builtin:tiny runs past 1500 tokens: seconds of streaming to interrupt.
    pane = open_pane("--data-dir", str(kvd.data_dir), "--new", "--temperature", "0", "--max-tokens", "4096")
    pane.wait_for_prompt()
    pane.type("tell me a story")
    pane.wait_for("the answer to start", answer_started("tell me a story"))
    pane.keys("C-c")
    lines = pane.wait_for("the status line", has_status_after("tell me a story"))
    answer, status = answer_to(lines, "tell me a story")
    assert status.endswith("(cancelled)"), status
    assert int(status.split()[0]) < 4096
    assert "^C" not in answer  # Ctrl-C is not echoed into the answer

    pane.wait_for_prompt()
    pane.type("and again")  # the session was not left busy, and Ctrl-C works twice
    pane.wait_for("the second answer", answer_started("and again"))
    pane.keys("C-c")
    lines = pane.wait_for("the second status line", has_status_after("and again"))
    assert answer_to(lines, "and again")[1].endswith("(cancelled)")
    pane.wait_for_prompt()
    pane.keys("C-d")
    assert pane.wait_for_exit() == 0


@pytest.mark.tmux
def test_resume_shows_the_history(kvd: Kvd, open_pane: Callable[..., Pane]) -> None:
    first = open_pane("--data-dir", str(kvd.data_dir), "--title", "resume me", "--max-tokens", "20")
    first.wait_for_prompt()
    first.type("remember this, \\", enter=True)
    # The backslash asked for the next line: it goes, the message stays on the prompt, the cursor moves on.
    first.wait_for("the next line", lambda lines: lines[-1:] == ["you> remember this,"])
    first.type("please")
    first.wait_for("the status line", lambda lines: any(is_status(line) for line in lines))
    first.wait_for_prompt()
    first.type("/exit")
    assert first.wait_for_exit() == 0

    again = open_pane("--data-dir", str(kvd.data_dir), "--last")
    lines = again.wait_for_prompt()
    assert lines[0] == "resume me"
    assert "2 messages" in lines[1]
    asked = lines.index("you> remember this,")
    assert lines[asked + 1] == "     please"
    assert lines[asked + 2].startswith("kvd> ")
    again.keys("C-d")
    assert again.wait_for_exit() == 0


@pytest.mark.tmux
def test_a_day_with_kvchat_across_a_daemon_restart(tmp_path: Path, open_pane: Callable[..., Pane]) -> None:
    """Start, ask, cancel with Ctrl-C, /regen, /export, quit; restart kvd; `kvchat --last`, ask again."""
    data = tmp_path / "kvd"
    daemon = DaemonProcess(data)
    try:
        pane = open_pane("--data-dir", str(data), "--new", "--title", "a day")
        lines = pane.wait_for_prompt()
        assert lines[0] == "a day" and re.match(r"session [0-9a-f]{16} · model builtin:tiny", lines[1])
        sid = re.search(r"[0-9a-f]{16}", lines[1]).group(0)  # type: ignore[union-attr]

        # Greedy from the start: the story below follows from this answer, so it must not be sampled.
        pane.type("/params temperature=0")
        pane.wait_for("greedy", lambda lines: "session params: temperature=0.0" in lines)
        pane.type("Tell me about the sea")
        lines = pane.wait_for("the first answer", has_status_after("Tell me about the sea"))
        assert STATUS.match(answer_to(lines, "Tell me about the sea")[1])
        pane.wait_for_prompt()

        # Greedy with room for 4096 tokens, a story runs long enough to interrupt.
        pane.type("/params temperature=0 max_tokens=4096")
        pane.wait_for("the params", lambda lines: "session params: temperature=0.0 max_tokens=4096" in lines)
        pane.type("tell me a story")
        pane.wait_for("the story to start", answer_started("tell me a story"))
        pane.keys("C-c")
        lines = pane.wait_for("the cancelled story's status", has_status_after("tell me a story"))
        status = answer_to(lines, "tell me a story")[1]
        assert status.endswith("(cancelled)"), status
        pane.wait_for_prompt()

        pane.type("/params max_tokens=12")
        pane.wait_for("the shorter limit", lambda lines: "session params: temperature=0.0 max_tokens=12" in lines)
        pane.type("/regen")
        lines = pane.wait_for("the new answer", has_status_after("/regen"))
        after = lines[lines.index("(a new answer to your last message)") + 1 :]
        assert after[0].startswith("kvd> ")
        regen_status = next(line for line in after if is_status(line))
        assert regen_status.startswith("12 tokens") and "cache: resident" in regen_status
        pane.wait_for_prompt()

        export = tmp_path / "a-day.md"
        pane.type(f"/export {export}")
        pane.wait_for("the export", lambda lines: f"exported 4 messages to {export}" in lines)
        text = export.read_text()
        assert text.startswith("# a day\n") and text.count("## You") == 2 and text.count("## kvd") == 2
        assert "tell me a story" in text

        pane.type("/quit")
        assert pane.wait_for_exit() == 0
        assert daemon.terminate() == 0
        daemon = DaemonProcess(data)  # a new process, on a new port

        again = open_pane("--data-dir", str(data), "--last")
        lines = again.wait_for_prompt()
        assert lines[0] == "a day" and sid in lines[1] and "4 messages" in lines[1]
        assert "you> Tell me about the sea" in lines and "you> tell me a story" in lines
        again.type("And after the restart?")
        lines = again.wait_for("the answer after the restart", has_status_after("And after the restart?"))
        status = answer_to(lines, "And after the restart?")[1]
        assert re.search(r"cache: disk \d+ tok in [\d.]+ ms", status), status
        again.keys("C-d")
        assert again.wait_for_exit() == 0
    finally:
        daemon.terminate()


@pytest.mark.tmux
def test_daemon_restart_mid_answer_is_followed_and_told(tmp_path: Path, open_pane: Callable[..., Pane]) -> None:
    """The connection drops mid-answer: kvchat reconnects to the new daemon and says the answer was cut off."""
    data = tmp_path / "kvd"
    daemon = DaemonProcess(data)
    try:
        pane = open_pane("--data-dir", str(data), "--new", "--temperature", "0", "--max-tokens", "4096")
        pane.wait_for_prompt()
        pane.type("tell me a story")
        pane.wait_for("the story to start", answer_started("tell me a story"))
        assert daemon.terminate() == 0  # SIGTERM: the answer is stopped and kept as far as it got
        pane.wait_for("the reconnect note", lambda lines: "connection lost; reconnecting…" in lines)
        daemon = DaemonProcess(data)
        lines = pane.wait_for("the answer's end", has_status_after("tell me a story"))
        # The notes are never printed inside the answer (they were, between its printed lines and its live
        # tail): "reconnecting…" showed below the live text while it lasted, and the rest is said after it.
        story, status = answer_to(lines, "tell me a story")
        assert "reconnect" not in story, story
        assert status.endswith("(cancelled)")
        said = lines.index("the connection to kvd dropped mid-answer; kvchat reconnected")
        assert is_status(lines[said - 1]) or STATUS_PART.match(lines[said - 1]), lines[said - 1]  # after the status
        assert lines[said + 1] == ("kvd stopped while writing this answer (it was restarted?), so it is cut off; "
                                   "/regen writes it again"), lines[said:]
        pane.wait_for_prompt()
        with daemon.client() as c:
            sid = c.request("session.list")["sessions"][0]["id"]
            kept = c.request("session.get", session=sid)["messages"][1]["content"]
        assert " ".join(story.split()) == " ".join(kept.split())  # the whole kept answer, once
        pane.keys("C-d")
        assert pane.wait_for_exit() == 0
    finally:
        daemon.terminate()


# -- without tmux ------------------------------------------------------------------


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_no_daemon_says_how_to_start_it(tmp_path: Path) -> None:
    url = f"ws://127.0.0.1:{closed_port()}/v1"
    result = subprocess.run(
        [*kvchat_command(), "--url", url, "--data-dir", str(tmp_path)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1, result
    # The hint names the data directory kvchat was given: the daemon must use the same one.
    assert f"nothing answers at {url}: kvd is not running there; start it with `kvd serve --data-dir {tmp_path}`" \
        in result.stderr


def test_a_wrong_url_names_where_kvd_runs(kvd: Kvd) -> None:
    """kvd runs, the typed URL is wrong: say so, name the URL from the data directory, and do not
    tell the user to start a kvd that is already running."""
    url = f"ws://127.0.0.1:{closed_port()}/v1"
    result = subprocess.run([*kvchat_command(), "--url", url, "--data-dir", str(kvd.data_dir), "hello"],
                            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result
    assert f"nothing answers at {url}; kvd runs at {kvd.url} (from {kvd.data_dir / 'daemon.json'})" \
        in result.stderr, result.stderr
    assert "start it" not in result.stderr
    status = subprocess.run([sys.executable, "-m", "daemon.cli", "status", "--url", url, "--data-dir",
                             str(kvd.data_dir)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert status.returncode == 1
    lines = status.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvd status: nothing answers at {url}; kvd runs at {kvd.url}"), \
        status.stderr  # one line, and none of the running daemon's log


def test_a_one_shot_cut_by_a_dead_kvd_ends_its_line_and_names_this_daemon(tmp_path: Path) -> None:
    """`kvd` killed mid-answer: the error was printed on the answer's last line (`…went saiderror: lost the
    connection`), and said `kvd serve --port N` without the data dir this kvd ran on (issue 44, item 6)."""
    data = tmp_path / "kvd"
    daemon = DaemonProcess(data)
    try:
        one = subprocess.Popen([*kvchat_command(), "--data-dir", str(data), "--max-tokens", "4000", "--temperature",
                                "0", "tell me a long story"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
        assert one.stdout is not None
        got = one.stdout.read(1)  # the answer has begun: kvd is mid-answer
        daemon.kill()
        out, err = one.communicate(timeout=60)
    finally:
        if daemon.proc.poll() is None:
            daemon.kill()
    answer, said = (got + out).decode(), err.decode()
    assert one.returncode == 1 and answer.strip(), (answer, said)
    assert answer.endswith("\n"), answer[-200:]  # the error goes on a line of its own
    port = daemon.url.split(":")[-1].split("/")[0]
    assert re.fullmatch(rf"error: lost the connection to kvd at {re.escape(daemon.url)} \(.*\); if it stopped, "
                        rf"start it with `kvd serve --data-dir {re.escape(str(data))} --port {port}`\n", said), said


def test_no_daemon_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tui.cli import main

    url = f"ws://127.0.0.1:{closed_port()}/v1"
    assert main(["--url", url, "--data-dir", str(tmp_path)]) == 1
    assert f"nothing answers at {url}" in capsys.readouterr().err


def test_wrong_or_missing_token_says_which_file(kvd: Kvd, tmp_path: Path) -> None:
    wrong = tmp_path / "wrong-token"
    wrong.write_text("not-the-token\n")
    result = subprocess.run(
        [*kvchat_command(), "--url", kvd.url, "--token-file", str(wrong)],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 1
    assert f"the daemon refused the token in {wrong}" in result.stderr

    result = subprocess.run(
        [*kvchat_command(), "--url", kvd.url, "--data-dir", str(tmp_path / "empty")],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 1
    assert f"no token at {tmp_path / 'empty' / 'token'}" in result.stderr
    assert "kvd serve" in result.stderr


def test_client_routes_events_by_request_id(kvd: Kvd) -> None:
    """A cancel sent on the same connection mid-stream gets its own reply."""

    async def scenario() -> None:
        endpoint = locate(data_dir=kvd.data_dir)
        assert endpoint.url == kvd.url  # found through daemon.json
        async with await Client.connect(endpoint.url, endpoint.token) as client:
            assert client.hello["model"] == "builtin:tiny"
            session = (await client.request("session.create", title="client"))["session"]
            events = []
            async for event in client.stream(
                "chat.send", session=session["id"], text="hello", max_tokens=4096, temperature=0
            ):
                events.append(event)
                if event["type"] == "chat.delta" and event["seq"] == 0:
                    assert (await client.request("chat.cancel", session=session["id"]))["type"] == "ok"
            assert [e["type"] for e in events[:2]] == ["chat.start", "chat.delta"]
            assert events[-1]["type"] == "chat.done" and events[-1]["finish_reason"] == "cancelled"
            assert len({e["id"] for e in events}) == 1
            with pytest.raises(ServerError) as info:
                await client.request("session.get", session="0" * 16)
            assert info.value.code == "unknown_session"
            assert client.statistics().pending == 0

    asyncio.run(asyncio.wait_for(scenario(), 60))



def test_no_daemon_json_names_no_port(tmp_path: Path) -> None:
    """With no daemon.json kvchat's URL is a guess: the message names the data directory, not a port."""
    result = subprocess.run([*kvchat_command(), "--data-dir", str(tmp_path), "hi"], stdin=subprocess.DEVNULL,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr == (f"error: kvd is not running for {tmp_path} (it has no daemon.json); start it with "
                             f"`kvd serve --data-dir {tmp_path}` (or `make serve` in its source tree)\n")


def test_a_daemon_that_does_not_come_back_is_named_where_it_was(tmp_path: Path) -> None:
    """kvchat, whose kvd ran on another port, said `kvd at ws://127.0.0.1:8765/v1 did not come back`: a stopped
    kvd removes its daemon.json, and kvchat fell back to the default URL. It names where kvd was, and how to
    start it there (data dir and port)."""
    from daemonproc import DaemonProcess
    from tui.errors import GaveUp
    from tui.link import Link

    data_dir = tmp_path / "kvd"
    data_dir.mkdir()
    d = DaemonProcess(data_dir)
    port = int(d.url.rsplit(":", 1)[1].split("/")[0])

    async def go() -> str:
        link = Link(data_dir=data_dir, reconnect_for=0.5)
        await link.connect()
        assert await asyncio.to_thread(d.terminate) == 0
        try:
            with pytest.raises(GaveUp) as gave_up:
                await link.reconnect()
        finally:
            await link.close()
        return str(gave_up.value)

    said = asyncio.run(go())
    assert said.startswith(f"kvd at {d.url} did not come back within 0.5 s ("), said
    assert f"start it with `kvd serve --data-dir {data_dir} --port {port}`" in said, said
