"""Segment files: exact round trips, atomic writes, and every corruption caught.

A segment that fails verification must raise CorruptSegment with the right
reason (the daemon then drops it and rebuilds from the transcript) and must
never reach MLX: MLX loads a bit-flipped file without complaint.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.utils import load

from cachestore.errors import (
    ChecksumMismatch,
    CorruptSegment,
    FingerprintMismatch,
    InvariantViolation,
    SegmentMissing,
    SegmentTruncated,
    UnsupportedFormat,
)
from cachestore.segments import SegmentFile, fingerprint, read_segment, write_segment
from cachestore.snapshot import Snapshot, layout, merge, restore, snapshot
from daemon.models.builtin import ensure_builtin
from snapshots import assert_same, assert_same_layer  # noqa: F401

FP = fingerprint(
    model_id="builtin:tiny-swa", config={"a": 1}, dtype="float32", kv_bits=None, layout=["kv"]
)
OTHER_FP = fingerprint(
    model_id="builtin:tiny", config={"a": 1}, dtype="float32", kv_bits=None, layout=["kv"]
)
TOKENS = [(i * 37 + 11) % 1600 + 10 for i in range(150)]


@pytest.fixture(scope="module")
def swa(tmp_path_factory: pytest.TempPathFactory) -> Any:
    model = load(str(ensure_builtin("builtin:tiny-swa", tmp_path_factory.mktemp("models"))))[0]
    model.set_dtype(mx.float32)
    return model


@pytest.fixture(scope="module")
def snap(swa: Any) -> Snapshot:
    """A wrapped sliding-window model: rotating and KV layers, 100 tokens."""
    cache = make_prompt_cache(swa)
    swa(mx.array([TOKENS[:100]]), cache=cache)
    return snapshot(cache)


@pytest.fixture
def written(tmp_path: Path, snap: Snapshot) -> SegmentFile:
    return write_segment(tmp_path / "s1.seg", snap, fingerprint=FP)


@pytest.fixture
def no_mlx_load(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fail the test if a rejected segment reaches MLX."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a segment that failed verification was handed to MLX")

    monkeypatch.setattr(mx, "load", refuse)
    yield


def digest(path: Path) -> str:
    """The checksum kvd indexes a file with, computed here independently."""
    import xxhash

    return f"xxh3:{xxhash.xxh3_64_hexdigest(path.read_bytes())}"


def crc(path: Path) -> str:
    """The checksum indexes held before xxh3."""
    return f"crc32:{zlib.crc32(path.read_bytes()):08x}"


def flip_bit(path: Path, offset: int, bit: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))


def header_len(path: Path) -> int:
    return int(struct.unpack("<Q", path.read_bytes()[:8])[0])


# -- round trips --------------------------------------------------------------


def test_round_trip_is_exact(written: SegmentFile, snap: Snapshot) -> None:
    assert written.path.name == "s1.seg"  # no ".safetensors" appended
    assert written.nbytes == written.path.stat().st_size
    assert written.checksum == digest(written.path)
    back = read_segment(written.path, checksum=written.checksum, fingerprint=FP)
    assert_same(back, snap)
    assert [layer.kind for layer in back.layers] == ["rotating", "kv", "rotating", "kv"]


def test_round_trip_of_every_kind(tmp_path: Path) -> None:
    def kv(n: int, dtype: mx.Dtype = mx.float16) -> KVCache:
        c = KVCache()
        k = mx.random.normal((1, 2, n, 64), key=mx.random.key(n)).astype(dtype)
        c.update_and_fetch(k, -k)
        return c

    ring = RotatingKVCache(max_size=8, keep=2)
    ring.update_and_fetch(*(mx.random.normal((1, 2, 11, 64), key=mx.random.key(3)),) * 2)
    state = ArraysCache(2)
    state[1] = mx.arange(6, dtype=mx.int32)[None]
    cache = [
        kv(11, mx.bfloat16),
        kv(11).to_quantized(group_size=32, bits=4),
        ring,
        CacheList(kv(11), state),
    ]
    for start in (0, 4):
        snap = snapshot(cache, start)
        path = tmp_path / f"every-{start}"
        seg = write_segment(path, snap, fingerprint=FP)
        assert_same(read_segment(path, checksum=seg.checksum, fingerprint=FP), snap)


def test_incremental_segments_restore_through_batch_generator(tmp_path: Path, swa: Any) -> None:
    """Two segments on disk, read back, merged, restored, inserted: same tokens."""
    cache = make_prompt_cache(swa)
    swa(mx.array([TOKENS[:40]]), cache=cache)
    first = write_segment(tmp_path / "a", snapshot(cache), fingerprint=FP)
    swa(mx.array([TOKENS[40:120]]), cache=cache)
    second = write_segment(tmp_path / "b", snapshot(cache, 40), fingerprint=FP)
    snap = merge(*(read_segment(s.path, checksum=s.checksum, fingerprint=FP) for s in (first, second)))

    def run(prompt: list[int], caches: list[Any] | None, fed: list[list[int]] | None) -> list[int]:
        gen = BatchGenerator(swa, max_tokens=12)
        try:
            gen.insert([prompt], caches=caches, all_tokens=fed)
            out: list[int] = []
            while True:
                for r in gen.next_generated():
                    out.append(r.token)
                    if r.finish_reason is not None:
                        return out
        finally:
            gen.close()

    assert run(TOKENS[120:], [restore(snap)], [TOKENS[:120]]) == run(TOKENS, None, None)


def test_empty_snapshot_round_trips(tmp_path: Path, swa: Any) -> None:
    snap = snapshot(make_prompt_cache(swa))
    seg = write_segment(tmp_path / "empty", snap, fingerprint=FP)
    assert_same(read_segment(seg.path, checksum=seg.checksum, fingerprint=FP), snap)


def test_new_files_are_indexed_with_xxh3_and_older_crc32_still_reads(written: SegmentFile) -> None:
    assert written.checksum == digest(written.path)
    old = crc(written.path)
    read_segment(written.path, checksum=old, fingerprint=FP)  # an index from before xxh3
    flip_bit(written.path, written.nbytes - 1)
    for checksum in (written.checksum, old):
        with pytest.raises(ChecksumMismatch):
            read_segment(written.path, checksum=checksum, fingerprint=FP)


def test_only_xxh3_and_crc32_checksums_are_known(written: SegmentFile) -> None:
    digest = written.checksum.partition(":")[2]
    with pytest.raises(ChecksumMismatch, match="unknown checksum"):
        read_segment(written.path, checksum=f"md5:{digest}", fingerprint=FP)


def test_fingerprint_is_stable_and_sensitive() -> None:
    base: dict[str, Any] = dict(
        model_id="m", config={"b": 1, "a": [1, 2]}, dtype="bfloat16", kv_bits=None, layout=["kv", "kv"]
    )
    fp = fingerprint(**base)
    assert fp == fingerprint(**{**base, "config": {"a": [1, 2], "b": 1}})  # key order does not matter
    assert len(fp) == 16 and int(fp, 16) >= 0
    for change in (
        {"model_id": "n"},
        {"config": {"b": 2, "a": [1, 2]}},
        {"dtype": "float16"},
        {"kv_bits": 8},
        {"layout": ["kv", "rotating(max_size=64,keep=0)"]},
    ):
        assert fingerprint(**{**base, **change}) != fp


def test_layout_feeds_the_fingerprint(swa: Any) -> None:
    assert layout(make_prompt_cache(swa))[0] == "rotating(max_size=64,keep=0)"


# -- atomicity ----------------------------------------------------------------


def test_no_file_at_path_until_complete(
    tmp_path: Path, snap: Snapshot, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "seg"
    events: list[str] = []
    real_replace, real_fsync = os.replace, os.fsync

    def fsync(fd: int) -> None:
        events.append("fsync-dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "fsync-file")
        real_fsync(fd)

    def replace(src: Any, dst: Any) -> None:
        assert not path.exists(), "the final name appeared before the rename"
        temp = Path(src)
        assert temp.parent == tmp_path and temp.name.startswith(".") and temp.name.endswith(".tmp")
        events.append("rename")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    seg = write_segment(path, snap, fingerprint=FP)
    if sys.platform.startswith("linux"):
        assert events == ["fsync-file", "rename", "fsync-dir"]
    assert [p.name for p in tmp_path.iterdir()] == ["seg"]
    read_segment(path, checksum=seg.checksum, fingerprint=FP)


def test_failed_write_leaves_nothing(
    tmp_path: Path, snap: Snapshot, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_save = mx.save_safetensors

    def half_then_fail(f: Any, arrays: dict[str, Any], metadata: dict[str, str]) -> None:
        f.write(b"\x00" * 100)
        raise OSError(28, "No space left on device")

    path = tmp_path / "seg"
    monkeypatch.setattr(mx, "save_safetensors", half_then_fail)
    with pytest.raises(OSError, match="No space"):
        write_segment(path, snap, fingerprint=FP)
    assert list(tmp_path.iterdir()) == []
    # An old segment under the name survives a failed rewrite intact.
    monkeypatch.setattr(mx, "save_safetensors", real_save)
    old = write_segment(path, snap, fingerprint=FP)
    monkeypatch.setattr(mx, "save_safetensors", half_then_fail)
    with pytest.raises(OSError):
        write_segment(path, snap, fingerprint=OTHER_FP)
    read_segment(path, checksum=old.checksum, fingerprint=FP)


CRASH = """
import os, sys
from daemon.service.blas import preload_blas
preload_blas()
import mlx.core as mx
from cachestore import segments
from cachestore.snapshot import snapshot
from mlx_lm.models.cache import KVCache
c = KVCache()
k = mx.ones((1, 2, 300, 32))
c.update_and_fetch(k, k)
os.fsync = lambda fd: os._exit(3)  # power cut: data written, never synced or renamed
segments.write_segment(sys.argv[1], snapshot([c]), fingerprint="x")
"""


def test_crash_mid_write_leaves_no_segment(tmp_path: Path) -> None:
    path = tmp_path / "seg"
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", CRASH, str(path)], cwd=root, timeout=120)
    assert done.returncode == 3
    (temp,) = tmp_path.iterdir()
    assert temp.name.startswith(".seg.") and temp.stat().st_size > 300 * 2 * 32 * 4
    assert not path.exists()
    with pytest.raises(SegmentMissing) as e:
        read_segment(path, checksum="crc32:00000000", fingerprint="x")
    assert e.value.reason == "missing"  # the temp file is no row's: the index's sweep removes it at start


# -- corruption ---------------------------------------------------------------


@pytest.mark.usefixtures("no_mlx_load")
def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SegmentMissing) as e:
        read_segment(tmp_path / "nope", checksum="crc32:00000000", fingerprint=FP)
    assert e.value.reason == "missing" and isinstance(e.value, CorruptSegment)


@pytest.mark.usefixtures("no_mlx_load")
@pytest.mark.parametrize("keep", ["half", "header-part", "4-bytes", "empty", "one-byte-short"])
def test_truncated_file(written: SegmentFile, keep: str) -> None:
    data = written.path.read_bytes()
    n = {
        "half": len(data) // 2,
        "header-part": 8 + header_len(written.path) // 2,
        "4-bytes": 4,
        "empty": 0,
        "one-byte-short": len(data) - 1,
    }[keep]
    written.path.write_bytes(data[:n])
    with pytest.raises(SegmentTruncated) as e:
        read_segment(written.path, checksum=written.checksum, fingerprint=FP)
    assert e.value.reason == "truncated" and str(written.path) in str(e.value)


@pytest.mark.usefixtures("no_mlx_load")
def test_flipped_bit_in_data(written: SegmentFile) -> None:
    flip_bit(written.path, written.nbytes - 1000, bit=3)
    with pytest.raises(ChecksumMismatch) as e:
        read_segment(written.path, checksum=written.checksum, fingerprint=FP)
    assert e.value.reason == "checksum"


@pytest.mark.usefixtures("no_mlx_load")
def test_flipped_bit_in_header(written: SegmentFile) -> None:
    text = written.path.read_bytes()[: 8 + header_len(written.path)]
    flip_bit(written.path, text.index(b"kvd.layout") + 2)  # "kvd.layout" -> "kve.layout"
    with pytest.raises(ChecksumMismatch):
        read_segment(written.path, checksum=written.checksum, fingerprint=FP)


@pytest.mark.usefixtures("no_mlx_load")
def test_swapped_file(tmp_path: Path, written: SegmentFile, swa: Any) -> None:
    """Another session's (or model's) segment under this name: never loaded."""
    cache = make_prompt_cache(swa)
    swa(mx.array([TOKENS[50:120]]), cache=cache)
    other = write_segment(tmp_path / "other", snapshot(cache), fingerprint=OTHER_FP)
    os.replace(other.path, written.path)
    with pytest.raises(ChecksumMismatch):
        read_segment(written.path, checksum=written.checksum, fingerprint=FP)
    # With its own checksum (say the index row came along) the model still differs.
    with pytest.raises(FingerprintMismatch) as e:
        read_segment(written.path, checksum=other.checksum, fingerprint=FP)
    assert e.value.reason == "fingerprint" and OTHER_FP in str(e.value)


@pytest.mark.usefixtures("no_mlx_load")
def test_wrong_fingerprint(written: SegmentFile) -> None:
    with pytest.raises(FingerprintMismatch):
        read_segment(written.path, checksum=written.checksum, fingerprint=OTHER_FP)


@pytest.mark.usefixtures("no_mlx_load")
def test_garbage_with_matching_checksum(tmp_path: Path) -> None:
    for name, data in {
        "random": bytes(range(256)) * 40,
        "json-junk": struct.pack("<Q", 5) + b"12345",
        "not-ours": struct.pack("<Q", 2) + b"{}",
    }.items():
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(UnsupportedFormat):
            read_segment(path, checksum=digest(path), fingerprint=FP)


# -- hand-crafted files: format and invariants --------------------------------


def craft(
    path: Path,
    tensors: dict[str, mx.array],
    layout: Any,
    *,
    start: int = 0,
    end: int = 4,
    meta: dict[str, str] | None = None,
) -> str:
    """Write a segment by hand (bypassing write_segment's well-formed output)."""
    metadata = {
        "kvd.format": "1",
        "kvd.fingerprint": FP,
        "kvd.start": str(start),
        "kvd.end": str(end),
        "kvd.layout": layout if isinstance(layout, str) else json.dumps(layout),
        **(meta or {}),
    }
    with open(path, "wb") as f:
        mx.save_safetensors(f, tensors, metadata)
    return crc(path)


def node(kind: str, arrays: int, **meta: int) -> dict[str, Any]:
    return {"kind": kind, "meta": meta, "arrays": arrays, "children": []}


KV4 = {"L0.0": mx.zeros((1, 2, 4, 8)), "L0.1": mx.zeros((1, 2, 4, 8))}


def test_crafted_well_formed_file_loads(tmp_path: Path) -> None:
    path = tmp_path / "ok"
    checksum = craft(path, KV4, [node("kv", 2, start=0, offset=4)])
    snap = read_segment(path, checksum=checksum, fingerprint=FP)
    assert snap.layers[0].arrays[0].shape == (1, 2, 4, 8)


def _ring(n: int) -> dict[str, mx.array]:
    return {"L0.0": mx.zeros((1, 2, n, 8)), "L0.1": mx.zeros((1, 2, n, 8))}


def _quant() -> dict[str, mx.array]:
    w, s, b = mx.quantize(mx.zeros((1, 2, 4, 64)), group_size=32, bits=4)
    return {f"L0.{i}": a for i, a in enumerate((w, s, b, w, s, b))}


INVARIANT_CASES: dict[str, tuple[dict[str, mx.array], Any, dict[str, Any]]] = {
    "kv length != end - start": (KV4, [node("kv", 2, start=0, offset=5)], {"end": 5}),
    "kv offset != segment end": (KV4, [node("kv", 2, start=0, offset=3)], {}),
    "kv start != segment start": (KV4, [node("kv", 2, start=1, offset=4)], {}),
    "negative range": (KV4, [node("kv", 2, start=0, offset=4)], {"start": 6}),
    "keys/values disagree": (
        {"L0.0": mx.zeros((1, 2, 4, 8)), "L0.1": mx.zeros((1, 3, 4, 8))},
        [node("kv", 2, start=0, offset=4)],
        {},
    ),
    "integer keys": (
        {"L0.0": mx.zeros((1, 2, 4, 8), mx.int32), "L0.1": mx.zeros((1, 2, 4, 8), mx.int32)},
        [node("kv", 2, start=0, offset=4)],
        {},
    ),
    "batch of two": (
        {"L0.0": mx.zeros((2, 2, 4, 8)), "L0.1": mx.zeros((2, 2, 4, 8))},
        [node("kv", 2, start=0, offset=4)],
        {},
    ),
    "three-dim keys": (
        {"L0.0": mx.zeros((2, 4, 8)), "L0.1": mx.zeros((2, 4, 8))},
        [node("kv", 2, start=0, offset=4)],
        {},
    ),
    "missing tensor": ({"L0.0": mx.zeros((1, 2, 4, 8))}, [node("kv", 2, start=0, offset=4)], {}),
    "extra tensor": ({**KV4, "L9.0": mx.zeros((1,))}, [node("kv", 2, start=0, offset=4)], {}),
    "arrays for no tokens": (KV4, [node("kv", 2, start=0, offset=0)], {"end": 0}),
    "ring index beyond the window": (
        _ring(8),
        [node("rotating", 2, offset=100, max_size=8, keep=0, idx=9)],
        {"end": 100},
    ),
    "ring shorter than the window": (
        _ring(6),
        [node("rotating", 2, offset=100, max_size=8, keep=0, idx=6)],
        {"end": 100},
    ),
    "ring longer than its tokens": (
        _ring(8),
        [node("rotating", 2, offset=5, max_size=8, keep=0, idx=8)],
        {"end": 5},
    ),
    "ring keep beyond max_size": (
        _ring(8),
        [node("rotating", 2, offset=100, max_size=8, keep=9, idx=8)],
        {"end": 100},
    ),
    "ring negative offset": (
        _ring(8),
        [node("rotating", 2, offset=-1, max_size=8, keep=0, idx=8)],
        {"end": -1},
    ),
    "quantized bits": (_quant(), [node("quantized", 6, start=0, offset=4, group_size=32, bits=7)], {}),
    "quantized group size": (
        _quant(),
        [node("quantized", 6, start=0, offset=4, group_size=16, bits=4)],
        {},
    ),
    "quantized packing": (
        _quant(),
        [node("quantized", 6, start=0, offset=4, group_size=32, bits=8)],
        {},
    ),
    "arrays present mask": (
        {"L0.0": mx.zeros((1, 3))},
        [node("arrays", 1, offset=4, slots=2, present=0b11)],
        {},
    ),
    "arrays mask beyond slots": (
        {"L0.0": mx.zeros((1, 3))},
        [node("arrays", 1, offset=4, slots=1, present=0b10)],
        {},
    ),
    "arrays batch": ({"L0.0": mx.zeros((2, 3))}, [node("arrays", 1, offset=4, slots=1, present=1)], {}),
    "empty cache list": ({}, [node("list", 0, offset=4)], {}),
}


@pytest.mark.usefixtures("no_mlx_load")
@pytest.mark.parametrize("case", list(INVARIANT_CASES))
def test_invariant_violations(tmp_path: Path, case: str) -> None:
    tensors, lay, kw = INVARIANT_CASES[case]
    path = tmp_path / "bad"
    checksum = craft(path, tensors, lay, **kw)
    with pytest.raises(InvariantViolation) as e:
        read_segment(path, checksum=checksum, fingerprint=FP)
    assert e.value.reason == "invariant"


FORMAT_CASES: dict[str, tuple[Any, dict[str, str]]] = {
    "future version": ([node("kv", 2, start=0, offset=4)], {"kvd.format": "2"}),
    "unknown kind": ([node("ChunkedKVCache", 2, start=0, offset=4)], {}),
    "a class name": ([node("KVCache", 2, start=0, offset=4)], {}),
    "layout not json": ("[{", {}),
    "meta keys": ([node("kv", 2, offset=4)], {}),
    "meta not int": (
        [{"kind": "kv", "meta": {"start": "0", "offset": 4}, "arrays": 2, "children": []}],
        {},
    ),
    "children under kv": (
        [{**node("kv", 2, start=0, offset=4), "children": [node("kv", 0, start=0, offset=4)]}],
        {},
    ),
    "start not a number": ([node("kv", 2, start=0, offset=4)], {"kvd.start": "zero"}),
}


@pytest.mark.usefixtures("no_mlx_load")
@pytest.mark.parametrize("case", list(FORMAT_CASES))
def test_format_errors(tmp_path: Path, case: str) -> None:
    lay, meta = FORMAT_CASES[case]
    path = tmp_path / "bad"
    checksum = craft(path, KV4, lay, meta=meta)
    with pytest.raises(UnsupportedFormat) as e:
        read_segment(path, checksum=checksum, fingerprint=FP)
    assert e.value.reason == "format"


@pytest.mark.usefixtures("no_mlx_load")
def test_fingerprint_is_checked_before_the_version(tmp_path: Path) -> None:
    path = tmp_path / "bad"
    checksum = craft(path, KV4, [node("kv", 2, start=0, offset=4)], meta={"kvd.format": "9"})
    with pytest.raises(FingerprintMismatch):
        read_segment(path, checksum=checksum, fingerprint=OTHER_FP)
    with pytest.raises(UnsupportedFormat, match="version"):
        read_segment(path, checksum=checksum, fingerprint=FP)
