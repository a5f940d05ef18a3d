"""OpenAI-API benchmark: time to first token of a conversation's next turn, kvd against mlx_lm.server.

Run: .venv/bin/python bench/openai_ttft.py --model DIR [--lengths 2048 4096] [--new 8]
     .venv/bin/python bench/openai_ttft.py --model 05b   # writes bench/concurrency.py's 0.5B-shaped model

DIR is any mlx-lm model directory; `05b` writes the Qwen2.5-0.5B-shaped
float32 model with random weights that bench/concurrency.py uses (into
$KVD_BENCH_DIR, default a temp dir) and measures on it.

Both servers are real processes on this machine, spoken to with the official
`openai` client, streaming, greedy: `kvd serve` and `mlx_lm.server`, the
latter with OpenBLAS preloaded exactly as kvd does (daemon/service/blas.py), the
same model directory and the same prefill chunk (512). For each length N a
conversation of about N tokens is built (a system prompt and turns of
words); then, for each server:

1. the conversation so far, ending with a user message (untimed: the first
   prefill, which also fills the server's prompt cache);
2. the next turn (the answer it got, plus a new message), `--repeat` times:
   "same process";
3. the server is stopped and started again and the turn after that is
   sent: "after restart", `--repeat` times for kvd, once for mlx_lm.server
   (each of its restarts re-reads the whole conversation). The server
   `kvd-prefetch` is kvd with `cache.prefetch` on, each restart timed once
   its prefetch is done; plain `kvd` restarts cold, from disk.

Medians are reported with their range: other work on a shared 2-core machine
makes single turns vary by several times.

Between an answer and the next message the client waits THINK seconds, as a
reader would; kvd is also asked for its status first, which it answers
only once the last turn's cache is written (on the engine thread today).

TTFT is measured at the client: request sent to the first content chunk.

With `--bare`, stock mlx-lm's bare forward is measured in this process
(`mlx_lm.load`, the same directory, OpenBLAS preloaded as kvd does, mlx-lm's
own attention) right after each of kvd's same-process next turns, during the
reader's pause: as many new tokens as kvd prefilled for that turn, over a
cache as long as its cached prefix, timed to the first token's argmax,
median of 3. The table's last column is the median over the turns of kvd's
next turn (as the client saw it) over the bare forward measured beside it:
measured minutes apart, the two drift more than the ratio's margin.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import openai  # noqa: E402

from daemonproc import DaemonProcess  # noqa: E402

PREFILL_STEP = 512
THINK = 2.0  # seconds between an answer and the next message, as a person reading it takes at least
WORDS = ("the cache keeps every session warm and the daemon pages cold ones out to disk "
         "so a long pause costs nothing when the user comes back later").split()
SYSTEM = "You are a patient assistant who answers questions about caches and restarts."


def conversation(model_dir: Path, tokens: int) -> list[dict[str, str]]:
    """System prompt and alternating turns of ~250 tokens, until about `tokens`; ends with a user message."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    rng = random.Random(0)
    messages = [{"role": "system", "content": SYSTEM}]
    role = "user"
    while True:
        size = len(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        if size >= tokens - 300 and role == "user":
            break
        words = " ".join(rng.choice(WORDS) for _ in range(180))
        messages.append({"role": role, "content": words})
        role = "assistant" if role == "user" else "user"
    messages.append({"role": "user", "content": "Summarize what we said so far, briefly."})
    return messages


class MlxServer:
    """mlx_lm.server in its own process, with OpenBLAS preloaded as kvd preloads it."""

    name = "default_model"  # mlx_lm.server's name for the model it was started with

    def __init__(self, model: Path):
        with socket.socket() as probe:  # a free port now: a server left over elsewhere must not answer for it
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        code = ("import sys; from daemon.service.blas import preload_blas; "
                "print(preload_blas().reason, file=sys.stderr); "
                "from mlx_lm.server import main; main()")
        self.base_url = f"http://127.0.0.1:{port}/v1"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, "--model", str(model), "--port", str(port),
             "--prefill-step-size", str(PREFILL_STEP), "--log-level", "WARNING"],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        deadline = time.monotonic() + 300
        while True:  # a benchmark, not a test: polling its port is the only readiness signal it has
            try:
                with urllib.request.urlopen(f"{self.base_url}/models", timeout=5):
                    break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"mlx_lm.server did not start (exit {self.proc.poll()})") from None
                time.sleep(0.5)

    def settle(self) -> None:
        pass  # nothing is written behind an answer

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Kvd:
    name = "kvd"  # kvd's alias for the model it serves (docs/openai.md)

    def __init__(self, model: Path, data_dir: Path, *, prefetch: bool = False):
        """With `prefetch`, a restart returns once the last session was paged into warm (a user
        coming back after a restart, not racing it); otherwise restarts are cold, from disk."""
        restart = (data_dir / "cache").exists()
        self.d = DaemonProcess(data_dir, "--model", str(model), prefetch=prefetch)
        with self.d.client() as c:
            deadline = time.monotonic() + 300
            while prefetch and restart and c.request("status")["prefetched"].get("sessions", 0) < 1:
                if time.monotonic() > deadline:
                    raise SystemExit("kvd's prefetch did not finish within 300 s")
                time.sleep(0.1)
        self.base_url = self.d.base_url
        self.key = self.d.token

    def settle(self) -> None:
        """Return once the last turn's cache is kept: status is answered between engine steps,
        after the disk writes queued before it (the I/O worker writes behind the answer)."""
        with self.d.client() as c:
            c.request("status")

    def stop(self) -> None:
        self.d.terminate()


