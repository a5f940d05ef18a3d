"""kvchat's rendering, on a capture console of fixed width; no daemon needed."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from typing import Any

import pytest
from rich.console import Console

from tui import render
from tui.lineinput import read_message

USAGE = {"prompt_tokens": 40, "completion_tokens": 12, "cached_tokens": 28, "ttft_ms": 35.2, "decode_tps": 210.4,
         "restored_from": "disk", "restored_tokens": 28, "restore_ms": 86.3, "prefill_tokens": 12, "prefill_ms": 20.5}


def capture_console() -> Console:
    return Console(width=60, color_system=None, file=io.StringIO(), force_terminal=False)


def output(console: Console) -> str:
    file = console.file
    assert isinstance(file, io.StringIO)
    return file.getvalue()


# -- status line ------------------------------------------------------------


def test_status_line() -> None:
    assert render.status_line(USAGE, "stop") == "12 tokens · TTFT 35 ms · 210.4 tok/s · cache: disk 28 tok in 86 ms"


@pytest.mark.parametrize("reason", ["cancelled", "length"])
def test_status_line_says_why_the_answer_stopped(reason: str) -> None:
    assert render.status_line(USAGE, reason) == (
        f"12 tokens · TTFT 35 ms · 210.4 tok/s · cache: disk 28 tok in 86 ms ({reason})")


@pytest.mark.parametrize(
    "cache, says",
    [
        ({"restored_from": "resident", "restored_tokens": 512, "restore_ms": 0.04},
         "cache: resident 512 tok in 0.0 ms"),
        ({"restored_from": "resident", "prefetched": True, "restored_tokens": 512, "restore_ms": 0.04},
         "cache: resident (prefetched from disk) 512 tok in 0.0 ms"),
        ({"restored_from": "warm", "restored_tokens": 512, "restore_ms": 3.14}, "cache: warm 512 tok in 3.1 ms"),
        ({"restored_from": "shared", "restored_tokens": 2048, "shared_tokens": 2048, "restore_ms": 9.5},
         "cache: shared 2048 tok in 9.5 ms"),
        ({"restored_from": "none", "restored_tokens": 0, "prefill_tokens": 40}, "cache: none, prefilled 40 tok"),
        ({"cached_tokens": 28}, "28 cached"),  # a daemon from before cache tiers
    ],
)
def test_status_line_says_where_the_cache_came_from(cache: dict[str, object], says: str) -> None:
    assert render.status_line({"completion_tokens": 3, **cache}) == f"3 tokens · {says}"


def test_status_line_says_what_a_long_read_cost() -> None:
    """A 4,946-token paste read on top of a 201-token cache in 98 s: the line said only `cache: resident 201 tok
    in 0.6 ms`. A short message read on top of a cache is not worth a part."""
    paste = {"completion_tokens": 3, "restored_from": "resident", "restored_tokens": 201, "restore_ms": 0.6,
             "prefill_tokens": 4745, "prefill_ms": 98_450.0}
    assert render.status_line(paste) == "3 tokens · cache: resident 201 tok in 0.6 ms · read 4745 tok in 98 s"
    slow = {**paste, "prefill_tokens": 90, "prefill_ms": 3140.0}  # few tokens, but a wait the user noticed
    assert render.status_line(slow).endswith(" · read 90 tok in 3.1 s")
    quick = {**paste, "prefill_tokens": 12, "prefill_ms": 40.0}
    assert render.status_line(quick) == "3 tokens · cache: resident 201 tok in 0.6 ms"
    none = {"completion_tokens": 3, "restored_from": "none", "prefill_tokens": 4946, "prefill_ms": 98_500.0}
    assert render.status_line(none) == "3 tokens · cache: none, prefilled 4946 tok in 98 s"


def test_status_line_says_a_rewind_restored_a_checkpoint_and_what_it_computed_again() -> None:
    """A hybrid model's regenerate: the state kept at the prompt's end less one id, that one id read again (a
    read that small is otherwise not worth a part, but here it is what the rewind cost)."""
    regen = {"completion_tokens": 3, "restored_from": "resident", "restored_tokens": 94, "restore_ms": 0.4,
             "checkpoint": True, "prefill_tokens": 1, "prefill_ms": 12.0}
    assert render.status_line(regen) == (
        "3 tokens · cache: resident 94 tok at a checkpoint in 0.4 ms · read 1 tok in 12 ms")
    assert render.status_line({**regen, "checkpoint": False}) == "3 tokens · cache: resident 94 tok in 0.4 ms"


def test_status_line_shows_the_acceptance_when_speculation_ran() -> None:
    ran = {**USAGE, "drafted_tokens": 52, "accepted_tokens": 41}
    assert render.status_line(ran) == (
        "12 tokens · TTFT 35 ms · 210.4 tok/s · draft 41/52 kept · cache: disk 28 tok in 86 ms")
    assert "draft" not in render.status_line({**USAGE, "drafted_tokens": 0, "accepted_tokens": 0})


def test_status_line_one_token_and_missing_fields() -> None:
    assert render.status_line({"completion_tokens": 1}) == "1 token"
    assert render.status_line({}, "cancelled") == "(cancelled)"


def test_print_status_from_chat_done() -> None:
    console = capture_console()
    render.print_status(console, {"type": "chat.done", "finish_reason": "length", "usage": USAGE})
    assert output(console) == "12 tokens · TTFT 35 ms · 210.4 tok/s · cache: disk 28 tok in 86 ms (length)\n\n"


# -- sanitizing -------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        "a\x1b[2Jb",  # clear screen
        "a\x1b[31;1mb",  # colour
        "a\x07b",  # bell
        "a\rb",  # carriage return: overwrite the line
        "a\x08b",  # backspace
        "a\x1b]0;pwned\x07b",  # set the window title
        "a\x1b]52;c;aGk=\x1b\\b",  # write the clipboard
        "a\x1bcb",  # reset the terminal
        "a\x9b2Jb",  # C1 CSI
        "a\x00\x7fb",
    ],
)
def test_sanitize_strips_what_drives_the_terminal(raw: str) -> None:
    assert render.sanitize(raw) == "ab"


def test_sanitize_keeps_newlines_tabs_and_text() -> None:
    assert render.sanitize("one\n\ttwo — über 漢字 [bold]x[/bold]") == "one\n\ttwo — über 漢字 [bold]x[/bold]"


def test_stream_sanitizer_joins_a_sequence_split_across_deltas() -> None:
    stream = render.StreamSanitizer()
    pieces = ["hello \x1b[", "2", "J world\x1b", "]0;title\x07", "!"]
    assert "".join(stream.feed(p) for p in pieces) + stream.flush() == "hello  world!"


def test_stream_sanitizer_flushes_an_unfinished_escape_as_text() -> None:
    stream = render.StreamSanitizer()
    assert stream.feed("a\x1b[3") == "a"
    assert stream.flush() == "3"


def test_answer_never_reaches_the_terminal_with_controls() -> None:
    console = capture_console()
    printer = render.answer_printer(console)
    printer.start()
    for piece in ["Hi\x1b[2J", "\x1b", "[H there\r\n", "\x07done"]:
        printer.feed(piece)
    printer.finish()
    assert output(console) == "kvd> Hi there\n     done\n"  # one paragraph; the model's newline kept


def test_a_single_newline_in_an_answer_stays_a_line_break() -> None:
    """A model's newline means one (a poem, an address, JSON outside a fence); CommonMark would join."""
    console = capture_console()
    printer = render.answer_printer(console)
    printer.start()
    printer.feed('Roses are red\nViolets are blue\n\n{\n"name": "Ada",\n"age": 36\n}')
    printer.finish()
    assert output(console) == ('kvd> Roses are red\n     Violets are blue\n\n     {\n     "name": "Ada",\n'
                               '     "age": 36\n     }\n')


