"""A decoding session's inter-token gaps while another session's cache is read from disk.

Run: .venv/bin/python bench/restore_gaps.py [--mb 500] [--steps 200]
     .venv/bin/python bench/restore_gaps.py --part budget   (eight sessions over the budget: peak RSS)
     .venv/bin/python bench/restore_gaps.py --part checkin  (the write-behind of an answer, back to back)

`gaps` (the default): one Engine (the built-in tiny model, driven on this
thread one step at a time, as tests/test_engine.py does) decodes session B
while session A's cache, `--mb` megabytes of it and only on disk (a
restart), is restored for A's next turn. A's cache is written first with
random keys and values in the model's own layout (4 layers, 2 KV heads of
32, float32: 2 KB a token, so 500 MB is ~250k tokens; the model's context
limit is lifted for A's turn, which only restores and feeds one token).
Reported: B's gaps (the time between two of its tokens) over `--steps` steps
alone, then from A's submission until A starts (the read under way on the
I/O worker's reader, and the engine's own steps for it: planning, allocating
the buffers, building the cache), p50 / p99 / max; apart from them the gap
over the step A starts in, which also runs A's first prefill chunk (its new
token over the whole restored cache: A's own work, whatever restored it);
then A's restore time
and a plain read of the same files (`read_bytes`), for the disk's speed.

`budget`: eight sessions of the tiny model, each turn's cache reckoned at
prompt + max_tokens, under a resident budget that holds three at once; two
turns each. Reported: the most turns running at once, the most bytes
running + resident, and the process's peak RSS against the same eight run
with no byte limit.

`checkin`: one session, `--turns` back-to-back turns; the engine thread's
time to keep each answer (SessionCaches.checkin: evaluating what the turn
writes behind it), p50 / p99, against the turn's own time.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from daemon.service.blas import preload_blas  # noqa: E402

preload_blas()

from daemon.config import Config, load_config  # noqa: E402
from daemon.engine.jobs import Done, EngineEvent  # noqa: E402
from daemon.engine.running import Answer  # noqa: E402
from daemon.engine.thread import Engine  # noqa: E402
from daemon.events import AnswerDelta  # noqa: E402
from daemon.prompt import prompt_tokens  # noqa: E402
from protocol.shapes import Sampling  # noqa: E402

A, B = "a" * 16, "b" * 16


def cfg(root: Path, **fields: Any) -> Config:
    return load_config(None, data_dir=root, model="builtin:tiny", **fields)


def engine(c: Config) -> Engine:
    e = Engine(c)
    e.load()
    return e


def job(e: Engine, sid: str, tokens: list[int], events: list[EngineEvent], max_tokens: int) -> Answer:
    return Answer(session_id=sid, tokens=tokens, sampling=Sampling.of(max_tokens, 0.0, 1.0), emit=events.append)


def first(e: Engine, text: str) -> list[int]:
    return prompt_tokens(e.tokenizer, [{"role": "user", "content": text}], None, [], fed_covers=0)[0]


def ended(events: list[EngineEvent]) -> Done | None:
    return next((x for x in events if isinstance(x, Done)), None)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def fmt(xs: list[float]) -> str:
    return (f"p50 {statistics.median(xs) * 1000:.2f} ms, p99 {pct(xs, 0.99) * 1000:.2f} ms, "
            f"max {max(xs) * 1000:.2f} ms ({len(xs)} gaps)")


def gaps(mb: int, steps: int) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    with tempfile.TemporaryDirectory(dir=os.environ.get("KVD_BENCH_DIR")) as tmp:
        root = Path(tmp)
        c = cfg(root, block_tokens=1 << 16)  # a few large blocks: the write is not the point here
        e = engine(c)
        assert e.caches is not None
        layers, heads, dim = len(e.model.layers), 2, 32  # the tiny model's KV layout (builtin.py)
        n = mb * (1 << 20) // (layers * 2 * heads * dim * 4)
        big = [KVCache() for _ in range(layers)]
        for k in big:
            k.update_and_fetch(mx.random.normal((1, heads, n, dim)), mx.random.normal((1, heads, n, dim)))
        mx.eval([k.state for k in big])
        ids = [3 + (k * 7919) % 197 for k in range(n)]  # any ids: the cache's values are random too
        e.caches.checkin(A, big, ids)
        del big
        e.close()  # flushes A to disk
        files = sorted((root / "cache").rglob("*.safetensors"))
        on_disk = sum(f.stat().st_size for f in files)
        e = engine(c)  # a restart: A is only on disk
        assert e.caches is not None and e.caches.locations().get(A) == "disk"
        # A's ~250k tokens are past the tiny model's context; it only feeds one (the turn steps check it)
        e.max_context = None
        assert e.steps is not None
        e.steps.max_context = None
        b_events: list[EngineEvent] = []
        e.submit(job(e, B, first(e, "Hi."), b_events, max_tokens=100_000))

        def b_tokens() -> int:
            t = e.statistics().answers.get(B)
            return t.generated if t is not None else 0

        while b_tokens() < 4:
            if ended(b_events) is not None:
                raise SystemExit(f"B ended before decoding: {b_events}")
            e.step()

        last_counted = [False]  # whether the last step gave B tokens (its gap is the list's last)

        def gaps_until(stop: Any, most: int) -> list[float]:
            out: list[float] = []
            last = time.perf_counter()
            count = b_tokens()
            while not stop() and len(out) < most:
                e.step()
                last_counted[0] = (now_count := b_tokens()) > count
                if last_counted[0]:
                    now = time.perf_counter()
                    out.append((now - last) / (now_count - count))
                    last, count = now, now_count
            return out

        alone = gaps_until(lambda: False, steps)
        a_events: list[EngineEvent] = []
        started_at: list[float] = []

        def a_emit(ev: EngineEvent) -> None:
            if not started_at:  # its first event: its first delta, in the step it started in
                started_at.append(time.perf_counter())
            a_events.append(ev)

        t0 = time.perf_counter()
        a_job = job(e, A, ids + [5], a_events, max_tokens=2)
        a_job.emit = a_emit
        e.submit(a_job)
        during = gaps_until(lambda: bool(a_events), 10**9)
        restore_s = (started_at[0] if started_at else time.perf_counter()) - t0
        # The step A started in also ran A's first prefill chunk (its one new token over the whole
        # restored cache): A's own work, not the read, reported apart.
        first_step = during.pop() if during and last_counted[0] else 0.0
        after = gaps_until(lambda: ended(a_events) is not None, 10**9)
        end = ended(a_events)
        e.cancel(B)
        e.step()
        e.caches.close()
        t1 = time.perf_counter()
        for f in files:
            f.read_bytes()
        plain_s = time.perf_counter() - t1
    assert end is not None
    print(f"# load average {os.getloadavg()[0]:.2f} (after); {os.cpu_count()} CPUs")
    print(f"A: {on_disk / 1e6:.0f} MB on disk in {len(files)} files, {n} tokens; "
          f"restored_from {end.usage['restored_from']}, cached_tokens {end.usage['cached_tokens']}")
    print(f"B alone:                  {fmt(alone)}")
    print(f"B while A's cache is read: {fmt(during)}")
    print(f"B's gap over the step A started in (A's first prefill chunk in it): {first_step * 1000:.1f} ms")
    print(f"B while A feeds and ends:  {fmt(after) if after else '-'} (A's one-token prefill over "
          f"{n} tokens is an ordinary prefill chunk)")
    print(f"A submitted -> started: {restore_s * 1000:.0f} ms ({on_disk / 1e6 / restore_s / 1000:.2f} GB/s); "
          f"plain read of the same files afterwards (page cache warm): {plain_s * 1000:.0f} ms "
          f"({on_disk / 1e6 / plain_s / 1000:.2f} GB/s)")
    print(f"p99 during / p50 alone: {pct(during, 0.99) / statistics.median(alone):.2f}x; "
          f"p99 during / p99 alone: {pct(during, 0.99) / pct(alone, 0.99):.2f}x")


def budget(limit: bool) -> None:
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVD_BENCH_DIR")) as tmp:
        root = Path(tmp)
        probe = engine(cfg(root / "probe"))
        text = "Tell me everything about caches and how they page out to disk. " * 6
        probe.submit(job(probe, "0" * 16, first(probe, text), [], max_tokens=64))
        probe.step()
        assert probe.caches is not None
        need = probe.caches.statistics()["running"]["bytes"]
        probe.cancel("0" * 16)
        probe.step()
        probe.caches.close()
        budget_bytes = 3 * need + need // 2
        e = engine(cfg(root, resident_bytes=budget_bytes if limit else 1 << 40, warm_bytes=0))
        assert e.caches is not None
        most_running, most_bytes = 0, 0
        fed: dict[str, list[int]] = {}
        for _ in range(2):
            events: dict[str, list[EngineEvent]] = {}
            for k in range(8):
                sid = f"{k:x}" * 16
                events[sid] = []
                tokens = fed.get(sid) or first(e, f"Session {k}: " + text)
                if sid in fed:
                    tokens = tokens + first(e, "And then?")
                e.submit(job(e, sid, tokens, events[sid], max_tokens=64))
            while any(ended(ev) is None for ev in events.values()):
                e.step()
                s = e.caches.statistics()
                most_running = max(most_running, e.statistics().running)
                most_bytes = max(most_bytes, s["running"]["bytes"] + s["resident"]["bytes"])
            for sid, ev in events.items():
                d = ended(ev)
                assert d is not None and d.tokens is not None and any(isinstance(x, AnswerDelta) for x in ev)
                fed[sid] = d.tokens
        e.caches.close()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"# load average {os.getloadavg()[0]:.2f} (after)")
    print(f"{'budget ' + str(budget_bytes) + ' B' if limit else 'no byte limit'}: one turn's cache may reach "
          f"{need} B; at most {most_running} turns at once; running + resident at most {most_bytes} B; "
          f"peak RSS {rss:.0f} MiB")


def checkin(turns: int) -> None:
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVD_BENCH_DIR")) as tmp:
        e = engine(cfg(Path(tmp)))
        caches = e.caches
        assert caches is not None
        spent: list[float] = []
        real = caches.checkin

        def timed(key: str, cache: Any, tokens: Any) -> None:
            t0 = time.perf_counter()
            real(key, cache, tokens)
            spent.append(time.perf_counter() - t0)

        caches.checkin = timed  # type: ignore[method-assign]
        turn_s: list[float] = []
        tokens = first(e, "Tell me about caches.")
        for _ in range(turns):
            events: list[EngineEvent] = []
            t0 = time.perf_counter()
            e.submit(job(e, A, tokens, events, max_tokens=32))
            while (d := ended(events)) is None:
                e.step()
            turn_s.append(time.perf_counter() - t0)
            assert d.tokens is not None
            tokens = d.tokens + first(e, "And then?")
        caches.close()
    print(f"# load average {os.getloadavg()[0]:.2f} (after)")
    print(f"checkin (engine thread, after each answer): {fmt(spent)}; whole turns: {fmt(turn_s)}; "
          f"the session grew to {len(tokens)} tokens")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["gaps", "budget", "checkin"], default="gaps")
    parser.add_argument("--mb", type=int, default=500)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--turns", type=int, default=60)
    parser.add_argument("--no-limit", action="store_true", help="budget: run the eight with no byte limit")
    args = parser.parse_args()
    print(f"# load average {os.getloadavg()[0]:.2f} (before)")
    if args.part == "gaps":
        gaps(args.mb, args.steps)
    elif args.part == "budget":
        budget(not args.no_limit)
    else:
        checkin(args.turns)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
