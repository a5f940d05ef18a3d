"""The memory budgets every loaded model's cache store shares (cachestore/pool.py): the accounting alone.

Plain numbers, no caches: who evicts next (least recently used across stores),
who is asked and woken, what a store waiting for room is told, and that a
grant keeps two stores from both taking the last free bytes.
"""

from __future__ import annotations

import threading

import pytest

from cachestore.pool import Pool, Room

R, W = "resident", "warm"


def pool(resident: int = 100, warm: int = 50) -> tuple[Pool, list[str]]:
    return Pool({R: resident, W: warm}), []


def test_a_store_evicts_its_own_only_while_its_entry_is_the_oldest() -> None:
    p, woken = pool()
    a = p.join("a", lambda: woken.append("a"))
    b = p.join("b", lambda: woken.append("b"))
    a.report(R, 60, coldest=10.0)
    b.report(R, 30, coldest=20.0)
    assert b.plan(R, 30) is Room.ASKED and woken == ["a"]  # a's entry is older: a is asked, b waits
    assert a.fit(R)  # woken, a evicts for b
    a.report(R, 20, coldest=15.0)
    assert woken == ["a", "b"]  # bytes given back: the waiting store is woken
    assert b.plan(R, 30) is Room.FITS
    assert not a.fit(R)  # nobody waits any more
    # The reverse: now b holds the oldest entry, and a's need makes b evict.
    b.report(R, 30, coldest=5.0, fixed=30)
    assert a.plan(R, 60) is Room.ASKED and woken[-1] == "b"
    assert b.fit(R)


def test_the_oldest_entry_of_the_asking_store_goes_first() -> None:
    p, _ = pool()
    a, b = p.join("a"), p.join("b")
    a.report(R, 60, coldest=1.0)
    b.report(R, 40, coldest=2.0)
    assert a.plan(R, 10) is Room.EVICT  # its own is the oldest of all: evict it, no one is asked


def test_a_grant_holds_the_bytes_so_two_stores_never_take_the_same_room() -> None:
    p, _ = pool()
    a, b = p.join("a"), p.join("b")
    assert a.plan(R, 70) is Room.FITS
    assert b.plan(R, 70) is Room.STUCK  # a's 70 count until a reports what it holds
    assert p.statistics()[R] == {"budget": 100, "bytes": 70, "by_model": {"a": 70, "b": 0}}
    a.report(R, 0, None, fixed=0)  # a's turn ended and its cache went
    assert b.plan(R, 70) is Room.FITS


def test_a_store_stuck_behind_running_caches_is_woken_when_they_end() -> None:
    p, woken = pool()
    a = p.join("a", lambda: woken.append("a"))
    b = p.join("b", lambda: woken.append("b"))
    a.report(R, 0, None, fixed=90)  # running, not evictable
    assert b.plan(R, 20) is Room.STUCK and woken == []
    a.report(R, 0, None, fixed=0)
    assert woken == ["b"]


def test_larger_than_the_budget_runs_alone_once_every_store_is_empty() -> None:
    p, woken = pool()
    a = p.join("a", lambda: woken.append("a"))
    b = p.join("b", lambda: woken.append("b"))
    a.report(R, 10, coldest=3.0)
    assert b.plan(R, 150) is Room.ASKED and woken == ["a"]
    assert a.fit(R)
    a.report(R, 0, None)
    assert b.plan(R, 150) is Room.FITS


def test_fit_passes_the_baton_to_the_store_holding_the_oldest() -> None:
    p, woken = pool()
    a = p.join("a", lambda: woken.append("a"))
    b = p.join("b", lambda: woken.append("b"))
    c = p.join("c", lambda: woken.append("c"))
    a.report(W, 20, coldest=5.0)
    b.report(W, 20, coldest=1.0)
    c.report(W, 10, coldest=9.0)
    assert c.plan(W, 20) is Room.ASKED and woken == ["b"]
    assert c.plan(W, 20) is Room.ASKED and woken == ["b"]  # asked once: not woken again before it looks
    woken.clear()
    assert b.fit(W)  # b looks: its snapshot is the oldest, and c waits
    b.report(W, 0, None)  # b let it go
    assert woken == ["c"]
    assert c.plan(W, 20) is Room.FITS  # 20 + 10 + 20 = 50
    # a passes: a fit asked of a store whose entry is not the oldest wakes the one whose is.
    c.report(W, 10, coldest=9.0)
    b.report(W, 20, coldest=0.5)
    woken.clear()
    assert c.plan(W, 20) is Room.ASKED and woken == ["b"]
    assert not a.fit(W) and woken == ["b", "b"]


def test_want_nothing_stops_the_asking_and_over_says_by_how_much() -> None:
    p, woken = pool()
    a = p.join("a", lambda: woken.append("a"))
    b = p.join("b")
    a.report(R, 90, coldest=1.0)
    assert b.plan(R, 50) is Room.ASKED
    b.want_nothing()  # its queued turn was cancelled
    assert not a.fit(R)
    assert a.over(R) == 0
    b.report(R, 30, coldest=2.0)
    assert a.over(R) == 20 and a.fit(R)  # a budget passed: the oldest goes, asked or not
    assert a.others(R) == 30


def test_leave_and_resize_wake_the_stores() -> None:
    p, woken = pool()
    a = p.join("a", lambda: woken.append("a"))
    b = p.join("b", lambda: woken.append("b"))
    a.report(R, 0, None, fixed=90)
    assert b.plan(R, 20) is Room.STUCK
    a.leave()  # its model unloaded
    assert woken == ["b"] and b.plan(R, 20) is Room.FITS
    p.resize({R: 10})
    assert woken == ["b", "b"] and b.over(R) == 10


def test_negative_budgets_are_refused() -> None:
    with pytest.raises(ValueError, match="budget"):
        Pool({R: -1})


def test_many_threads_never_take_more_than_the_budget() -> None:
    """Stores on their own threads asking at once: the grants never add up past the budget."""
    p = Pool({R: 1000, W: 0})
    members = [p.join(str(i)) for i in range(8)]
    granted = [0] * len(members)
    start = threading.Barrier(len(members))

    def run(i: int) -> None:
        start.wait()
        for _ in range(200):
            if members[i].plan(R, 7) is Room.FITS:
                granted[i] += 7

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(members))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(granted) == p.statistics()[R]["bytes"] <= 1000
    assert sum(granted) > 1000 - 7
