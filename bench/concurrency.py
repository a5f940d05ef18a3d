"""Concurrency benchmark: aggregate decode rate, inter-token latency, event-loop lag.

Run: .venv/bin/python bench/concurrency.py [--sessions 1 2 4 8] [--tokens 48]
                                           [--prefill 4096] [--slices 0 0.5]

The real daemon (server, engine thread, store) runs in this process on a
Qwen2.5-0.5B-shaped float32 model with random weights, written once to
$KVD_BENCH_DIR (default: a temp dir) in mlx-lm's format with the built-in
tokenizer. The model's vocabulary has Qwen's 151936 rows, but only the
tokenizer's ids have non-zero embeddings, so greedy decoding (used throughout)
only picks tokens the tokenizer can print. Clients are real websocket clients.

1. Decode: N sessions send a short message at once and decode `--tokens`
   tokens each. Aggregate rate = deltas from all sessions while all N were
   decoding / that window; inter-token gaps per session (p50/p99).
2. Prefill beside streams: 4 sessions stream while a fifth sends a
   `--prefill`-token message, once per prefill slice (0: whole 512-token
   chunks, as if there were no slicing). Meanwhile a probe in
   the daemon's event loop measures its lag (a 10 ms sleep's overshoot), a
   client pings every 100 ms, and the streams' inter-token gaps are recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from daemon.service.blas import preload_blas  # noqa: E402
from shapes import QWEN25_05B  # noqa: E402

BLAS = preload_blas()

import anyio  # noqa: E402
import mlx.core as mx  # noqa: E402
from websockets.asyncio.client import connect  # noqa: E402

from daemon.cli import ensure_token  # noqa: E402
from daemon.config import load_config  # noqa: E402
from daemon.engine.thread import Engine  # noqa: E402
from daemon.models.builtin import ensure_builtin  # noqa: E402
from daemon.server import Daemon  # noqa: E402
from sessions import Store  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
WORDS = ("the cache keeps every session warm and the daemon pages cold ones out to disk "
         "so a long pause costs nothing when the user comes back later").split()


def write_model(root: Path) -> Path:
    """The Qwen2.5-0.5B-shaped model, in mlx-lm's format, with the built-in tokenizer."""
    dest = root / "qwen05b-shaped"
    if (dest / "model.safetensors").exists():
        return dest
    tiny = ensure_builtin("builtin:tiny", root / "builtin")
    tiny_config = json.loads((tiny / "config.json").read_text())
    dest.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        (dest / name).write_bytes((tiny / name).read_bytes())
    vocab = int(tiny_config["vocab_size"])
    eos = int(tiny_config["eos_token_id"])
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen2

    mx.random.seed(0)
    model = qwen2.Model(qwen2.ModelArgs.from_dict(QWEN25_05B))
    weights = dict(tree_flatten(model.parameters()))
    embed = weights["model.embed_tokens.weight"].astype(mx.float32)
    keep = mx.arange(embed.shape[0])[:, None] < vocab
    embed = mx.where(keep, embed, 0.0)
    embed[eos] = 0.0  # tied head: a zero row never wins the argmax, so answers run to max_tokens
    weights = {k: v.astype(mx.float32) for k, v in weights.items()}
    weights["model.embed_tokens.weight"] = embed
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    config = {**QWEN25_05B, "architectures": ["Qwen2ForCausalLM"], "eos_token_id": eos,
              "pad_token_id": tiny_config["pad_token_id"], "torch_dtype": "float32"}
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def text_of(tokens: int) -> str:
    """Words whose tokenization is about `tokens` long (the built-in tokenizer splits some words)."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(ensure_builtin("builtin:tiny", Path(tempfile.gettempdir()) / "kvd-bench-tok"))
    rng = random.Random(0)
    words = [rng.choice(WORDS) for _ in range(tokens)]
    per_word = len(tokenizer.encode(" ".join(words))) / len(words)
    return " ".join(words[: int(tokens / per_word)])


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


class LagProbe:
    """Overshoot of a 10 ms sleep in the daemon's own event loop."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []  # (when, lag in s)
        self.stopped = False

    async def run(self) -> None:
        while not self.stopped:
            t0 = time.perf_counter()
            await anyio.sleep(0.01)
            now = time.perf_counter()
            self.samples.append((now, now - t0 - 0.01))

    def between(self, a: float, b: float) -> list[float]:
        return [lag for when, lag in self.samples if a <= when <= b]


