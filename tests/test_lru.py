"""Budgets and LRU order, with fakes that have only a size (no model, no MLX)."""

from __future__ import annotations

import random

import pytest

from cachestore.lru import Tier


def test_lru_order_and_budget() -> None:
    t: Tier[str] = Tier("resident", budget=100)
    assert t.put("a", "A", 40, now=1) == []
    assert t.put("b", "B", 40, now=2) == []
    assert t.take("a") == "A"  # promoted out...
    assert t.put("a", "A", 40, now=3) == []  # ...and back as most recent
    assert t.put("c", "C", 40, now=4) == [("b", "B")]  # b is now the coldest
    assert list(t) == ["a", "c"] and t.nbytes == 80


def test_value_larger_than_budget_is_refused() -> None:
    t: Tier[str] = Tier("warm", budget=10)
    assert t.put("big", "X", 11, now=0) == [("big", "X")]
    assert len(t) == 0 and t.nbytes == 0


def test_entry_limit_evicts_least_recently_used() -> None:
    t: Tier[str] = Tier("resident", budget=1000, max_entries=2)
    assert t.put("a", "A", 1, now=0) == [] and t.put("b", "B", 1, now=1) == []
    assert t.put("c", "C", 1, now=2) == [("a", "A")]
    assert t.put("c", "C2", 1, now=3) == []  # replacing a key does not count twice
    assert list(t) == ["b", "c"]
    none: Tier[str] = Tier("resident", budget=1000, max_entries=0)
    assert none.put("a", "A", 1, now=0) == [("a", "A")] and len(none) == 0


def test_replacing_a_key_counts_its_new_size_once() -> None:
    t: Tier[str] = Tier("warm", budget=100)
    t.put("a", "1", 60, now=0)
    t.put("a", "2", 70, now=1)
    assert t.nbytes == 70 and t.peek("a") == "2"


def test_idle_entries_leave_oldest_first() -> None:
    t: Tier[str] = Tier("resident", budget=1000)
    for i, key in enumerate("abcd"):
        t.put(key, key.upper(), 10, now=i * 10)
    assert t.idle(now=35, idle_for=20) == [("a", "A"), ("b", "B")]
    assert list(t) == ["c", "d"]


def test_stats_count_hits_misses_and_moves() -> None:
    t: Tier[str] = Tier("resident", budget=20)
    t.put("a", "A", 10, now=0)
    t.take("a")
    t.take("zzz")
    t.put("a", "A", 10, now=1)
    t.put("b", "B", 10, now=2)
    t.put("c", "C", 10, now=3)
    s = t.statistics()
    assert (s["hits"], s["misses"], s["page_ins"], s["page_outs"]) == (1, 1, 1, 1)
    assert s["budget"] == 20 and s["bytes"] == 20 and s["sessions"] == 2


@pytest.mark.parametrize("seed", range(5))
def test_cycling_many_sessions_never_exceeds_budgets(seed: int) -> None:
    """Resident demotes into warm, warm drops: neither ever holds more than its budget."""
    rng = random.Random(seed)
    resident: Tier[int] = Tier("resident", budget=1000)
    warm: Tier[int] = Tier("warm", budget=600)
    for step in range(2000):
        key = f"{rng.randrange(50):x}"
        size = rng.randrange(1, 400)
        resident.take(key)
        warm.take(key)
        for cold, value in resident.put(key, value=size, nbytes=size, now=step):
            warm.put(cold, value, value // 2, now=step)  # a compact snapshot
        assert resident.nbytes <= resident.budget and warm.nbytes <= warm.budget
        assert resident.nbytes == sum(resident.peek(k) or 0 for k in resident)
        assert not (set(resident) & set(warm))


def test_offer_goes_to_the_cold_end_and_never_evicts() -> None:
    t: Tier[str] = Tier("warm", budget=100)
    t.put("used", "U", 40, now=10)
    assert t.offer("p1", "P1", 30, now=20)  # prefetched: behind what was used
    assert t.offer("p2", "P2", 30, now=30)  # planned later, so colder still
    assert list(t) == ["p2", "p1", "used"] and t.nbytes == 100
    assert not t.offer("p3", "P3", 1, now=40)  # no room: refused, nothing evicted
    assert not t.offer("used", "U2", 0, now=40)  # a key already held is left as it is
    assert t.peek("used") == "U" and list(t) == ["p2", "p1", "used"]
    # Idle times stay ordered: the cold end is never younger than what follows it.
    assert t.idle(now=10 + 50, idle_for=50) == [("p2", "P2"), ("p1", "P1"), ("used", "U")]
    capped: Tier[str] = Tier("warm", budget=100, max_entries=1)
    assert capped.offer("a", "A", 1, now=0) and not capped.offer("b", "B", 1, now=0)


def test_reserving_part_of_the_budget_evicts_the_least_recently_used() -> None:
    """Running caches hold part of the resident budget: idle values make room, coldest first."""
    t: Tier[str] = Tier("resident", budget=100)
    t.put("a", "A", 40, now=1)
    t.put("b", "B", 40, now=2)
    assert t.reserve(30) == [("a", "A")] and list(t) == ["b"]
    assert not t.fits(40) and t.fits(30)
    assert t.put("c", "C", 80, now=3) == [("c", "C")]  # more than the reservation leaves
    assert t.reserve(0) == [] and t.fits(60)
    assert t.statistics()["reserved"] == 0