def test_rich_markup_in_model_text_is_printed_literally() -> None:
    console = capture_console()
    render.print_message(console, "assistant", "[bold]x[/bold] and [red]y[/] :smile:")
    assert output(console) == "kvd> [bold]x[/bold] and [red]y[/] :smile:\n"


def test_links_show_where_they_go() -> None:
    console = capture_console()
    render.print_message(console, "assistant", "see [the docs](https://example.com/kvd)")
    assert output(console) == "kvd> see the docs (https://example.com/kvd)\n"


# -- streamed answers (tests/test_answer_stream.py has the Markdown blocks) ------


def test_answer_wraps_under_its_label() -> None:
    console = capture_console()
    printer = render.answer_printer(console)
    printer.start()
    words = [f" word{i:02d}" for i in range(20)]
    for word in words:
        printer.feed(word)
    printer.finish()
    lines = output(console).splitlines()
    assert all(len(line) <= 60 for line in lines)
    assert lines[0].startswith("kvd> word00 word01")
    assert all(line.startswith("     word") for line in lines[1:])
    assert " ".join(" ".join(lines)[len("kvd> ") :].split()) == " ".join(w.strip() for w in words)
    assert all(not line.endswith(" ") for line in lines)


def test_answer_breaks_a_word_wider_than_the_screen() -> None:
    console = capture_console()
    printer = render.answer_printer(console)
    printer.start()
    printer.feed("x" * 130)
    printer.finish()
    assert output(console) == "kvd> " + "x" * 55 + "\n     " + "x" * 55 + "\n     " + "x" * 20 + "\n"


