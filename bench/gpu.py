"""kvd on the device it runs on, beside mlx-lm itself: one table, same device, same model, one run.

Run (a machine with one NVIDIA GPU, no network needed; about 5 minutes on an H200):
    python bench/gpu.py                      # ~1B and ~8B Llama shapes, bf16; writes docs/benchmarks.md
    python bench/gpu.py --small              # tiny shapes: checks the whole bench on a CPU in a few minutes
    python bench/gpu.py --shapes 1b --out -  # one shape, the table on stdout only

Models (bench/llamas.py): random weights in the shapes of Llama 3.2 1B and Llama 3.1 8B, made on
the device by mlx-lm's own llama module, in the device's dtype (bf16 on a GPU), with the built-in
tokenizer (builtin:tiny: no hub); a greedy answer runs to its max_tokens.

Every runner does the same work, timed at its caller: a conversation of about 4,500 tokens (a
system prompt, turns of words, a user message) is rendered with the chat template, tokenized and
answered (the *first turn*), then grows by its answer and a short message, `--repeat` times (the
*next turns*: rendered and tokenized whole again; what a runner keeps of the last turn is up to
it). Time to first token: from the request (in-process: from the render) to the first text at the
caller. Decode tok/s: the tokens after the first over the time from the first text to the last.

- in-process mlx-lm: `mlx_lm.stream_generate` with a prompt cache kept across turns (the
  common prefix of the last turn's ids and the new ones kept, `trim_prompt_cache`, the rest fed),
  as an application embedding mlx-lm would do it;
- `mlx_lm.server` (a process, the official `openai` client, streaming, greedy: the peer row);
- `kvd serve` (the same; prefetch on, as kvd's defaults): seconds from start to ready, the turns,
  and the next turn after a restart (once the start's prefetch has paged the conversation back);
- batch 8: eight conversations like the first (each its own system prompt), each answered once,
  then their next turns sent at once: the aggregate decode tok/s (all their tokens after each
  one's first, over the time from the first text of any to the last of all), kvd and mlx_lm.server;
- `KVD_SPECULATE=on` (1B only): kvd's decode with speculation forced on, where the device's
  policy keeps "auto" off (daemon/device.py).

The step split (daemon/engine/profile.py: graph, launch, device, books, gil, runq; ms per decode
step) comes from kvd's step profiler (`KVD_PROFILE=1`, `kvd status`), and for mlx-lm's
`stream_generate` and mlx_lm.server's generator from bench/sections.py, over the next turns
(batch 1) and the batch-8 turn. Ready: also the weights' read (`mx.load` of the safetensors,
evaluated) for comparison.

Each time is the median of the timed turns. The tables name the device (daemon/device.py's
description) and are written into docs/benchmarks.md between this bench's markers, replacing an
older table of the same device, after each shape (a run cut short leaves what it measured).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from daemon.service.blas import preload_blas  # noqa: E402

BLAS = preload_blas()  # on the CPU (--small), as kvd does; a GPU's policy skips it

import mlx.core as mx  # noqa: E402
import openai  # noqa: E402

from daemon.device import describe, policy  # noqa: E402
from daemonproc import DaemonProcess  # noqa: E402
from llamas import write_model  # noqa: E402
from sections import Sections  # noqa: E402

WORDS = ("the cache keeps every session warm and the daemon pages cold ones out to disk "
         "so a long pause costs nothing when the user comes back later").split()
SYSTEM = "You are a patient assistant who answers questions about caches and restarts."
MARK = "<!-- bench/gpu.py"
BATCH = 8
SPLIT = ("graph", "launch", "device", "books", "gil", "runq", "step")


# --- the conversations --------------------------------------------------------------------------


def conversation(model_dir: Path, tokens: int, system: str = SYSTEM) -> list[dict[str, str]]:
    """System prompt and alternating turns of words until about `tokens`; ends with a user message."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    rng = random.Random(0)
    messages = [{"role": "system", "content": system}]
    role = "user"
    while True:
        size = len(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        if size >= tokens - 100 and role == "user":
            break
        messages.append({"role": role, "content": " ".join(rng.choice(WORDS) for _ in range(60))})
        role = "assistant" if role == "user" else "user"
    messages.append({"role": "user", "content": "Summarize what we said so far, briefly."})
    return messages


def next_turn(messages: list[dict[str, str]], answer: str, i: int) -> list[dict[str, str]]:
    return [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": f"And then ({i})?"}]


def weights_read(model_dir: Path) -> float:
    """Seconds to read the model's weights into the device's memory (mx.load, evaluated)."""
    t0 = time.perf_counter()
    weights = mx.load(str(model_dir / "model.safetensors"))
    mx.eval(weights)
    took = time.perf_counter() - t0
    del weights
    mx.clear_cache()
    return took


# --- in-process mlx-lm ------------------------------------------------------------------------


def in_process(model_dir: Path, messages: list[dict[str, str]], new: int, repeat: int) -> dict[str, Any]:
    """mlx-lm's stream_generate doing the turns an application would: render, tokenize, a prompt cache
    kept across turns, first text at the caller."""
    from mlx_lm import load, stream_generate
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    loaded = load(str(model_dir))
    model, tokenizer = loaded[0], loaded[1]
    cache: list[Any] = make_prompt_cache(model)
    held: list[int] = []  # the ids the cache holds

    def turn(msgs: list[dict[str, str]]) -> tuple[float, float, str, int]:
        nonlocal held
        t0 = time.perf_counter()
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
        keep = next((k for k, (a, b) in enumerate(zip(held, ids)) if a != b), min(len(held), len(ids)))
        keep = min(keep, len(ids) - 1)  # at least one token is fed
        trim_prompt_cache(cache, len(held) - keep)
        first = last = None
        text, tokens = "", []
        for r in stream_generate(model, tokenizer, mx.array(ids[keep:]), max_tokens=new, prompt_cache=cache):
            if r.text and first is None:
                first = time.perf_counter()
            last = time.perf_counter()
            text += r.text
            tokens.append(r.token)
        held = [*ids, *tokens][:cache[0].offset]
        n = len(tokens)
        tps = (n - 1) / (last - first) if first and last and last > first and n > 1 else 0.0
        return (first or time.perf_counter()) - t0, tps, text, len(ids)

    out: dict[str, Any] = {"first": [], "next": [], "decode": [], "split": {}}
    with Sections() as split:
        turn([{"role": "user", "content": "hi"}])  # warm-up, untimed
        cache, held = make_prompt_cache(model), []
        ttft, tps, answer, out["prompt"] = turn(messages)
        out["first"].append(ttft)
        out["decode"].append(tps)
        split.reset()
        for i in range(repeat):
            messages = next_turn(messages, answer, i)
            ttft, tps, answer, _ = turn(messages)
            out["next"].append(ttft)
            out["decode"].append(tps)
        out["split"] = split.figures()
    return out


# --- servers ----------------------------------------------------------------------------------


def stream(base_url: str, key: str, messages: list[dict[str, str]], new: int, model: str = "default_model"
           ) -> tuple[float, float, str, int, float, float, int]:
    """One streamed greedy answer: (seconds to first content, decode tok/s, its text, prompt tokens,
    the first and last content's times, completion tokens)."""
    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=600)
    t0 = time.perf_counter()
    first = last = None
    text = ""
    usage: dict[str, Any] = {}
    chunks = client.chat.completions.create(model=model, messages=messages,  # type: ignore[call-overload]
                                            stream=True, temperature=0, max_tokens=new,
                                            stream_options={"include_usage": True})
    for chunk in chunks:
        if chunk.choices:
            if chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                text += chunk.choices[0].delta.content
                last = time.perf_counter()
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
    n = int(usage.get("completion_tokens") or 0)
    # Decode: the tokens after the first over the time from the first content to the last.
    tps = (n - 1) / (last - first) if first and last and last > first and n > 1 else 0.0
    f = first or time.perf_counter()
    return f - t0, tps, text, int(usage.get("prompt_tokens") or 0), f, last or f, n


class MlxServer:
    """mlx_lm.server in its own process, its own defaults, its steps split (bench/sections.py)."""

    def __init__(self, model: Path, root: Path):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.base_url, self.key, self.model = f"http://127.0.0.1:{port}/v1", "none", "default_model"
        self.split_file = Path(tempfile.mkstemp(dir=root, suffix=".json")[1])
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "bench" / "sections.py"), str(self.split_file), "-m", "mlx_lm.server",
             "--model", str(model), "--port", str(port), "--log-level", "WARNING"],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        t0 = time.perf_counter()
        deadline = time.monotonic() + 300
        while True:  # a benchmark: polling its port is the only readiness signal mlx_lm.server has
            try:
                with urllib.request.urlopen(f"{self.base_url}/models", timeout=5):
                    break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"mlx_lm.server did not start (exit {self.proc.poll()})") from None
                time.sleep(0.2)
        self.ready_s = time.perf_counter() - t0  # (its port answers before its model is loaded)

    def reset_split(self) -> None:
        self.proc.send_signal(signal.SIGUSR1)

    def split(self) -> dict[str, float]:
        """The split since the last reset; read once the server has stopped."""
        try:
            out: dict[str, float] = json.loads(self.split_file.read_text() or "{}")
        except (OSError, ValueError):
            return {}
        return out

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Kvd:
    """`kvd serve` (tests/daemonproc.py): port 0, its own data dir, prefetch on, its step profiler on."""

    def __init__(self, model: Path, data_dir: Path, env: dict[str, str] | None = None, *, prefetch: bool = False):
        t0 = time.perf_counter()
        self.d = DaemonProcess(data_dir, "--model", str(model), env={"KVD_PROFILE": "1", **(env or {})},
                               prefetch=True)
        with self.d.client() as c:
            status = c.request("status")  # answered once the model is loaded and warmed up
            self.ready_s = time.perf_counter() - t0
            deadline = time.monotonic() + 120
            while prefetch and status["prefetched"].get("sessions", 0) < 1 and time.monotonic() < deadline:
                time.sleep(0.05)  # the start's prefetch pages the conversation back (a user back a moment later)
                status = c.request("status")
        self.base_url, self.key, self.model = self.d.base_url, self.d.token, str(model)
        self.device = str(status.get("device") or "")
        self.start_log = [line.strip() for line in self.d.log if "loaded" in line or "warmed up" in line
                          or "ready" in line]

    def profile(self) -> dict[str, float]:
        """The step profiler's figures so far (every turn's writes done: status waits for them)."""
        with self.d.client() as c:
            return dict(c.request("status").get("profile") or {})

    def stop(self) -> None:
        self.d.terminate()


