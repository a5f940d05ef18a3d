"""Cache files gone at start (issue 25): kvd starts, cuts the chains there, and prefills exactly.

A real `kvd serve`, restarted over a cache directory with files deleted the
ways a crash leaves them: a shared block with a successor, and an eviction
that unlinked a session's files but never unlisted them (killed in between,
or its transaction rolled back on a full disk: the same state on disk).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cachestore.index import SegmentIndex
from conftest import fed_tokens, greedy_reference
from daemonproc import DaemonProcess

BLOCK = 16
SYSTEM = "You are a careful assistant who answers about caches. " * 3
FIRST = "Tell me everything about caches. " * 3


def _check_exact(data: Path, session: str, done: dict[str, Any]) -> None:
    """The answer equals a fresh full prefill's greedy continuation of the same ids."""
    u = done["usage"]
    tokens = fed_tokens(data / "kvd.sqlite", session)
    reference = greedy_reference(data / "models" / "tiny", tokens[: u["prompt_tokens"]], u["completion_tokens"])
    got = tokens[u["prompt_tokens"]:]
    stopped = done["finish_reason"] == "stop" and len(reference) == len(got) + 1
    assert got == reference[:len(got)] and (len(got) == len(reference) or stopped)


def _two_sessions(data: Path, second_text: str) -> tuple[str, str, int]:
    """Two sessions with one system prompt; returns their ids and how many ids the first has fed."""
    d = DaemonProcess(data, block_tokens=BLOCK)
    with d.client() as c:
        first = c.request("session.create", system=SYSTEM)["session"]["id"]
        second = c.request("session.create", system=SYSTEM)["session"]["id"]
        fed = 0
        for sid, text in ((first, FIRST), (second, second_text)):
            _, done = c.chat(sid, text, max_tokens=8, temperature=0)
            assert done["type"] == "chat.done", done
            fed = fed or done["usage"]["prompt_tokens"] + done["usage"]["completion_tokens"]
    assert d.terminate() == 0
    return first, second, fed


def _resume_both(data: Path, first: str, second: str) -> tuple[dict[str, Any], dict[str, Any], str]:
    d = DaemonProcess(data, block_tokens=BLOCK)
    try:
        with d.client() as c:
            _, a = c.chat(first, "And then?", max_tokens=8, temperature=0)
            _, b = c.chat(second, "And then?", max_tokens=8, temperature=0)
    finally:
        assert d.terminate() == 0
    assert a["type"] == b["type"] == "chat.done", (a, b)
    return a, b, "".join(d.log)


def test_a_deleted_shared_block_with_a_successor_cuts_both_chains_there(tmp_path: Path) -> None:
    first, second, _ = _two_sessions(tmp_path, FIRST)
    index = SegmentIndex(tmp_path / "cache")
    chain = index.blocks_of(first)
    assert [b.block for b in chain] == [b.block for b in index.blocks_of(second)] and len(chain) >= 3
    chain[1].path.unlink()  # the second block: it has a successor, and both sessions list it
    index.close()

    a, b, log = _resume_both(tmp_path, first, second)

    assert "Traceback" not in log and "error" not in log.lower()
    assert f"cache block {chain[1].path} is missing; 2 session(s)" in log
    assert a["usage"]["restored_from"] == "disk" and a["usage"]["cached_tokens"] == BLOCK  # then a prefill
    # The first session's turn wrote the blocks again (the same keys): the second finds them.
    assert b["usage"]["restored_from"] == "shared" and b["usage"]["cached_tokens"] > BLOCK
    _check_exact(tmp_path, first, a)
    _check_exact(tmp_path, second, b)


def test_an_eviction_that_unlinked_but_never_unlisted_leaves_a_startable_cache(tmp_path: Path) -> None:
    first, second, fed = _two_sessions(tmp_path, FIRST + "And a different ending for this one. " * 3)
    index = SegmentIndex(tmp_path / "cache")
    mine, theirs = index.blocks_of(second), index.blocks_of(first)
    shared = sum(1 for x, y in zip(mine, theirs, strict=False) if x.block == y.block)
    assert 1 <= shared < len(mine)
    # What evict() deletes before it unlists: the session's segments and the blocks only it lists.
    for path in [row.path for row in index.chain(second)] + [row.path for row in mine[shared:]]:
        path.unlink()
    index.close()

    a, b, log = _resume_both(tmp_path, first, second)

    assert "Traceback" not in log and "error" not in log.lower()
    assert a["usage"]["restored_from"] == "disk"  # the first session's chain is whole
    assert a["usage"]["cached_tokens"] == fed
    # Its own chain is gone: what it shares with the first session (up to where their ids part), then a prefill.
    assert b["usage"]["restored_from"] == "shared"
    assert shared * BLOCK <= b["usage"]["cached_tokens"] < (shared + 1) * BLOCK, b
    _check_exact(tmp_path, first, a)
    _check_exact(tmp_path, second, b)

