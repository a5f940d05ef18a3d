"""The host's cost per decoded token, on any machine: kvd against in-process mlx-lm on a model whose
forward is nearly free, so what is left is the host's own path (issue 50's CPU guard).

Run: .venv/bin/python bench/hostcost.py [--runs 5] [--tokens 512] [--shapes micro [small]]

(../shared/gpu/check.sh runs it with its defaults, the micro model only, within 120 s on a GPU.)

Models (bench/llamas.py): random-weight Llamas in the device's dtype, `micro` (one layer, 64 wide:
the forward nearly free) and `small` (4 layers, 256 wide). For each, alternately, `--runs` times:

- kvd: a real `kvd serve` (`--speculate off`: both sides do one token a step) answers a fresh
  session's greedy turn of `--tokens` tokens over the websocket;
- mlx-lm: `mlx_lm.stream_generate` in a process of its own (the same prompt ids, greedy), driven by
  this bench the same way.

Decode tok/s is measured at the caller on both sides: the tokens after the first over the time from
the first token's arrival to the last's (kvd: its `chat.delta` frames; mlx-lm: the generator's
yields); kvd's own `decode_tps` is printed beside it. CPU per token is each thread's CPU time over
that same window (Linux: /proc/PID/task/*/schedstat): kvd's own threads by name (`kvd status`
lists them with their kernel ids: kvd-engine, kvd-loop (the main thread, the event loop),
kvd-io, kvd-io-read, kvd-writer, kvd-tokenizer, anyio's workers), the rest (MLX's stream
workers, the BLAS's) as "native"; against mlx-lm's main thread and its native threads.

Reported: medians over the runs, and the two targets: kvd/mlx-lm decode >= 0.95 on `micro`, and
kvd's engine and loop threads together at most mlx-lm's main thread per token. Exit status 0 whatever
the figures (a guard to read, not a test that fails on a loaded machine): the last line says which
targets hold. `uptime` is printed before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

PROMPT = "Tell me everything you know about caches, restarts and the sessions a daemon keeps. " * 4
NATIVE = "native (MLX, BLAS)"


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """Every thread of `pid`: its kernel name and its CPU seconds so far (schedstat's first field)."""
    out: dict[int, tuple[str, float]] = {}
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            comm = (task / "comm").read_text().strip()
            out[int(task.name)] = (comm, int((task / "schedstat").read_text().split()[0]) / 1e9)
        except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
            continue
    return out


def cpu_by_name(pid: int, before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
                names: dict[int, str]) -> dict[str, float]:
    """CPU seconds each named group of threads spent between two readings: a thread in `names` (its
    Python threads, by kernel id) by that name, any other (MLX's and the BLAS's) as "native"."""
    out: dict[str, float] = {}
    for tid, (comm, t1) in after.items():
        t0 = before.get(tid, (comm, 0.0))[1]
        name = names.get(tid, NATIVE)
        out[name] = out.get(name, 0.0) + t1 - t0
    return out


# --- mlx-lm, in a process of its own ------------------------------------------------------------


def child(model_dir: str) -> None:
    """mlx-lm's side: one greedy stream_generate per "run N" line on stdin, its figures as a JSON line."""
    from daemon.service.blas import preload_blas

    preload_blas()  # as kvd does on the CPU (a GPU's policy skips it)
    import mlx.core as mx
    from mlx_lm import load, stream_generate

    loaded = load(model_dir)
    model, tokenizer = loaded[0], loaded[1]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    pid = os.getpid()
    for line in sys.stdin:
        n = int(line.split()[1])
        first = last = None
        c0 = c1 = 0.0
        tokens = 0
        before: dict[int, tuple[str, float]] = {}
        for _ in stream_generate(model, tokenizer, mx.array(prompt), max_tokens=n):
            tokens += 1
            last = time.perf_counter()
            if first is None:
                first, c0, before = last, time.thread_time(), thread_cpu(pid)
        c1 = time.thread_time()
        after = thread_cpu(pid)
        assert first is not None and last is not None
        cpu = cpu_by_name(pid, before, after, {pid: "main"})
        cpu["main"] = c1 - c0  # (the same, to the clock's grain)
        print(json.dumps({"tokens": tokens, "tps": (tokens - 1) / (last - first), "cpu": cpu}), flush=True)


class MlxLm:
    def __init__(self, model: Path):
        self.proc = subprocess.Popen([sys.executable, __file__, "--child", str(model)], cwd=ROOT, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def run(self, tokens: int) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"run {tokens}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the mlx-lm process ended ({self.proc.wait()})")
        out: dict[str, Any] = json.loads(line)
        return out

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


# --- kvd -----------------------------------------------------------------------------------------


class Kvd:
    def __init__(self, model: Path, data: Path, env: dict[str, str] | None = None):
        from daemonproc import DaemonProcess

        self.d = DaemonProcess(data, "--model", str(model), "--speculate", "off", env=env)
        self.pid = self.d.proc.pid
        self.names: dict[int, str] = {}

    def threads(self) -> None:
        """kvd's own threads by kernel id (`status`), once all have started (after a turn)."""
        with self.d.client() as c:
            threads = c.request("status").get("threads") or py_spy_threads(self.pid)
        self.names = {tid: name for name, tids in threads.items() for tid in tids}
        self.names[self.pid] = "kvd-loop"  # the main thread: the event loop
        for tid, name in list(self.names.items()):
            if name.startswith("AnyIO worker"):
                self.names[tid] = "anyio workers"

    def run(self, tokens: int) -> dict[str, Any]:
        import json as _json

        with self.d.client() as c:
            sid = c.request("session.create", title="hostcost")["session"]["id"]
            rid = c.send(type="chat.send", session=sid, text=PROMPT, max_tokens=tokens, temperature=0)
            first = last = None
            before: dict[int, tuple[str, float]] = {}
            after: dict[int, tuple[str, float]] = {}
            usage: dict[str, Any] = {}
            frames = 0
            while True:
                e = _json.loads(c.ws.recv(timeout=120))
                if e.get("id") != rid:
                    continue
                if e["type"] == "chat.delta":
                    frames += 1
                    last = time.perf_counter()
                    if first is None:
                        first, before = last, thread_cpu(self.pid)
                elif e["type"] == "chat.done":
                    after = thread_cpu(self.pid)  # (read here, not at each frame: the reading costs a core)
                    usage = e["usage"]
                    break
                elif e["type"] == "error":
                    raise SystemExit(f"kvd: {e}")
        assert first is not None and last is not None
        n = int(usage["completion_tokens"])
        return {"tokens": n, "tps": (n - 1) / (last - first), "kvd_tps": usage.get("decode_tps"), "frames": frames,
                "cpu": cpu_by_name(self.pid, before, after, self.names)}

    def stop(self) -> None:
        self.d.terminate()


def py_spy_threads(pid: int) -> dict[str, list[int]]:
    """A kvd older than `status`'s `threads` (a before/after run): its Python threads from `py-spy dump`."""
    import re
    import shutil

    spy = os.environ.get("KVD_PYSPY") or shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    try:
        dump = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    out: dict[str, list[int]] = {}
    for tid, name in re.findall(r'^Thread (\d+) \([^)]*\): "([^"]*)"', dump, re.M):
        out.setdefault(name, []).append(int(tid))
    return out


# --- the report ----------------------------------------------------------------------------------


def median_cpu(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Per thread group, the median over the runs of its CPU ms per token (runs without it count 0)."""
    names = {name for r in runs for name in r["cpu"]}
    return {name: statistics.median(r["cpu"].get(name, 0.0) * 1000 / max(r["tokens"] - 1, 1) for r in runs)
            for name in names}


def report(shape: str, kvd: list[dict[str, Any]], mlx: list[dict[str, Any]]) -> dict[str, Any]:
    k_tps, m_tps = statistics.median(r["tps"] for r in kvd), statistics.median(r["tps"] for r in mlx)
    ratio = k_tps / m_tps
    k_cpu, m_cpu = median_cpu(kvd), median_cpu(mlx)
    k_runs, m_runs = ", ".join(f"{r['tps']:.0f}" for r in kvd), ", ".join(f"{r['tps']:.0f}" for r in mlx)
    print(f"\n[{shape}] decode at the caller, medians of {len(kvd)}: kvd {k_tps:.1f} tok/s "
          f"(runs {k_runs}; kvd's own decode_tps "
          f"{statistics.median(r['kvd_tps'] or 0 for r in kvd):.1f}; frames per token "
          f"{statistics.median(r['frames'] / r['tokens'] for r in kvd):.2f}), mlx-lm {m_tps:.1f} tok/s "
          f"(runs {m_runs}): ratio {ratio:.3f}")
    print(f"[{shape}] CPU ms per token, by thread (medians):")
    for name, ms in sorted(k_cpu.items(), key=lambda kv: -kv[1]):
        print(f"    kvd    {name:20} {ms:7.3f}")
    for name, ms in sorted(m_cpu.items(), key=lambda kv: -kv[1]):
        print(f"    mlx-lm {name:20} {ms:7.3f}")
    host = k_cpu.get("kvd-engine", 0.0) + k_cpu.get("kvd-loop", 0.0)
    main = m_cpu.get("main", 0.0)
    print(f"[{shape}] kvd's engine + loop {host:.3f} ms/token against mlx-lm's main thread {main:.3f}: "
          f"{host / main if main else float('nan'):.2f}x")
    return {"shape": shape, "ratio": ratio, "kvd_tps": k_tps, "mlx_tps": m_tps, "engine_loop_ms": host,
            "mlx_main_ms": main, "kvd_cpu": k_cpu, "mlx_cpu": m_cpu}


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="alternating runs per side and shape")
    ap.add_argument("--tokens", type=int, default=512, help="tokens per answer")
    ap.add_argument("--shapes", nargs="+", default=["micro"], help="of micro, small (default: micro)")
    ap.add_argument("--dir", help="where the models and the data dir go (default a temp dir)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child)
        return 0
    from llamas import write_model

    print("before:", uptime(), flush=True)
    root = Path(args.dir or tempfile.mkdtemp(prefix="kvd-hostcost-"))
    results = []
    for shape in args.shapes:
        model = write_model(root, shape)
        kvd = Kvd(model, Path(tempfile.mkdtemp(dir=root, prefix="kvd-")))
        mlx = MlxLm(model)
        try:
            kvd.run(16)
            mlx.run(16)  # warm-ups, untimed
            kvd.threads()
            k_runs: list[dict[str, Any]] = []
            m_runs: list[dict[str, Any]] = []
            for i in range(args.runs):  # alternating, kvd first in even runs
                order = (kvd, mlx) if i % 2 == 0 else (mlx, kvd)
                for side in order:
                    (k_runs if side is kvd else m_runs).append(side.run(args.tokens))
            results.append(report(shape, k_runs, m_runs))
        finally:
            kvd.stop()
            mlx.stop()
    print("\nafter:", uptime())
    micro = next((r for r in results if r["shape"] == "micro"), None)
    verdicts = []
    if micro is not None:
        verdicts.append(f"micro decode ratio {micro['ratio']:.3f} (target >= 0.95: "
                        f"{'met' if micro['ratio'] >= 0.95 else 'NOT met'})")
    for r in results:
        ok = r["engine_loop_ms"] <= r["mlx_main_ms"]
        verdicts.append(f"{r['shape']} engine+loop {r['engine_loop_ms']:.3f} vs mlx-lm main {r['mlx_main_ms']:.3f} "
                        f"ms/token (target <=: {'met' if ok else 'NOT met'})")
    print("RESULT: " + "; ".join(verdicts))
    print("JSON: " + json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
