"""Inter-token latency of 4 streams while a fifth session's turns finish and compact.

Run: .venv/bin/python bench/iowork.py [--history 1500] [--turns 8] [--max-segments 1]

The real daemon (server, engine thread, store, cache tiers on a real disk)
runs in this process on the real default model (builtin:smollm2, float32,
installed once into $TMPDIR/kvd-bench-real/models). Four clients stream long
answers. A fifth session first gets a long message (about --history words),
then --turns short ones back to back (4 answer tokens each): each short turn
costs the engine a few tokens of prefill, and ends with a segment write behind
it; with --max-segments 1 that write rewrites the session's whole history (a
compaction): at ~46 kB of float32 KV per token, a 2k-token history is a
~90 MB write with two fsyncs.

Reported: the streams' inter-token gaps during the short turns (p50, p99,
max), those that end within 1 s after one of them finished (where the write
behind the turn lands), and what the disk tier wrote. Run it
on `main` before the I/O worker and after to compare; the machine's load
average is printed with the figures, since other work on the cores moves them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from daemon.service.blas import preload_blas  # noqa: E402

BLAS = preload_blas()

import anyio  # noqa: E402
from websockets.asyncio.client import connect  # noqa: E402

from concurrency import Stream, pct  # noqa: E402
from daemon.cli import ensure_token  # noqa: E402
from daemon.config import load_config  # noqa: E402
from daemon.engine.thread import Engine  # noqa: E402
from daemon.models.sources import DEFAULT_MODEL, prepare_model  # noqa: E402
from daemon.server import Daemon  # noqa: E402
from sessions import Store  # noqa: E402

WORDS = ("the cache keeps every session warm and the daemon pages cold ones out to disk "
         "so a long pause costs nothing when the user comes back later").split()


@asynccontextmanager
async def daemon(data_dir: Path, model: Path, max_segments: int) -> AsyncIterator[tuple[str, str]]:
    config = load_config(None, data_dir=data_dir, model=str(model), port=0, temperature=0.0,
                         max_segments=max_segments, max_text_chars=64000, max_tokens_limit=8192)
    data_dir.mkdir(parents=True, exist_ok=True)
    token = ensure_token(data_dir)
    store = Store(config.db_path)
    engine = Engine(config)
    engine.start()
    d = Daemon(config, store, engine, token)
    try:
        async with anyio.create_task_group() as tg:
            url = await tg.start(d.run)
            await anyio.to_thread.run_sync(engine.ready.wait)
            yield url, token
            d.shutdown()
    finally:
        store.close()


async def writer(url: str, token: str, turns: int, history: int) -> tuple[float, list[float], dict[str, Any]]:
    """A long turn, then short turns back to back: when the short ones started, when each chat.done
    arrived, and the daemon's status after."""
    finished: list[float] = []
    started = 0.0
    async with connect(url, additional_headers={"Authorization": f"Bearer {token}"}, max_size=None) as ws:
        json.loads(await ws.recv())  # hello
        await ws.send(json.dumps({"id": "c", "type": "session.create"}))
        sid = json.loads(await ws.recv())["session"]["id"]
        for turn in range(turns + 1):
            if turn == 0:
                text = " ".join(WORDS[i % len(WORDS)] for i in range(history))
            else:
                text = f"Part {turn}: go on."
            if turn == 1:
                await ws.send(json.dumps({"id": "s", "type": "status"}))  # answered once turn 0 is on disk
                while json.loads(await ws.recv()).get("id") != "s":
                    pass
                started = time.perf_counter()
            await ws.send(json.dumps({"id": turn, "type": "chat.send", "session": sid, "text": text,
                                      "max_tokens": 4, "temperature": 0}))
            while True:
                event = json.loads(await ws.recv())
                if event.get("id") != turn:
                    continue
                if event["type"] == "chat.done":
                    if turn:
                        finished.append(time.perf_counter())
                    print(f"# turn {turn}: {event['usage']['prompt_tokens']} tokens, restored from "
                          f"{event['usage']['restored_from']}", file=sys.stderr)
                    break
                if event["type"] == "error":
                    raise RuntimeError(event)
        await ws.send(json.dumps({"id": "s", "type": "status"}))
        while (status := json.loads(await ws.recv())).get("id") != "s":
            pass
    return started, finished, status


async def run(model: Path, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    async with daemon(root, model, args.max_segments) as (url, token):
        streams = [Stream(url, token) for _ in range(4)]
        async with anyio.create_task_group() as tg:
            for i, s in enumerate(streams):
                tg.start_soon(s.run, f"Stream {i}: tell me a very long story about caches.", 8000)
            for s in streams:
                await s.streaming.wait()
            t0, finished, status = await writer(url, token, args.turns, args.history)
            t1 = time.perf_counter()
            for s in streams:
                await s.cancel()
    gaps = [g for s in streams for g in s.gaps(t0, t1)]
    after = [t1_ - t0_ for s in streams for t0_, t1_ in zip(s.times, s.times[1:])
             if any(f <= t1_ <= f + 1.0 for f in finished)]
    disk = status.get("tiers", {}).get("disk", {})
    return {"gaps": len(gaps), "p50": pct(gaps, 50), "p99": pct(gaps, 99), "max": max(gaps, default=0.0),
            "after_done_p99": pct(after, 99), "after_done_max": max(after, default=0.0),
            "seconds": t1 - t0, "writes": disk.get("writes"), "bytes_written": disk.get("bytes_written"),
            "load": os.getloadavg()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--history", type=int, default=1500, help="words in the fifth session's first message")
    parser.add_argument("--turns", type=int, default=8, help="short turns of the fifth session after it")
    parser.add_argument("--max-segments", type=int, default=1, help="1: every turn after the first compacts")
    args = parser.parse_args()
    store = Path(tempfile.gettempdir()) / "kvd-bench-real" / "models"
    model = prepare_model(DEFAULT_MODEL, store)
    print(f"# {BLAS.reason}; model {model}; load before {os.getloadavg()}", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVD_BENCH_DIR")) as tmp:
        r = anyio.run(run, model, Path(tmp), args)
    print(json.dumps(r))
    print(f"| {args.turns} turns, max_segments {args.max_segments} | {r['p50'] * 1000:.0f} ms "
          f"| {r['p99'] * 1000:.0f} ms | {r['max'] * 1000:.0f} ms | {r['after_done_p99'] * 1000:.0f} ms "
          f"| {r['writes']} writes, {r['bytes_written'] / 1e6:.0f} MB | "
          f"{r['load'][0]:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
