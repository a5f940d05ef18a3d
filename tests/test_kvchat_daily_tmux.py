"""kvchat for every day (issue 12), as a person and as a script use it: a real `kvd serve`,
kvchat in tmux for the terminal items, and kvchat as a subprocess for one-shot and pipe modes.

Reuses test_kvchat_tmux's daemon (builtin:tiny, pinned) and panes; screens are
polled under a deadline, never slept on.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import test_kvchat_tmux
from test_kvchat_tmux import Kvd, Pane, has_status_after, is_status, kvchat_command
from tui.client import Client
from tui.discover import locate

# The module-scoped daemon fixture: a module-level name makes it this module's fixture too.
kvd = test_kvchat_tmux.kvd


def request(kvd: Kvd, type_: str, **fields: Any) -> dict[str, Any]:
    """One protocol request to the test daemon, from a client of its own."""

    async def go() -> dict[str, Any]:
        endpoint = locate(data_dir=kvd.data_dir)
        async with await Client.connect(endpoint.url, endpoint.token) as client:
            return await client.request(type_, **fields)

    return asyncio.run(asyncio.wait_for(go(), 60))


def session_of(lines: list[str]) -> str:
    match = re.search(r"session ([0-9a-f]{16})", "\n".join(lines))
    assert match, lines
    return match.group(1)


def messages(kvd: Kvd, sid: str) -> list[dict[str, Any]]:
    return list(request(kvd, "session.get", session=sid)["messages"])


@pytest.fixture
def pane(tmp_path: Path) -> Iterator[Callable[..., Pane]]:
    panes: list[Pane] = []

    def open_(*args: str, env: dict[str, str] | None = None, options: str = "",
              size: tuple[int, int] = (100, 30)) -> Pane:
        prefix = ["env", *(f"{k}={v}" for k, v in (env or {}).items())] if env else []
        p = Pane([*prefix, *kvchat_command(), *args], tmp_path, options=options, size=size)
        panes.append(p)
        return p

    yield open_
    for p in panes:
        p.close()


# -- in tmux -------------------------------------------------------------------


@pytest.mark.tmux
def test_a_bracketed_paste_is_one_message(kvd: Kvd, pane: Callable[..., Pane], tmp_path: Path) -> None:
    p = pane("--data-dir", str(kvd.data_dir), "--new", "--max-tokens", "3")
    lines = p.wait_for_prompt()
    sid = session_of(lines)
    pasted = tmp_path / "pasted.txt"
    pasted.write_text("first line\nsecond line\n\tindented third\n")
    p.tmux("load-buffer", str(pasted))
    p.tmux("paste-buffer", "-p", "-t", "kvchat")  # -p: inside the terminal's bracketed-paste markers
    p.wait_for("the paste on the prompt", lambda lines: "you> first line" in lines and "second line" in lines)
    p.keys("Enter")
    lines = p.wait_for("the answer", lambda lines: any(is_status(line) for line in lines))
    assert len([line for line in lines if is_status(line)]) == 1  # one message, one answer
    got = messages(kvd, sid)
    assert [m["role"] for m in got] == ["user", "assistant"]
    assert got[0]["content"] == "first line\nsecond line\n\tindented third"
    p.wait_for_prompt()
    p.keys("C-d")
    assert p.wait_for_exit() == 0


@pytest.mark.tmux
def test_a_paste_taller_than_the_terminal_is_shown_exactly_once_accepted(
        kvd: Kvd, pane: Callable[..., Pane], tmp_path: Path) -> None:
    """While it is on the prompt the editor shows the paste's end, every row a piece of one paragraph
    (readline spliced rows of two and lost the end); once sent, the message is written whole again."""
    p = pane("--data-dir", str(kvd.data_dir), "--new", "--max-tokens", "3", size=(100, 40))
    sid = session_of(p.wait_for_prompt())
    text = "\n\n".join(f"Paragraph {i}: " + " ".join(f"word{i}_{j}" for j in range(30)) for i in range(14))
    pasted = tmp_path / "tall.txt"
    pasted.write_text(text)
    p.tmux("load-buffer", str(pasted))
    p.tmux("paste-buffer", "-p", "-t", "kvchat")
    wanted = text.split("\n")
    # The editor wraps a row at the width itself, so each screen row is a slice of one paragraph.

    def rows() -> list[str]:  # the screen's non-blank rows, not the scrollback
        shown = p.tmux("capture-pane", "-p", "-J", "-t", "kvchat").splitlines()
        return [row.rstrip().removeprefix("you> ") for row in shown if row.strip()]

    p.wait_for("the paste's end on the prompt", lambda _: wanted[-1].endswith(rows()[-1]))
    on_prompt = rows()
    assert len(on_prompt) >= 20, on_prompt  # the window is full: the paste is taller than it
    assert all(any(row in w for w in wanted) for row in on_prompt), on_prompt  # no row spliced from two
    p.keys("Enter")
    p.wait_for("the answer", lambda lines: any(is_status(line) for line in lines))
    visible = p.tmux("capture-pane", "-p", "-J", "-t", "kvchat").splitlines()  # the screen, not the scrollback
    shown = visible[:next(i for i, line in enumerate(visible) if line.startswith("kvd>"))]
    shown = [line.rstrip() for line in shown if line.strip()]
    assert shown[-1] == wanted[-1], visible
    assert all(line in wanted for line in shown[1:]), visible  # no line spliced from two paragraphs
    assert any(w.endswith(shown[0]) for w in wanted), visible  # the top row may be a paragraph's tail
    assert messages(kvd, sid)[0]["content"] == text
    p.wait_for_prompt()
    p.keys("C-d")
    assert p.wait_for_exit() == 0


@pytest.mark.tmux
def test_the_prompt_edits_a_message_of_many_lines(kvd: Kvd, pane: Callable[..., Pane], tmp_path: Path) -> None:
    """A backslash after a paste, Alt-Enter, a block, Up for a whole earlier message, Ctrl-C and Ctrl-D
    on a message of several lines; the history file keeps each message as one entry."""
    p = pane("--data-dir", str(kvd.data_dir), "--new", "--max-tokens", "3")
    sid = session_of(p.wait_for_prompt())
    answers = 0

    def sent() -> None:
        nonlocal answers
        answers += 1
        p.wait_for(f"answer {answers}", lambda lines: sum(is_status(line) for line in lines) == answers)
        p.wait_for_prompt()

    pasted = tmp_path / "pasted.txt"
    pasted.write_text("pasted one\npasted two")
    p.tmux("load-buffer", str(pasted))
    p.tmux("paste-buffer", "-p", "-t", "kvchat")
    p.type("\\")
    p.wait_for("the backslash's next line", lambda lines: lines[-2:] == ["you> pasted one", "pasted two"])
    p.type("typed after")
    sent()
    p.type("first", enter=False)
    p.keys("M-Enter")
    p.type("second")
    sent()
    for line in ('"""', "in a block", '"""'):
        p.type(line)
    sent()
    p.keys("Up")  # the last message, whole, as it was typed
    p.wait_for("the block recalled", lambda lines: lines[-3:] == ['you> """', "in a block", '"""'])
    p.keys("Enter")
    sent()
    p.type("dropped", enter=False)
    p.keys("M-Enter")
    p.type("too", enter=False)
    p.keys("C-c")
    p.wait_for("the dropped message marked", lambda lines: lines[-3:] == ["you> dropped", "too^C", "you>"])
    p.type("ended", enter=False)
    p.keys("M-Enter")
    p.type("by Ctrl-D", enter=False)
    p.keys("C-d")
    sent()
    got = [m["content"] for m in messages(kvd, sid) if m["role"] == "user"]
    assert got == ["pasted one\npasted two\ntyped after", "first\nsecond", "in a block", "in a block",
                   "ended\nby Ctrl-D"]
    p.keys("C-d")
    assert p.wait_for_exit() == 0
    kept = [json.loads(line) for line in (kvd.data_dir / "kvchat_history").read_text().splitlines()]
    assert kept[-4:] == ["pasted one\npasted two\ntyped after", "first\nsecond", '"""\nin a block\n"""',
                         "ended\nby Ctrl-D"]  # a repeat is kept once; the dropped message is not kept


@pytest.mark.tmux
def test_tab_ctrl_o_and_keys_typed_during_an_answer(kvd: Kvd, pane: Callable[..., Pane], tmp_path: Path) -> None:
    editor = tmp_path / "editor.sh"
    editor.write_text('#!/bin/sh\nprintf "written by the editor\\n" >> "$1"\n')
    editor.chmod(0o755)
    p = pane("--data-dir", str(kvd.data_dir), "--new", "--max-tokens", "200", "--temperature", "0",
             env={"VISUAL": str(editor)})
    sid = session_of(p.wait_for_prompt())
    # Tab completes a /command.
    p.type("/hel", enter=False)
    p.keys("Tab")
    p.wait_for("the completed command", lambda lines: lines[-1:] == ["you> /help"])
    p.keys("Enter")
    p.wait_for("the help", lambda lines: any(line.startswith("/quit, /exit, /bye") for line in lines))
    p.wait_for_prompt()
    # Ctrl-O: what is typed goes to $VISUAL, and what it saved is sent.
    p.type("my draft", enter=False)
    p.keys("C-o")
    lines = p.wait_for("the editor's message answered", lambda lines: "(from the editor)" in lines
                       and any(is_status(line) for line in lines))
    assert lines[lines.index("(from the editor)") + 1 :][:2] == ["my draft", "written by the editor"]
    assert messages(kvd, sid)[0]["content"] == "my draft\nwritten by the editor"
    p.wait_for_prompt()
    # Keys typed while an answer streams appear once, at the next prompt.
    p.type("tell me a story")
    p.wait_for("the story to start", lambda lines: any(line.startswith("kvd> ") for line in lines[-8:]))
    p.type("typed ahead", enter=False)
    lines = p.wait_for("the typed-ahead text at the prompt", lambda lines: lines[-1:] == ["you> typed ahead"])
    assert sum(line.count("typed ahead") for line in lines) == 1
    p.keys("C-u", "C-d")
    assert p.wait_for_exit() == 0


@pytest.mark.tmux
def test_copy_sends_osc52_to_the_terminal(kvd: Kvd, pane: Callable[..., Pane]) -> None:
    # With set-clipboard on, tmux takes an application's OSC 52 into a paste buffer (and passes it on).
    p = pane("--data-dir", str(kvd.data_dir), "--new", "--max-tokens", "12", options="set -g set-clipboard on\n")
    sid = session_of(p.wait_for_prompt())
    p.type("hello")
    p.wait_for("the answer", has_status_after("hello"))
    p.wait_for_prompt()
    p.type("/copy")
    lines = p.wait_for("the copy note", lambda lines: any(line.startswith("copied the last answer") for line in lines))
    answer = messages(kvd, sid)[1]["content"]
    assert p.tmux("show-buffer") == answer
    note = " ".join(lines[next(i for i, line in enumerate(lines) if line.startswith("copied the last answer")):])
    assert f"copied the last answer ({len(answer)} characters) to the clipboard through the terminal (OSC 52)" in note
    assert (kvd.data_dir / "kvchat-copy.txt").read_text() == answer + "\n"
    p.type("/quit")
    assert p.wait_for_exit() == 0


@pytest.mark.tmux
def test_shrinking_the_terminal_mid_answer_leaves_no_stale_lines(kvd: Kvd, pane: Callable[..., Pane]) -> None:
    p = pane("--data-dir", str(kvd.data_dir), "--new", "--max-tokens", "1500", "--temperature", "0", size=(120, 40))
    sid = session_of(p.wait_for_prompt())
    p.type("tell me a story")

    def well_under_way(lines: list[str]) -> bool:
        asked = lines.index("you> tell me a story") if "you> tell me a story" in lines else len(lines)
        return len(lines) - asked > 30

    lines = p.wait_for("a screenful of answer", well_under_way)
    assert not any(is_status(line) for line in lines), "the answer ended before the resize; make it longer"
    p.tmux("resize-window", "-t", "kvchat", "-x", "80", "-y", "24")
    lines = p.wait_for("the answer's end", has_status_after("tell me a story"))
    p.wait_for_prompt()
    lines = p.screen()  # the scrollback included
    asked = lines.index("you> tell me a story")
    status = next(i for i in range(asked, len(lines)) if is_status(lines[i]))
    shown = lines[asked + 1 : status]
    assert [line for line in shown if line.startswith("kvd>")] == [shown[0]]  # one answer, no stale copy
    answer = messages(kvd, sid)[1]["content"]
    assert " ".join(" ".join(shown).removeprefix("kvd>").split()) == " ".join(answer.split())  # no gap, no repeat
    p.keys("C-d")
    assert p.wait_for_exit() == 0


# -- as a script -------------------------------------------------------------------


def kvchat(kvd: Kvd, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*kvchat_command(), "--data-dir", str(kvd.data_dir), *args],
                          input=stdin, stdin=None if stdin is not None else subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=120)


CUT_NOTE = re.compile(r"kvchat: the answer stopped at max_tokens \((\d+) tokens\), cut where it stopped; "
                      r"--max-tokens N allows a longer one( \(--strict exits 3 on this\))?\n")


def quiet_or_cut(result: subprocess.CompletedProcess[str]) -> None:
    """stderr is empty, or says only that the answer stopped at max_tokens."""
    assert result.stderr == "" or CUT_NOTE.fullmatch(result.stderr), result.stderr


def test_one_shot_prints_only_the_answer(kvd: Kvd) -> None:
    result = kvchat(kvd, "--max-tokens", "6", "--temperature", "0", "what is the sea?")
    assert result.returncode == 0
    quiet_or_cut(result)
    newest = request(kvd, "session.list")["sessions"][0]
    assert newest["title"] == "what is the sea?"  # a new session, titled after the question
    answer = messages(kvd, newest["id"])[1]["content"]
    assert result.stdout == answer + "\n"
    # --last goes on in it.
    again = kvchat(kvd, "--last", "--max-tokens", "3", "and then?")
    assert again.returncode == 0
    quiet_or_cut(again)
    got = messages(kvd, newest["id"])
    assert [m["content"] for m in got if m["role"] == "user"] == ["what is the sea?", "and then?"]
    assert again.stdout == got[3]["content"] + "\n"


def test_an_answer_cut_by_max_tokens_says_so_and_strict_exits_3(kvd: Kvd) -> None:
    """`Je su` with exit 0 and no word: now stderr says the answer was cut, and --strict fails."""
    plain = kvchat(kvd, "--max-tokens", "2", "--temperature", "0", "tell me a story")
    assert plain.returncode == 0 and plain.stdout.strip()
    assert CUT_NOTE.fullmatch(plain.stderr) and "(--strict exits 3 on this)" in plain.stderr, plain.stderr
    strict = kvchat(kvd, "--strict", "--json", "--max-tokens", "2", "--temperature", "0", "tell me a story")
    assert strict.returncode == 3, strict
    assert json.loads(strict.stdout)["finish_reason"] == "length"
    assert re.fullmatch(r"kvchat: the answer stopped at max_tokens \(2 tokens\), cut where it stopped; "
                        r"--max-tokens N allows a longer one\n", strict.stderr), strict.stderr


def test_piped_input_is_one_message_and_json_says_it_all(kvd: Kvd) -> None:
    result = kvchat(kvd, "-", "--json", "--max-tokens", "4", "--temperature", "0", "--system", "Be brief.",
                    stdin="line one\nline two\n\nline four\n")
    assert result.returncode == 0
    quiet_or_cut(result)
    out = json.loads(result.stdout)
    assert result.stdout.count("\n") == 1 and set(out) == {"answer", "finish_reason", "usage", "session"}
    got = request(kvd, "session.get", session=out["session"])
    assert got["session"]["system"] == "Be brief."
    assert [m["content"] for m in got["messages"]] == ["line one\nline two\n\nline four", out["answer"]]
    assert out["usage"]["completion_tokens"] <= 4 and out["finish_reason"] in ("stop", "length")
    # stdin that is not a terminal is read without `-`, into the session named.
    piped = kvchat(kvd, "--session", out["session"], "--max-tokens", "2", stdin="more\ntext\n")
    assert piped.returncode == 0
    quiet_or_cut(piped)
    assert messages(kvd, out["session"])[2]["content"] == "more\ntext"


def test_script_errors_go_to_stderr_with_a_non_zero_exit(kvd: Kvd) -> None:
    unknown = kvchat(kvd, "--session", "0" * 16, "hi")
    assert (unknown.returncode, unknown.stdout) == (1, "")
    assert unknown.stderr == "error: no such session; `kvchat` lists them, `--last` continues the most recent\n"
    empty = kvchat(kvd, "-", stdin="")
    assert (empty.returncode, empty.stdout) == (2, "")
    assert empty.stderr == "error: nothing to send: the message is empty (stdin was empty)\n"
    both = kvchat(kvd, "--last", "--system", "x", "hi")
    assert (both.returncode, both.stdout) == (2, "")
    assert both.stderr == ("error: --system and --title set up a new session; with --session or --last, change the "
                           "session's system prompt in kvchat with /system\n")
    # Out of range is unusable input, whichever side checks it: kvchat (0) or the daemon's limit (999999).
    for n in ("0", "999999"):
        assert kvchat(kvd, "--max-tokens", n, "hi").returncode == 2, n
    # --json: the failure as JSON on stdout too, for the script that parses it.
    failed = kvchat(kvd, "--json", "--session", "0" * 16, "hi")
    assert failed.returncode == 1
    assert json.loads(failed.stdout) == {"error": {"message": "no such session; `kvchat` lists them, `--last` "
                                                              "continues the most recent", "code": "unknown_session"},
                                         "exit_status": 1}
    refused = json.loads(kvchat(kvd, "--json", "--max-tokens", "999999", "hi").stdout)
    assert refused["error"]["code"] == "bad_request" and refused["exit_status"] == 2


def test_kvchat_version() -> None:
    version = subprocess.run([*kvchat_command(), "--version"], capture_output=True, text=True, timeout=60)
    assert version.returncode == 0 and version.stdout.startswith("kvchat ")


def test_help_names_every_default_data_dir() -> None:
    result = subprocess.run([*kvchat_command(), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    flat = " ".join(result.stdout.split())
    assert "$KVD_DATA_DIR, else $XDG_DATA_HOME/kvd, else ~/.local/share/kvd" in flat


def test_ctrl_c_stops_a_one_shot_answer_and_keeps_it(kvd: Kvd) -> None:
    import os
    import select
    import signal

    proc = subprocess.Popen([*kvchat_command(), "--data-dir", str(kvd.data_dir), "--max-tokens", "4096",
                             "--temperature", "0", "--title", "interrupted", "tell me a story"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    ready, _, _ = select.select([proc.stdout], [], [], 60)  # the answer has begun
    assert ready, "no answer within 60 s"
    first = os.read(proc.stdout.fileno(), 65536)
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=60)
    assert (proc.returncode, err) == (130, b"")
    sid = next(s["id"] for s in request(kvd, "session.list")["sessions"] if s["title"] == "interrupted")
    answer = messages(kvd, sid)[1]
    assert answer["status"] == "cancelled" and answer["usage"]["completion_tokens"] < 4096
    assert (first + rest).decode() == answer["content"] + "\n"  # what was kept is what was printed


@pytest.mark.tmux
def test_a_60_line_paste_leaves_one_copy_in_the_scrollback(
        kvd: Kvd, pane: Callable[..., Pane], tmp_path: Path) -> None:
    """A paste taller than the terminal, sent: the scrollback holds each of its lines once (it held the
    editor's partial views too: two extra copies of the paste's end)."""
    p = pane("--data-dir", str(kvd.data_dir), "--new", "--max-tokens", "3", size=(120, 40))
    p.wait_for_prompt()
    wanted = [f"log line {i:02d}: the disk on /var filled up at 10:{i:02d}" for i in range(60)]
    pasted = tmp_path / "tall.txt"
    pasted.write_text("\n".join(wanted) + "\n")
    p.tmux("load-buffer", str(pasted))
    p.tmux("paste-buffer", "-p", "-t", "kvchat")
    p.wait_for("the paste on the prompt", lambda lines: any(line.endswith(wanted[-1]) for line in lines))
    p.keys("Enter")
    lines = p.wait_for("the answer", lambda lines: any(is_status(line) for line in lines))
    for w in wanted:
        copies = [line for line in lines if line.endswith(w)]
        assert len(copies) == 1, (w, copies, lines)
    p.wait_for_prompt()
    p.keys("C-d")
    assert p.wait_for_exit() == 0


@pytest.mark.tmux
def test_up_at_the_first_line_of_a_recalled_message_goes_to_older_history(
        kvd: Kvd, pane: Callable[..., Pane]) -> None:
    """Up recalls a message of many lines with the cursor on its first line, so the next Up goes on to the
    message before it (as IPython does), not through the recalled message's lines."""
    p = pane("--data-dir", str(kvd.data_dir), "--new", "--max-tokens", "3")
    p.wait_for_prompt()
    answers = 0

    def send(*rows: str) -> None:
        nonlocal answers
        for i, row in enumerate(rows):
            p.type(row, enter=False)
            if i < len(rows) - 1:
                p.keys("M-Enter")
        p.keys("Enter")
        answers += 1
        p.wait_for(f"answer {answers}", lambda lines: sum(is_status(line) for line in lines) == answers)
        p.wait_for_prompt()

    send("the older one")
    send(*[f"row {i}" for i in range(8)])
    p.keys("Up")
    p.wait_for("the tall message recalled", lambda lines: lines[-8:] == ["you> row 0", *[f"row {i}" for i in
                                                                                       range(1, 8)]])
    p.keys("Up")
    p.wait_for("the older message", lambda lines: lines[-1] == "you> the older one")
    p.keys("Down")  # and back: the tall one again, cursor at its end, so Down goes on to the empty prompt
    p.wait_for("the tall message again", lambda lines: lines[-1] == "row 7")
    p.keys("Down")
    p.wait_for("the empty prompt", lambda lines: lines[-1] == "you>")
    p.keys("C-d")
    assert p.wait_for_exit() == 0


