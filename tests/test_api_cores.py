"""The API's pure parts as tables: stop sequences, Host names, placing a stateless request."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from daemon.config import load_config
from daemon.doors.guards import host_allowed, host_name
from daemon.doors.httpdoor import DOOR, REFUSED, ApiError
from daemon.doors.placement import Said, links
from daemon.doors.titles import title_for
from daemon.server import RefusalLog
from daemon.turn import StopScan
from sessions.chains import Chains


@pytest.mark.parametrize(
    "stops, deltas, shown, hit",
    [
        (["END"], ["hello ", "world"], ["hello ", "world"], False),
        (["END"], ["hello E", "N", "D and more"], ["hello ", "", ""], True),
        (["END"], ["hello E", "Nx"], ["hello ", "ENx"], False),  # held back, then released
        (["\n\n", "User:"], ["a\n", "\nb"], ["a", ""], True),
        (["ab", "b"], ["xab"], ["x"], True),  # the earliest stop wins
        (["stop"], ["sto", "p"], ["", ""], True),
    ],
)
def test_stop_scan(stops: list[str], deltas: list[str], shown: list[str], hit: bool) -> None:
    scan = StopScan(stops)
    assert [scan.feed(d) for d in deltas] == shown
    assert scan.hit == hit
    rest = scan.flush()
    assert "".join(shown) + rest == scan.text
    assert not any(s in scan.text for s in stops)


@pytest.mark.parametrize(
    "header, name",
    [("localhost:8765", "localhost"), ("[::1]:80", "::1"), ("127.0.0.1", "127.0.0.1"), ("Example.COM.", "example.com"),
     ("::1", "::1")],
)
def test_host_name(header: str, name: str) -> None:
    assert host_name(header) == name


def test_host_allowed(tmp_path: Path) -> None:
    config = load_config(None, data_dir=tmp_path, allowed_hosts=["box.local"])
    for ok in ("localhost", "127.0.0.1:9", "127.1.2.3", "[::1]:8765", "box.local:8765", "LOCALHOST"):
        assert host_allowed(ok, config), ok
    for bad in (None, "", "evil.example", "localhost.evil.example", "127.0.0.1.nip.io", "10.0.0.1", "[::2]"):
        assert not host_allowed(bad, config), bad
    lan = load_config(None, data_dir=tmp_path, host="192.168.1.5")
    assert host_allowed("192.168.1.5:8765", lan) and not host_allowed("192.168.1.6", lan)


def test_agreement_and_titles() -> None:
    a, b = Said("user", "hi"), Said("assistant", "hello")
    chains = Chains()
    chains.put("s", None, [{"index": i, "role": m.role, "content": m.content} for i, m in enumerate([a, b])])
    assert chains.agree("s", links(None, [a, b, Said("user", "more")])) == 2
    assert chains.agree("s", links(None, [a, Said("assistant", "hullo")])) == 1
    assert chains.agree("s", links("a system prompt", [a, b])) == 0  # the chain is rooted in it
    assert title_for([Said("user", "  What is a KV cache?\nsecond line")]) == "What is a KV cache?"
    assert len(title_for([Said("user", "x" * 500)])) == 60
    assert title_for([Said("assistant", "only")]) == "New chat"
    # An agent's own text is not a title: Claude Code's context before the question, its title request's
    # <session>, Codex's AGENTS.md and environment as user messages of their own.
    reminder = "<system-reminder>\nContents of /w/CLAUDE.md:\nRun the tests.\n</system-reminder>\n"
    assert title_for([Said("user", f"{reminder}Say hello.")]) == "Say hello."
    assert title_for([Said("user", "<session>\nSay hello.\n</session>\n\nWrite the title in ...")]) == "Say hello."
    codex = [Said("user", "# AGENTS.md instructions for /w\n\n<INSTRUCTIONS>\nbe brief\n</INSTRUCTIONS>"),
             Said("user", "<environment_context>\n  <cwd>/w</cwd>\n</environment_context>")]
    assert title_for([*codex, Said("user", "List the files.")]) == "List the files."
    assert title_for(codex) == "New chat"  # nothing of the user's yet
    assert title_for([Said("user", "Use <b>bold</b> here")]) == "Use <b>bold</b> here"
    # A tool call is the same call when a client sends its arguments back re-serialized; another id is not.
    call = {"id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}
    called = links(None, [a, Said("assistant", "", (call,))])
    assert links(None, [a, Said("assistant", "", ({**call, "arguments": '{"unit":"C","city":"Paris"}'},))]) == called
    assert links(None, [a, Said("assistant", "", ({**call, "id": "call_2"},))])[1] != called[1]
    assert links(None, [Said("tool", "18", tool_call_id="call_1")]) != links(None, [Said("tool", "18",
                                                                                        tool_call_id="x")])


@pytest.mark.parametrize("body, holds", [
    (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', True),
    (b'{"messages": [{"role": "user", "content": "a\\uDFFFb"}]}', True),
    ('{"messages": [{"role": "user", "content": "a\ud800b"}]}'.encode("utf-8", "surrogatepass"), True),
    ('{"messages": [{"role": "user", "content": "a\ud800b"}]}'.encode("utf-16", "surrogatepass"), True),
    (b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00 \\u00e9"}]}', True),  # a pair: walked
    ('{"messages": [{"role": "user", "content": "\U0001f600 \\u00e9 \\\\ud800"}]}'.encode(), True),
    ('{"messages": [{"role": "user", "content": "\U0001f600 \\u00e9 caf\u00e9"}]}'.encode(), False),
])
def test_a_body_that_cannot_hold_a_surrogate_is_not_walked_for_one(body: bytes, holds: bool) -> None:
    """The bytes say when the decoded body may hold a surrogate; each one that may is walked, a lone one refused."""
    import json
    from functools import partial

    from daemon.doors.httpdoor import ApiError, may_hold_surrogates, read_bytes
    from daemon.doors.openai_api import _read
    from protocol.shapes import lone_surrogate

    assert may_hold_surrogates(body) == holds
    lone = lone_surrogate(json.loads(body)) is not None
    assert holds or not lone
    config = load_config(None, model="builtin:tiny")
    if lone:
        with pytest.raises(ApiError, match="lone UTF-16 surrogate"):
            read_bytes(body, partial(_read, config=config))
    else:
        assert read_bytes(body, partial(_read, config=config))[0].messages[0].role == "user"


def test_a_client_that_repeats_a_refused_request_is_logged_once_a_second(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvd.server")
    now = [100.0]
    refusals = RefusalLog(clock=lambda: now[0])

    def refuse(code: str) -> None:
        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "client": ("127.0.0.1", 5),
                 "headers": [], DOOR: "chat", REFUSED: ApiError(400, f"bad {code}", code=code)}  # type: ignore[arg-type]
        refusals.said(scope, 400)

    for _ in range(3):
        refuse("a")
    refuse("b")  # another kind: its own line
    now[0] += 1.0
    refuse("a")
    lines = [r.getMessage() for r in caplog.records if r.name == "kvd.server"]
    assert lines == [
        "refused (chat door) POST /v1/chat/completions from 127.0.0.1:5: HTTP 400 a: bad a",
        "refused (chat door) POST /v1/chat/completions from 127.0.0.1:5: HTTP 400 b: bad b",
        "refused (chat door) POST /v1/chat/completions from 127.0.0.1:5: HTTP 400 a: bad a (2 more like it not logged)",
    ], lines
