"""A turn's own overhead: the client's time to first token of the next turn on `builtin:tiny`.

Run: .venv/bin/python bench/overhead.py [--turns 214] [--pause S] [--config FILE] [--profile OUT]

`builtin:tiny` is a 4-layer model with a hidden size of 128, so what the
client waits for is mostly kvd's own work per turn: its forward of a short
turn takes about 5 ms over a 0.8k-token cache on this project's 2-core CPU
and about 11 ms over 5k (attention grows with the cache). A real `kvd serve`
(prefetch off, the defaults otherwise) and two conversations, one per door,
each starting with a ~700-token message and then growing by one short
message and a one-token answer per turn, back to back (no pause between an
answer and the next message; `--pause S` waits S seconds, as a reader would):

- websocket: `chat.send` on one session; TTFT is the frame sent to the first `chat.delta`;
- OpenAI: the official `openai` client, streaming, the whole conversation each
  time (as a stateless client sends it); TTFT is the request to the first
  content chunk. The client's own preparation of a long request is part of it
  (bench/api_client.py measures it: ~58 ms of a turn-200 request here).

For the websocket it also reports kvd's own `ttft_ms` (from the turn's start
in the turn core, before its tokenizing), the client's TTFT minus it (the
part spent outside it), `prefill_ms` (of `ttft_ms`, the forward of the new
tokens and the first draw, from the cache's checkout), and the *bare
forward*: the same model loaded in this process as kvd loads it, the same
number of new tokens fed over a cache as long as the turn's, timed to the
first token's draw, median of 15. The client's TTFT minus the bare forward
is what kvd adds to the model's own work ("kvd's part").

Reported per door: the median (and range) of 15 turns around turn 5 and of
15 around turn 200, and their ratio. With `--profile OUT`, py-spy (on PATH or
KVD_PYSPY) records the daemon at 500 Hz during each door's run and writes
milliseconds per turn in each thread and the event loop's top functions to
OUT-<door>.txt.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import openai  # noqa: E402

from daemonproc import DaemonProcess, SyncClient  # noqa: E402

FIRST = " ".join(["the cache keeps every session warm and pages cold ones out"] * 33)  # ~700 tokens (tiny)
WINDOW = 15
ENGINE_TTFT: list[float] = []  # kvd's own ttft_ms of each websocket turn: from the job reaching the engine
PAUSE = [0.0]  # seconds between an answer and the next message (--pause)
WS_TTFT: list[float] = []  # the client's TTFT of each websocket turn
USAGE: list[tuple[int, int]] = []  # each websocket turn's (cached_tokens, prompt_tokens)
PREFILL: list[float] = []  # its prefill_ms: from the turn's cache being checked out to its first token


def windows(ttfts: list[float], at: tuple[int, ...]) -> dict[int, list[float]]:
    """The 15 turns starting at each turn number in `at` (turn 1 is the first timed one)."""
    return {n: ttfts[n - 1:n - 1 + WINDOW] for n in at}


def ws_turns(d: DaemonProcess, turns: int) -> list[float]:
    out: list[float] = []
    with d.client() as c:
        session = c.request("session.create", title="overhead")["session"]["id"]
        c.chat(session, FIRST, max_tokens=1)  # untimed: the first prefill
        ENGINE_TTFT.clear()
        PREFILL.clear()
        USAGE.clear()
        for n in range(turns):
            time.sleep(PAUSE[0])
            out.append(_ws_turn(c, session, f"next {n}"))
    return out


def _ws_turn(c: SyncClient, session: str, text: str) -> float:
    started = time.perf_counter()
    rid = c.send(type="chat.send", session=session, text=text, max_tokens=1, temperature=0)
    first: float | None = None
    while True:
        e = c.recv()
        if e.get("id") != rid:
            continue
        if e["type"] == "chat.delta" and first is None:
            first = time.perf_counter() - started
        elif e["type"] == "error":
            raise SystemExit(f"turn failed: {e}")
        elif e["type"] == "chat.done":
            ENGINE_TTFT.append((e["usage"].get("ttft_ms") or 0) / 1000)
            PREFILL.append((e["usage"].get("prefill_ms") or 0) / 1000)
            USAGE.append((e["usage"]["cached_tokens"], e["usage"]["prompt_tokens"]))
            return first if first is not None else time.perf_counter() - started


def api_turns(d: DaemonProcess, turns: int) -> list[float]:
    client = openai.OpenAI(base_url=d.base_url, api_key=d.token, max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": FIRST}]
    messages.append({"role": "assistant", "content": _api_turn(client, messages)[1]})
    out: list[float] = []
    for n in range(turns):
        messages.append({"role": "user", "content": f"next {n}"})
        time.sleep(PAUSE[0])
        ttft, text = _api_turn(client, messages)
        messages.append({"role": "assistant", "content": text})
        out.append(ttft)
    return out


def _api_turn(client: openai.OpenAI, messages: list[dict[str, Any]]) -> tuple[float, str]:
    started = time.perf_counter()
    first: float | None = None
    text = ""
    stream = client.chat.completions.create(model="builtin:tiny", messages=cast(Any, messages),
                                            max_tokens=1, temperature=0, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first if first is not None else time.perf_counter() - started
            text += chunk.choices[0].delta.content
    return (first if first is not None else time.perf_counter() - started), text


def bare_forwards(at: tuple[int, ...]) -> dict[int, float]:
    """By window, the median bare forward of its middle turn (see the module docstring), in seconds."""
    from daemon.service.blas import preload_blas

    print(preload_blas("auto").reason)  # before MLX is imported, as kvd serve does
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from daemon.engine.modelload import load_model
    from daemon.models.builtin import ensure_builtin

    with tempfile.TemporaryDirectory() as tmp:
        model = load_model("builtin:tiny", ensure_builtin("builtin:tiny", Path(tmp))).model
    out = {}
    for n in at:
        cached, prompt = USAGE[n - 1 + WINDOW // 2]
        cache = make_prompt_cache(model)
        for i in range(0, cached, 512):
            model(mx.array([[7] * min(512, cached - i)]), cache=cache)
            mx.eval([c.state for c in cache])
        times = []
        for _ in range(WINDOW + 1):
            t0 = time.perf_counter()
            logits = model(mx.array([[9] * (prompt - cached)]), cache=cache)[:, -1, :]
            mx.eval(mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1))
            times.append(time.perf_counter() - t0)
            for c in cache:
                c.trim(prompt - cached)
        out[n] = statistics.median(times[1:])  # the first one compiles
        print(f"bare fwd  turn {n:3}: median {out[n] * 1000:6.1f} ms ({prompt - cached} new tokens over {cached})")
    return out


def report(name: str, ttfts: list[float], at: tuple[int, ...]) -> None:
    spans = windows(ttfts, at)
    medians = {}
    for n, xs in spans.items():
        ms = sorted(x * 1000 for x in xs)
        medians[n] = statistics.median(ms)
        print(f"{name:9} turns {n:3}-{n + len(xs) - 1:3}: median {medians[n]:6.1f} ms "
              f"(range {ms[0]:.1f}-{ms[-1]:.1f})")
    first, last = medians[at[0]], medians[at[-1]]
    print(f"{name:9} turn {at[-1]} / turn {at[0]}: {last / first:.2f}x")


def profile(pid: int, out: Path, duration: int) -> subprocess.Popen[str]:
    spy = os.environ.get("KVD_PYSPY") or shutil.which("py-spy")
    if spy is None:
        raise SystemExit("--profile needs py-spy on PATH or in KVD_PYSPY (pip install py-spy)")
    raw = out.with_suffix(".raw.txt")
    return subprocess.Popen([spy, "record", "--pid", str(pid), "--rate", "500", "--format", "raw",
                             "--duration", str(duration), "--nonblocking", "--output", str(raw)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)


THREADS = (("event loop", "_run_module_as_main"), ("tokenizer stage", "TokenizerStage._call"),
           ("transcript writer", "Writer._run"), ("engine", "Engine._run"), ("I/O worker", "IOWorker"))


def thread_of(frames: list[str]) -> str:
    return next((name for name, mark in THREADS if any(mark in f for f in frames)), "other")


def summarize(raw: Path, out: Path, turns: int) -> None:
    """py-spy's raw (collapsed) stacks: ms per turn in each thread, and the event loop's top functions."""
    per_thread: dict[str, int] = {}
    own: dict[str, int] = {}
    total: dict[str, int] = {}
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        if "EpollSelector.select" in frames[-1] or frames[-1].startswith("Writer._run "):
            continue  # the event loop, or the transcript writer, waiting for work (py-spy counts it as busy)
        thread = thread_of(frames)
        per_thread[thread] = per_thread.get(thread, 0) + n
        if thread != "event loop":
            continue
        own[frames[-1]] = own.get(frames[-1], 0) + n
        for f in set(frames):
            total[f] = total.get(f, 0) + n
    lines = [f"py-spy at 500 Hz (busy samples only), {turns} turns: ms per turn by thread"]
    lines += [f"  {name:18} {n / 500 / turns * 1000:6.2f} ms/turn ({n} samples)"
              for name, n in sorted(per_thread.items(), key=lambda kv: -kv[1])]
    lines += ["", "event loop, own samples:"]
    lines += [f"{n:6} {f}" for f, n in sorted(own.items(), key=lambda kv: -kv[1])[:30]]
    lines += ["", "event loop, total samples:"]
    lines += [f"{n:6} {f}" for f, n in sorted(total.items(), key=lambda kv: -kv[1])[:50]]
    out.write_text("\n".join(lines) + "\n")


def profiled(d: DaemonProcess, out: Path | None, door: str, run: Callable[[], list[float]], turns: int) -> list[float]:
    """`run()`, recorded by py-spy into OUT-<door>.txt when OUT is given."""
    if out is None:
        return run()
    target = out.with_name(f"{out.stem}-{door}.txt")
    spy = profile(d.proc.pid, target, 10_000)
    try:
        return run()
    finally:
        spy.send_signal(signal.SIGINT)  # py-spy writes what it recorded
        spy.wait(timeout=120)
        summarize(target.with_suffix(".raw.txt"), target, turns)
        print(f"profile: {target}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=214, help="timed turns per door (>= 214 for the turn-200 window)")
    ap.add_argument("--profile", type=Path, help="write py-spy's summary of each door's run to PROFILE-<door>.txt")
    ap.add_argument("--doors", nargs="+", default=["websocket", "openai"], choices=["websocket", "openai"])
    ap.add_argument("--pause", type=float, default=0.0,
                    help="seconds between an answer and the next message (default 0: back to back)")
    ap.add_argument("--config", type=Path, help="a config.toml for the daemon (to compare settings)")
    args = ap.parse_args()
    PAUSE[0] = args.pause
    at = (5, 200) if args.turns >= 200 + WINDOW - 1 else (5,)
    print(f"load before: {os.getloadavg()[0]:.2f} (1-minute average), {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "kvd"
        data.mkdir()
        d = DaemonProcess(data, *(("--config", str(args.config.resolve())) if args.config else ()))
        try:
            with d.client():
                pass  # the model has loaded
            if "websocket" in args.doors:
                ttfts = WS_TTFT[:] = profiled(d, args.profile, "websocket", lambda: ws_turns(d, args.turns), args.turns)
                report("websocket", ttfts, at)
                report("ws engine", ENGINE_TTFT, at)  # kvd's own ttft_ms: the part inside the engine
                report("ws outside", [c - e for c, e in zip(ttfts, ENGINE_TTFT)], at)
                report("ws prefill", PREFILL, at)  # of ttft_ms, the forward of the new tokens and the first draw
            if "openai" in args.doors:
                report("openai", profiled(d, args.profile, "openai", lambda: api_turns(d, args.turns), args.turns), at)
        finally:
            d.terminate()
    if "websocket" in args.doors:
        bare = bare_forwards(at)  # with the daemon gone: nothing beside it
        parts = {n: statistics.median(xs) - bare[n] for n, xs in windows(WS_TTFT, at).items()}
        for n, part in parts.items():
            print(f"kvd part  turn {n:3}: {part * 1000:6.1f} ms (the websocket's median minus the bare forward)")
        print(f"kvd part  turn {at[-1]} / turn {at[0]}: {parts[at[-1]] / parts[at[0]]:.2f}x")
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