def test_an_answer_that_never_started_prints_nothing() -> None:
    """A refused chat.send (busy, too_large) shows its error alone, no dangling label."""
    console = capture_console()
    printer = render.answer_printer(console)
    printer.finish()
    assert output(console) == ""
    printer.start()  # an empty answer still shows whose it is
    printer.finish()
    assert output(console) == "kvd>\n"


# -- header, history, errors --------------------------------------------------


SESSION = {
    "id": "3f9a0c2b7d1e4a56",
    "title": "Trip [b]planning[/b]",
    "system": None,
    "message_count": 3,
    "tokens": 512,
}
HELLO = {"type": "hello", "protocol": 1, "server": "kvd 0.1.0", "model": "builtin:tiny", "ready": True}


def test_header_names_the_session_and_model() -> None:
    console = capture_console()
    render.print_header(console, SESSION, HELLO)
    lines = output(console).splitlines()
    assert lines[0] == "Trip [b]planning[/b]"
    assert lines[1] == "session 3f9a0c2b7d1e4a56 · model builtin:tiny · kvd 0.1.0"
    assert "/help" in lines[2]


def test_header_of_a_resumed_session_counts_its_messages() -> None:
    console = capture_console()
    render.print_header(console, {**SESSION, "system": "Be brief."}, {**HELLO, "ready": False}, resumed=True)
    lines = output(console).splitlines()
    assert lines[1] == "session 3f9a0c2b7d1e4a56 · model builtin:tiny (loading) · 3 messages · kvd 0.1.0"
    assert lines[2] == "system: Be brief."


def test_history() -> None:
    console = capture_console()
    messages = [
        {"index": 0, "role": "user", "content": "Where to?", "status": "complete"},
        {"index": 1, "role": "assistant", "content": "Lisbon\x1b[2J.", "status": "complete"},
        {"index": 2, "role": "user", "content": "And then?\n  and after", "status": "complete"},
        {"index": 3, "role": "assistant", "content": "Por", "status": "cancelled"},
    ]
    render.print_history(console, messages)
    assert output(console) == (
        "you> Where to?\nkvd> Lisbon.\n\nyou> And then?\n       and after\nkvd> Por\n(cancelled)\n\n")


def test_history_with_an_api_clients_tool_calls() -> None:
    console = capture_console()
    call = {"id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    render.print_history(console, [
        {"role": "user", "content": "Weather?", "status": "complete"},
        {"role": "assistant", "content": "", "status": "complete", "tool_calls": [call]},
        {"role": "tool", "content": "18 C", "status": "complete", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "Mild.", "status": "complete"},
    ])
    assert output(console) == (
        'you> Weather?\nkvd> called get_weather({"city": "Paris"})\n\ntool result: 18 C\nkvd> Mild.\n\n')


def test_status_and_error_lines_wrap_at_words_on_a_terminal() -> None:
    """At 120 columns the terminal used to cut `176/8192 ctx` and `session` in two."""
    console = Console(width=40, color_system=None, file=io.StringIO(), force_terminal=True)
    render.print_error(console, "the conversation no longer fits; start a new session carrying less of the history")
    render.print_status(console, {"usage": {"completion_tokens": 20, "ttft_ms": 1677, "tokens_per_second": 3.2,
                                            "restored_from": "resident", "restored_tokens": 45, "restore_ms": 0.0,
                                            "context_tokens": 176, "context_window": 8192}})
    lines = output(console).splitlines()
    assert all(len(line) <= 40 for line in lines), lines
    words = " ".join(lines).split()
    assert "session" in words and "carrying" in words, lines
    # The status line is broken between its parts, never inside one.
    assert lines[3:6] == ["20 tokens · TTFT 1677 ms", "cache: resident 45 tok in 0.0 ms", "176/8192 ctx"], lines


