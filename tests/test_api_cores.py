"""The API's pure parts as tables: stop sequences, Host names, placing a stateless request."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.config import load_config
from daemon.doors.guards import host_allowed, host_name
from daemon.doors.placement import Said, divergence, title_for
from daemon.turns import StopScan
from sessions import Store


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


def test_divergence_and_titles() -> None:
    a, b = Said("user", "hi"), Said("assistant", "hello")
    assert divergence([a, b], [a, b, Said("user", "more")]) == 2
    assert divergence([a, b], [a, Said("assistant", "hullo")]) == 1
    assert divergence([], [a]) == 0
    assert title_for([Said("user", "  What is a KV cache?\nsecond line")]) == "What is a KV cache?"
    assert len(title_for([Said("user", "x" * 500)])) == 60
    assert title_for([Said("assistant", "only")]) == "New chat"
    # A tool call is the same call when a client sends its arguments back re-serialized; another id is not.
    call = {"id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}
    called = Said("assistant", "", (call,))
    echoed = Said("assistant", "", ({**call, "arguments": '{"unit":"C","city":"Paris"}'},))
    assert divergence([a, called], [a, echoed]) == 2
    assert divergence([a, called], [a, Said("assistant", "", ({**call, "id": "call_2"},))]) == 1
    assert divergence([Said("tool", "18", tool_call_id="call_1")], [Said("tool", "18", tool_call_id="x")]) == 0


def test_continuable_sessions_share_the_system_prompt_and_first_message(tmp_path: Path) -> None:
    """The candidates a stateless request may continue: most recent first, at most `limit`."""
    clock = iter(range(1, 1000))
    store = Store(tmp_path / "kvd.sqlite", clock=lambda: float(next(clock)))
    made = []
    for system in ("Be brief.", None):
        for _ in range(3):
            sid = store.create_session(title="New chat", system=system)["id"]
            store.append_message(sid, "user", "hi")
            store.append_message(sid, "assistant", "hello")
            made.append((system, sid))
    other = store.create_session(title="New chat", system="Be brief.")["id"]
    store.append_message(other, "user", "something else")
    brief = [sid for system, sid in made if system == "Be brief."]
    bare = [sid for system, sid in made if system is None]
    assert store.continuable("Be brief.", "user", "hi") == brief[::-1]
    assert store.continuable(None, "user", "hi") == bare[::-1]
    assert store.continuable("Be brief.", "user", "hi", limit=2) == brief[::-1][:2]
    assert store.continuable("Be brief.", "user", "something else") == [other]
    assert store.continuable("Other.", "user", "hi") == []
    store.append_message(brief[0], "user", "more")  # used again: first now
    assert store.continuable("Be brief.", "user", "hi")[0] == brief[0]
    store.delete_session(brief[0])
    assert brief[0] not in store.continuable("Be brief.", "user", "hi")
    store.close()
