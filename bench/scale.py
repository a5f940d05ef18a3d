"""The block table at scale (issue 22): 10,000 sessions, 100,000 blocks indexed.

Run: .venv/bin/python bench/scale.py [--sessions 10000] [--prompts 100] [--own-blocks 10] [--block 128]
                                     [--repeat 200]

Builds a cache index the way kvd's I/O worker leaves one (rows through
SegmentIndex's schema, one empty file per row so the start-up sweep keeps
them; no model: the files are never read), then opens a `SessionCaches`
on it and times, on the engine thread's side:

- start: opening the store, which loads the index into the block table once;
- find: what restores the longest prefix of a wanted id list
  (`SessionCaches.find`: hashing the ids not hashed yet, the walk down the
  table, the disk plan, the other sessions' memory), for three kinds of
  request: a session's own next turn, a new session opening with one of the
  shared system prompts, and a branch from the middle of another session;
- status: what the `status` request reads from the store
  (`statistics()` and `locations()`).

The shape: `--prompts` system prompts of 2 blocks, each opening
sessions/prompts sessions; each session then has `--own-blocks` blocks of
its own and a private tail of 40 ids. Goals: find <= 1 ms, status <= 10 ms.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cachestore.blocks import block_key, root_key  # noqa: E402
from cachestore.index import SegmentIndex  # noqa: E402
from cachestore.store import Budgets, SessionCaches  # noqa: E402
from common.tokenids import pack_tokens  # noqa: E402

FINGERPRINT = "scale-bench"
TAIL = 40


def build(root: Path, *, sessions: int, prompts: int, own_blocks: int, block: int) -> dict[str, list[int]]:
    """An index of `sessions` sessions; returns each session's ids."""
    rng = random.Random(22)
    index = SegmentIndex(root)
    top = root_key(FINGERPRINT)
    prompt_ids = [[rng.randrange(50_000) for _ in range(2 * block)] for _ in range(prompts)]
    blocks: dict[str, tuple[str, int, list[int]]] = {}  # key -> (parent, start, ids)
    chains: list[tuple[str, str, int, str]] = []
    segments = []
    ids_of: dict[str, list[int]] = {}
    for i in range(sessions):
        key = f"{i:08x}"
        ids = prompt_ids[i % prompts] + [rng.randrange(50_000) for _ in range(own_blocks * block + TAIL)]
        ids_of[key] = ids
        parent = top
        for k in range((len(ids) - 1) // block):
            part = ids[k * block:(k + 1) * block]
            bk = block_key(parent, part)
            blocks.setdefault(bk, (parent, k * block, part))
            chains.append((key, FINGERPRINT, k, bk))
            parent = bk
        start = (len(ids) - 1) // block * block
        path = index.path_for(key, FINGERPRINT, start, len(ids), parent)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
        segments.append((key, start, len(ids), path.relative_to(index.files).as_posix(), 4096, "0",
                         FINGERPRINT, pack_tokens(ids[start:]), 0.0))
    block_rows = []
    for bk, (parent, start, part) in blocks.items():
        path = index.block_path(bk, parent)
        path.touch()
        block_rows.append((bk, parent, start, start + block, path.name, 65536, "0", FINGERPRINT,
                           pack_tokens(part), 0.0))
    db = index.db
    db.execute("BEGIN")
    db.executemany('INSERT INTO blocks (block, parent, start, "end", file, nbytes, checksum, fingerprint, '
                   "tokens, last_used) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", block_rows)
    db.executemany("INSERT INTO chains (key, fingerprint, n, block) VALUES (?, ?, ?, ?)", chains)
    db.executemany('INSERT INTO segments (key, start, "end", file, nbytes, checksum, fingerprint, tokens, '
                   "created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", segments)
    db.executemany("INSERT INTO keys (key, fingerprint, last_used) VALUES (?, ?, ?)",
                   [(k, FINGERPRINT, float(i)) for i, k in enumerate(ids_of)])
    db.execute("COMMIT")
    print(f"indexed {sessions} sessions, {len(blocks)} blocks, {len(chains)} chain rows")
    index.close()
    return ids_of


def timed(fn: Callable[[], object], repeat: int) -> tuple[float, float, float]:
    """Median, min and max milliseconds of `repeat` calls."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times), min(times), max(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=10_000)
    ap.add_argument("--prompts", type=int, default=100)
    ap.add_argument("--own-blocks", type=int, default=10)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()
    rng = random.Random(7)
    with tempfile.TemporaryDirectory(prefix="kvd-scale-") as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        ids_of = build(root, sessions=args.sessions, prompts=args.prompts, own_blocks=args.own_blocks,
                       block=args.block)
        print(f"built in {time.perf_counter() - t0:.1f} s")
        budgets = Budgets(resident_bytes=1 << 30, warm_bytes=1 << 30, disk_bytes=1 << 50, resident_idle=60.0,
                          warm_idle=600.0, max_segments=16, block_tokens=args.block)
        t0 = time.perf_counter()
        caches = SessionCaches(root, FINGERPRINT, budgets)
        start_s = time.perf_counter() - t0
        keys = list(ids_of)
        stats = caches.statistics()["disk"]
        assert stats["sessions"] == args.sessions, stats
        prompts = {i % args.prompts: ids_of[k][:2 * args.block] for i, k in enumerate(keys[:args.prompts])}

        def own() -> object:
            key = rng.choice(keys)
            got = caches.find(key, [*ids_of[key], 1, 2, 3])
            assert got == ("disk", len(ids_of[key])), got
            return got

        def new_session() -> object:
            key = f"{rng.randrange(1 << 30):08x}ff"
            got = caches.find(key, [*prompts[rng.randrange(args.prompts)], *range(60)])
            assert got == ("shared", 2 * args.block), got
            return got

        def branch() -> object:
            other = rng.choice(keys)
            cut = rng.randrange(3 * args.block, len(ids_of[other]) - TAIL)
            got = caches.find(f"{rng.randrange(1 << 30):08x}ee", [*ids_of[other][:cut], 1, 2])
            assert got == ("shared", cut), (got, cut)
            return got

        def status() -> object:
            return caches.statistics(), caches.locations()

        print(f"load: {os.getloadavg()[0]:.2f}")
        print(f"| start (load the table) | {start_s * 1000:.0f} ms |")
        for name, fn in (("find: own next turn", own), ("find: new session, shared prompt", new_session),
                         ("find: branch mid-session", branch), ("status", status)):
            med, lo, hi = timed(fn, args.repeat if name != "status" else max(args.repeat // 10, 5))
            print(f"| {name} | {med:.3f} ms (min {lo:.3f}, max {hi:.3f}) |")
        caches.close()


if __name__ == "__main__":
    main()
