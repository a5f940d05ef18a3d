"""kvchat's picker and /commands against a real in-process daemon: typed input in, the screen out."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

import pytest

from conftest import Client, RunningDaemon, client, running_daemon
from kvchat_harness import Screen, data_file, in_loop, kvchat, newest_connection, tap
from tui import render
from tui.answer import render_answer

pytestmark = pytest.mark.anyio

STATUS = re.compile(r"^\d+ tokens? · TTFT \d+ ms · [\d.]+ tok/s · (draft \d+/\d+ kept · )?cache: ")
STATUS_LINE = re.compile(r"^\d+ tokens? · ")  # also a short answer's: no tok/s for one token


async def make_session(c: Client, title: str, *texts: str, **params: Any) -> str:
    sid: str = (await c.request("session.create", title=title))["session"]["id"]
    if params:
        await c.request("session.update", session=sid, params=params)
    for text in texts:
        _, done = await c.chat(sid, text, max_tokens=6, temperature=0)
        assert done["type"] == "chat.done"
    await c.request("status")  # through the engine's queue: the turn's cache is kept, its tier published
    return sid


async def transcript(d: RunningDaemon, sid: str) -> dict[str, Any]:
    async with client(d) as c:
        return await c.request("session.get", session=sid)


def answer_lines(screen: Screen, asked: str) -> tuple[list[str], str]:
    """The answer printed after the prompt line `asked`, and its status line."""
    rest = screen.after(asked)
    end = next(i for i, line in enumerate(rest) if STATUS_LINE.match(line))
    return rest[:end], rest[end]


def rendered(text: str, width: int = 80) -> list[str]:
    import io

    from rich.console import Console
    from rich.text import Text

    console = Console(width=width, record=True, color_system=None, file=io.StringIO())
    console.print(render_answer(text, Text(render.KVD)))
    return [line.rstrip() for line in console.export_text().splitlines()]


async def test_picker_then_sessions_new_switch_rename(tmp_path: Path) -> None:
    async with running_daemon(tmp_path) as d:
        async with client(d) as c:
            older = await make_session(c, "Older chat", "first question")
            newer = await make_session(c, "Newer chat", "second question")
        screen = await kvchat(d, script=["9", "2", "/sessions", "/new Fresh start", "/switch 2",
                                         "/rename Renamed chat", "/switch nonsense", "/quit"])
        assert screen.code == 0
        lines = screen.lines
        # The picker: a numbered table, most recent first, with tokens, cache tier, who made it and age
        # (this test's raw client did not say: "ws").
        header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("#"))
        assert re.match(r"\s*# +title +last message +msgs +tokens +cache +from +last used$", lines[header])
        first_row = lines[header + 1]
        assert re.match(r"\s*1 +Newer chat +\S.* +2 +\d+ +(resident|warm|disk) +ws +just now$", first_row), first_row
        assert re.match(r"\s*2 +Older chat +", lines[header + 2])
        assert "no session number 9; /sessions lists them" in lines
        # Picking 2 opens the older chat with its history.
        opened = lines.index("Older chat")
        assert lines[opened + 1].startswith(f"session {older} · model builtin:tiny · 2 messages")
        assert "you> first question" in lines[opened:]
        # /sessions marks the current one; /new starts a session; /switch 2 follows that table.
        assert any(re.match(r"\s*2\* +Older chat", line) for line in lines)
        assert "Fresh start" in lines
        after_switch = screen.after("you> /switch 2")
        assert after_switch[0] == "Older chat"
        assert "renamed to 'Renamed chat'" in lines
        assert "'nonsense' is not a session number, id or title; /sessions lists them (usage: /switch N|id)" in lines
        async with client(d) as c:
            listed = {s["id"]: s for s in (await c.request("session.list"))["sessions"]}
        assert listed[older]["title"] == "Renamed chat"
        assert listed[newer]["title"] == "Newer chat"
        assert "Fresh start" in {s["title"] for s in listed.values()}  # a title is kept, even unused


async def test_delete_asks_first(tmp_path: Path) -> None:
    async with running_daemon(tmp_path) as d:
        async with client(d) as c:
            keep = await make_session(c, "Keep me", "hello")
            await make_session(c, "Doomed", "hello")
        screen = await kvchat(d, "--session", keep, script=[
            "/sessions", "/delete 1", "n", "/delete 1", "y", "/delete", "yes", "/quit"])
        lines = screen.lines
        assert "delete 'Doomed'? [y/N] n" in lines
        assert "kept" in lines
        assert "delete 'Doomed'? [y/N] y" in lines and "deleted 'Doomed'" in lines
        # Deleting the session you are in opens a new chat.
        assert "delete 'Keep me'? [y/N] yes" in lines
        assert "deleted 'Keep me'; here is a new chat" in lines
        assert screen.after("deleted 'Keep me'; here is a new chat")[1] == "New chat"
        async with client(d) as c:
            sessions = (await c.request("session.list"))["sessions"]
        # Both are gone, and the new chat nobody wrote in was not kept either.
        assert sessions == []


async def test_delete_takes_numbers_ranges_and_the_empty_ones_asking_once(tmp_path: Path) -> None:
    async with running_daemon(tmp_path) as d:
        async with client(d) as c:
            keep = await make_session(c, "Keep me", "hello")
            await c.request("session.create", title="Nothing said")
            for title in ("Alpha", "Beta", "Gamma"):
                await make_session(c, title, "hello")
        screen = await kvchat(d, "--session", keep, script=[
            "/sessions", "/delete 1-2, 3", "y", "/delete 9-2", "/delete empty", "y", "/delete empty", "/quit"])
        lines = screen.lines
        assert "delete 3 sessions ('Gamma', 'Beta', 'Alpha')? [y/N] y" in lines
        assert "deleted 3 sessions" in lines
        assert any("9-2: a range goes from the smaller number to the larger" in line for line in lines)
        assert "delete 'Nothing said'? [y/N] y" in lines and "deleted 'Nothing said'" in lines
        assert any("no listed session is empty" in line for line in lines)
        async with client(d) as c:
            sessions = (await c.request("session.list"))["sessions"]
        assert [s["id"] for s in sessions] == [keep]


async def test_export_writes_the_transcript_as_markdown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    async with running_daemon(tmp_path / "kvd") as d:
        async with client(d) as c:
            sid = await make_session(c, "Trip: Lisbon / Porto!", "Where to go?", "And then?")
            await c.request("session.update", session=sid, system="Be brief.\nBe kind.")
        screen = await kvchat(d, "--session", sid, script=["/export", f"/export {tmp_path / 'out.md'}", "/quit"])
        got = await transcript(d, sid)
    default = tmp_path / f"trip-lisbon-porto-{sid[:8]}.md"
    assert f"exported 4 messages to {default.name}" in screen.lines
    assert f"exported 4 messages to {tmp_path / 'out.md'}" in screen.lines
    text = default.read_text()
    assert text == (tmp_path / "out.md").read_text()
    m = got["messages"]
    assert text.startswith(f"# Trip: Lisbon / Porto!\n\nkvd session `{sid}`, exported ")
    assert "**System prompt:**\n\n> Be brief.\n> Be kind.\n" in text
    body = text.split("## You", 1)[1]
    assert body == (f"\n\n{m[0]['content']}\n\n## kvd\n\n{m[1]['content']}\n\n"
                    f"## You\n\n{m[2]['content']}\n\n## kvd\n\n{m[3]['content']}\n")


async def test_system_and_params(tmp_path: Path) -> None:
    async with running_daemon(tmp_path) as d:
        screen = await kvchat(d, "--new", script=[
            "/system", "/system Answer in French.", "/system", "/params",
            "/params temperature=0 max_tokens=5", "/params top_p=2", "/params seed=1", "/params max_tokens=x",
            "/params", "Hello there", "/params max_tokens=-", "/system -", "/system", "/quit"])
        lines = screen.lines
        assert "no system prompt; /system TEXT sets one" in lines
        assert "system prompt set; it applies from the next answer on" in lines
        assert "system: Answer in French." in lines
        assert "session params: none set" in lines
        assert ("in effect: temperature=0.2 (kvd's default), top_p=0.9 (kvd's default), "
                "max_tokens=512 (kvd's default)") in lines
        assert "session params: temperature=0.0 max_tokens=5" in lines
        assert "error: 'params.top_p' must be in (0, 1] (bad_request)" in lines
        assert ("'seed=1' is not key=value with a key of temperature, top_p, max_tokens "
                "(usage: /params [key=value…])") in lines
        assert "max_tokens must be a whole number, not 'x' (usage: /params [key=value…])" in lines
        _, status = answer_lines(screen, "you> Hello there")
        assert int(status.split()[0]) <= 5
        assert "session params: temperature=0.0" in lines
        assert "system prompt cleared; from the next answer on" in lines
        sid = re.search(r"session ([0-9a-f]{16})", screen.text).group(1)  # type: ignore[union-attr]
        session = (await transcript(d, sid))["session"]
        assert session["system"] is None and session["params"] == {"temperature": 0.0}
        assert session["title"] == "Hello there"  # a new chat is titled after its first message


async def test_regen_and_edit(tmp_path: Path) -> None:
    async with running_daemon(tmp_path) as d:
        async with client(d) as c:
            sid = await make_session(c, "Greedy", temperature=0, max_tokens=12)
        screen = await kvchat(d, "--session", sid, script=[
            "Tell me about the sea", "/regen", "Another question", "/edit 3", "/edit", "1", "A new first question",
            "/quit"])
        lines = screen.lines
        first, status1 = answer_lines(screen, "you> Tell me about the sea")
        assert first[0].startswith("kvd> ")
        regen, status2 = answer_lines(screen, "(a new answer to your last message)")
        assert regen == first  # greedy: the same answer again
        assert "cache: resident" in status2  # rewound in memory, not prefilled from zero
        assert "N counts your messages, 1 to 2 (usage: /edit [N])" in lines
        # /edit alone lists your messages by number.
        listing = screen.after("you> /edit")
        assert listing[:2] == ["  1  Tell me about the sea", "  2  Another question"]
        assert "edit which? (number, Enter for the last) 1" in lines
        assert "editing your message 1; what came after it is replaced by the new answer" in lines
        edited, _ = answer_lines(screen, "edit> A new first question")
        got = await transcript(d, sid)
    assert [m["role"] for m in got["messages"]] == ["user", "assistant"]
    assert got["messages"][0]["content"] == "A new first question"
    assert edited == rendered(got["messages"][1]["content"])


async def test_editing_the_first_message_of_a_chat_titled_after_it_retitles_it(tmp_path: Path) -> None:
    """/export after /edit kept the original first message as the title; a title given by hand stays."""
    async with running_daemon(tmp_path) as d:
        out = tmp_path / "chat.md"
        await kvchat(d, "--new", "--max-tokens", "3", script=[
            "Tell me about the sea", "/edit 1", "Tell me about lakes", f"/export {out}", "/quit"])
        async with client(d) as c:
            named = await make_session(c, "Named by hand", max_tokens=3)
        await kvchat(d, "--session", named, script=["First words", "/edit 1", "Other words", "/quit"])
        titles = {s["id"]: s["title"] for s in d.store.list_sessions()}
    assert out.read_text().splitlines()[0] == "# Tell me about lakes"
    assert sorted(titles.values()) == ["Named by hand", "Tell me about lakes"], titles


async def test_history_is_kept_across_runs(tmp_path: Path) -> None:
    async with running_daemon(tmp_path) as d:
        path = data_file(d, "kvchat_history")
        path.write_text("from readline's file\n")  # the plain lines kvchat kept before its JSON entries
        await kvchat(d, "--new", script=["/params max_tokens=3", "first run message", '"""', "two", "lines", '"""',
                                          "/quit"])
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600

        def kept() -> list[str]:
            return [json.loads(line) for line in path.read_text().splitlines()]

        # One entry per message, however many lines it had.
        assert kept() == ["from readline's file", "/params max_tokens=3", "first run message", "two\nlines", "/quit"]
        await kvchat(d, "--last", script=["second run", "/quit"])
        # The second run read the first's entries back (it writes what it read and what it added).
        assert kept() == ["from readline's file", "/params max_tokens=3", "first run message", "two\nlines", "/quit",
                          "second run", "/quit"]


async def test_reconnect_continues_the_same_answer(tmp_path: Path) -> None:
    async with running_daemon(tmp_path) as d:
        async with client(d) as c:
            sid = await make_session(c, "Dropped", temperature=0, max_tokens=300)
        known = set(d.daemon.websocket.connections)

        def drop_after_some_deltas() -> str:
            def hook() -> None:
                conn = newest_connection(d, known)
                count = 0

                def on_event(event: dict[str, Any]) -> None:
                    nonlocal count
                    if event.get("type") == "chat.delta":
                        count += 1
                        if count == 20:
                            conn.abort()  # the connection drops mid-answer, as a network would drop it

                tap(conn, on_event)

            in_loop(hook)
            return "tell me a story"

        screen = await kvchat(d, "--session", sid, script=[drop_after_some_deltas, "/quit"])
        got = await transcript(d, sid)
    answer = got["messages"][-1]
    assert answer["status"] == "complete"
    shown, status = answer_lines(screen, "you> tell me a story")
    assert shown == rendered(answer["content"])  # no gap, no duplicate, and no note inside it
    assert status.startswith(f"{answer['usage']['completion_tokens']} tokens")
    assert screen.after(status)[0] == "the connection to kvd dropped mid-answer; kvchat reconnected"


async def test_busy_session_then_attach(tmp_path: Path) -> None:
    async with running_daemon(tmp_path) as d:
        async with client(d) as other:
            sid = await make_session(other, "Shared")
            # Another window asks for a long answer.
            await other.send({"id": "elsewhere", "type": "chat.send", "session": sid, "text": "go on",
                              "max_tokens": 4000, "temperature": 0})
            assert (await other.recv())["type"] == "chat.start"
            assert (await other.recv())["type"] == "chat.delta"  # it is under way
            known = set(d.daemon.websocket.connections)

            def attach_then_stop_it() -> str:
                def hook() -> None:
                    def on_event(event: dict[str, Any]) -> None:
                        if event.get("type") == "chat.attached" and event.get("generating"):
                            d.daemon.engine.cancel(sid)  # the other window stops it once kvchat follows

                    tap(newest_connection(d, known), on_event)

                in_loop(hook)
                return "/attach"

            screen = await kvchat(d, "--session", sid,
                                  script=["hello", "/system Be brief.", attach_then_stop_it, "/attach", "/quit"])
        got = await transcript(d, sid)
    lines = screen.lines
    assert ("error: this session is answering in another window; /attach to watch that answer, "
            "or wait for it to finish") in lines
    assert screen.after("you> /system Be brief.")[0] == (
        "error: this session is answering right now (in another window?); /attach to watch it, Ctrl-C there "
        "stops it; or wait for it to finish")
    shown, status = answer_lines(screen, "you> /attach")
    assert status.endswith("(cancelled)")
    assert shown == rendered(got["messages"][1]["content"])  # replayed from the start, then live
    assert "nothing is being written in this session right now" in screen.after(status)


async def test_waits_for_the_model_to_load(tmp_path: Path) -> None:
    async with running_daemon(tmp_path, start_engine=False) as d:

        def start_engine_then(text: str) -> Any:
            def step() -> str:
                in_loop(d.daemon.engine.start)
                return text

            return step

        screen = await kvchat(d, "--new", "--max-tokens", "3", script=[start_engine_then("hi"), "/new", "/quit"])
    lines = screen.lines
    assert re.match(r"session [0-9a-f]{16} · model builtin:tiny \(loading\)", lines[1])
    assert screen.after("you> hi")[0] == "waiting for kvd to finish loading model builtin:tiny…"
    _, status = answer_lines(screen, "waiting for kvd to finish loading model builtin:tiny…")
    assert STATUS.match(status)
    # Loaded since: a header said "(loading)" for as long as the connection made while it loaded lasted.
    header = screen.after("you> /new")[1]
    assert re.match(r"session [0-9a-f]{16} · model builtin:tiny · kvd ", header), header


async def test_a_model_that_failed_to_load_is_reported(tmp_path: Path) -> None:
    async with running_daemon(tmp_path, model="/nonexistent/model") as d:
        screen = await kvchat(d, "--new", script=["hi", "/quit"])
    error = next(line for line in screen.lines if line.startswith("error: "))
    assert error.startswith("error: the model failed to load: ")
    assert "restart kvd" in screen.text


async def test_nothing_typed_crashes_kvchat(tmp_path: Path) -> None:
    async with running_daemon(tmp_path) as d:
        screen = await kvchat(d, "--new", "--max-tokens", "2", script=[
            "/", "/help", "//not a command", "/regen", "/edit", "/switch 0", "/delete zzzz", "/rename " + "t" * 300,
            "/export /nonexistent/dir/x.md", "/EXIT"])
    assert screen.code == 0
    lines = screen.lines
    assert "unknown command /; /help lists them (// sends text that starts with /)" in lines
    assert any(line.startswith("/quit, /exit") for line in lines)
    _, status = answer_lines(screen, "you> //not a command")
    assert STATUS.match(status)
    assert any("must be 1-200 characters" in line for line in lines)
    assert any(line.startswith("error: cannot write /nonexistent/dir/x.md") for line in lines)
    assert not any("kvchat hit a bug" in line for line in lines)


async def test_reconnecting_gives_up_with_what_to_do(tmp_path: Path) -> None:
    import socket

    from tui.errors import GaveUp
    from tui.link import Link

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"ws://127.0.0.1:{sock.getsockname()[1]}/v1"  # nothing listens once closed
    link = Link(url=url, data_dir=tmp_path, reconnect_for=0.5)
    with pytest.raises(GaveUp) as info:
        await link.reconnect()
    assert str(info.value).startswith(f"kvd at {url} did not come back within 0.5 s "
                                      f"(nothing answers at {url}: kvd is not running there)")
    port = url.rsplit(":", 1)[1].split("/")[0]
    assert f"start it with `kvd serve --data-dir {tmp_path} --port {port}`" in str(info.value)  # the same dir, port


async def test_a_connection_lost_between_answers_is_made_again(tmp_path: Path) -> None:
    async with running_daemon(tmp_path) as d:
        async with client(d) as c:
            sid = await make_session(c, "Idle drop", temperature=0, max_tokens=5)
        known = set(d.daemon.websocket.connections)

        def drop_then(text: str) -> Any:
            def step() -> str:
                in_loop(lambda: newest_connection(d, known).abort())  # idle, between two answers
                return text

            return step

        screen = await kvchat(d, "--session", sid, script=["first", drop_then("second"), "/sessions", "/quit"])
    assert screen.code == 0
    after = screen.after("you> second")
    assert after[:2] == ["connection lost; reconnecting…", "reconnected"]
    assert after[2].startswith("kvd> ")
    _, status = answer_lines(screen, "you> second")
    assert STATUS_LINE.match(status)
    assert any(re.match(r"\s*1\* +Idle drop", line) for line in screen.lines)
