"""SessionCaches policy on real (tiny) caches: idle demotion, compaction, fingerprints, disk budget."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from sqlite_utils import Database

from cachestore.migrations import MIGRATIONS
from cachestore.store import Budgets, SessionCaches

A, B, C = "aaaa", "bbbb", "cccc"


@pytest.fixture
def model(models: dict[str, Any]) -> Any:
    return models["builtin:tiny"]


def grow(model: Any, cache: list[Any] | None, tokens: list[int], more: list[int]) -> tuple[list[Any], list[int]]:
    """Feed `more` tokens to the cache holding `tokens`."""
    cache = cache if cache is not None else make_prompt_cache(model)
    model(mx.array([more]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache, tokens + more


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def budgets(**kw: Any) -> Budgets:
    base: dict[str, Any] = dict(resident_bytes=1 << 30, warm_bytes=1 << 30, disk_bytes=1 << 30,
                                resident_idle=60.0, warm_idle=600.0, max_segments=16)
    return Budgets(**{**base, **kw})


def test_idle_caches_move_down_and_disk_keeps_them(model: Any, tmp_path: Path) -> None:
    clock = Clock()
    caches = SessionCaches(tmp_path, "fp", budgets(), clock=clock)
    cache, toks = grow(model, None, [], list(range(10, 50)))
    caches.checkin(A, cache, toks)
    caches.flush()  # the I/O worker has written it
    assert A in caches.resident
    clock.now += 61
    caches.maintain()
    assert A not in caches.resident and A in caches.warm
    clock.now += 601
    caches.maintain()
    assert A not in caches.warm
    got = caches.checkout(A, toks + [7])
    assert got.restored_from == "disk" and got.tokens == len(toks)
    caches.close()


def test_many_turns_compact_into_one_segment(model: Any, tmp_path: Path) -> None:
    caches = SessionCaches(tmp_path, "fp", budgets(max_segments=3), clock=Clock())
    cache: Any = None
    toks: list[int] = []
    for turn in range(5):
        cache, toks = grow(model, cache, toks, [100 + turn] * 7)
        caches.checkin(A, cache, toks)
        got = caches.checkout(A, toks + [1])
        assert got.restored_from == "resident"
        cache = got.cache
    caches.flush()
    chain = caches.index.chain(A)
    # Segments 1-3 were written per turn, turn 4 compacted them into one, turn 5 appended.
    assert [(r.start, r.end) for r in chain] == [(0, 28), (28, 35)]
    caches.resident.discard(A)
    got = caches.checkout(A, toks + [1])
    assert got.restored_from == "disk" and got.tokens == len(toks)
    caches.close()


def test_another_models_cache_is_never_loaded_and_is_kept_for_its_model(model: Any, tmp_path: Path) -> None:
    first = SessionCaches(tmp_path, "model-one", budgets(), clock=Clock(), model="one")
    cache, toks = grow(model, None, [], list(range(10, 40)))
    first.checkin(A, cache, toks)
    first.close()
    second = SessionCaches(tmp_path, "model-two", budgets(), clock=Clock(), model="two")
    assert second.locations() == {} and second.kept_for() == {A: ["one"]}
    got = second.checkout(A, toks + [1])
    assert got.restored_from == "none" and got.cache is None
    other, other_toks = grow(model, None, [], list(range(50, 70)))
    second.checkin(A, other, other_toks)  # the same session, now under model two: a cache of its own
    second.flush()
    assert [(r.start, r.end, r.fingerprint) for r in second.index.chain(A)] == [(0, 20, "model-two")]
    second.close()
    again = SessionCaches(tmp_path, "model-one", budgets(), clock=Clock(), model="one")
    assert again.locations() == {A: "disk"} and again.kept_for() == {A: ["two"]}
    got = again.checkout(A, toks + [1])
    assert got.restored_from == "disk" and got.tokens == len(toks) and got.cache is not None
    fresh, _ = grow(model, None, [], toks)
    assert all(mx.array_equal(a, b).item() for a, b in zip(_held(got.cache), _held(fresh), strict=True))
    again.forget(A)  # a deleted session: every model's cache of it goes
    again.flush()
    assert again.kept_for() == {} and not list((tmp_path / "segments").rglob("*.safetensors"))
    again.close()


def test_the_disk_budget_evicts_least_recently_used_across_models(model: Any, tmp_path: Path) -> None:
    clock = Clock()
    first = SessionCaches(tmp_path, "model-one", budgets(), clock=clock, model="one")
    cache, toks = grow(model, None, [], list(range(10, 40)))
    first.checkin(A, cache, toks)
    first.flush()
    one_session = first.index.total_bytes()
    first.close()
    clock.now += 10
    second = SessionCaches(tmp_path, "model-two", budgets(disk_bytes=one_session * 3 // 2), clock=clock, model="two")
    assert second.kept_for() == {A: ["one"]}
    cache, toks = grow(model, None, [], list(range(50, 80)))
    second.checkin(B, cache, toks)  # over the budget: the least recently used cache goes, whichever model's
    second.flush()
    assert second.kept_for() == {} and second.locations() == {B: "resident"}
    assert [(key, fp) for key, fp, _ in second.index.by_use()] == [(B, "model-two")]
    second.close()


def test_a_cache_from_before_caches_per_model_is_kept_and_restores_exactly(model: Any, tmp_path: Path) -> None:
    """An index and files as kvd wrote them before m003_per_model: migrated, kept under another
    model, and restored exactly under its own (the files stay where they were)."""
    first = SessionCaches(tmp_path, "model-one", budgets(block_tokens=8), clock=Clock())
    cache, toks = grow(model, None, [], list(range(10, 40)))  # 3 blocks of 8 ids, then a private tail
    first.checkin(A, cache, toks)
    first.close()
    with closing(sqlite3.connect(tmp_path / "index.sqlite")) as db:
        blocks = db.execute("SELECT * FROM blocks").fetchall()
        segments = db.execute('SELECT key, start, "end", file, nbytes, checksum, fingerprint, tokens, created_at '
                              "FROM segments").fetchall()
        chains = db.execute("SELECT key, n, block FROM chains").fetchall()
        keys = db.execute("SELECT key, last_used FROM keys").fetchall()
    assert len(blocks) == 3 and len(segments) == 1 and len(chains) == 3
    for name in ("index.sqlite", "index.sqlite-wal", "index.sqlite-shm"):
        (tmp_path / name).unlink(missing_ok=True)
    old = []
    for seg in segments:  # the layout before: segments/<session>/<file>
        path = tmp_path / "segments" / seg[3]
        path.rename(tmp_path / "segments" / A / path.name)
        path.parent.rmdir()
        old.append((*seg[:3], f"{A}/{path.name}", *seg[4:]))
    legacy = Database(tmp_path / "index.sqlite")
    MIGRATIONS.apply(legacy, stop_before="m003_per_model")
    legacy.conn.executemany(f"INSERT INTO blocks VALUES ({', '.join('?' * 10)})", blocks)
    legacy.conn.executemany(f"INSERT INTO segments VALUES ({', '.join('?' * 9)})", old)
    legacy.conn.executemany("INSERT INTO chains VALUES (?, ?, ?)", chains)
    legacy.conn.executemany("INSERT INTO keys VALUES (?, ?)", keys)
    legacy.conn.commit()
    legacy.close()
    second = SessionCaches(tmp_path, "model-two", budgets(block_tokens=8), clock=Clock(), model="two")
    assert second.locations() == {} and second.kept_for() == {A: ["model-one"]}  # no name was recorded then
    second.close()
    again = SessionCaches(tmp_path, "model-one", budgets(block_tokens=8), clock=Clock())
    got = again.checkout(A, toks + [1])
    assert got.restored_from == "disk" and got.tokens == len(toks) and got.cache is not None
    fresh, _ = grow(model, None, [], toks)
    assert all(mx.array_equal(a, b).item() for a, b in zip(_held(got.cache), _held(fresh), strict=True))
    again.close()


def test_disk_budget_evicts_least_recently_used_sessions(model: Any, tmp_path: Path) -> None:
    clock = Clock()
    one_session = 30 * 2048 + 4096  # ~30 tokens of tiny KV plus the file header
    caches = SessionCaches(tmp_path, "fp", budgets(disk_bytes=2 * one_session), clock=clock)
    for key in (A, B, C):
        clock.now += 1
        cache, toks = grow(model, None, [], list(range(10, 40)))
        caches.checkin(key, cache, toks)
        caches.flush()
        assert caches.index.total_bytes() <= 2 * one_session
    assert [k for k, _ in caches.index.keys_by_use()] == [B, C]
    caches.close()


def test_prefetch_pages_the_most_recent_sessions_into_warm_within_its_room(model: Any, tmp_path: Path) -> None:
    clock = Clock()
    caches = SessionCaches(tmp_path, "fp", budgets(), clock=clock)
    kept: dict[str, tuple[list[Any], list[int]]] = {}
    for i, key in enumerate((A, B, C)):  # C used last
        clock.now += 10
        cache, toks = grow(model, None, [], list(range(10 + i, 50 + i)))  # no prefix to share
        caches.checkin(key, cache, toks)
        cache, toks = grow(model, cache, toks, list(range(60, 70)))  # a second turn: a second segment
        caches.checkin(key, cache, toks)
        kept[key] = (cache, toks)
    caches.flush()
    per_session = caches.index.keys_by_use()[0][1]
    caches.close()

    # After a restart: no resident room, room in warm for two sessions' caches, not three.
    caches = SessionCaches(tmp_path, "fp", budgets(resident_bytes=0, warm_bytes=2 * per_session + per_session // 2),
                           clock=clock)
    assert caches.prefetch_plan(limit=per_session + per_session // 2) == [C]  # the machine's share: one
    plan = caches.prefetch_plan()
    assert plan == [C, B]
    for key in plan:
        assert caches.page_in(key) == "warm"
    assert caches.locations() == {A: "disk", B: "warm", C: "warm"}
    assert caches.page_in(C) is None  # already warm
    stats = caches.statistics()
    assert stats["prefetched"] == {"sessions": 2, "bytes": caches.warm.nbytes, "resident": 0, "warm": 2,
                                    "reading": False}
    assert stats["disk"]["hits"] == 0  # a prefetch is not a use

    cache, toks = kept[C]
    got = caches.checkout(C, toks + [7])
    assert got.restored_from == "warm" and got.tokens == len(toks)
    assert got.cache is not None
    for restored, live in zip(got.cache, cache):
        assert mx.array_equal(restored.keys[..., :len(toks), :], live.keys[..., :len(toks), :])
        assert mx.array_equal(restored.values[..., :len(toks), :], live.values[..., :len(toks), :])
    assert caches.checkout(A, kept[A][1] + [7]).restored_from == "disk"
    caches.close()


def test_prefetch_fills_resident_room_first_with_live_caches(model: Any, tmp_path: Path) -> None:
    """Resident room for one session, warm room for one: the most recent goes live, the next warm.

    The live one holds room for a next message, so its next forward does not grow
    it, and both continue exactly as the caches from before the restart.
    """
    clock = Clock()
    caches = SessionCaches(tmp_path, "fp", budgets(), clock=clock)
    kept: dict[str, tuple[list[Any], list[int]]] = {}
    for key in (A, B, C):  # C used last
        clock.now += 10
        cache, toks = grow(model, None, [], list(range(10, 50)))
        caches.checkin(key, cache, toks)
        kept[key] = (cache, toks)
    caches.flush()
    per_session = caches.index.keys_by_use()[0][1]
    caches.close()

    live_bytes = per_session * 256 // 40  # a live buffer holds a whole 256-token step
    caches = SessionCaches(tmp_path, "fp", budgets(resident_bytes=live_bytes * 3 // 2, warm_bytes=per_session + 1),
                           clock=clock)
    assert [caches.page_in(key) for key in caches.prefetch_plan()] == ["resident", "warm"]
    assert caches.locations() == {A: "disk", B: "warm", C: "resident"}
    assert caches.statistics()["prefetched"]["resident"] == 1
    assert caches.statistics()["disk"]["hits"] == 0  # a prefetch is not a use
    for key, tier in ((C, "resident"), (B, "warm")):
        live, toks = kept[key]
        got = caches.checkout(key, toks + [7, 8])
        assert got.restored_from == tier and got.tokens == len(toks) and got.cache is not None
        shape = got.cache[0].keys.shape
        nxt = model(mx.array([[7, 8]]), cache=got.cache)
        ref = model(mx.array([[7, 8]]), cache=live)
        assert mx.array_equal(nxt, ref).item()
        if tier == "resident":
            assert got.cache[0].keys.shape == shape  # written into its room, not grown
    caches.close()

def test_prefetch_plans_nothing_that_does_not_fit(model: Any, tmp_path: Path) -> None:
    caches = SessionCaches(tmp_path, "fp", budgets())
    cache, toks = grow(model, None, [], list(range(10, 50)))
    caches.checkin(A, cache, toks)
    caches.flush()
    nbytes = caches.index.total_bytes()
    caches.close()
    caches = SessionCaches(tmp_path, "fp", budgets(resident_bytes=nbytes - 1, warm_bytes=nbytes - 1))
    assert caches.prefetch_plan() == []
    caches.close()


def _held(cache: list[Any]) -> list[Any]:
    """The keys and values of the tokens a cache holds (a live buffer is longer)."""
    return [mx.array(a[..., :c.offset, :]) for c in cache for a in (c.keys, c.values)]


def _state(cache: list[Any]) -> list[Any]:
    return [mx.array(a) for c in cache for a in c.state]


@pytest.mark.parametrize("tier, shared", [("resident", 30), ("warm", 30), ("disk", 30)])
def test_a_new_session_copies_a_shared_prefix_and_the_source_keeps_its_own(
        model: Any, tmp_path: Path, tier: str, shared: int) -> None:
    """A branch copies another session's prefix from any tier; the source keeps its cache, intact.

    From memory any prefix is copied; from disk, whole blocks (8 ids here), then the next
    block cut where the ids part: all 30.
    """
    clock = Clock()
    caches = SessionCaches(tmp_path, "fp", budgets(block_tokens=8), clock=clock)
    cache, toks = grow(model, None, [], list(range(10, 50)))
    caches.checkin(A, cache, toks)
    caches.flush()
    if tier != "resident":
        clock.now += 61
        caches.maintain()  # resident -> warm
    if tier == "disk":
        clock.now += 601
        caches.maintain()  # warm dropped; disk holds it
    kept = _state(caches.checkout(A, toks + [7]).cache or []) if tier == "resident" else None
    if kept is not None:
        caches.checkin(A, cache, toks)  # back where it was, resident
    branch = toks[:30] + [3, 4, 5]
    got = caches.checkout(B, branch)
    assert got.restored_from == "shared" and got.tokens == got.shared_tokens == shared and got.cache is not None
    # The copy is fed the branch's own tokens: the source must not see them.
    model(mx.array([branch[shared:]]), cache=got.cache)
    mx.eval([c.state for c in got.cache])
    assert got.cache[0].offset == 33
    again = caches.checkout(A, toks + [7])
    assert again.restored_from == tier and again.tokens == len(toks)
    assert again.cache is not None and again.cache[0].offset == len(toks)
    if kept is not None:
        assert all(mx.array_equal(x, y).item() for x, y in zip(kept, _state(again.cache)))
    caches.close()


@pytest.mark.parametrize("warm_bits", [0, 8])
def test_warm_holds_a_shared_prefix_once(model: Any, tmp_path: Path, warm_bits: int) -> None:
    """Six sessions over one 64-token prefix: warm holds its blocks once, plus six tails; each restores exactly."""
    prefix = list(range(100, 164))
    sizes = {}
    for block_tokens in (16, 4096):  # sharing, and (blocks longer than any session) not
        clock = Clock()
        caches = SessionCaches(tmp_path / str(block_tokens), "fp",
                               budgets(resident_bytes=0, block_tokens=block_tokens, warm_bits=warm_bits),
                               clock=clock)
        kept = {}
        for i in range(6):
            key = f"{i:04x}"
            cache, toks = grow(model, None, [], prefix + [200 + i] * 5)
            caches.checkin(key, cache, toks)  # no resident room: straight to warm
            kept[key] = (_held(cache), toks)
        sizes[block_tokens] = caches.warm.nbytes
        if block_tokens == 16:
            assert caches.statistics()["warm"]["blocks"] == 4 and caches.statistics()["warm"]["sessions"] == 6
            for key, (state, toks) in kept.items():
                got = caches.checkout(key, toks + [7])
                assert got.restored_from == "warm" and got.tokens == len(toks) and got.cache is not None
                if not warm_bits:
                    assert all(mx.array_equal(x, y).item() for x, y in zip(state, _held(got.cache)))
            caches.forget("0000")
        caches.close()
    one_session = sizes[4096] / 6
    tail = one_session * 5 / 69
    # One prefix plus six tails, against six whole sessions.
    assert sizes[16] <= 1.01 * (one_session * 64 / 69 + 6 * tail)
    assert sizes[16] < sizes[4096] / 3


def test_warm_eviction_never_leaves_a_tail_without_its_blocks(model: Any, tmp_path: Path) -> None:
    """A warm budget for about two sessions, six sessions over one prefix: the shared blocks stay while any
    warm tail needs them, the budget holds, and every tail still warm restores exactly."""
    prefix = list(range(100, 148))
    clock = Clock()
    one = SessionCaches(tmp_path / "one", "fp", budgets(resident_bytes=0, block_tokens=16), clock=clock)
    cache, toks = grow(model, None, [], prefix + [200] * 5)
    one.checkin(A, cache, toks)
    session_bytes = one.warm.nbytes
    one.close()
    caches = SessionCaches(tmp_path / "two", "fp", budgets(resident_bytes=0, block_tokens=16,
                                                           warm_bytes=int(session_bytes * 1.3)), clock=clock)
    kept = {}
    for i in range(6):
        key = f"{i:04x}"
        clock.now += 1
        cache, toks = grow(model, None, [], prefix + [200 + i] * 5)
        caches.checkin(key, cache, toks)
        kept[key] = (_held(cache), toks)
        assert caches.warm.nbytes <= caches.warm.budget
        for warm_key in caches.warm:
            parts = caches.warm.parts(warm_key)
            assert parts is not None and [p.start for p in parts[0]] == [0, 16, 32, 48]  # blocks, then the tail
    caches.flush()
    assert len(caches.warm) >= 2 and caches.statistics()["warm"]["blocks"] == 3
    for key in list(caches.warm):
        state, toks = kept[key]
        got = caches.checkout(key, toks + [7])
        assert got.restored_from == "warm" and got.cache is not None
        assert all(mx.array_equal(x, y).item() for x, y in zip(state, _held(got.cache)))
    caches.close()
