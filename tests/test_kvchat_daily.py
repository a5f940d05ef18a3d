"""kvchat for every day (issue 12), through the real tui code against an in-process daemon.

Paste, the editor, /copy, the context on the status line, a long prefill's
progress, a full session and /compact, ollama's habits, and the bugs a day
of use found. builtin:tiny is pinned: these tests are about kvchat, not a model.
The terminal-only parts (bracketed paste, Tab, echo, OSC 52, resize) are in
test_kvchat_daily_tmux.py.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any

import anyio.from_thread
import anyio.to_thread
import pytest
from rich.console import Console

from conftest import client, running_daemon
from kvchat_harness import Screen, data_file, kvchat
from test_kvchat_commands import answer_lines, make_session, transcript
from tui import compact
from tui.lineinput import Completer

pytestmark = pytest.mark.anyio

MODEL = "builtin:tiny"
CTX = re.compile(r" · (\d+)/8192 ctx")


def session_id(screen: Screen) -> str:
    ids: list[str] = re.findall(r"session ([0-9a-f]{16})", screen.text)
    return ids[-1]


async def test_a_paste_is_one_message(tmp_path: Path) -> None:
    pasted = "def f(x):\n\treturn x + 1\n\nprint(f(1))"
    async with running_daemon(tmp_path, model=MODEL) as d:
        # Read line by line (as the tests script kvchat), a paste is one line holding its newlines.
        screen = await kvchat(d, "--new", "--max-tokens", "3", script=[pasted + "\n", "/quit"])
        got = await transcript(d, session_id(screen))
    assert [m["role"] for m in got["messages"]] == ["user", "assistant"]  # one message, one answer
    assert got["messages"][0]["content"] == pasted
    assert len([line for line in screen.lines if re.match(r"^\d+ tokens? · ", line)]) == 1


async def test_a_pasted_path_is_a_message_and_a_pasted_command_still_runs(tmp_path: Path) -> None:
    async with running_daemon(tmp_path, model=MODEL) as d:
        screen = await kvchat(d, "--new", "--max-tokens", "2", script=[
            "/usr/lib/x.so: cannot open\nwhat does this mean?", "/rename Pasted\n", "/quit"])
        got = await transcript(d, session_id(screen))
    assert got["messages"][0]["content"] == "/usr/lib/x.so: cannot open\nwhat does this mean?"
    assert "renamed to 'Pasted'" in screen.lines


@pytest.fixture
def editor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """$VISUAL: a script that appends a known line to the file it is given, and logs what it found."""
    script = tmp_path / "fake-editor"
    script.write_text('#!/bin/sh\ncat "$1" >> "$0.seen"; echo "---" >> "$0.seen"\n'
                      'printf "written in the editor\\n" >> "$1"\n')
    script.chmod(0o755)
    monkeypatch.setenv("VISUAL", str(script))
    monkeypatch.setenv("EDITOR", "false")  # $VISUAL wins
    return script


async def test_ctrl_o_and_editor_send_what_the_editor_saved(tmp_path: Path, editor: Path) -> None:
    async with running_daemon(tmp_path / "kvd", model=MODEL) as d:
        screen = await kvchat(d, "--new", "--max-tokens", "2", script=[
            "typed so far\x0f",  # Ctrl-O, read line by line: a line ending in ^O
            "/editor",
            "/edit 1", "\x0f",  # Ctrl-O on an empty edit line: the editor starts on the old message
            "/quit"])
        got = await transcript(d, session_id(screen))
    seen = (tmp_path / "fake-editor.seen").read_text().split("---\n")
    assert seen[:3] == ["typed so far\n", "", "typed so far\nwritten in the editor\n"]
    assert screen.after("you> typed so far")[:2] == ["(from the editor)", "typed so far"]
    # /edit 1 replaced the first message and everything after it.
    contents = [m["content"] for m in got["messages"] if m["role"] == "user"]
    assert contents == ["typed so far\nwritten in the editor\nwritten in the editor"]
    assert screen.lines.count("(from the editor)") == 3


async def test_an_editor_that_fails_sends_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VISUAL", "false")
    async with running_daemon(tmp_path, model=MODEL) as d:
        screen = await kvchat(d, "--new", script=["draft\x0f", "/quit"])
        async with client(d) as c:
            sessions = (await c.request("session.list"))["sessions"]
    assert "error: the editor 'false' exited with status 1; nothing sent (set $VISUAL or $EDITOR to change it)" \
        in screen.lines
    assert sessions == []  # nothing was sent, so the new chat was not kept


def test_tab_completes_commands_and_their_first_word() -> None:
    complete = Completer(["/help", "/history-free", "/set", "/copy", "/quit"])
    assert complete.candidates("/he", "/he") == ["/help "]
    assert complete.candidates("/h", "/h") == ["/help ", "/history-free "]
    assert complete.candidates("/set pa", "pa") == ["parameter "]
    assert complete.candidates("/copy ", "") == ["code "]
    assert complete.candidates("hello /he", "/he") == []  # only at the start of a line
    assert complete.candidates("/set parameter te", "te") == []


async def test_copy_without_a_terminal_keeps_it_in_a_file(tmp_path: Path) -> None:
    async with running_daemon(tmp_path, model=MODEL) as d:
        async with client(d) as c:
            sid = await make_session(c, "Copy me", "hello", temperature=0, max_tokens=8)
        screen = await kvchat(d, "--session", sid, script=["/copy", "/copy code", "/copy all", "/quit"])
        got = await transcript(d, sid)
    path = data_file(d, "kvchat-copy.txt")
    answer = got["messages"][-1]["content"]
    assert f"no terminal to copy through: the last answer ({len(answer)} characters) is in {path}" in screen.lines
    assert path.read_text() == answer + "\n"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert "the last answer has no code block; /copy copies all of it" in screen.lines
    assert "/copy copies the last answer, /copy code its last code block (usage: /copy [code])" in screen.lines


def test_copy_code_takes_the_last_code_block() -> None:
    from tui.clipboard import code_blocks, osc52

    answer = "Try:\n\n```python\nprint(1)\n```\n\nor\n\n    indented()\n\n~~~\nlast()\n  kept\n~~~\n"
    assert code_blocks(answer) == ["print(1)", "indented()", "last()\n  kept"]
    assert osc52("hé") == "\x1b]52;c;aMOp\x07"


async def test_status_line_shows_the_context_and_a_reread(tmp_path: Path) -> None:
    async with running_daemon(tmp_path, model=MODEL) as d:
        screen = await kvchat(d, "--new", "--max-tokens", "4", "--temperature", "0", script=[
            "first question", "second question", "/system Be brief.", "third question", "/quit"])
        got = await transcript(d, session_id(screen))
    answers = [m for m in got["messages"] if m["role"] == "assistant"]
    used = []
    for question, answer in zip(["first question", "second question", "third question"], answers):
        _, status = answer_lines(screen, f"you> {question}")
        match = CTX.search(status)
        assert match, status
        used.append(int(match.group(1)))
        usage = answer["usage"]
        assert used[-1] == usage["prompt_tokens"] + usage["completion_tokens"] == usage["context_tokens"]
        assert usage["context_window"] == 8192
    assert used[0] < used[1]
    _, status = answer_lines(screen, "you> second question")
    assert "re-read" not in status  # appended to the cache: nothing read again
    # A new system prompt: kvd re-reads the history, and the status line owns up to it.
    _, status = answer_lines(screen, "you> third question")
    reread = answers[2]["usage"]["reread_tokens"]
    assert reread > 0 and f"re-read {reread} tok" in status, status


async def test_a_long_prefill_shows_progress(tmp_path: Path) -> None:
    long = " ".join(["the sea and the sky"] * 40)  # some 300 tokens: 5 chunks of 64
    async with running_daemon(tmp_path, model=MODEL, prefill_step_size=64) as d:
        async with client(d) as c:
            sid = (await c.request("session.create"))["session"]["id"]
            await c.send({"id": "p", "type": "chat.send", "session": sid, "text": long, "max_tokens": 2})
            progress = []
            while (event := await c.recv())["type"] != "chat.done":
                if event["type"] == "chat.progress":
                    assert event["id"] == "p" and event["session"] == sid
                    progress.append((event["fed"], event["total"]))
            total = event["usage"]["prompt_tokens"]
        assert progress, "a prefill of many chunks reports progress"
        assert progress[0] == (64, total)  # right after the first chunk, then at most four a second
        assert all(a[0] < b[0] for a, b in zip(progress, progress[1:])) and progress[-1][0] < total
        # Another beginning: the same text would start from the first session's cache (shared).
        screen = await kvchat(d, "--new", "--max-tokens", "2", script=["Again: " + long, "/quit"])
        # A question, then the long paste on top of its cache: the status line says what reading it cost.
        pasted = await kvchat(d, "--new", "--max-tokens", "2", script=["hello", "Now: " + long, "/quit"])
    assert re.match(r"\(kvd is reading \d+ tokens of history…\)$", screen.after(f"you> Again: {long}")[0])
    _, status = answer_lines(pasted, f"you> Now: {long}")
    assert re.search(r" · cache: resident \d+ tok in [\d.]+ ms · read \d{3} tok in [\d.]+ m?s · ", status), status


async def test_a_first_message_too_long_says_to_shorten_it_not_to_compact(tmp_path: Path) -> None:
    long = " ".join(["the sea and the sky"] * 600)  # some 4,200 tokens: with max_tokens 4096, past 8192
    async with running_daemon(tmp_path, model=MODEL) as d:
        screen = await kvchat(d, "--new", "--max-tokens", "4096", script=[long, "/quit"])
        sessions = d.store.list_sessions()
    after = screen.after(f"you> {long}")
    said = [line for line in after if not line.startswith("waiting for kvd")]
    assert said[0].startswith("error: "), after  # the refusal comes after chat.start: no empty `kvd>` first
    error = next(line for line in after if line.startswith("error: "))
    assert error.endswith("; lower max_tokens to " + error.split("lower max_tokens to ")[1].split()[0]
                          + " or less, or send a shorter message"), error
    assert any(line.startswith("the message itself does not fit") for line in after), after
    assert not any("/compact" in line for line in after), after
    assert all(s["message_count"] == 0 for s in sessions)  # the refused message was taken back
    # ...and the new chat was not left behind titled after it (an empty "the sea and the sky…" row in the list):
    # it went back to "New chat", so leaving it deleted it.
    assert sessions == [], sessions


async def test_a_paste_larger_than_the_context_after_a_turn_is_not_sent_to_compact(tmp_path: Path) -> None:
    """A short turn, then a paste that alone exceeds the context: /compact cannot make room for it."""
    huge = " ".join(["the sea and the sky"] * 1300)  # some 9,000 tokens, past 8192 on its own
    async with running_daemon(tmp_path, model=MODEL) as d:
        screen = await kvchat(d, "--new", "--max-tokens", "8", script=["hello", huge, "/quit"])
    after = screen.after(f"you> {huge}")
    assert any(line.startswith("error: the conversation (") for line in after), after
    # Not "lower /params max_tokens=N": no answer's room makes a message longer than the context fit.
    assert ("the message alone is longer than the model's context: send a part of it at a time, or use a model "
            "with a longer context (/model)") in after, after
    assert not any(line.startswith("the session is full") for line in after), after  # kvchat's own hint


async def test_a_message_past_the_character_limit_says_what_to_do(tmp_path: Path) -> None:
    text = "x" * 32001
    async with running_daemon(tmp_path, model=MODEL) as d:
        screen = await kvchat(d, "--new", script=[text, "/quit"])
    after = [line for line in screen.after(f"you> {text}") if not line.startswith("waiting for kvd")]
    assert after[:2] == ["error: 'text' is longer than 32000 characters",
                         "send it in parts (Up recalls it; Ctrl-O edits it in $EDITOR), or raise limits.max_text_chars "
                         "in kvd's config.toml and restart kvd"], after


async def test_a_full_session_says_how_to_go_on_and_compact_does(tmp_path: Path) -> None:
    long = " ".join(["the sea and the sky"] * 600)  # some 4,200 tokens: with max_tokens 4096, past 8192
    async with running_daemon(tmp_path, model=MODEL) as d:
        async with client(d) as c:
            sid = await make_session(c, "Full", temperature=0)
            await c.request("session.update", session=sid, system="Be brief.")
        screen = await kvchat(d, "--session", sid, script=[
            "/params max_tokens=8", "an early one", "a short one", "/params max_tokens=4096", long, "/compact",
            "y", "/params", "/params max_tokens=8", "next", "/sessions", "/quit"])
        old = await transcript(d, sid)
        new_id = session_id(screen)
        new = await transcript(d, new_id)
    error = next(line for line in screen.after(f"you> {long}") if line.startswith("error: "))
    room = int(re.search(r"lower max_tokens to (\d+) or less", error).group(1))  # type: ignore[union-attr]
    assert re.match(r"error: the conversation \(\d+ tokens\) plus max_tokens \(4096\) exceeds the model's "
                    r"context of 8192 tokens; lower max_tokens to \d+ or less, or start a new session "
                    r"carrying less of the history \(kvchat: /compact\)$", error), error
    assert 3000 < room < 4096
    assert ("the session is full. /params max_tokens=N lowers the answer's room if that is enough; /compact goes "
            "on in a new session that carries the system prompt and the last turns that fit in half the context") \
        in screen.lines
    # The refused turn was taken back; /compact carries the turns that fit in half the context (both, here).
    assert [m["content"] for m in old["messages"] if m["role"] == "user"] == ["an early one", "a short one"]
    assert new_id != sid and new["session"]["title"] == "Full (compacted)"
    # Its params are the old session's.
    assert ("in effect: temperature=0.0 (session), top_p=0.9 (kvd's default), max_tokens=4096 (session)"
            in screen.after("you> /compact"))
    # The carried turns are its first messages, under the old system prompt: it begins as the old session did.
    assert new["session"]["system"] == "Be brief." and new["session"]["origin"] == f"kvchat (compacted from {sid})"
    assert [(m["role"], m["content"]) for m in new["messages"][:4]] == [
        (m["role"], m["content"]) for m in old["messages"]]
    tokens = old["messages"][3]["usage"]["context_tokens"]
    # It said what it would carry before it made anything.
    assert (f"/compact: the new session will carry the system prompt and the last 2 turns (turns 1-2, {tokens} "
            "tokens)") in screen.lines
    assert screen.after("you> /compact")[1] == "go on? [Y/n] y"
    assert (f"this new session carries the system prompt and the last 2 turns ({tokens} tokens; at most half the "
            "8192-token context) as its first messages; 'Full' is kept (/switch to it)") in screen.lines
    assert [m["content"] for m in new["messages"] if m["role"] == "user"] == ["an early one", "a short one", "next"]
    # Its header shows the carried turns as a resumed session's would, and the system prompt as it was.
    shown = screen.after("you> /compact")
    assert "system: Be brief." in shown and "you> an early one" in shown and "you> a short one" in shown, shown
    # Its first answer read none of them again: the old session's cache holds them (it was all prefilled before).
    assert any(re.match(r"\s*1\* +Full \(compact… ← #2 ", line) for line in screen.after("you> /sessions")), \
        screen.after("you> /sessions")  # the list says where it came from (its origin names it)
    usage = new["messages"][-1]["usage"]
    first_prompt = old["messages"][1]["usage"]["prompt_tokens"]
    assert usage["restored_from"] == "shared" and usage["shared_tokens"] >= first_prompt, usage


def test_compact_keeps_the_paste_the_conversation_is_about() -> None:
    """A 3000-token log pasted first, then small questions about it: the plain rule (the last turns in
    half the context) would carry the small talk and drop the log."""
    log = compact.Exchange("ERROR 2026-11-25 disk full on /var " * 300, "The disk filled up.", 3000, 1)
    small = [compact.Exchange(f"question {n} about the log", "an answer", 300, n) for n in range(2, 17)]
    plain = compact.carried([log, *small], 8192 // 2)
    assert log not in plain  # what the plain rule alone would do
    p = compact.plan([log, *small], 8192)
    assert p.anchor == log and [t.number for t in p.kept] == [1, *range(7, 17)]  # 3000 + 10 x 300 <= 6144
    assert [t.number for t in p.left_out] == [2, 3, 4, 5, 6]
    said = compact.describe(p, 8192, system=False)
    assert said == ["/compact: the new session will carry turn 1 (your 3000-token message 'ERROR 2026-11-25 disk "
                    "full on /var ERRO…' and its answer: by far the largest turn, likely what the others are about) "
                    "and the last 10 turns "
                    "(turns 7-16, 3000 tokens); it leaves out turns 2-6 (1500 tokens)"]
    # Too large for three quarters of the context: said plainly, not dropped in silence.
    huge = compact.Exchange("x " * 7000, "ok", 7414, 1)
    p = compact.plan([huge, *small[:3]], 8192)  # turns 2-4
    assert p.anchor is None and p.unfit == huge and [t.number for t in p.kept] == [2, 3, 4]
    said = compact.describe(p, 8192, system=True)
    assert said == [
        "/compact: the new session will carry the system prompt and the last 3 turns (turns 2-4, 900 tokens); "
        "it leaves out turn 1 (7414 tokens)",
        "it cannot carry turn 1, your 7414-token message 'x x x x x x x x x x x x x x x x x x x x…': carried turns "
        "may take at most 6144 tokens (three quarters of the 8192-token context); paste again the part of it you "
        "need"]
    # Turns of like size have no anchor: the plain rule.
    p = compact.plan(small, 1000)
    assert p.anchor is None and p.unfit is None and [t.number for t in p.kept] == [16]


def test_compact_carries_the_small_turns_before_the_paste_so_its_cache_is_reused() -> None:
    """A greeting, then the log: carrying the log without the greeting would make the new session begin
    otherwise than the old one, and its first answer would read the log again (issue 44, item 11)."""
    hello = compact.Exchange("hello", "Hi! How can I help?", 50, 1)
    log = compact.Exchange("ERROR 2026-11-25 disk full on /var " * 300, "The disk filled up.", 3000, 2)
    small = [compact.Exchange(f"question {n} about the log", "an answer", 300, n) for n in range(3, 18)]
    p = compact.plan([hello, log, *small], 8192)
    assert p.anchor == log and [t.number for t in p.kept] == [1, 2, *range(8, 18)]  # 50 + 3000 + 10 x 300
    assert compact.describe(p, 8192, system=False) == [
        "/compact: the new session will carry turn 2 (your 3000-token message 'ERROR 2026-11-25 disk full on /var "
        "ERRO…' and its answer: by far the largest turn, likely what the others are about) and turn 1 before it "
        "(50 tokens: the new session begins as this one did, so its cache is reused, not read again) and the last "
        "10 turns (turns 8-17, 3000 tokens); it leaves out turns 3-7 (1500 tokens)"]
    # Turns before it that are not small beside it stay behind: the context is worth more than the read.
    chatty = [compact.Exchange(f"chat {n}", "an answer", 300, n) for n in range(1, 4)]
    log2 = compact.Exchange(log.question, log.answer, 3000, 4)
    p = compact.plan([*chatty, log2, *[compact.Exchange(t.question, t.answer, 300, t.number + 2) for t in small]], 8192)
    assert p.anchor == log2 and p.kept[0] == log2


def test_a_compacted_session_compacted_again_keeps_its_title() -> None:
    assert compact.compacted_title("Lisbon") == "Lisbon (compacted)"
    assert compact.compacted_title("Lisbon (compacted)") == "Lisbon (compacted)"  # not "(compacted) (compacted)"
    assert compact.compacted_title("t" * 200) == "t" * 188 + " (compacted)"


def test_compact_rule() -> None:
    def turn(q: str, after: int | None) -> list[dict[str, Any]]:
        usage = None if after is None else {"context_tokens": after, "context_window": 100}
        return [{"role": "user", "content": q}, {"role": "assistant", "content": q.upper(), "usage": usage}]

    messages = turn("a", 30) + turn("b", None) + turn("c", 60) + turn("d", 80) + turn("e", 95)
    for m in messages:
        m["status"] = "complete" if m["role"] == "user" or m["usage"] else "error"  # b's answer failed
    measured = compact.turns(messages)
    assert [(t.question, t.tokens) for t in measured] == [("c", 60), ("d", 20), ("e", 15)]
    # Turns a /compact carried (stored complete, never answered: no usage) share the next answer's count by
    # their characters: a compacted session compacted again still carries its paste.
    carried: list[dict[str, Any]] = [{"role": "user", "content": "p" * 300, "status": "complete"},
               {"role": "assistant", "content": "ok", "status": "complete", "usage": None},
               {"role": "user", "content": "q", "status": "complete"},
               {"role": "assistant", "content": "a", "status": "complete", "usage": None}]
    again = compact.turns(carried + turn("next", 120))
    assert [(t.question[:1], t.number, t.tokens) for t in again] == [("p", 1, 115), ("q", 2, 1), ("n", 3, 3)]
    assert compact.window(messages) == 100
    assert [t.question for t in compact.carried(measured, 50)] == ["d", "e"]
    assert compact.carried(measured, 10) == []


async def test_ollama_habits(tmp_path: Path) -> None:
    async with running_daemon(tmp_path, model=MODEL) as d:
        screen = await kvchat(d, "--new", "--title", "Habits", "--max-tokens", "9", script=[
            "/set system Answer in French.", "/set parameter temperature 0.2", "/set parameter num_predict 5",
            "/set parameter seed 1", "/set verbose", "/params", "/clear", "/bye", "never sent"])
        got = await transcript(d, session_id(screen))
    lines = screen.lines
    assert screen.code == 0
    assert got["session"]["system"] == "Answer in French."
    assert got["session"]["params"] == {"temperature": 0.2, "max_tokens": 5}
    assert ("parameters are temperature, top_p, max_tokens (num_predict is max_tokens) "
            "(usage: /set system|parameter …)") in lines
    assert "kvchat knows /set system and /set parameter (usage: /set system|parameter …)" in lines
    # /params: the values the next answer uses, and where each comes from.
    assert "in effect: temperature=0.2 (session), top_p=0.9 (kvd's default), max_tokens=9 (--max-tokens)" in lines
    # /clear: the screen is cleared (no terminal here) and the header drawn again; the session stays.
    assert screen.after("you> /clear")[0] == "Habits"
    assert "you> never sent" not in lines  # /bye left


async def test_a_session_deleted_elsewhere_offers_the_picker(tmp_path: Path) -> None:
    async with running_daemon(tmp_path, model=MODEL) as d:
        async with client(d) as c:
            other = await make_session(c, "Other chat", "hello")
            doomed = await make_session(c, "Doomed chat", "hello")

        async def delete_elsewhere() -> None:
            async with client(d) as c:  # another window
                assert (await c.request("session.delete", session=doomed))["type"] == "ok"

        def delete_then(text: str) -> Any:
            def step() -> str:
                anyio.from_thread.run(delete_elsewhere)
                return text

            return step

        screen = await kvchat(d, "--session", doomed, "--max-tokens", "2", script=[
            delete_then("are you there?"), "Oth", "still here?", "/quit"])
        got = await transcript(d, other)
    after = screen.after("you> are you there?")
    assert after[0] == ("this session ('Doomed chat') was deleted, in another window or by another client; "
                        "what you sent was not kept (Up recalls it)")
    assert re.match(r"\s*1 +Other chat", after[2])
    assert "number or title, Enter for a new chat: Oth" in screen.lines  # a title's start picks it
    assert [m["content"] for m in got["messages"] if m["role"] == "user"] == ["hello", "still here?"]
    assert "unknown_session" not in screen.text, screen.lines


async def test_export_asks_before_overwriting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    async with running_daemon(tmp_path / "kvd", model=MODEL) as d:
        async with client(d) as c:
            sid = await make_session(c, "Exported", "hello")
        first = await kvchat(d, "--session", sid, script=["/export", "/quit"])
        path = tmp_path / f"exported-{sid[:8]}.md"
        path.write_text("my own notes\n")
        screen = await kvchat(d, "--session", sid, script=["/export", "n", "/export", "y", "/quit"])
    assert f"exported 2 messages to {path.name}" in first.lines
    assert f"{path.name} exists; overwrite it? [y/N] n" in screen.lines
    assert "not exported; /export PATH writes elsewhere" in screen.lines
    assert f"{path.name} exists; overwrite it? [y/N] y" in screen.lines
    assert screen.lines.count(f"exported 2 messages to {path.name}") == 1
    assert path.read_text().startswith("# Exported\n")


async def test_picker_takes_a_unique_title_prefix(tmp_path: Path) -> None:
    async with running_daemon(tmp_path, model=MODEL) as d:
        async with client(d) as c:
            await make_session(c, "Lisbon trip", "hello")
            await make_session(c, "Lisbon food", "hello")
            await make_session(c, "Porto", "hello")
        screen = await kvchat(d, script=["lisbon", "lisbon t", "/switch porto", "/quit"])
    assert "'lisbon' starts 2 titles; type the number of the one you mean:" in screen.lines
    listed = screen.after("'lisbon' starts 2 titles; type the number of the one you mean:")[:2]
    assert [line.split()[:3] for line in listed] == [["2", "Lisbon", "food"], ["3", "Lisbon", "trip"]], listed
    assert screen.after("number or title, Enter for a new chat: lisbon t")[0] == "Lisbon trip"
    assert screen.after("you> /switch porto")[0] == "Porto"


async def test_code_blocks_start_at_column_0_and_copy_code_takes_the_last(tmp_path: Path) -> None:
    answer = ("Two ways:\n\n```python\ndef f(x):\n    return x + 1\n```\n\n- or in a list:\n\n  ```\n  nested()\n"
              "  ```\n\n```sh\necho done\n```")
    async with running_daemon(tmp_path, model=MODEL) as d:
        async with client(d) as c:
            sid = (await c.request("session.create", title="Code"))["session"]["id"]
        d.store.append_message(sid, "user", "show me code")  # a transcript with code in it, as a model writes one
        d.store.append_message(sid, "assistant", answer)
        screen = await kvchat(d, "--session", sid, script=["/copy code", "/quit"])
    shown = screen.after("you> show me code")
    assert shown[:5] == ["kvd> Two ways:", "", "def f(x):", "    return x + 1", ""]
    assert shown[5:9] == ["      • or in a list:", "        nested()", "", "echo done"]  # in a list: with its item
    assert data_file(d, "kvchat-copy.txt").read_text() == "echo done\n"
    assert f"no terminal to copy through: its last code block (9 characters) is in {data_file(d, 'kvchat-copy.txt')}" \
        in screen.lines


async def test_one_shot_in_process(tmp_path: Path) -> None:
    import io
    import json

    import anyio.to_thread
    from rich.console import Console

    from daemon.service.control import write_daemon_file
    from tui.cli import build_parser
    from tui.oneshot import answer_one

    async with running_daemon(tmp_path, model=MODEL) as d:
        write_daemon_file(Path(d.config.data_dir), d.url, d.config.log_path)

        def one(*argv: str, stdin: str = "") -> tuple[int, str, str]:
            out, err = io.StringIO(), io.StringIO()
            args = build_parser().parse_args(["--data-dir", str(d.config.data_dir), *argv])
            code = answer_one(args, io.StringIO(stdin), out, Console(file=err, width=200, color_system=None))
            return code, out.getvalue(), err.getvalue()

        code, out, err = await anyio.to_thread.run_sync(
            lambda: one("-", "--json", "--max-tokens", "3", "--title", "piped", stdin="a\nb\n"))
        got = json.loads(out)
        messages = (await transcript(d, got["session"]))["messages"]
        cut = "" if got["finish_reason"] == "stop" else ("kvchat: the answer stopped at max_tokens (3 tokens), cut "
                                                         "where it stopped; --max-tokens N allows a longer one "
                                                         "(--strict exits 3 on this)\n")
        assert (code, err) == (0, cut)
        assert [m["content"] for m in messages] == ["a\nb", got["answer"]]
        code, out, err = await anyio.to_thread.run_sync(lambda: one("--last", "--max-tokens", "2", "more"))
        messages = (await transcript(d, got["session"]))["messages"]
        assert (code, out) == (0, messages[3]["content"] + "\n")
        assert err in ("", "kvchat: the answer stopped at max_tokens (2 tokens), cut where it stopped; --max-tokens "
                       "N allows a longer one (--strict exits 3 on this)\n")
        code, out, err = await anyio.to_thread.run_sync(lambda: one("   "))
        assert (code, out, err) == (2, "", "error: nothing to send: the message is empty\n")
        # A send refused before any answer leaves no session behind (max_tokens past the limit).
        sessions = d.store.list_sessions()
        code, out, err = await anyio.to_thread.run_sync(lambda: one("--max-tokens", "5000", "hi"))
        assert code != 0 and "max_tokens" in err and out == ""
        assert d.store.list_sessions() == sessions


async def test_sessions_say_who_made_them_and_last_resumes_kvchat_s_own(tmp_path: Path) -> None:
    import httpx

    async with running_daemon(tmp_path, model=MODEL) as d:
        await kvchat(d, "--new", "--max-tokens", "2", script=["from kvchat", "/quit"])
        base = d.url.replace("ws://", "http://").removesuffix("/v1")
        async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {d.token}",
                                                             "User-Agent": "some-agent/1.0"}) as h:
            r = await h.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "from the api"}],
                                                           "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200, r.text
        listed = d.store.list_sessions()
        assert [(s["title"], s["origin"]) for s in listed] == [("from the api", "api (some-agent/1.0)"),
                                                               ("from kvchat", "kvchat")]
        # The API session is the most recent, but --last resumes kvchat's own; --from any takes it.
        mine = await kvchat(d, "--last", script=["/quit"])
        anyone = await kvchat(d, "--last", "--from", "any", script=["/quit"])
        picker = await kvchat(d, "--from", "api", script=[""])
    assert mine.lines[0] == "from kvchat" and anyone.lines[0] == "from the api"
    rows = [line for line in picker.lines if line.lstrip().startswith("1 ")]
    assert len(rows) == 1 and "from the api" in rows[0] and " api " in rows[0]
    assert not any("from kvchat" in line for line in picker.lines)


async def test_last_opens_the_chat_typed_in_not_a_one_shot(tmp_path: Path) -> None:
    """After `echo "Say OK." | kvchat`, `kvchat --last` opened that one-shot, not the chat you were in."""
    import io

    from daemon.service.control import write_daemon_file
    from tui.cli import build_parser
    from tui.oneshot import answer_one

    async with running_daemon(tmp_path, model=MODEL) as d:
        await kvchat(d, "--new", "--max-tokens", "2", script=["typed in here", "/quit"])
        write_daemon_file(Path(d.config.data_dir), d.url, d.config.log_path)
        args = build_parser().parse_args(["--data-dir", str(d.config.data_dir), "--max-tokens", "2", "-"])
        code = await anyio.to_thread.run_sync(lambda: answer_one(args, io.StringIO("Say OK."), io.StringIO(),
                                                                 Console(file=io.StringIO())))
        assert code == 0 and d.store.list_sessions()[0]["title"] == "Say OK."
        last = await kvchat(d, "--last", script=["/quit"])
        scripted = await kvchat(d, "--last", "--from", "one-shot", script=["/quit"])
    assert last.lines[0] == "typed in here", last.text
    assert scripted.lines[0] == "Say OK.", scripted.text


async def test_the_list_groups_an_api_conversation_s_branches_and_titles_by_what_was_typed(tmp_path: Path) -> None:
    """Every retry and edit of an API conversation was a row of its own (four identical "What is the capital
    of France?" rows), every one-shot too, and aider's runs were titled by the example message its requests
    begin with. The official openai client, a real daemon, kvchat's picker."""
    import io

    import openai

    from daemon.service.control import write_daemon_file
    from tui.cli import build_parser
    from tui.oneshot import answer_one

    async with running_daemon(tmp_path, model=MODEL) as d:
        api = openai.AsyncOpenAI(base_url=d.url.replace("ws://", "http://", 1), api_key=d.token, max_retries=0)

        async def ask(*said: tuple[str, str], system: str | None = None) -> str:
            messages: list[Any] = [{"role": "system", "content": system}] if system else []
            messages += [{"role": role, "content": text} for role, text in said]
            got = await api.chat.completions.create(model="kvd", messages=messages, max_tokens=3, temperature=0)
            return got.choices[0].message.content or ""

        q1 = ("user", "What is the capital of France?")
        a1 = await ask(q1)
        a2 = await ask(q1, ("assistant", a1), ("user", "And of Spain?"))  # continues the session
        await ask(q1, ("assistant", a1), ("user", "And of Spain?"))  # a retry: a branch
        await ask(q1, ("assistant", a1), ("user", "And of Italy?"))  # an edit: a branch
        await ask(q1, ("assistant", a1), ("user", "And of Spain?"), ("assistant", a2), ("user", "Thanks."))
        aider = "You are an expert software developer. Follow the examples."
        example = [("user", "Change the greeting to be more casual"), ("assistant", "Ok, I will change it.")]
        await ask(*example, ("user", "Add a docstring to main"), system=aider)
        await ask(*example, ("user", "Rename foo to bar"), system=aider)
        await api.close()
        write_daemon_file(Path(d.config.data_dir), d.url, d.config.log_path)
        args = build_parser().parse_args(["--data-dir", str(d.config.data_dir), "--max-tokens", "2", "Say OK."])
        assert await anyio.to_thread.run_sync(lambda: answer_one(args, io.StringIO(""), io.StringIO(),
                                                                 Console(file=io.StringIO()))) == 0
        listed = await kvchat(d, script=[""], width=120)
        everything = await kvchat(d, "--all", script=[""], width=120)
    table = listed.lines[:next(i for i, line in enumerate(listed.lines) if line.startswith("number or title"))]
    rows = [line for line in table if re.match(r"\s*\d+ ", line)]
    assert len(rows) == 3, table
    # The retry and the edit are branches (the last request continued the retry: at temperature 0 it holds
    # the same answer, and placement takes the most recently used).
    assert any(re.match(r"\s*\d +What is the capital of France\? \(\+2 branches\) ", r) for r in rows), rows
    assert any(re.match(r"\s*\d +Add a docstring to main ", r) for r in rows), rows
    assert any(re.match(r"\s*\d +Rename foo to bar ", r) for r in rows), rows
    assert not any("Change the greeting" in r or "Say OK." in r for r in rows), rows
    assert "(1 one-shot not listed: kvchat --all lists them)" in table, table
    every = [line for line in everything.lines if re.match(r"\s*\d+ ", line)]
    assert len(every) == 3 + 2 + 1 and any("Say OK." in r for r in every), every


async def test_opening_a_grouped_row_shows_the_conversation_s_title_and_renames_it_whole(tmp_path: Path) -> None:
    """The row read "What is the capital of France? (+1 branch)"; opening it showed the branch's own title
    ("And of Spain?", the request that started the branch), and /rename renamed that branch only, so the row
    kept its old title. The row is one conversation to the user: one title, in the list and once opened."""
    import openai

    async with running_daemon(tmp_path, model=MODEL) as d:
        api = openai.AsyncOpenAI(base_url=d.url.replace("ws://", "http://", 1), api_key=d.token, max_retries=0)
        q1: Any = {"role": "user", "content": "What is the capital of France?"}
        got = await api.chat.completions.create(model="kvd", messages=[q1], max_tokens=3, temperature=0)
        a1: Any = {"role": "assistant", "content": got.choices[0].message.content or ""}
        for _ in range(2):  # the second is a retry: a branch of the first
            await api.chat.completions.create(model="kvd", messages=[q1, a1, {"role": "user", "content": "And of "
                                                                              "Spain?"}], max_tokens=3, temperature=0)
        await api.close()
        titles = sorted(s["title"] for s in d.store.list_sessions())
        assert titles == ["And of Spain?", "What is the capital of France?"]  # each session's own
        steps = ["1", "/rename Capitals", "/sessions", "/delete", "n", "/quit"]
        screen = await kvchat(d, "--from", "api", script=steps, width=120)
        every = await kvchat(d, "--all", script=[""], width=120)
    opened = screen.after("number or title, Enter for a new chat: 1")
    assert opened[0] == "What is the capital of France?", opened
    assert ("this API conversation has 1 more branch (a retry or an edited message each); this is the most "
            "recently used one; /sessions all lists each") in opened, opened
    assert "renamed to 'Capitals' (and its 1 other branch)" in screen.lines
    rows = [line for line in screen.after("you> /sessions") if re.match(r"\s*\d+\*? ", line)]
    assert len(rows) == 1 and re.match(r"\s*1\* +Capitals \(\+1 branch\) ", rows[0]), rows
    assert "delete 'Capitals' and its 1 branch? [y/N] n" in screen.lines  # the conversation, as the row would
    every_rows = [line for line in every.lines if re.match(r"\s*\d+ ", line)]
    assert len(every_rows) == 2 and all(" Capitals " in r for r in every_rows), every_rows


async def test_a_narrow_terminal_keeps_the_number_to_type_and_whole_counts(tmp_path: Path) -> None:
    """At 60 columns or fewer the `#` column disappeared while the prompt still asked for a number; at 40 the
    token counts read `5…`. Columns are left out instead, the least needed first."""
    async with running_daemon(tmp_path, model=MODEL) as d:
        for question in ("What is the capital of France, and why is it there?", "Name three colours please"):
            await kvchat(d, "--new", "--max-tokens", "3", script=[question, "/quit"])
        tokens = {s["title"][:10]: s["tokens"] for s in d.store.list_sessions()}
        screens = {width: await kvchat(d, script=["2", "/quit"], width=width) for width in (60, 40)}
    for width, screen in screens.items():
        rows = [line for line in screen.lines if re.match(r"\s*\d+ ", line)]
        assert [int(row.split()[0]) for row in rows] == [1, 2], (width, screen.text)
        for row in rows:
            assert len(row) <= width and "…" not in row.split("  ", 2)[-1], (width, row)  # counts whole
            assert str(tokens[row.split(None, 1)[1][:10]]) in row.split(), (width, row)
        assert screen.lines[0] == "#  title" or screen.lines[0].split()[:2] == ["#", "title"], screen.text
        assert any(line.startswith("session ") and "2 messages" in line for line in screen.lines), screen.text
        assert any(line.startswith("you> What is the capital of France,") for line in screen.lines), screen.text


async def test_resume_shows_the_last_exchanges_and_the_cache_up_front(tmp_path: Path) -> None:
    """Resuming replayed the whole transcript, a 200-line paste included, and said nothing of the cache
    until the next answer. Now: the cache in the header, the last two exchanges, a long message cut."""
    paste = "\n".join(f"log line {i:03d}: the disk on /var filled up" for i in range(200))
    async with running_daemon(tmp_path, model=MODEL) as d:
        first = await kvchat(d, "--new", "--max-tokens", "2", script=["hello there", paste, "and now?", "/quit"])
        sid = session_id(first)
        tokens = d.store.get_session(sid)["tokens"]  # type: ignore[index]
        again = await kvchat(d, "--session", sid, script=["/history", "/quit"])
    header = next(line for line in again.lines if line.startswith(f"session {sid}"))
    assert f" · 6 messages · cache: resident {tokens} tok · " in header, header
    shown = again.lines[:again.lines.index("you> /history")]
    assert "(2 earlier messages not shown; /history shows them all)" in shown, shown
    assert "you> hello there" not in shown
    assert "you> log line 000: the disk on /var filled up" in shown and "     log line 005: the disk on /var " \
        "filled up" in shown and not any("log line 006" in line for line in shown), shown
    assert "… (194 more lines; /history shows them all)" in shown, shown
    assert any(line == "you> and now?" for line in shown), shown
    history = again.lines[again.lines.index("you> /history"):]
    assert "you> hello there" in history and sum("log line" in line for line in history) == 200, history