@asynccontextmanager
async def daemon(data_dir: Path, model: Path, slice_s: float) -> AsyncIterator[tuple[str, str, LagProbe]]:
    config = load_config(None, data_dir=data_dir, model=str(model), port=0, temperature=0.0,
                         prefill_slice=slice_s or 1e9, max_text_chars=32000, max_tokens_limit=4096)
    data_dir.mkdir(parents=True, exist_ok=True)
    token = ensure_token(data_dir)
    store = Store(config.db_path)
    engine = Engine(config)
    engine.start()
    d = Daemon(config, store, engine, token)
    probe = LagProbe()
    try:
        async with anyio.create_task_group() as tg:
            url = await tg.start(d.run)
            await anyio.to_thread.run_sync(engine.ready.wait)
            tg.start_soon(probe.run)
            yield url, token, probe
            probe.stopped = True
            d.shutdown()
    finally:
        store.close()


class Stream:
    """One client streaming one answer; delta arrival times."""

    def __init__(self, url: str, token: str) -> None:
        self.url, self.token = url, token
        self.times: list[float] = []
        self.done: dict[str, Any] = {}
        self.streaming = anyio.Event()
        self.ws: Any = None
        self.session = ""

    async def run(self, text: str, max_tokens: int) -> None:
        async with connect(self.url, additional_headers={"Authorization": f"Bearer {self.token}"},
                           max_size=None) as ws:
            self.ws = ws
            json.loads(await ws.recv())  # hello
            await ws.send(json.dumps({"id": "c", "type": "session.create"}))
            self.session = json.loads(await ws.recv())["session"]["id"]
            await ws.send(json.dumps({"id": "q", "type": "chat.send", "session": self.session,
                                      "text": text, "max_tokens": max_tokens, "temperature": 0}))
            async for raw in ws:
                event = json.loads(raw)
                if event["type"] == "chat.delta":
                    self.times.append(time.perf_counter())
                    if len(self.times) >= 2:
                        self.streaming.set()
                elif event["type"] in ("chat.done", "error"):
                    self.done = event
                    self.streaming.set()
                    return

    async def cancel(self) -> None:
        await self.ws.send(json.dumps({"id": "x", "type": "chat.cancel", "session": self.session}))

    def gaps(self, a: float = 0.0, b: float = float("inf")) -> list[float]:
        return [t1 - t0 for t0, t1 in zip(self.times, self.times[1:]) if a <= t1 <= b]


async def decode_rates(url: str, token: str, n: int, tokens: int) -> dict[str, Any]:
    streams = [Stream(url, token) for _ in range(n)]
    async with anyio.create_task_group() as tg:
        for i, s in enumerate(streams):
            tg.start_soon(s.run, f"Question {i}: how do caches work?", tokens)
    # From when every session has its second token (the first comes from its prefill) on.
    start = max(s.times[1] for s in streams)
    end = min(s.times[-1] for s in streams)
    inside = sum(1 for s in streams for t in s.times if start < t <= end)
    gaps = [g for s in streams for g in s.gaps(start, end)]
    return {"n": n, "rate": inside / (end - start) if end > start else float("nan"),
            "p50": pct(gaps, 50), "p99": pct(gaps, 99), "window": end - start}