def split_between(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """kvd's profile over the steps between two readings (each is ms per step since the start)."""
    steps = b.get("steps", 0.0) - a.get("steps", 0.0)
    if steps <= 0:
        return {}
    return {**{k: (b.get(k, 0.0) * b["steps"] - a.get(k, 0.0) * a.get("steps", 0.0)) / steps for k in SPLIT},
            "steps": steps, "batch": (b.get("batch", 0) * b["steps"] - a.get("batch", 0) * a.get("steps", 0)) / steps}


@contextmanager
def running(start: Callable[[], Any]) -> Iterator[Any]:
    server = start()
    try:
        yield server
    finally:
        server.stop()


def batch(s: Any, convos: list[list[dict[str, str]]], new: int) -> float:
    """Each conversation answered once (untimed), then all their next turns at once: aggregate decode tok/s."""
    answers = [stream(s.base_url, s.key, m, new, s.model)[2] for m in convos]
    results: list[tuple[float, float, int]] = []

    def one(m: list[dict[str, str]]) -> None:
        _, _, _, _, first, last, n = stream(s.base_url, s.key, m, new, s.model)
        results.append((first, last, n))

    threads = [threading.Thread(target=one, args=(next_turn(m, a, 0),)) for m, a in zip(convos, answers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    span = max(r[1] for r in results) - min(r[0] for r in results)
    return sum(r[2] - 1 for r in results) / span if span > 0 else 0.0


def served(kind: str, model: Path, messages: list[dict[str, str]], convos: list[list[dict[str, str]]], new: int,
           repeat: int, root: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """First turn, next turns, batch 8, (kvd) a next turn after a restart, decode tok/s, through one server."""
    data = Path(tempfile.mkdtemp(dir=root, prefix=f"{kind}-"))
    start: Callable[[], Any] = (lambda: Kvd(model, data, env)) if kind == "kvd" else (lambda: MlxServer(model, root))
    out: dict[str, Any] = {"first": [], "next": [], "restart": [], "decode": [], "ready": [], "device": "",
                           "batch": [], "split": {}, "split8": {}}
    with running(start) as s:
        out["ready"].append(s.ready_s)
        out["device"] = getattr(s, "device", "")
        out["start_log"] = getattr(s, "start_log", [])
        stream(s.base_url, s.key, [{"role": "user", "content": "hi"}], 2, s.model)  # warm-up, untimed
        ttft, tps, answer, out["prompt"], *_ = stream(s.base_url, s.key, messages, new, s.model)
        out["first"].append(ttft)
        out["decode"].append(tps)
        before = s.profile() if kind == "kvd" else s.reset_split()
        for i in range(repeat):
            messages = next_turn(messages, answer, i)
            ttft, tps, answer, *_ = stream(s.base_url, s.key, messages, new, s.model)
            out["next"].append(ttft)
            out["decode"].append(tps)
        if kind == "kvd":
            after = s.profile()
            out["split"] = split_between(before, after)
        if convos:
            out["batch"].append(batch(s, convos, new))
            if kind == "kvd":
                out["split8"] = split_between(after, s.profile())
    if kind == "server":
        out["split"] = s.split()  # (next turns and the batch together: the server's split is read at its stop)
    if kind == "kvd" and env is None:
        with running(lambda: Kvd(model, data, prefetch=True)) as s:
            out["ready"].append(s.ready_s)
            messages = next_turn(messages, answer, repeat)
            ttft, tps, answer, *_ = stream(s.base_url, s.key, messages, new, s.model)
            out["restart"].append(ttft)
            out["decode"].append(tps)
    return out


# --- the table --------------------------------------------------------------------------------


def ms(values: list[float]) -> str:
    if not values:
        return "-"
    mid = f"{statistics.median(values) * 1000:.0f} ms"
    return mid if len(values) == 1 else f"{mid} ({min(values) * 1000:.0f}-{max(values) * 1000:.0f})"


def tps(values: list[float]) -> str:
    values = [v for v in values if v > 0]
    return f"{statistics.median(values):.1f}" if values else "-"


def split_line(name: str, f: dict[str, float]) -> str:
    if not f or not f.get("steps"):
        return f"| {name} | - | - | - | - | - | - | - | - |"
    return (f"| {name} | {f['step']:.2f} | {f['graph']:.2f} | {f['launch']:.2f} | {f['device']:.2f} | "
            f"{f['books']:.2f} | {f.get('gil', 0):.2f} | {f.get('runq', 0):.2f} | {int(f['steps'])} |")


def table(device_line: str, rows: list[dict[str, Any]], argv: list[str]) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = os.getloadavg()[0]
    version = getattr(mx, "__version__", "?")
    lines = [f"{MARK} {device_line} -->",
             f"Device: **{device_line}** (MLX {version}). `python bench/gpu.py {' '.join(argv)}`, "
             f"{stamp}, load {load:.1f}. Medians (range) of the timed turns; time to first token at the caller, "
             "render and tokenization included on every side.",
             "",
             "| model | prompt | runner | ready after start | first turn TTFT | next turn TTFT | "
             "next turn after restart | decode tok/s | batch 8 tok/s |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        p, m, k, sp = r["mlx_lm"], r["server"], r["kvd"], r.get("kvd_spec")
        lines.append(f"| {r['shape']} | {p['prompt']} tok | in-process mlx-lm | weights read {ms([r['read']])} | "
                     f"{ms(p['first'])} | {ms(p['next'])} | - | {tps(p['decode'])} | - |")
        lines.append(f"| {r['shape']} | {m.get('prompt', '?')} tok | mlx_lm.server | - | {ms(m['first'])} | "
                     f"{ms(m['next'])} | - | {tps(m['decode'])} | {tps(m['batch'])} |")
        lines.append(f"| {r['shape']} | {k.get('prompt', '?')} tok | kvd | {ms(k['ready'])} | {ms(k['first'])} | "
                     f"{ms(k['next'])} | {ms(k['restart'])} | {tps(k['decode'])} | {tps(k['batch'])} |")
        if sp is not None:
            lines.append(f"| {r['shape']} | {sp.get('prompt', '?')} tok | kvd, KVD_SPECULATE=on | - | "
                         f"{ms(sp['first'])} | {ms(sp['next'])} | - | {tps(sp['decode'])} | - |")
    lines += ["", "Where a decode step's time goes, ms per step (kvd: its step profiler, daemon/engine/profile.py; "
              "mlx-lm: bench/sections.py): graph (the model call), launch (`mx.async_eval`), device (waiting "
              "for a result), books (the rest of the loop: bookkeeping, detokenizing, hand-offs), and of the "
              "step, waiting for the GIL and for a core.", "",
              "| model, runner | step | graph | launch | device | books | GIL | run queue | steps |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(split_line(f"{r['shape']}, in-process mlx-lm (next turns)", r["mlx_lm"]["split"]))
        lines.append(split_line(f"{r['shape']}, mlx_lm.server (next turns and batch 8)", r["server"]["split"]))
        lines.append(split_line(f"{r['shape']}, kvd (next turns)", r["kvd"]["split"]))
        lines.append(split_line(f"{r['shape']}, kvd (batch 8)", r["kvd"]["split8"]))
    lines.append(f"{MARK} end -->")
    return "\n".join(lines) + "\n"


SECTION = "## kvd beside mlx-lm on a GPU (bench/gpu.py)"


def write_table(path: Path, device_line: str, text: str) -> None:
    """Into `path`'s bench/gpu.py section: replacing this device's older table, else first in it."""
    doc = path.read_text()
    old = re.compile(re.escape(f"{MARK} {device_line} -->") + r".*?" + re.escape(f"{MARK} end -->") + r"\n",
                     re.DOTALL)
    if old.search(doc):
        doc = old.sub(lambda _: text, doc, count=1)
    elif SECTION in doc:
        doc = doc.replace(SECTION + "\n\n", SECTION + "\n\n" + text + "\n", 1)
    else:
        head, _, rest = doc.partition("\n## ")
        doc = f"{head}\n{SECTION}\n\n{text}\n## {rest}" if rest else f"{doc}\n{SECTION}\n\n{text}"
    path.write_text(doc)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny shapes: the whole bench on a CPU")
    parser.add_argument("--shapes", nargs="+", help="of 1b, 8b, tiny, small")
    parser.add_argument("--prompt", type=int, help="conversation tokens before the first answer (default 4500; "
                        "--small 1500)")
    parser.add_argument("--new", type=int, help="tokens per answer (default 128; --small 32)")
    parser.add_argument("--repeat", type=int, default=2, help="timed next turns per runner")
    parser.add_argument("--no-batch", action="store_true", help="skip the batch-8 turns")
    parser.add_argument("--no-speculation", action="store_true", help="skip the KVD_SPECULATE=on decode run")
    parser.add_argument("--out", help="markdown file for the table ('-': stdout only); default "
                        "docs/benchmarks.md, or stdout only with --small")
    parser.add_argument("--dir", help="where the models and data dirs go (default a temp dir)")
    args = parser.parse_args()
    shapes = args.shapes or (["tiny"] if args.small else ["1b", "8b"])
    new = args.new or (32 if args.small else 128)
    prompt = args.prompt or (1500 if args.small else 4500)
    out = args.out or ("-" if args.small else str(ROOT / "docs" / "benchmarks.md"))
    root = Path(args.dir or tempfile.mkdtemp(prefix="kvd-gpu-bench-"))
    device = describe()
    pol = policy(device)
    device_line = pol.line("bf16" if device.gpu else "float32")
    print(f"{device_line}; {BLAS.reason}; models and data in {root}", flush=True)
    t_all = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for shape in shapes:
        t0 = time.perf_counter()
        model = write_model(root, shape)
        messages = conversation(model, prompt)
        convos = [] if args.no_batch else [conversation(model, prompt, f"{SYSTEM} (conversation {i})")
                                           for i in range(BATCH)]
        print(f"[{shape}] model written in {time.perf_counter() - t0:.1f} s", flush=True)
        row: dict[str, Any] = {"shape": shape, "read": weights_read(model)}
        print(f"[{shape}] weights read in {row['read']:.2f} s", flush=True)
        row["mlx_lm"] = in_process(model, messages, new, args.repeat)
        print(f"[{shape}] in-process mlx-lm: {row['mlx_lm']}", flush=True)
        row["server"] = served("server", model, messages, convos, new, args.repeat, root)
        print(f"[{shape}] mlx_lm.server: {row['server']}", flush=True)
        row["kvd"] = served("kvd", model, messages, convos, new, args.repeat, root)
        print(f"[{shape}] kvd: {row['kvd']}", flush=True)
        if not args.no_speculation and shape == shapes[0]:
            row["kvd_spec"] = served("kvd", model, messages, [], new, 1, root, env={"KVD_SPECULATE": "on"})
            print(f"[{shape}] kvd, KVD_SPECULATE=on: {row['kvd_spec']}", flush=True)
        rows.append(row)
        print(f"[{shape}] done at {time.perf_counter() - t_all:.0f} s", flush=True)
        line = rows[0]["kvd"]["device"] or device_line
        text = table(line.removeprefix("device: "), rows, sys.argv[1:])
        print(text, flush=True)
        if out != "-":  # after each shape: a run cut short leaves what it measured
            write_table(Path(out), line.removeprefix("device: "), text)
            print(f"written to {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
