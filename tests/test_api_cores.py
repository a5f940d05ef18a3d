"""The API's pure parts as tables: stop sequences, Host names, placing a stateless request, the prefix index."""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

import pytest

from daemon.config import load_config
from daemon.guards import host_allowed, host_name
from daemon.stateless import divergence, title_for
from daemon.turns import StopScan
from sessions import Store
from sessions.prefixes import BLOCK, block_keys


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
    a, b = ("user", "hi"), ("assistant", "hello")
    assert divergence([a, b], [a, b, ("user", "more")]) == 2
    assert divergence([a, b], [a, ("assistant", "hullo")]) == 1
    assert divergence([], [a]) == 0
    assert title_for([("user", "  What is a KV cache?\nsecond line")]) == "What is a KV cache?"
    assert len(title_for([("user", "x" * 500)])) == 60
    assert title_for([("assistant", "only")]) == "New chat"


def test_prefix_index_finds_the_longest_true_prefix(tmp_path: Path) -> None:
    rng = random.Random(7)
    store = Store(tmp_path / "kvd.sqlite")
    system = [rng.randrange(50000) for _ in range(3 * BLOCK + 5)]  # shared by every session
    sessions = {}
    for _ in range(300):
        sid = store.create_session(title="New chat")["id"]
        ids = system + [rng.randrange(50000) for _ in range(rng.randrange(BLOCK, 20 * BLOCK))]
        store.set_tokens(sid, ids)
        sessions[sid] = ids
    target, ids = next(iter(sessions.items()))
    # A request continuing one session finds it alone, at its deepest whole block.
    depth, found = store.sharing_prefix(ids + [1, 2, 3])
    assert found == [target] and depth == len(ids) // BLOCK * BLOCK
    # One sharing only the system prompt finds the most recently used sessions sharing it.
    depth, found = store.sharing_prefix(system + [9] * 40)
    assert depth == 3 * BLOCK and len(found) == 8 and set(found) <= set(sessions)
    # Less than a block in common: nothing.
    assert store.sharing_prefix(system[:BLOCK - 1]) == (0, [])
    assert store.sharing_prefix([]) == (0, [])
    # A session's ids rewritten (a rewind) re-key only its blocks past the change.
    store.set_tokens(target, ids[:2 * BLOCK] + [5] * BLOCK)
    depth, found = store.sharing_prefix(ids)
    assert depth == 3 * BLOCK and target not in found  # the others still share the system prompt's 3 blocks
    assert store.sharing_prefix(ids[:2 * BLOCK] + [5] * BLOCK) == (3 * BLOCK, [target])
    # Deleting a session drops its keys.
    store.delete_session(target)
    assert target not in store.sharing_prefix(ids[:2 * BLOCK] + [5] * BLOCK)[1]
    store.close()


def test_migration_indexes_existing_sessions(tmp_path: Path) -> None:
    """m003 keys the fed ids sessions already had, so conversations from before the upgrade are found."""
    path = tmp_path / "kvd.sqlite"
    ids = list(range(1000, 1000 + 5 * BLOCK + 3))
    with Store(path) as store:
        sid = store.create_session(title="New chat")["id"]
        store.set_tokens(sid, ids)
    db = sqlite3.connect(path)
    db.execute("DELETE FROM fed_blocks")
    db.execute("DELETE FROM _kvd_migrations WHERE name = 'm003_fed_blocks'")
    db.execute("DROP TABLE fed_blocks")
    db.commit()
    db.close()
    with Store(path) as store:
        assert store.sharing_prefix(ids + [1]) == (5 * BLOCK, [sid])
    assert len(block_keys(ids)) == 5
