"""The I/O worker behind SessionCaches: what holds while a write is still queued.

The worker is held at a gate (a job that waits on an Event), so "queued" is a
state the test controls, not a race it hopes to win.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.models.cache import make_prompt_cache

from cachestore import SessionCaches, ioworker
from cachestore.ioworker import FirstTokens
from cachestore.rows import BlockRow, SegmentRow
from test_direct import greedy
from test_store_tiers import A, B, Clock, budgets, grow


@pytest.fixture
def model(models: dict[str, Any]) -> Any:
    return models["builtin:tiny"]


@pytest.fixture
def gate() -> Iterator[threading.Event]:
    g = threading.Event()
    yield g
    g.set()  # never leave a worker waiting


def files(root: Path, key: str) -> list[Path]:
    return sorted((root / "segments" / key).rglob("*.safetensors")) if (root / "segments" / key).exists() else []


def test_a_checkin_does_not_wait_for_disk(model: Any, tmp_path: Path, gate: threading.Event) -> None:
    caches = SessionCaches(tmp_path, "fp", budgets(), clock=Clock())
    caches.after_writes(gate.wait)  # the worker is busy with something slow
    cache, toks = grow(model, None, [], list(range(10, 40)))
    caches.checkin(A, cache, toks)  # returns with the write queued
    assert caches.index.chain(A) == [] and files(tmp_path, A) == []
    gate.set()
    caches.flush()
    assert [(r.start, r.end) for r in caches.index.chain(A)] == [(0, 30)] and len(files(tmp_path, A)) == 1
    caches.close()


def test_a_warm_snapshot_is_kept_until_disk_holds_it(model: Any, tmp_path: Path, gate: threading.Event) -> None:
    clock = Clock()
    caches = SessionCaches(tmp_path, "fp", budgets(resident_bytes=0, warm_bytes=0), clock=clock)
    caches.after_writes(gate.wait)
    cache, toks = grow(model, None, [], list(range(10, 40)))
    caches.checkin(A, cache, toks)  # no room resident or warm: only disk would hold it, and it is queued
    assert A not in caches.resident and A not in caches.warm
    assert caches.locations() == {A: "warm"}
    got = caches.checkout(A, toks + [7])
    assert got.restored_from == "warm" and got.tokens == len(toks)  # not a prefill from nothing
    caches.checkin(A, cache, toks)
    gate.set()
    caches.flush()
    assert caches.locations() == {A: "disk"}  # written: the copy in memory is let go
    got = caches.checkout(A, toks + [7])
    assert got.restored_from == "disk" and got.tokens == len(toks)
    caches.close()


def test_a_session_forgotten_while_its_write_is_queued_leaves_nothing(model: Any, tmp_path: Path,
                                                                        gate: threading.Event) -> None:
    caches = SessionCaches(tmp_path, "fp", budgets(), clock=Clock())
    cache, toks = grow(model, None, [], list(range(10, 40)))
    caches.checkin(A, cache, toks)
    caches.flush()
    caches.after_writes(gate.wait)
    cache, toks = grow(model, cache, toks, list(range(50, 60)))
    caches.checkin(A, cache, toks)  # turn two's segment queued...
    caches.forget(A)  # ...and the session deleted before it is written
    gate.set()
    caches.flush()
    assert caches.index.chain(A) == [] and files(tmp_path, A) == []
    assert caches.locations() == {}
    caches.close()


def test_a_rewind_while_a_write_is_queued_indexes_only_the_new_history(model: Any, tmp_path: Path,
                                                                        gate: threading.Event) -> None:
    caches = SessionCaches(tmp_path, "fp", budgets(), clock=Clock())
    cache, toks = grow(model, None, [], list(range(10, 30)))
    caches.checkin(A, cache, toks)
    caches.flush()
    caches.after_writes(gate.wait)
    old, old_toks = grow(model, cache, toks, list(range(50, 60)))
    caches.checkin(A, old, old_toks)  # [20, 30) queued
    got = caches.checkout(A, toks + [99])  # regenerate: back to the first 20 tokens
    assert got.restored_from == "resident" and got.cache is not None
    new, new_toks = grow(model, got.cache, toks, list(range(70, 75)))
    caches.checkin(A, new, new_toks)  # [20, 25) of another history, planned on top of [0, 20)
    gate.set()
    caches.flush()
    chain = caches.index.chain(A)
    assert [(r.start, r.end) for r in chain] == [(0, 20), (20, 25)]
    assert [t for r in chain for t in r.tokens] == new_toks
    assert len(files(tmp_path, A)) == 2
    caches.resident.discard(A)
    got = caches.checkout(A, new_toks + [7])
    assert got.restored_from == "disk" and got.tokens == len(new_toks)
    caches.close()


def test_each_thread_has_its_own_index_connection(tmp_path: Path) -> None:
    caches = SessionCaches(tmp_path, "fp", budgets(), clock=Clock())
    seen: list[Any] = []
    caches.after_writes(lambda: seen.append(caches.index))
    caches.flush()
    assert seen and seen[0] is not caches.index and seen[0].db is not caches.index.db
    caches.close()


def test_close_finishes_the_queued_writes(model: Any, tmp_path: Path) -> None:
    caches = SessionCaches(tmp_path, "fp", budgets(), clock=Clock())
    for key in (A, B):
        cache, toks = grow(model, None, [], list(range(10, 40)))
        caches.checkin(key, cache, toks)
    caches.close()
    again = SessionCaches(tmp_path, "fp", budgets(), clock=Clock())
    assert {k for k, _ in again.index.keys_by_use()} == {A, B}
    again.close()


def disk_ids(caches: SessionCaches, key: str) -> list[int]:
    """The token ids the session's disk chain holds: its blocks, then its private segments."""
    rows: list[BlockRow | SegmentRow] = [*caches.index.blocks_of(key), *caches.index.chain(key)]
    return [t for row in rows for t in row.tokens]


