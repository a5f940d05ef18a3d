"""Restore bandwidth: a session's disk chain back into a live cache, against a plain read.

Run: .venv/bin/python bench/restore.py [--lengths 1024 2048 4096] [--turn 256] [--repeat 5]

The KV shape is SmolLM2-135M-Instruct's (the default model: 30 layers, 3 KV
heads of 64, float32; speed does not depend on the values, so they are
random). A conversation of N tokens is written the way the daemon writes it,
one segment per turn of `--turn` tokens, by kvd's own SessionCaches (so on
disk: whole content-addressed blocks of `cache.block_tokens`, then the tail). Then a
fresh SessionCaches (a restart) restores it, timed to evaluated arrays:

- `kvd`: `SessionCaches.checkout` as the daemon calls it (cachestore/direct.py:
  one read of each file into the live cache's own buffers, hashed where the
  bytes land);
- `general`: the path every other layout takes, and all layouts took before:
  `read_segment` per file, `merge`, `restore`;
- `plain read`: `read_bytes()` of the same files, nothing else (in a loop,
  into the memory the last read freed);
- `plain read into fresh memory`: the same bytes read into an anonymous map
  made for each read, so the read faults its pages in, as a restore after a
  restart must for the buffers the cache will live in (on this project's VM,
  ~0.7 ms a MB, far more than the copy).

Each with the page cache warm (files just read) and cold (`drop_caches`, which
needs root; without it the cold columns are left out). Medians of `--repeat`.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from daemon.service.blas import preload_blas  # noqa: E402

preload_blas()

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

from cachestore.rows import BlockRow, SegmentRow  # noqa: E402
from cachestore.segments import read_segment  # noqa: E402
from cachestore.snapshot import merge, restore  # noqa: E402
from cachestore.store import Budgets, SessionCaches  # noqa: E402
from resume import drop_page_cache  # noqa: E402  # the same method as bench/resume.py

KEY = "0123456789abcdef"
LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64  # SmolLM2-135M
GIB = 1 << 30


def budgets() -> Budgets:
    return Budgets(resident_bytes=64 * GIB, warm_bytes=0, disk_bytes=64 * GIB,
                   resident_idle=3600.0, warm_idle=3600.0, max_segments=64)


def write(root: Path, n: int, turn: int) -> None:
    caches = SessionCaches(root, "bench", budgets())
    cache = [KVCache() for _ in range(LAYERS)]
    tokens: list[int] = []
    for a in range(0, n, turn):
        k = min(turn, n - a)
        for c in cache:
            c.update_and_fetch(mx.random.normal((1, KV_HEADS, k, HEAD_DIM)),
                               mx.random.normal((1, KV_HEADS, k, HEAD_DIM)))
        mx.eval([c.state for c in cache])
        tokens += list(range(a, a + k))
        caches.checkin(KEY, cache, tokens)
    caches.close()


def timed(fn: Callable[[], Any], cold: bool) -> float:
    if cold:
        drop_page_cache()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(n: int, turn: int, repeat: int, can_drop: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVD_BENCH_DIR")) as tmp:
        root = Path(tmp)
        write(root, n, turn)
        store = SessionCaches(root, "bench", budgets())  # a restart: the session is only on disk
        rows: list[BlockRow | SegmentRow] = [*store.index.blocks_of(KEY), *store.index.chain(KEY)]  # blocks, then tail
        nbytes = sum(r.nbytes for r in rows)
        wanted = list(range(n)) + [n]

        def kvd() -> None:
            got = store.checkout(KEY, wanted)  # not checked back in: the next one reads disk again
            assert got.restored_from == "disk" and got.tokens == n and got.cache is not None
            mx.eval([c.state for c in got.cache])

        def general() -> None:
            live = restore(merge(*(read_segment(r.path, checksum=r.checksum, fingerprint="bench")
                                   for r in rows)))
            mx.eval([c.state for c in live])

        def plain() -> None:
            for r in rows:
                r.path.read_bytes()

        def plain_fresh() -> None:
            # Into memory the process has not touched yet, as a restored cache's buffers are after a
            # restart: an anonymous map, its pages faulted in by the read. read_bytes() in a loop gets
            # back the pages the last one freed.
            with mmap.mmap(-1, nbytes) as m, memoryview(m) as view:
                at = 0
                for r in rows:
                    with open(r.path, "rb", buffering=0) as f:
                        while (got := f.readinto(view[at:at + r.nbytes])) > 0:
                            at += got

        out: dict[str, Any] = {"n": n, "segments": len(rows), "bytes": nbytes}
        for name, fn in (("kvd", kvd), ("general", general), ("plain", plain), ("fresh", plain_fresh)):
            for cold in (False, True) if can_drop else (False,):
                fn()  # warm-up (and the page cache, for the warm case)
                secs = statistics.median(timed(fn, cold) for _ in range(repeat))
                out[f"{name}_{'cold' if cold else 'warm'}"] = secs
        store.close()
        return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--turn", type=int, default=256, help="tokens per segment (one per turn)")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    can_drop = drop_page_cache()
    print(f"# load average {os.getloadavg()[0]:.2f}; page cache can be dropped: {can_drop}", file=sys.stderr)
    rows = [run(n, args.turn, args.repeat, can_drop) for n in args.lengths]
    print(f"# load average after {os.getloadavg()[0]:.2f}", file=sys.stderr)
    cases = ["warm", "cold"] if can_drop else ["warm"]
    head = "| N | segments | MB |"
    for c in cases:
        head += (f" kvd ({c}) | general ({c}) | plain read ({c}) | kvd / plain ({c}) "
                 f"| plain read into fresh memory ({c}) | kvd / that ({c}) |")
    print(head)
    print("| ---: " * (3 + 6 * len(cases)) + "|")
    for r in rows:
        mb = r["bytes"] / 1e6
        line = f"| {r['n']} | {r['segments']} | {mb:.0f} |"
        for c in cases:
            k, g, p, fr = r[f"kvd_{c}"], r[f"general_{c}"], r[f"plain_{c}"], r[f"fresh_{c}"]
            line += (f" {k * 1000:.0f} ms, {mb / k / 1000:.2f} GB/s | {g * 1000:.0f} ms, {mb / g / 1000:.2f} GB/s "
                     f"| {p * 1000:.0f} ms, {mb / p / 1000:.2f} GB/s | {p / k:.0%} "
                     f"| {fr * 1000:.0f} ms, {mb / fr / 1000:.2f} GB/s | {fr / k:.0%} |")
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
