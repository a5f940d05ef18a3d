"""Attention on the CPU backend: kvd's (daemon/engine/attention.py) against MLX's own, A/B in one run.

Run: .venv/bin/python bench/attention.py [--models DIR] [--parts layers decode turn]
         [--llama-server PATH]   # also the next turn through llama.cpp's llama-server, same GGUF, 2 threads

Three parts, each measured both ways in the same run, alternating, so a
shared machine's load falls on both alike:

- layers: one layer's attention, SmolLM2-135M's shapes (9 query heads, 3 KV
  heads, head_dim 64, float32), q = 1, 16, 64 queries over 512, 2k and 4k
  keys; MLX's path is `mx.fast.scaled_dot_product_attention`, the call
  mlx-lm makes; the best of `--reps` runs, the two paths in turn.
- decode: the real default model in this process, a 2k-token prompt
  prefilled in 512-token chunks (one cache per path), then `--decode` greedy
  tokens one forward at a time, the paths in turn; tokens per second. Then a
  16-token forward over the same caches (trimmed back after each), the
  forward a next turn's prefill is.
- turn: `kvd serve` on the default model, `KVD_ATTENTION=mlx` for MLX's
  path, the official `openai` client, streaming, greedy: a ~2k-token
  conversation (untimed), then `--repeat` next turns (the answer, plus a new
  message); the time to the first content chunk, at the client. With
  `--llama-server`, llama-server on the GGUF kvd converted the model from
  (`-t 2`, its prompt cache on), the same conversation and turns.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from daemon.service.blas import preload_blas  # noqa: E402

preload_blas()

import mlx.core as mx  # noqa: E402

from daemon.engine import attention  # noqa: E402
from daemon.models.smollm2 import GGUF_NAME  # noqa: E402
from daemon.models.sources import DEFAULT_MODEL, prepare_model  # noqa: E402

H, KV, D = 9, 3, 64  # SmolLM2-135M
THINK = 1.0  # seconds between an answer and the next message, as in bench/openai_ttft.py


def best_ms(fs: list[Callable[[], Any]], reps: int) -> list[float]:
    """The best of `reps` runs of each, run in turn (a loaded machine's noise only ever adds)."""
    for f in fs:
        mx.eval(f())  # compiled kernels, buffers
    times: list[list[float]] = [[] for _ in fs]
    for _ in range(reps):
        for f, t in zip(fs, times, strict=True):
            t0 = time.perf_counter()
            mx.eval(f())
            t.append(time.perf_counter() - t0)
    return [min(t) * 1000 for t in times]


def layers(reps: int) -> None:
    print(f"\n## One layer's attention (SmolLM2-135M shapes, float32), best of {reps}, ms\n")
    print("| queries | keys | MLX | kvd | speed-up |\n| ---: | ---: | ---: | ---: | ---: |")
    for q_len in (1, 16, 64):
        for keys in (512, 2048, 4096):
            mx.random.seed(0)
            q = mx.random.normal((1, H, q_len, D))
            k = mx.random.normal((1, KV, keys, D))
            v = mx.random.normal((1, KV, keys, D))
            mx.eval(q, k, v)
            mask: Any = "causal" if q_len > 1 else None
            a, b = best_ms([partial(mx.fast.scaled_dot_product_attention, q, k, v, scale=D ** -0.5, mask=mask),
                            partial(attention.attention, q, k, v, scale=D ** -0.5, mask=mask)], reps)
            print(f"| {q_len} | {keys} | {a:.2f} | {b:.2f} | {a / b:.2f}x |", flush=True)


def decode(model_dir: Path, context: int, n: int) -> None:
    """Two caches of the same 2k-token prompt, one per attention path, decoded a step each in turn:
    whatever else the machine does falls on both paths alike."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load

    model = load(str(model_dir))[0]
    model.set_dtype(mx.float32)
    prompt = [(i * 7919) % 40000 + 100 for i in range(context)]
    paths: dict[str, Callable[[], object]] = {"MLX": attention.uninstall, "kvd": attention.install}
    caches: dict[str, Any] = {}
    tokens: dict[str, mx.array] = {}
    for name, use in paths.items():
        use()
        caches[name] = make_prompt_cache(model)
        for i in range(0, context, 512):
            model(mx.array(prompt[i:i + 512])[None], cache=caches[name])
            mx.eval([c.state for c in caches[name]])
        tokens[name] = mx.array([[prompt[-1]]])
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(n + 1):
        for name, use in paths.items():
            use()
            t0 = time.perf_counter()
            tokens[name] = mx.argmax(model(tokens[name], cache=caches[name])[:, -1, :], axis=-1)[:, None]
            mx.eval(tokens[name])
            times[name].append(time.perf_counter() - t0)
    # A next turn's forward: 16 new tokens over the cache, then trimmed off again.
    forward: dict[str, list[float]] = {name: [] for name in paths}
    new = mx.array([prompt[:16]])
    for _ in range(max(n // 2, 3)):
        for name, use in paths.items():
            use()
            t0 = time.perf_counter()
            mx.eval(model(new, cache=caches[name]))
            forward[name].append(time.perf_counter() - t0)
            for c in caches[name]:
                c.trim(16)
    attention.install()
    fa, fb = (min(forward[name]) for name in paths)
    print(f"\n## One forward of 16 tokens over {context} cached tokens (a next turn's prefill), best of "
          f"{len(forward['kvd'])}, alternating\n")
    print(f"| MLX | {fa * 1000:.1f} ms |\n| kvd | {fb * 1000:.1f} ms |\n\nkvd/MLX: {fa / fb:.2f}x")
    a, b = (statistics.median(times[name][1:]) for name in paths)
    amin, bmin = (min(times[name][1:]) for name in paths)
    print(f"\n## Decode at {context} tokens of context: {n} steps per path, alternating\n")
    print("| path | median ms per token | tok/s | best ms per token | tok/s |\n| --- | ---: | ---: | ---: | ---: |")
    print(f"| MLX | {a * 1000:.1f} | {1 / a:.1f} | {amin * 1000:.1f} | {1 / amin:.1f} |")
    print(f"| kvd | {b * 1000:.1f} | {1 / b:.1f} | {bmin * 1000:.1f} | {1 / bmin:.1f} |")
    print(f"\nkvd/MLX decode speed: {a / b:.2f}x (medians), {amin / bmin:.2f}x (best)", flush=True)


class LlamaServer:
    """llama.cpp's llama-server on a GGUF, 2 threads, its prompt cache on (its default)."""

    def __init__(self, binary: Path, gguf: Path):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}/v1"
        self.key = "none"
        self.proc = subprocess.Popen([str(binary), "-m", str(gguf), "--port", str(port), "-t", "2", "-tb", "2",
                                      "-c", "8192", "--parallel", "1"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while True:  # a benchmark, not a test: its health endpoint is the only readiness signal it has
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"llama-server did not start (exit {self.proc.poll()})")
            time.sleep(0.5)

    def settle(self) -> None:
        pass

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class KvdServer:
    def __init__(self, model: Path, data_dir: Path, attention_path: str):
        from daemonproc import DaemonProcess

        env = {attention.ENV_VAR: "mlx"} if attention_path == "MLX" else {attention.ENV_VAR: ""}
        self.d = DaemonProcess(data_dir, "--model", str(model), env=env)
        self.base_url = self.d.base_url
        self.key = self.d.token

    def settle(self) -> None:
        with self.d.client() as c:
            c.request("status")  # answered once the last turn's cache is kept

    def stop(self) -> None:
        self.d.terminate()


def turns(model_dir: Path, llama: tuple[Path, Path] | None, repeat: int, new: int, which: list[str]) -> None:
    import openai_ttft as ot

    messages0 = ot.conversation(model_dir, 2048)
    root = Path(tempfile.mkdtemp(prefix="kvd-attn-"))
    servers: dict[str, Callable[[], Any]] = {}
    if "mlx" in which:
        servers["kvd, MLX attention"] = lambda: KvdServer(model_dir, root / "mlx", "MLX")
    if "kvd" in which:
        servers["kvd, kvd attention"] = lambda: KvdServer(model_dir, root / "kvd", "kvd")
    if llama:
        servers["llama-server (2 threads)"] = lambda: LlamaServer(*llama)
    results: dict[str, list[float]] = {name: [] for name in servers}
    prompt: dict[str, int] = {}
    for name, start in servers.items():
        messages = [dict(m) for m in messages0]
        s = start()
        try:
            ot.warm_up(s.base_url, s.key)
            _, answer, usage = ot.turn(s.base_url, s.key, messages, new)
            for i in range(repeat):
                s.settle()
                time.sleep(THINK)
                messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"And then ({i})?"}]
                ttft, answer, usage = ot.turn(s.base_url, s.key, messages, new)
                results[name].append(ttft)
                prompt[name] = int(usage.get("prompt_tokens") or 0)
        finally:
            s.stop()
    print(f"\n## Next turn of a ~2k-token conversation, time to first token at the client ({repeat} turns)\n")
    print("| server | prompt tokens (last turn) | median TTFT | range |\n| --- | ---: | ---: | ---: |")
    for name, values in results.items():
        print(f"| {name} | {prompt.get(name, 0)} | {statistics.median(values) * 1000:.0f} ms | "
              f"{min(values) * 1000:.0f}-{max(values) * 1000:.0f} ms |", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", type=Path, default=Path(os.environ.get("KVD_BENCH_DIR", tempfile.gettempdir()))
                        / "kvd-bench-models", help="where the default model is fetched and converted (kept)")
    parser.add_argument("--parts", nargs="+", default=["layers", "decode", "turn"],
                        choices=["layers", "decode", "turn"])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--decode", type=int, default=32, help="tokens decoded per run")
    parser.add_argument("--repeat", type=int, default=5, help="next turns per server")
    parser.add_argument("--new", type=int, default=8, help="max_tokens of each turn")
    parser.add_argument("--llama-server", type=Path, help="a llama-server binary to compare with")
    parser.add_argument("--turn-servers", nargs="+", default=["mlx", "kvd"], choices=["mlx", "kvd"],
                        help="the turn part's kvd daemons (llama-server joins with --llama-server)")
    args = parser.parse_args()
    with open("/proc/loadavg") as f:
        print(f"load average before: {f.read().split()[0]}; mlx {getattr(mx, '__version__', '?')}")
    if "layers" in args.parts:
        layers(args.reps)
    model_dir = prepare_model(DEFAULT_MODEL, args.models) if {"decode", "turn"} & set(args.parts) else None
    if model_dir is not None and "decode" in args.parts:
        decode(model_dir, 2048, args.decode)
    if model_dir is not None and "turn" in args.parts:
        llama = (args.llama_server, args.models / "downloads" / GGUF_NAME) if args.llama_server else None
        turns(model_dir, llama, args.repeat, args.new, args.turn_servers)
    with open("/proc/loadavg") as f:
        print(f"\nload average after: {f.read().split()[0]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