def test_turns_planned_while_the_worker_is_busy_reach_disk_whole(model: Any, tmp_path: Path,
                                                                  gate: threading.Event,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """Blocks completed, a tail appended, a rewind, a compaction: all planned before any was written."""
    caplog.set_level(logging.DEBUG, logger="kvd.cache")
    caches = SessionCaches(tmp_path, "fp", budgets(block_tokens=8, max_segments=2), clock=Clock())
    caches.after_writes(gate.wait)
    cache, toks = grow(model, None, [], list(range(10, 30)))  # two blocks and a tail of 4
    caches.checkin(A, cache, toks)
    for more in ([40, 41, 42], [43], [44, 45], list(range(50, 62))):  # appends, a compaction, new blocks
        cache, toks = grow(model, cache, toks, more)
        caches.checkin(A, cache, toks)
    got = caches.checkout(A, toks[:12] + [99])  # a rewind into the second block
    assert got.restored_from == "resident" and got.cache is not None
    cache, toks = grow(model, got.cache, toks[:12], [70, 71, 72, 73, 74, 75])
    caches.checkin(A, cache, toks)
    assert disk_ids(caches, A) == []  # nothing written yet: the worker is still at the gate
    gate.set()
    caches.flush()
    assert disk_ids(caches, A) == toks
    assert not [r for r in caplog.records if "not writing the cache" in r.getMessage()]
    caches.resident.discard(A)
    caches.warm.discard(A)
    out = caches.checkout(A, toks + [7])
    assert out.restored_from == "disk" and out.tokens == len(toks) and out.cache is not None
    assert greedy(model, out.cache, [7]) == greedy(model, make_prompt_cache(model), toks + [7])
    caches.close()


def test_a_block_not_yet_written_is_not_found_by_another_session(model: Any, tmp_path: Path,
                                                                  gate: threading.Event) -> None:
    caches = SessionCaches(tmp_path, "fp", budgets(block_tokens=8, resident_bytes=0, warm_bytes=0),
                           clock=Clock())
    caches.after_writes(gate.wait)
    cache, toks = grow(model, None, [], list(range(10, 30)))
    caches.checkin(A, cache, toks)  # blocks [0, 8) and [8, 16) queued
    wanted = toks[:16] + [99, 98]
    assert caches.checkout(B, wanted).restored_from == "none"
    gate.set()
    caches.flush()
    got = caches.checkout(B, wanted)
    assert got.restored_from == "shared" and got.tokens == 16 and got.cache is not None
    assert greedy(model, got.cache, wanted[16:]) == greedy(model, make_prompt_cache(model), wanted)
    caches.close()


def test_the_live_cache_moving_on_does_not_change_what_is_written(model: Any, tmp_path: Path,
                                                                   gate: threading.Event) -> None:
    """The engine decodes into the live cache while the worker still holds the turn's evaluated pieces."""
    caches = SessionCaches(tmp_path, "fp", budgets(block_tokens=8), clock=Clock())
    caches.after_writes(gate.wait)
    cache, toks = grow(model, None, [], list(range(10, 30)))
    caches.checkin(A, cache, toks)
    got = caches.checkout(A, toks[:12] + [5])  # a rewind: the live buffers' positions 12.. are reused
    assert got.restored_from == "resident" and got.cache is not None
    grow(model, got.cache, toks[:12], list(range(60, 70)))  # the regenerated turn overwrites them in place
    gate.set()
    caches.flush()
    out = caches.checkout(A, toks + [5])
    assert out.restored_from == "disk" and out.tokens == len(toks) and out.cache is not None
    assert greedy(model, out.cache, [5]) == greedy(model, make_prompt_cache(model), toks + [5])
    caches.close()


def test_a_session_forgotten_while_its_blocks_are_queued_leaves_no_block(model: Any, tmp_path: Path,
                                                                         gate: threading.Event) -> None:
    caches = SessionCaches(tmp_path, "fp", budgets(block_tokens=8), clock=Clock())
    caches.after_writes(gate.wait)
    cache, toks = grow(model, None, [], list(range(10, 40)))  # three blocks and a tail, queued
    caches.checkin(A, cache, toks)
    caches.forget(A)
    gate.set()
    caches.flush()
    assert disk_ids(caches, A) == [] and caches.locations() == {}
    assert not list((tmp_path / "blocks").rglob("*.safetensors")) and files(tmp_path, A) == []
    caches.close()


# --- writes give way to a turn that wants its first token (issue 32) ---------------------------


class WatchedTokens(FirstTokens):
    """FirstTokens that says when the worker starts waiting on it: the test's gate, not a sleep."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()

    def wait(self, timeout: float) -> float:
        if not self.calm():
            self.waiting.set()
        return super().wait(timeout)


def test_a_write_waits_while_a_turn_wants_its_first_token(model: Any, tmp_path: Path) -> None:
    turns = WatchedTokens()
    caches = SessionCaches(tmp_path, "fp", budgets(), clock=Clock(), first_tokens=turns)
    turns.arrived()  # the next turn was sent: the answer's write-behind must not take its CPU
    cache, toks = grow(model, None, [], list(range(10, 40)))
    caches.checkin(A, cache, toks)
    assert turns.waiting.wait(10)
    assert caches.index.chain(A) == [] and files(tmp_path, A) == []  # held back
    turns.taken(busy=True)  # the engine has it: prefilling
    assert caches.index.chain(A) == []
    turns.engine(busy=False)  # its first token is out
    caches.flush()
    assert [(r.start, r.end) for r in caches.index.chain(A)] == [(0, 30)] and len(files(tmp_path, A)) == 1
    caches.close()


def test_a_write_waits_for_turns_only_so_long(model: Any, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream of turns that never lets up does not starve the disk tier: each job waits YIELD_MAX at most."""
    monkeypatch.setattr(ioworker, "YIELD_MAX", 0.05)
    turns = FirstTokens()
    caches = SessionCaches(tmp_path, "fp", budgets(), clock=Clock(), first_tokens=turns)
    turns.arrived()  # and never taken
    for key in (A, B):
        cache, toks = grow(model, None, [], list(range(10, 40)))
        caches.checkin(key, cache, toks)
    done = threading.Thread(target=caches.flush, daemon=True)
    done.start()
    done.join(30)
    assert not done.is_alive() and not turns.calm()
    assert {k for k, _ in caches.index.keys_by_use()} == {A, B}
    caches.close()


def test_a_restore_does_not_wait_for_turns(model: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reader is not held back: a restore is what a waiting turn waits for."""
    monkeypatch.setattr(ioworker, "YIELD_MAX", 3600.0)  # a read held back like a write would hang here
    cache, toks = grow(model, None, [], list(range(10, 40)))
    caches = SessionCaches(tmp_path, "fp", budgets(), clock=Clock())
    caches.checkin(A, cache, toks)
    caches.close()  # on disk only, as after a restart
    turns = FirstTokens()
    again = SessionCaches(tmp_path, "fp", budgets(), clock=Clock(), first_tokens=turns)
    turns.arrived()
    turns.taken(busy=True)  # this very turn is restoring
    got: list[Any] = []
    reading = threading.Thread(target=lambda: got.append(again.checkout(A, toks + [7])), daemon=True)
    reading.start()
    reading.join(30)
    assert not reading.is_alive() and not turns.calm()
    assert got[0].restored_from == "disk" and got[0].tokens == len(toks)
    turns.engine(busy=False)  # let whatever the checkout queued run, for close()
    again.close()


def test_a_turn_that_needs_its_sessions_queued_write_gets_it_at_once(models: dict[str, Any], tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A window cache cannot be rewound in place: without a checkpoint in memory (none kept here), a regenerate
    restores from what the last write holds. That write is still queued behind the turn's arrival; the checkout
    has it written, hurried, at once."""
    monkeypatch.setattr(ioworker, "YIELD_MAX", 3600.0)  # a write that gave way here would hang the checkout
    model = models["builtin:tiny-swa"]
    turns = FirstTokens()
    caches = SessionCaches(tmp_path, "fp", budgets(block_tokens=8, checkpoints=0), clock=Clock(), first_tokens=turns)
    turns.arrived()  # turn two was sent as turn one ended; its write waits for turn two's first token
    cache, one = grow(model, None, [], list(range(10, 110)))  # past the 64-token window: it has wrapped
    caches.checkin(A, cache, one)
    again = caches.checkout(A, one + [7])
    assert again.restored_from == "resident"
    cache, two = grow(model, again.cache, one, [7, 8, 9, 10])
    caches.checkin(A, cache, two)
    got: list[Any] = []  # the regenerate of turn two: turn one and a new token
    regen = threading.Thread(target=lambda: got.append(caches.checkout(A, one + [11])), daemon=True)
    regen.start()
    regen.join(30)
    turns.taken(busy=False)  # whatever happened, the writes may go on: close() runs them
    assert not regen.is_alive()
    assert got[0].restored_from == "disk" and got[0].tokens == len(one)
    caches.close()