def test_piped_text_and_a_question_travel_together(kvd: Kvd) -> None:
    """`printf 'a\\nb\\n' | kvchat --json "Summarize this."` stored only the question: the piped text went
    nowhere. Now it is sent first, then a blank line and the question (llm's order), titled by the question."""
    result = kvchat(kvd, "--json", "--max-tokens", "2", "Summarize this.", stdin="line one\nline two\n")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    got = request(kvd, "session.get", session=out["session"])
    assert got["messages"][0]["content"] == "line one\nline two\n\nSummarize this."
    assert got["session"]["title"] == "Summarize this."


@pytest.mark.tmux
def test_a_paste_past_the_limit_is_not_echoed_whole_and_questions_wrap_at_words(
        kvd: Kvd, pane: Callable[..., Pane], tmp_path: Path) -> None:
    """At 40 columns: a 33,000-character paste was written back whole before kvd refused it (the refusal
    scrolled away under it); prompt_toolkit broke a y/N question mid-word."""
    title = "A rather long title for a trip to Lisbon in the spring"
    p = pane("--data-dir", str(kvd.data_dir), "--new", "--max-tokens", "2", "--title", title, size=(40, 30))
    p.wait_for_prompt()
    rows = [f"paste row {i:03d} " + "x" * 68 for i in range(400)]
    pasted = tmp_path / "huge.txt"
    pasted.write_text("\n".join(rows))
    p.tmux("load-buffer", str(pasted))
    p.tmux("paste-buffer", "-p", "-t", "kvchat")
    p.wait_for("the paste on the prompt", lambda lines: any(rows[-1][-20:] in line for line in lines), timeout=60)
    p.keys("Enter")
    lines = p.wait_for("the refusal", lambda lines: any("longer than 32000" in line for line in lines), timeout=60)
    p.wait_for_prompt()
    assert sum("paste row" in line for line in p.screen()) <= 10, lines  # its first lines, then its size
    assert any(line.startswith("… (33,199 characters, 400 lines in all;") for line in lines), lines
    p.type("/delete")
    question = f"delete '{title}'? [y/N]"
    shown = p.wait_for("the question", lambda lines: lines[-1].endswith("[y/N]"))
    start = max(i for i, line in enumerate(shown) if line.startswith("delete '"))
    assert " ".join(shown[start:]) == question, shown[start:]  # broken between words, never inside one
    assert all(len(line) <= 40 for line in shown[start:]), shown[start:]
    p.type("n")
    p.wait_for("kept", lambda lines: lines[-2:] == ["kept", "you>"])
    p.keys("C-d")
    assert p.wait_for_exit() == 0