def turn(base_url: str, key: str, messages: list[dict[str, str]], new: int, *,
         name: str = "kvd") -> tuple[float, str, dict[str, Any]]:
    """Stream one answer; return seconds to its first content, its text and its usage (if reported)."""
    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=3600)
    t0 = time.perf_counter()
    first = None
    text = ""
    usage: dict[str, Any] = {}
    stream = client.chat.completions.create(model=name, messages=messages,  # type: ignore[call-overload]
                                            stream=True, temperature=0, max_tokens=new,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
            usage["kvd"] = (chunk.model_extra or {}).get("kvd")
    return (first or time.perf_counter()) - t0, text, usage


def warm_up(base_url: str, key: str, *, name: str = "kvd") -> None:
    turn(base_url, key, [{"role": "user", "content": "hi"}], 1, name=name)


def run(server: str, model: Path, tokens: int, new: int, root: Path, repeat: int,
        bare: Bare | None = None) -> dict[str, Any]:
    """`repeat` next turns in one process, then `repeat` restarts with one turn each (kvd; one for
    mlx_lm.server, whose every restart re-reads the whole conversation)."""
    messages = conversation(model, tokens)
    start: Any
    if server in ("kvd", "kvd-prefetch"):
        data = root / f"{server}-{tokens}"
        start = lambda: Kvd(model, data, prefetch=server == "kvd-prefetch")  # noqa: E731
    else:
        start = lambda: MlxServer(model)  # noqa: E731
    same: list[float] = []
    beside: list[float] = []  # stock mlx-lm's bare forward right after each same-process turn
    restarted: list[float] = []
    usages: list[dict[str, Any]] = []
    s = start()
    try:
        key = getattr(s, "key", "none")
        warm_up(s.base_url, key, name=s.name)
        cold, answer, first = turn(s.base_url, key, messages, new, name=s.name)
        for i in range(repeat):
            s.settle()
            time.sleep(THINK)
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"And then ({i})?"}]
            ttft, answer, usage = turn(s.base_url, key, messages, new, name=s.name)
            same.append(ttft)
            usages.append(usage)
            if bare is not None and server.startswith("kvd"):
                s.settle()  # the turn's cache is written: nothing of kvd's runs beside the bare forward
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                beside.append(bare.forward(cached, usage["prompt_tokens"] - cached))
        s.settle()
    finally:
        s.stop()
    for i in range(repeat if server.startswith("kvd") else 1):
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"After a restart ({i})?"}]
        s = start()
        try:
            key = getattr(s, "key", "none")
            warm_up(s.base_url, key, name=s.name)
            time.sleep(THINK)
            ttft, answer, usage = turn(s.base_url, key, messages, new, name=s.name)
            restarted.append(ttft)
            usages.append(usage)
            s.settle()
        finally:
            s.stop()
    return {"server": server, "tokens": tokens, "prompt_1": first.get("prompt_tokens"), "cold": cold,
            "same": same, "bare": beside, "restart": restarted, "usages": usages}