def test_error_is_one_line() -> None:
    console = capture_console()
    render.print_error(console, "kvd is not running at ws://127.0.0.1:8765/v1. Start it with: kvd serve")
    assert output(console) == "error: kvd is not running at ws://127.0.0.1:8765/v1. Start it with: kvd serve\n"


def test_error_from_the_wire_is_sanitized_and_literal() -> None:
    console = capture_console()
    render.print_error(console, "no session '[red]\x1b[2Jx'")
    assert output(console) == "error: no session '[red]x'\n"


def test_prompt_is_plain_without_colour_and_styled_with_it() -> None:
    assert render.prompt(capture_console(), render.YOU, render.YOU_STYLE) == "you> "
    colour = Console(width=60, color_system="standard", file=io.StringIO(), force_terminal=True)
    styled = render.prompt(colour, render.YOU, render.YOU_STYLE)
    assert styled.startswith("\x1b[") and "you> " in styled and styled.endswith("\x1b[0m")


# -- input --------------------------------------------------------------------


def test_backslash_continues_the_message() -> None:
    lines = iter(["first \\", "second\\", "third"])
    prompts: list[str] = []

    def read(prompt: str) -> str:
        prompts.append(prompt)
        return next(lines)

    assert read_message("you> ", "...> ", read) == "first \nsecond\nthird"
    assert prompts == ["you> ", "...> ", "...> "]


def test_a_backslash_typed_after_a_paste_continues_the_message() -> None:
    # A bracketed paste reaches read_message as one line holding its newlines.
    lines = iter(["pasted one\npasted two\\", "typed after"])
    assert read_message("you> ", "...> ", lambda prompt: next(lines)) == "pasted one\npasted two\ntyped after"
    lines = iter(["pasted one\npasted two\n"])
    assert read_message("you> ", "...> ", lambda prompt: next(lines)) == "pasted one\npasted two"


def test_ctrl_d_on_a_continuation_line_ends_the_message() -> None:
    lines = iter(["first \\"])

    def read(prompt: str) -> str:
        for line in lines:
            return line
        raise EOFError

    assert read_message("you> ", "...> ", read) == "first "
    with pytest.raises(EOFError):
        read_message("you> ", "...> ", read)


def test_triple_quotes_open_and_close_a_block() -> None:
    lines = iter(['"""', "def f():", "    return 1  \\", "", '"""', "next"])
    prompts: list[str] = []

    def read(prompt: str) -> str:
        prompts.append(prompt)
        return next(lines)

    assert read_message("you> ", "...> ", read) == "def f():\n    return 1  \\\n"
    assert prompts == ["you> ", "...> ", "...> ", "...> ", "...> "]
    assert read_message("you> ", "...> ", read) == "next"
    # Three quotes inside a message are text.
    assert read_message("you> ", "...> ", lambda prompt: 'say """hi"""') == 'say """hi"""'


# -- import-light ---------------------------------------------------------------


def test_kvchat_imports_no_mlx_numpy_or_stores() -> None:
    """kvchat runs where mlx does not; only the protocol package may come along (not its pydantic shapes)."""
    check = (
        "import tui.cli, sys; "
        "heavy = {'mlx','mlx_lm','numpy','pydantic','sessions','cachestore'}; "
        "assert not any(m.split('.')[0] in heavy for m in sys.modules), "
        "sorted(m for m in sys.modules if m.split('.')[0] in heavy); "
        "daemon = sorted(m for m in sys.modules if m == 'daemon' or m.startswith('daemon.')); "
        "assert daemon == [], daemon; "
        "assert 'protocol' in sys.modules"
    )
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr



def test_a_queued_turn_says_how_many_are_ahead_and_unknown_events_are_ignored() -> None:
    from tui.turn import show

    console = capture_console()
    printer = render.answer_printer(console)
    events: list[dict[str, Any]] = [
        {"type": "chat.queued", "id": "r1", "session": "s", "position": 2},
        {"type": "chat.start", "id": "r1", "message_index": 1},
        {"type": "chat.something_new", "id": "r1"},
        {"type": "chat.delta", "id": "r1", "seq": 0, "text": "Hello."},
    ]
    assert all(show(printer, event) is None for event in events)
    done = {"type": "chat.done", "id": "r1", "finish_reason": "stop", "usage": {}}
    assert show(printer, done) is done
    printer.finish()
    assert output(console) == "waiting for the daemon: 2 ahead of you\nkvd> Hello.\n"


CAPITALS = ["France", "Spain", "Portugal", "Italy"]


def capital_sessions() -> list[dict[str, object]]:
    sessions: list[dict[str, object]] = [
        {"id": f"{i:016x}", "title": f"What is the capital of {country}?", "message_count": 2 * (i + 1),
         "last_message": "It is a city.", "tokens": 40, "cache": "disk", "origin": "kvchat one-shot",
         "updated_at": 1000.0 - 60 * i}
        for i, country in enumerate(CAPITALS)]
    sessions.insert(0, {"id": "00000000000000ff", "title": "What is the capital of Spain? (compacted)",
                        "system": "Earlier in this conversation (carried over from the session "
                                  "'What is the capital of Spain?', 0000000000000001):\n\nUser: hi",
                        "message_count": 0, "tokens": 0, "cache": "none", "origin": "kvchat", "updated_at": 1000.0})
    return sessions


def test_the_session_list_tells_look_alikes_apart_at_120_columns() -> None:
    from tui import listing

    console = Console(width=120, color_system=None, file=io.StringIO(), force_terminal=False)
    console.print(listing.sessions_table(capital_sessions(), width=120, now=1000.0), soft_wrap=True)
    lines = output(console).splitlines()
    assert lines[0].split() == ["#", "title", "last", "message", "msgs", "tokens", "cache", "from", "last", "used"]
    for country in CAPITALS:  # the whole title, not `What is the capital of …`
        assert any(f"What is the capital of {country}?" in line for line in lines), lines
    assert "What is the capital of Spain? (compacted) ← #3" in lines[1], lines  # compacted from row 3
    assert re.search(r"What is the capital of Portugal\? +It is a city\. +6 +40 +disk +one-shot +2 min ago",
                     lines[4]), lines


def test_a_title_prefix_of_several_sessions_lists_them_to_pick_from() -> None:
    from tui import listing

    found = listing.find(capital_sessions(), "what is the capital")
    assert isinstance(found, str)
    lines = found.splitlines()
    assert lines[0] == "'what is the capital' starts 5 titles; type the number of the one you mean:"
    assert lines[3].split()[0] == "3" and "What is the capital of Spain?  (4 messages," in lines[3], lines
    assert listing.find(capital_sessions(), "3")["title"] == "What is the capital of Spain?"  # type: ignore[index]


def read_times(total: int, chunk: int, a: float, b: float, start: float = 0.0) -> list[tuple[int, float]]:
    """(fed, time) at each chunk's end, for a read whose token at position p takes a + b*p seconds."""
    out, now = [], start
    for fed in range(chunk, total + 1, chunk):
        now += a * chunk + b * (fed * fed - (fed - chunk) ** 2) / 2
        out.append((fed, now))
    return out


def test_the_reading_estimate_follows_a_prefill_that_slows_down() -> None:
    """7414 tokens read in about 140 s, each later token slower (attention looks back further): at 4632
    tokens the old estimate (the average rate so far) said about half the true time left."""
    from tui.estimate import PrefillClock

    total, a, b = 7424, 0.004, 4e-6
    times = read_times(total, 256, a, b)
    clock = PrefillClock()
    clock.start()
    for fed, now in times:
        clock.observe(fed, now)
        if fed == 4608:
            break
    truth = times[-1][1] - now
    left = clock.seconds_left(4608, total)
    assert left is not None and abs(left - truth) < 0.05 * truth, (left, truth)
    fed0, t0 = times[0]
    average = (total - 4608) / ((4608 - fed0) / (now - t0))
    assert average < 0.75 * truth  # what kvchat said before
    # The next read: its first progress already has an estimate, shaped by this read.
    for fed, then in times[times.index((4608, now)) + 1:]:
        clock.observe(fed, then)
    clock.start()
    clock.observe(256, 1000.0)
    first = clock.seconds_left(256, total)
    assert first is not None and abs(first - (times[-1][1] - times[0][1])) < 0.05 * times[-1][1]


