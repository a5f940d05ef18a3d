"""Segment files written by an earlier kvd still load, and kvd still writes the same bytes.

``data/segment-v1.seg`` was written by main at 421c6c9 (before the cache
kinds became objects and segments.py was split), from the cache
:func:`build_cache` makes, by running this file with main's code first on
the path (from outside the repository, or the repository's own code wins)::

    git archive 421c6c9 cachestore daemon | tar -x -C /tmp/main
    cd /tmp && PYTHONPATH=/tmp/main:$REPO/tests $REPO/.venv/bin/python \
        $REPO/tests/test_segment_compat.py $REPO/tests/data/segment-v1.seg

It holds one layer of every kind (kv, rotating wrapped by one-token updates,
quantized, arrays, a list of kv and rotating) for the tokens [2, 6).
"""

from __future__ import annotations

import sys
import zlib
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, QuantizedKVCache, RotatingKVCache

from cachestore.segments import read_header, read_segment, write_segment
from cachestore.snapshot import Snapshot, snapshot
from snapshots import assert_same

DATA = Path(__file__).parent / "data" / "segment-v1.seg"
FINGERPRINT = "0123456789abcdef"
TOKENS = [10, 11, 12, 13, 14, 15]
START = 2


def _step(i: int, dim: int = 32) -> mx.array:
    """One token's keys: (1 sequence, 2 heads, 1 token, dim), distinct values per token."""
    return (mx.arange(2 * dim, dtype=mx.float32).reshape(1, 2, 1, dim) + 100 * i) / 64


def build_cache() -> list[Any]:
    kv, rotating = KVCache(), RotatingKVCache(max_size=4, keep=1)
    quantized = QuantizedKVCache(group_size=32, bits=4)
    recurrent = ArraysCache(2)
    pair = CacheList(KVCache(), RotatingKVCache(max_size=3))
    for i in range(len(TOKENS)):  # one token at a time: the rotating rings wrap
        for c in (kv, rotating, quantized, *pair.caches):
            c.update_and_fetch(_step(i), -_step(i))
    recurrent[1] = mx.arange(12, dtype=mx.float32).reshape(1, 3, 4)
    return [kv, rotating, quantized, recurrent, pair]


def snap_now() -> Snapshot:
    return snapshot(build_cache(), START)


def test_a_segment_written_by_main_loads() -> None:
    import xxhash

    checksum = f"crc32:{zlib.crc32(DATA.read_bytes()):08x}"  # what main's index held
    old = read_segment(DATA, checksum=checksum, fingerprint=FINGERPRINT)
    header = read_header(DATA)  # an index rebuilt today lists it with today's checksum
    assert (header.start, header.end, header.tokens) == (START, len(TOKENS), tuple(TOKENS[START:]))
    assert header.checksum == f"xxh3:{xxhash.xxh3_64_hexdigest(DATA.read_bytes())}"
    read_segment(DATA, checksum=header.checksum, fingerprint=FINGERPRINT)
    now = snap_now()
    assert [layer.kind for layer in old.layers] == ["kv", "rotating", "quantized", "arrays", "list"]
    assert_same(old, now)


def test_this_kvd_writes_the_same_bytes(tmp_path: Path) -> None:
    written = write_segment(tmp_path / "seg", snap_now(), fingerprint=FINGERPRINT, tokens=TOKENS[START:])
    assert written.path.read_bytes() == DATA.read_bytes()


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.parent.mkdir(parents=True, exist_ok=True)
    seg = write_segment(out, snap_now(), fingerprint=FINGERPRINT, tokens=TOKENS[START:])
    print(seg)
