"""Direct restore (cachestore/direct.py): a chain of segments read straight into the live cache.

Checked against the general path (read_segment + merge + restore) and
against a fresh prefill, on the real mlx-lm caches of builtin:tiny.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, make_prompt_cache

from cachestore.direct import STEP, FileSpan, read_direct
from cachestore.errors import ChecksumMismatch, SegmentTruncated
from cachestore.segments import read_segment
from cachestore.snapshot import merge, restore
from cachestore.store import Budgets, SessionCaches

KEY = "abcd"
TURNS = [list(range(10, 50)), list(range(60, 90)), list(range(100, 133))]  # 40 + 30 + 33 tokens


@pytest.fixture
def model(models: dict[str, Any]) -> Any:
    return models["builtin:tiny"]


def budgets() -> Budgets:
    return Budgets(resident_bytes=1 << 30, warm_bytes=1 << 30, disk_bytes=1 << 30,
                   resident_idle=60.0, warm_idle=600.0, max_segments=16)


def written(model: Any, root: Path) -> tuple[SessionCaches, list[int]]:
    """A session whose three turns are three segments on disk, nothing in memory."""
    caches = SessionCaches(root, "fp", budgets())
    cache, toks = make_prompt_cache(model), []
    for more in TURNS:
        model(mx.array([more]), cache=cache)
        mx.eval([c.state for c in cache])
        toks += more
        caches.checkin(KEY, cache, toks)
    caches.flush()  # the I/O worker has written them
    caches.resident.discard(KEY)
    caches.warm.discard(KEY)
    return caches, toks


def pieces(caches: SessionCaches, use: int | None = None) -> list[FileSpan]:
    rows = caches.index.chain(KEY)
    last = rows[-1].end if use is None else use
    return [FileSpan(r.path, r.checksum, r.start, r.end, min(r.end, last)) for r in rows if r.start < last]


def greedy(model: Any, cache: list[Any], ids: list[int], n: int = 6) -> list[int]:
    out = []
    logits = model(mx.array([ids]), cache=cache)
    for _ in range(n):
        t = int(mx.argmax(logits[0, -1]).item())  # type: ignore[arg-type]
        out.append(t)
        logits = model(mx.array([[t]]), cache=cache)
    return out


def test_equals_the_general_path_and_leaves_room(model: Any, tmp_path: Path) -> None:
    caches, toks = written(model, tmp_path)
    rows = caches.index.chain(KEY)
    assert len(rows) == 3
    got = read_direct(pieces(caches), fingerprint="fp", room=20)
    assert got is not None and got.bad is None and got.tokens == len(toks)
    assert got.bytes_read == sum(r.nbytes for r in rows)
    general = restore(merge(*(read_segment(r.path, checksum=r.checksum, fingerprint="fp") for r in rows)))
    assert got.cache is not None and len(got.cache) == len(general)
    for d, g in zip(got.cache, general, strict=True):
        assert isinstance(d, KVCache) and d.offset == g.offset == len(toks)
        for a, b in zip(d.state[:2], g.state[:2], strict=True):
            assert mx.array_equal(a[..., :len(toks), :], b[..., :len(toks), :]).item()
        # Room for the 20 tokens that follow, so the next forward does not grow the buffer.
        assert d.keys is not None and d.keys.shape[2] >= len(toks) + 20 and d.keys.shape[2] % STEP == 0
    caches.close()


def test_continuation_equals_a_fresh_prefill(model: Any, tmp_path: Path) -> None:
    caches, toks = written(model, tmp_path)
    caches.close()
    restarted = SessionCaches(tmp_path, "fp", budgets())
    nxt = [140, 141, 142]
    out = restarted.checkout(KEY, toks + nxt)
    assert out.restored_from == "disk" and out.tokens == len(toks) and out.cache is not None
    before = out.cache[0].keys.shape
    restored = greedy(model, out.cache, nxt)
    assert out.cache[0].keys.shape == before  # the first forward wrote into the room it was given
    fresh = greedy(model, make_prompt_cache(model), toks + nxt)
    assert restored == fresh
    restarted.close()


def test_a_prefix_of_the_last_segment(model: Any, tmp_path: Path) -> None:
    caches, toks = written(model, tmp_path)
    got = read_direct(pieces(caches, use=55), fingerprint="fp")
    assert got is not None and got.tokens == 55 and got.cache is not None
    assert all(c.offset == 55 for c in got.cache)
    assert greedy(model, got.cache, toks[55:60]) == greedy(model, make_prompt_cache(model), toks[:60])
    caches.close()


def test_a_flipped_byte_stops_the_chain_there(model: Any, tmp_path: Path) -> None:
    caches, toks = written(model, tmp_path)
    second = caches.index.chain(KEY)[1]
    raw = bytearray(second.path.read_bytes())
    raw[-100] ^= 0x01  # in the data: MLX would load it without complaint
    second.path.write_bytes(bytes(raw))
    got = read_direct(pieces(caches), fingerprint="fp")
    assert got is not None and got.tokens == 40 and got.bad is not None
    assert got.bad[0].start == 40 and isinstance(got.bad[1], ChecksumMismatch)
    # Through the store: the bad segment and everything after it are dropped; the first serves.
    out = caches.checkout(KEY, toks + [1])
    assert out.restored_from == "disk" and out.tokens == 40
    caches.flush()  # the drop runs on the I/O worker
    assert [(r.start, r.end) for r in caches.index.chain(KEY)] == [(0, 40)]
    assert caches.statistics()["disk"]["dropped_corrupt"] == 1
    caches.close()


def test_a_truncated_file_is_refused(model: Any, tmp_path: Path) -> None:
    caches, _ = written(model, tmp_path)
    last = caches.index.chain(KEY)[2]
    last.path.write_bytes(last.path.read_bytes()[:-64])
    got = read_direct(pieces(caches), fingerprint="fp")
    assert got is not None and got.tokens == 70
    assert got.bad is not None and isinstance(got.bad[1], SegmentTruncated)
    caches.close()


def test_another_fingerprint_is_never_read(model: Any, tmp_path: Path) -> None:
    caches, _ = written(model, tmp_path)
    got = read_direct(pieces(caches), fingerprint="another")
    assert got is not None and got.cache is None and got.bad is not None
    caches.close()


@pytest.mark.parametrize("name", ["builtin:tiny-swa"])
def test_other_layouts_take_the_general_path(models: dict[str, Any], name: str, tmp_path: Path) -> None:
    caches, toks = written(models[name], tmp_path)
    assert read_direct(pieces(caches), fingerprint="fp") is None
    out = caches.checkout(KEY, toks + [1])  # still restored, by read_segment + merge
    assert out.restored_from == "disk" and out.tokens == len(toks)
    caches.close()


def test_an_index_from_before_xxh3_still_reads(model: Any, tmp_path: Path) -> None:
    caches, toks = written(model, tmp_path)
    old = [FileSpan(p.path, f"crc32:{zlib.crc32(p.path.read_bytes()):08x}", p.start, p.end, p.use)
           for p in pieces(caches)]
    got = read_direct(old, fingerprint="fp")
    assert got is not None and got.bad is None and got.tokens == len(toks)
    caches.close()


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """builtin:tiny in bfloat16, as a GPU runs a bf16 checkpoint (daemon/device.py)."""
    from mlx_lm.utils import load

    from daemon.models.builtin import ensure_builtin

    model = load(str(ensure_builtin("builtin:tiny", tmp_path_factory.mktemp("bf16"))))[0]
    model.set_dtype(mx.bfloat16)
    return model


def test_bfloat16_takes_the_direct_path_exactly(bf16_model: Any, tmp_path: Path) -> None:
    caches, toks = written(bf16_model, tmp_path)
    rows = caches.index.chain(KEY)
    got = read_direct(pieces(caches), fingerprint="fp", room=3)
    assert got is not None and got.bad is None and got.tokens == len(toks) and got.cache is not None
    general = restore(merge(*(read_segment(r.path, checksum=r.checksum, fingerprint="fp") for r in rows)))
    for d, g in zip(got.cache, general, strict=True):
        assert d.keys is not None and d.keys.dtype == mx.bfloat16
        for a, b in zip(d.state[:2], g.state[:2], strict=True):
            assert mx.array_equal(a[..., :len(toks), :], b[..., :len(toks), :]).item()
    nxt = [140, 141, 142]
    assert greedy(bf16_model, got.cache, nxt) == greedy(bf16_model, make_prompt_cache(bf16_model), toks + nxt)
    caches.close()


def _made_a_few_at_a_time(found: Any, filling: Any, allocation: Any) -> tuple[Any, int]:
    """Make the buffers one at a time, reading after each what the made ones can take (as the
    engine hands them to the reader); the Filled and how many reads ran before all were made."""
    from cachestore.direct import Filled

    reads_before_all = 0
    given = 0
    while True:
        got = allocation.step(1, now=True)  # one buffer a step
        assert got is not False
        if len(allocation.made) > given:
            given = len(allocation.made)
            out = filling.advance(allocation.buffers.made(), last=allocation.complete)
            if not allocation.complete:
                assert out is None
                reads_before_all += 1
            else:
                assert isinstance(out, Filled)
                return out, reads_before_all


def test_the_files_are_read_into_the_buffers_as_they_are_made(model: Any, tmp_path: Path) -> None:
    from cachestore.direct import Allocation, Filling, finish, scan

    caches, toks = written(model, tmp_path)
    found = scan(pieces(caches), fingerprint="fp")
    assert found is not None and found.shape is not None
    assert sorted(found.order) == list(range(2 * len(model.layers)))  # every buffer, in the files' order
    allocation = Allocation(found, 20)
    filled, early = _made_a_few_at_a_time(found, Filling(found, allocation.capacity, fingerprint="fp"), allocation)
    assert early == 2 * len(model.layers) - 1  # a read after every buffer but the last
    assert filled.bad is None and filled.tokens == len(toks)
    got = finish(allocation.buffers, filled)
    whole = read_direct(pieces(caches), fingerprint="fp", room=20)
    assert whole is not None and whole.cache is not None and got.cache is not None
    assert got.bytes_read == whole.bytes_read
    for a, b in zip(got.cache, whole.cache, strict=True):
        assert a.offset == b.offset == len(toks)
        for x, y in zip(a.state[:2], b.state[:2], strict=True):
            assert mx.array_equal(x, y).item()
    caches.close()


def test_a_flipped_byte_read_before_all_buffers_are_made_still_stops_the_chain(model: Any, tmp_path: Path) -> None:
    from cachestore.direct import Allocation, Filling, scan

    caches, _ = written(model, tmp_path)
    second = caches.index.chain(KEY)[1]
    raw = bytearray(second.path.read_bytes())
    raw[-100] ^= 0x01
    second.path.write_bytes(bytes(raw))
    found = scan(pieces(caches), fingerprint="fp")
    assert found is not None
    allocation = Allocation(found, 0)
    filled, _ = _made_a_few_at_a_time(found, Filling(found, allocation.capacity, fingerprint="fp"), allocation)
    assert filled.tokens == 40 and filled.bad is not None
    assert filled.bad[0].start == 40 and isinstance(filled.bad[1], ChecksumMismatch)
    allocation.buffers.release()
    caches.close()


def test_a_restore_made_a_buffer_per_step_equals_a_fresh_prefill(model: Any, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import cachestore.pagein as pagein

    monkeypatch.setattr(pagein, "ALLOC_STEP", 1)  # one buffer at a time: the reader reads between
    caches, toks = written(model, tmp_path)
    out = caches.checkout(KEY, toks + [5])
    assert out.restored_from == "disk" and out.tokens == len(toks) and out.cache is not None
    assert greedy(model, out.cache, [5]) == greedy(model, make_prompt_cache(model), toks + [5])
    caches.close()