def test_the_reading_line_shows_the_estimate() -> None:
    console = capture_console()
    printer = render.answer_printer(console)
    printer.progress(256, 1024, 10.0)
    assert printer.reading == "reading 256/1024 tokens"
    printer.progress(512, 1024, 11.0)
    assert printer.reading == "reading 512/1024 tokens, about 2 s left"


def test_a_narrow_list_gives_the_title_the_room() -> None:
    from tui import listing

    console = Console(width=70, color_system=None, file=io.StringIO(), force_terminal=False)
    console.print(listing.sessions_table(capital_sessions(), width=70, now=1000.0), soft_wrap=True)
    lines = output(console).splitlines()
    assert lines[0].split() == ["#", "title", "msgs", "tokens", "cache", "from", "last", "used"], lines
    assert "What is the capital of P…" in lines[4], lines  # not `What is …`


def test_an_answer_made_only_of_html_is_visible_as_it_arrives() -> None:
    """`</strong>` 197 times rendered as nothing (Rich drops inline HTML): an empty `kvd>` for 80 s."""
    from tui.answer import AnswerPrinter

    console = Console(width=60, file=io.StringIO(), force_terminal=True, color_system=None)
    printer = AnswerPrinter(console, "kvd> ", "bold")
    printer.start()
    try:
        for _ in range(30):
            printer.feed("</strong>")
        live = "".join(seg.text for line in printer.tail_lines(room=6) for seg in line)
        assert live.count("</strong>") >= 10, live  # on screen while it streams
        printer.feed("\n\n<div class=\"x\">\n<b>bold</b>\n</div>\n\nsome <!-- a comment --> text\n")
    finally:
        printer.finish()
    assert isinstance(console.file, io.StringIO)
    plain = console.file.getvalue()
    assert '<div class="x">' in plain and "<b>bold</b>" in plain and "some <!-- a comment --> text" in plain, plain


def test_a_turn_without_a_cache_for_its_model_says_which_models_keep_one() -> None:
    usage = {"restored_from": "none", "prefill_tokens": 40, "model": "builtin:gemma3", "kept_for": ["builtin:smollm2"]}
    assert render.cache_part(usage) == "cache: none for gemma3 (kept for smollm2), prefilled 40 tok"
    alone = {"restored_from": "none", "prefill_tokens": 40, "model": "x"}
    assert render.cache_part(alone) == "cache: none, prefilled 40 tok"


def test_a_long_paste_is_written_back_cut_with_its_size_in_words_that_agree() -> None:
    """A 40,000-character paste of one line was written back as `(39,999 characters, 1 lines in all; …)`."""
    from tui.terminal import echoed

    one = echoed("word " * 8000)
    assert one.endswith("\n\x1b[2m… (40,000 characters in all; Up recalls it whole)\x1b[0m"), one[-80:]
    many = echoed("\n".join(["x" * 99] * 400))
    assert many.endswith("… (39,999 characters, 400 lines in all; Up recalls it whole)\x1b[0m"), many[-80:]
    assert echoed("short\n") == "short"


def test_an_answer_kvd_died_writing_says_so_not_error() -> None:
    """Resumed after kvd was killed mid-answer, the answer showed `(error)`, which read as a failure of the
    model or of kvchat."""
    console = Console(width=60, color_system=None, file=io.StringIO(), force_terminal=False)
    render.print_history(console, [
        {"index": 0, "role": "user", "content": "Tell me a story.", "status": "complete"},
        {"index": 1, "role": "assistant", "content": "Once upon a", "status": "error", "finish_reason": "interrupted"},
        {"index": 2, "role": "user", "content": "Again.", "status": "complete"},
        {"index": 3, "role": "assistant", "content": "No", "status": "error", "finish_reason": "error"}])
    lines = output(console).splitlines()
    assert lines[2] == "(cut off: kvd stopped while writing it)" and "(error)" in lines, lines