class Bare:
    """Stock mlx-lm's forward in this process, over a cache kept between calls (grown as the
    conversation grows, so each call prefills only what is new to it)."""

    def __init__(self, model_dir: Path) -> None:
        from mlx_lm import load
        from mlx_lm.models.cache import make_prompt_cache

        self.model = load(str(model_dir))[0]
        self.cache = make_prompt_cache(self.model)
        self.length = 0

    def forward(self, cached: int, new: int, repeat: int = 3) -> float:
        """Seconds for `new` tokens over a cache of `cached`, to the first token's argmax (median)."""
        import mlx.core as mx

        if cached < self.length:
            for c in self.cache:
                c.trim(self.length - cached)
            self.length = cached
        while self.length < cached:
            n = min(PREFILL_STEP, cached - self.length)
            self.model(mx.array([[7] * n]), cache=self.cache)
            mx.eval([c.state for c in self.cache])
            self.length += n
        times = []
        for _ in range(repeat + 1):
            t0 = time.perf_counter()
            logits = self.model(mx.array([[9] * new]), cache=self.cache)[:, -1, :]
            mx.eval(mx.argmax(logits, axis=-1))
            times.append(time.perf_counter() - t0)
            for c in self.cache:
                c.trim(new)
        return statistics.median(times[1:])  # the first one after a growth allocates


def span(values: list[float]) -> str:
    """The median, and the range when there are several."""
    mid = f"{statistics.median(values) * 1000:.0f} ms"
    return mid if len(values) == 1 else f"{mid} ({min(values) * 1000:.0f}-{max(values) * 1000:.0f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="an mlx-lm model directory, or 05b")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--new", type=int, default=8, help="tokens per answer")
    parser.add_argument("--servers", nargs="+", default=["kvd", "mlx_lm.server"])
    parser.add_argument("--repeat", type=int, default=3, help="turns per case (medians are reported)")
    parser.add_argument("--bare", action="store_true", help="also stock mlx-lm's bare forward of kvd's next turn")
    args = parser.parse_args()
    if args.bare:
        from daemon.service.blas import preload_blas

        print(preload_blas("auto").reason)  # before MLX is imported, as kvd and MlxServer do
    root = Path(os.environ.get("KVD_BENCH_DIR") or tempfile.mkdtemp(prefix="kvd-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    if args.model == "05b":
        sys.path.insert(0, str(ROOT / "bench"))
        from concurrency import write_model

        model = write_model(root)
    else:
        model = Path(args.model).resolve()
    print(f"model {model}; load average {os.getloadavg()[0]:.2f}", flush=True)
    rows = []
    bare = Bare(model) if args.bare else None
    for tokens in args.lengths:
        for server in args.servers:
            row = run(server, model, tokens, args.new, Path(tempfile.mkdtemp(dir=root)), args.repeat, bare)
            print(json.dumps(row), flush=True)
            rows.append(row)
    print(f"\nload average after: {os.getloadavg()[0]:.2f}\n")
    for r in rows:
        if r["bare"]:
            print(f"{r['server']} {r['tokens']}: stock mlx-lm's bare forward beside each next turn: "
                  + ", ".join(f"{x * 1000:.0f}" for x in r["bare"]) + " ms")
    print("| conversation | server | first turn, cold | next turn, same process | after a restart "
          "| restart / same | cached after restart | next turn / bare forward |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        last = r["usages"][-1]
        restored = (last.get("prompt_tokens_details") or {}).get("cached_tokens")
        same, restart = statistics.median(r["same"]), statistics.median(r["restart"])
        pairs = [t / b for t, b in zip(r["same"], r["bare"], strict=False)]
        ratio = f"{statistics.median(pairs):.2f}x" if pairs else "-"
        print(f"| {last.get('prompt_tokens')} tok | {r['server']} | {r['cold'] * 1000:.0f} ms "
              f"| {span(r['same'])} | {span(r['restart'])} "
              f"| {restart / same:.2f}x | {restored} tok | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
