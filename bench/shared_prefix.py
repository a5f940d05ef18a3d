"""Shared prefixes (issue 14): a new session that begins like a stored one, and the bytes many such sessions take.

Run: .venv/bin/python bench/shared_prefix.py [--model builtin:smollm2 | DIR] [--lengths 1024 4096]
                                             [--repeat 3] [--sessions 16] [--prefix 2048]
     .venv/bin/python bench/shared_prefix.py --model DIR --prefix 4096 --block-sizes 64 128 256 512

A real `kvd serve` (tests/daemonproc.py) on the given model, spoken to over
its websocket protocol, greedy, `--new` answer tokens. TTFT is the daemon's
own `usage.ttft_ms` (request arrival to first token).

1. TTFT, for a system prompt of about N tokens already used by one session
   (its first turn untimed):
   - resumed: that session's next turn (its own resident cache);
   - shared: a new session with the same system prompt and a question of
     its own (the prefix is copied out of the first session's cache);
   - shared after restart: the same, after a cold restart (disk blocks);
   - without sharing: a new session whose system prompt of the same length
     shares nothing (a full prefill, what every new session paid before).
2. Bytes: `--sessions` sessions whose conversations share a `--prefix`-token
   system prompt (each then asks its own question), with no resident room so
   every cache is warm, then on disk; against the bytes per token of two
   sessions with blocks longer than any conversation (nothing shared). The
   ideal is one prefix plus each session's own suffix at that rate; "16x one
   session" is that rate times all sixteen sessions' tokens.

Other work shares this machine's 2 cores, so each number is printed with
the load average when it was taken; medians with their range.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import daemonproc  # noqa: E402
from conftest import fed_tokens  # noqa: E402
from daemonproc import DaemonProcess  # noqa: E402

# A 4k-token prompt chunk on a busy 2-core machine can take longer than a test waits for an event.
daemonproc.EVENT_TIMEOUT = 900.0

WORDS = ("cache block token prefix session model answer question system prompt window layer "
         "memory disk warm resident restore prefill decode batch chunk budget index segment "
         "history turn chat stream engine thread shared content address hash chain").split()


def prompt_of(tokens: int, seed: int) -> str:
    """About `tokens` tokens of words (SmolLM2's tokenizer: ~1.3 words a token here)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(int(tokens * 0.95)))


def load() -> float:
    return os.getloadavg()[0]


def span(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} ms ({min(values):.0f}-{max(values):.0f})"


class Bench:
    def __init__(self, model: str, data: Path, new: int, extra: tuple[str, ...] = ()):
        self.model, self.data, self.new, self.extra = model, data, new, extra
        self.d: DaemonProcess | None = None

    def start(self, **cache: int) -> None:
        config = self.data.parent / f"{self.data.name}.toml"
        config.write_text("[cache]\nprefetch = false\n" + "".join(f"{k} = {v}\n" for k, v in cache.items()))
        self.d = DaemonProcess(self.data, "--model", self.model, "--config", str(config), *self.extra)

    def stop(self) -> None:
        assert self.d is not None
        assert self.d.terminate() == 0
        self.d = None

    def turn(self, sid: str | None, system: str, text: str) -> tuple[str, dict[str, Any]]:
        assert self.d is not None
        with self.d.client() as c:
            if sid is None:
                sid = c.request("session.create", system=system)["session"]["id"]
            _, done = c.chat(sid, text, max_tokens=self.new, temperature=0)
            assert done["type"] == "chat.done", done
            c.request("status")  # answered once the turn's cache is kept (written behind it)
        return sid, done["usage"]

    def status(self) -> dict[str, Any]:
        assert self.d is not None
        with self.d.client() as c:
            return c.request("status")


def ttft(model: str, root: Path, tokens: int, repeat: int, new: int) -> dict[str, Any]:
    b = Bench(model, Path(tempfile.mkdtemp(dir=root)), new)
    system = prompt_of(tokens, 1)
    first = "What is this about?"
    rows: dict[str, list[tuple[float, float, dict[str, Any]]]] = {}

    def note(name: str, usage: dict[str, Any]) -> None:
        rows.setdefault(name, []).append((usage["ttft_ms"], load(), usage))

    b.start()
    try:
        sid, u = b.turn(None, system, first)
        for i in range(repeat):
            note("resumed", b.turn(sid, system, f"And point {i}?")[1])
            # A new session asking something new: the system prompt and the template's
            # head are shared, its own question is prefilled (as the resumed turn's is).
            note("shared", b.turn(None, system, f"What is point {i}, in short?")[1])
        # A full prefill: once (4k tokens take over a minute on 2 CPU cores; its spread is small).
        note("without sharing", b.turn(None, prompt_of(tokens, 100), first)[1])
        b.stop()
        for _ in range(repeat):
            b.start()
            note("shared after restart", b.turn(None, system, "And what is it not about?")[1])
            b.stop()
    finally:
        if b.d is not None:
            b.stop()
    return {"prompt_tokens": u["prompt_tokens"], "rows": rows}


def nbytes(model: str, root: Path, sessions: int, prefix: int, new: int, block_tokens: int) -> dict[str, Any]:
    b = Bench(model, Path(tempfile.mkdtemp(dir=root)), new)
    system = prompt_of(prefix, 7)
    b.start(resident_bytes=0, block_tokens=block_tokens)
    try:
        sids = [b.turn(None, system, f"Question number {i}: what does item {i} mean?")[0]
                for i in range(sessions)]
        tiers = b.status()["tiers"]
    finally:
        b.stop()
    ids = [fed_tokens(b.data / "kvd.sqlite", sid) for sid in sids]
    common = min(next((k for k, (x, y) in enumerate(zip(ids[0], other)) if x != y), len(other))
                 for other in ids[1:])
    return {"warm": tiers["warm"]["bytes"], "disk": tiers["disk"]["bytes"], "load": load(),
            "tokens": [len(t) for t in ids], "common": common}


def block_sizes(model_dir: str, root: Path, tokens: int, sizes: list[int], repeat: int) -> None:
    """How the block size costs: write a `tokens`-token cache, then restore it for another session
    from disk after a restart (every block read, checksummed, merged), in process on the model's caches."""
    import time

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load as load_model

    from cachestore.store import Budgets, SessionCaches

    model = load_model(model_dir)[0]
    model.set_dtype(mx.float32)
    ids = [int(t) % 1000 + 100 for t in random.Random(3).sample(range(10**6), tokens)]
    cache = make_prompt_cache(model)
    for i in range(0, tokens, 512):
        model(mx.array([ids[i:i + 512]]), cache=cache)
        mx.eval([c.state for c in cache])
    print(f"\nblock size: a {tokens}-token cache written once, then restored for a new session after a restart")
    for size in sizes:
        writes, reads = [], []
        for _ in range(repeat):
            where = Path(tempfile.mkdtemp(dir=root))
            budgets = Budgets(resident_bytes=1 << 34, warm_bytes=0, disk_bytes=1 << 40, resident_idle=1e9,
                              warm_idle=1e9, max_segments=16, block_tokens=size)
            caches = SessionCaches(where, "bench", budgets)
            t0 = time.perf_counter()
            caches.checkin("aaaa", cache, ids)
            writes.append((time.perf_counter() - t0) * 1000)
            files = caches.statistics()["disk"]["blocks"]
            caches.close()
            caches = SessionCaches(where, "bench", budgets)
            t0 = time.perf_counter()
            got = caches.checkout("bbbb", ids + [5])
            reads.append((time.perf_counter() - t0) * 1000)
            assert got.restored_from == "shared", got.restored_from
            caches.close()
        print(f"  block_tokens {size:4}: {files:3} blocks, write {span(writes)}, shared restore {span(reads)}, "
              f"load {load():.1f}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:smollm2")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--new", type=int, default=8)
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--prefix", type=int, default=2048)
    parser.add_argument("--skip-ttft", action="store_true")
    parser.add_argument("--skip-bytes", action="store_true")
    parser.add_argument("--block-sizes", type=int, nargs="*", default=[],
                        help="only measure write and restore cost per block size (in process; --model DIR)")
    args = parser.parse_args()
    root = Path(os.environ.get("KVD_BENCH_DIR") or tempfile.mkdtemp(prefix="kvd-shared-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"model {args.model}; load average {load():.2f}", flush=True)
    if args.block_sizes:
        block_sizes(args.model, root, args.prefix, args.block_sizes, args.repeat)
        return 0
    if not args.skip_ttft:
        for tokens in args.lengths:
            out = ttft(args.model, root, tokens, args.repeat, args.new)
            print(f"\nsystem prompt ~{tokens} tokens (first prompt {out['prompt_tokens']} tokens)")
            for name, rows in out["rows"].items():
                values = [r[0] for r in rows]
                loads = ", ".join(f"{r[1]:.1f}" for r in rows)
                where = sorted({f"{r[2]['restored_from']}:{r[2]['cached_tokens']}" for r in rows})
                restore = statistics.median(r[2]["restore_ms"] for r in rows)
                prefill = sorted({r[2]["prefill_tokens"] for r in rows})
                print(f"  {name:22} TTFT {span(values)}  load {loads}  restored {', '.join(where)} "
                      f"in {restore:.0f} ms, prefilled {prefill} tok", flush=True)
    if not args.skip_bytes:
        shared = nbytes(args.model, root, args.sessions, args.prefix, args.new, 128)
        # Unshared bytes per token, from two sessions (each prefills the whole prefix: slow on CPU).
        alone = nbytes(args.model, root, 2, args.prefix, args.new, 1 << 20)
        # The ideal: one copy of the common prefix plus each session's own suffix, at the
        # bytes per token the unshared run measured in each tier.
        kept = shared["common"] + sum(t - shared["common"] for t in shared["tokens"])
        ideal = {tier: alone[tier] / sum(alone["tokens"]) * kept for tier in ("warm", "disk")}
        print(f"\n{args.sessions} sessions sharing a {shared['common']}-token prefix "
              f"({min(shared['tokens'])}-{max(shared['tokens'])} tokens each)")
        everything = {tier: alone[tier] / sum(alone["tokens"]) * sum(shared["tokens"]) for tier in ("warm", "disk")}
        print(f"  shared (128-token blocks)  warm {shared['warm'] / 2**20:8.1f} MiB  disk "
              f"{shared['disk'] / 2**20:8.1f} MiB  load {shared['load']:.1f}")
        print(f"  {args.sessions}x one session (unshared) warm {everything['warm'] / 2**20:8.1f} MiB  disk "
              f"{everything['disk'] / 2**20:8.1f} MiB  load {alone['load']:.1f}")
        print(f"  ideal (one prefix + suffixes): warm {ideal['warm'] / 2**20:.1f} MiB, disk "
              f"{ideal['disk'] / 2**20:.1f} MiB; shared/ideal: warm {shared['warm'] / ideal['warm']:.2f}x, "
              f"disk {shared['disk'] / ideal['disk']:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