async def prefill_beside_streams(url: str, token: str, probe: LagProbe, prefill: int,
                                 streams_n: int = 4) -> dict[str, Any]:
    long_text = text_of(prefill)
    streams = [Stream(url, token) for _ in range(streams_n)]
    big = Stream(url, token)
    pings: list[tuple[float, float]] = []

    async def pinger(stop: anyio.Event) -> None:
        async with connect(url, additional_headers={"Authorization": f"Bearer {token}"}) as ws:
            await ws.recv()
            while not stop.is_set():
                t0 = time.perf_counter()
                await ws.send(json.dumps({"id": 1, "type": "ping"}))
                await ws.recv()
                pings.append((t0, time.perf_counter() - t0))
                await anyio.sleep(0.1)

    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        for i, s in enumerate(streams):
            tg.start_soon(s.run, f"Stream {i}: keep talking.", 4000)
        for s in streams:
            await s.streaming.wait()
        tg.start_soon(pinger, stop)
        t_send = time.perf_counter()
        await big.run(long_text, 1)
        t_first = time.perf_counter()
        stop.set()
        for s in streams:
            await s.cancel()
    lags = probe.between(t_send, t_first)
    gaps = [g for s in streams for g in s.gaps(t_send, t_first)]
    rtts = [r for when, r in pings if t_send <= when <= t_first]
    usage = big.done.get("usage", {})
    return {"prefill_tokens": usage.get("prefill_tokens"), "seconds": t_first - t_send,
            "lag_p50": pct(lags, 50), "lag_p99": pct(lags, 99), "lag_max": max(lags, default=float("nan")),
            "ping_p99": pct(rtts, 99), "gap_p50": pct(gaps, 50), "gap_p99": pct(gaps, 99),
            "gap_max": max(gaps, default=float("nan"))}


async def main_async(args: argparse.Namespace) -> None:
    root = Path(os.environ.get("KVD_BENCH_DIR") or tempfile.mkdtemp(prefix="kvd-bench-"))
    model = write_model(root)
    print(f"# {BLAS.reason}", file=sys.stderr)
    print(f"# model {model}", file=sys.stderr)
    rows = []
    async with daemon(root / "decode", model, args.slices[-1]) as (url, token, _):
        for n in args.sessions:
            rows.append(await decode_rates(url, token, n, args.tokens))
            print(f"# decode n={n}: {rows[-1]}", file=sys.stderr)
    prefills = []
    for slice_s in args.slices:
        async with daemon(root / f"prefill-{slice_s}", model, slice_s) as (url, token, probe):
            r = await prefill_beside_streams(url, token, probe, args.prefill)
            prefills.append({"slice": slice_s, **r})
            print(f"# prefill slice={slice_s}: {prefills[-1]}", file=sys.stderr)

    base = rows[0]["rate"]
    print(f"Decode, {args.tokens} tokens per session, greedy:")
    print()
    print("| sessions | aggregate decode | vs 1 session | inter-token p50 | inter-token p99 |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['n']} | {r['rate']:.1f} tok/s | {r['rate'] / base:.1f}x "
              f"| {r['p50'] * 1000:.0f} ms | {r['p99'] * 1000:.0f} ms |")
    print()
    print(f"A {args.prefill}-token message prefilled beside 4 streaming sessions:")
    print()
    print("| prefill_slice | prefill | event-loop lag p50 / p99 / max | ping RTT p99 "
          "| streams' inter-token p50 / p99 / max |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for r in prefills:
        label = f"{r['slice']} s" if r["slice"] else "off (512-token chunks)"
        print(f"| {label} | {r['prefill_tokens']} tok in {r['seconds']:.1f} s "
              f"| {r['lag_p50'] * 1000:.1f} / {r['lag_p99'] * 1000:.1f} / {r['lag_max'] * 1000:.1f} ms "
              f"| {r['ping_p99'] * 1000:.1f} ms "
              f"| {r['gap_p50']:.2f} / {r['gap_p99']:.2f} / {r['gap_max']:.2f} s |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--tokens", type=int, default=48, help="tokens each session decodes")
    parser.add_argument("--prefill", type=int, default=4096, help="tokens in the long message")
    parser.add_argument("--slices", type=float, nargs="+", default=[0.0, 0.5],
                        help="prefill_slice values to compare (0: off)")
    args = parser.parse_args()
    anyio.run(main_async, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
