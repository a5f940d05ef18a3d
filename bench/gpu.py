"""kvd on the device it runs on, beside mlx-lm itself: one table, same device, same model, one run.

Run (a machine with one NVIDIA GPU, no network needed; under 5 minutes):
    python bench/gpu.py                      # ~1B and ~8B Llama shapes, bf16; writes docs/benchmarks.md
    python bench/gpu.py --small              # tiny shapes: checks the whole bench on a CPU in a minute
    python bench/gpu.py --shapes 1b --out -  # one shape, the table on stdout only

Models: random weights in the shapes of Llama 3.2 1B and Llama 3.1 8B (`SHAPES`), made on the
device by mlx-lm's own llama module, saved in bfloat16 with the built-in tokenizer (builtin:tiny:
no hub). Rows of the output head past the tokenizer's vocabulary, and its end-of-turn row, are
zero, so a greedy answer is real tokens and runs to its max_tokens.

A conversation of about 4,500 tokens (a system prompt, turns of words, a user message); then, on
each model:
- in-process mlx-lm (`generate_step`, its own 2048-token prefill chunks): time to first token of
  the whole prompt; decode tok/s; and the next turn's time to first token over a cache holding
  the conversation (what the next turn costs when nothing but the new message is read);
- `mlx_lm.server` (a process, the official `openai` client, streaming, greedy): first turn, next
  turn (its prompt cache), decode tok/s;
- `kvd serve` (the same): seconds from start to ready, first turn, next turn, next turn after a
  restart (from disk), decode tok/s; and decode tok/s again with `KVD_SPECULATE=on`, where the
  device's policy keeps "auto" speculation off (daemon/device.py), so the table says what
  speculation would cost or give on this device.

Each time is the median of `--repeat` turns after one untimed warm-up turn. The table names the
device (daemon/device.py's description) and is written into docs/benchmarks.md between this
bench's markers, replacing an older table of the same device.
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
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from daemon.service.blas import preload_blas  # noqa: E402

BLAS = preload_blas()  # on the CPU (--small), as kvd does; a GPU's policy skips it

import mlx.core as mx  # noqa: E402
import openai  # noqa: E402

from daemon.device import describe, policy  # noqa: E402
from daemon.models.builtin import ensure_builtin  # noqa: E402
from daemonproc import DaemonProcess  # noqa: E402

LLAMA = {"model_type": "llama", "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
         "architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16"}
SHAPES: dict[str, dict[str, Any]] = {
    "1b": {"hidden_size": 2048, "num_hidden_layers": 16, "intermediate_size": 8192, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "tie_word_embeddings": True},
    "8b": {"hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "tie_word_embeddings": False},
    # --small: the same code on a shape a 2-core CPU runs in a minute ("small": a few minutes)
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 4096, "tie_word_embeddings": True},
    "small": {"hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 512, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 4096, "tie_word_embeddings": False},
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
WORDS = ("the cache keeps every session warm and the daemon pages cold ones out to disk "
         "so a long pause costs nothing when the user comes back later").split()
SYSTEM = "You are a patient assistant who answers questions about caches and restarts."
MARK = "<!-- bench/gpu.py"


# --- the models -------------------------------------------------------------------------------


def write_model(root: Path, shape: str) -> Path:
    """A random-weight Llama of `shape` in bfloat16, made on the default device, with builtin:tiny's tokenizer."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    dest = root / f"llama-{shape}"
    if (dest / "model.safetensors").exists():
        return dest
    tiny = ensure_builtin("builtin:tiny", root / "builtin")
    tiny_config = json.loads((tiny / "config.json").read_text())
    vocab, eos = int(tiny_config["vocab_size"]), int(tiny_config["eos_token_id"])
    config = {**LLAMA, **SHAPES[shape], "eos_token_id": eos, "bos_token_id": tiny_config.get("bos_token_id"),
              "pad_token_id": tiny_config.get("pad_token_id")}
    assert config["vocab_size"] >= vocab
    dest.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        (dest / name).write_bytes((tiny / name).read_bytes())
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.set_dtype(mx.bfloat16)
    weights = dict(tree_flatten(model.parameters()))
    head = "model.embed_tokens.weight" if config["tie_word_embeddings"] else "lm_head.weight"
    rows = mx.arange(config["vocab_size"])[:, None]
    # Only the tokenizer's ids can win a greedy argmax, and never its end of turn: answers run to max_tokens.
    weights[head] = mx.where((rows < vocab) & (rows != eos), weights[head], 0).astype(mx.bfloat16)
    mx.eval(weights)
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    (dest / "config.json").write_text(json.dumps(config))
    del model, weights
    mx.clear_cache()
    return dest


def conversation(model_dir: Path, tokens: int) -> tuple[list[dict[str, str]], Any]:
    """System prompt and alternating turns of words until about `tokens`; ends with a user message."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    rng = random.Random(0)
    messages = [{"role": "system", "content": SYSTEM}]
    role = "user"
    while True:
        size = len(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        if size >= tokens - 100 and role == "user":
            break
        messages.append({"role": role, "content": " ".join(rng.choice(WORDS) for _ in range(60))})
        role = "assistant" if role == "user" else "user"
    messages.append({"role": "user", "content": "Summarize what we said so far, briefly."})
    return messages, tokenizer


def next_turn(messages: list[dict[str, str]], answer: str, i: int) -> list[dict[str, str]]:
    return [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": f"And then ({i})?"}]


# --- in-process mlx-lm ------------------------------------------------------------------------


def in_process(model_dir: Path, messages: list[dict[str, str]], tokenizer: Any, new: int,
               repeat: int) -> dict[str, Any]:
    """mlx-lm's generate_step on the same prompt: whole-prompt TTFT, decode tok/s, and a cached next turn."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load

    model = load(str(model_dir))[0]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ttft: list[float] = []
    tps: list[float] = []
    answer: list[int] = []
    for i in range(repeat + 1):
        t0 = time.perf_counter()
        first = None
        answer = []
        for token, _ in generate_step(mx.array(prompt), model, max_tokens=new):
            first = first or time.perf_counter()
            answer.append(int(token))
        end = time.perf_counter()
        if i:  # the first run compiles and allocates: untimed
            ttft.append((first or end) - t0)
            tps.append((len(answer) - 1) / (end - (first or end)) if len(answer) > 1 else 0.0)
    # The next turn over a cache holding the conversation and its answer: only the new message is read.
    follow = tokenizer.apply_chat_template(next_turn(messages, tokenizer.decode(answer), 0),
                                           add_generation_prompt=True)
    shared = next((k for k, (a, b) in enumerate(zip(prompt, follow)) if a != b), len(prompt))
    cached: list[float] = []
    for i in range(repeat + 1):
        cache = make_prompt_cache(model)
        for start in range(0, shared, 2048):
            model(mx.array(follow[start:min(shared, start + 2048)])[None], cache=cache)
            mx.eval([c.state for c in cache])
        t0 = time.perf_counter()
        step = generate_step(mx.array(follow[shared:]), model, max_tokens=1, prompt_cache=cache)
        next(step)
        if i:
            cached.append(time.perf_counter() - t0)
    del model
    mx.clear_cache()
    return {"prompt": len(prompt), "ttft": ttft, "decode": tps, "next": cached, "new_tokens": len(follow) - shared}


# --- servers ----------------------------------------------------------------------------------


def stream(base_url: str, key: str, messages: list[dict[str, str]], new: int, model: str = "default_model"
           ) -> tuple[float, float, str, int]:
    """One streamed greedy answer: (seconds to first content, decode tok/s, its text, prompt tokens)."""
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
            last = time.perf_counter()  # the answer's end too (its finish_reason chunk)
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
    n = int(usage.get("completion_tokens") or 0)
    # Decode: the tokens after the first over the time from the first content to the answer's end.
    tps = (n - 1) / (last - first) if first and last and last > first and n > 1 else 0.0
    return (first or time.perf_counter()) - t0, tps, text, int(usage.get("prompt_tokens") or 0)


class MlxServer:
    """mlx_lm.server in its own process, its own defaults (2048-token prefill chunks)."""

    def __init__(self, model: Path):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.base_url, self.key, self.model = f"http://127.0.0.1:{port}/v1", "none", "default_model"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlx_lm.server", "--model", str(model), "--port", str(port),
             "--log-level", "WARNING"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while True:  # a benchmark: polling its port is the only readiness signal mlx_lm.server has
            try:
                with urllib.request.urlopen(f"{self.base_url}/models", timeout=5):
                    break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"mlx_lm.server did not start (exit {self.proc.poll()})") from None
                time.sleep(0.2)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Kvd:
    """`kvd serve` (tests/daemonproc.py): port 0, its own data dir, cold restarts (no prefetch)."""

    def __init__(self, model: Path, data_dir: Path, env: dict[str, str] | None = None):
        t0 = time.perf_counter()
        self.d = DaemonProcess(data_dir, "--model", str(model), env=env)
        with self.d.client() as c:
            c.request("status")  # answered once the model is loaded and warmed up
        self.ready_s = time.perf_counter() - t0
        self.base_url, self.key, self.model = self.d.base_url, self.d.token, str(model)
        self.device = ""
        with self.d.client() as c:
            self.device = str(c.request("status").get("device") or "")

    def settle(self) -> None:
        """Once the last turn's cache is kept (status is answered after the writes queued before it)."""
        with self.d.client() as c:
            c.request("status")

    def stop(self) -> None:
        self.d.terminate()


@contextmanager
def running(start: Callable[[], Any]) -> Iterator[Any]:
    server = start()
    try:
        yield server
    finally:
        server.stop()


def served(kind: str, model: Path, messages: list[dict[str, str]], new: int, repeat: int, root: Path,
           env: dict[str, str] | None = None) -> dict[str, Any]:
    """First turn, next turns, (kvd) a next turn after a restart, decode tok/s, through one server."""
    data = Path(tempfile.mkdtemp(dir=root, prefix=f"{kind}-"))
    start: Callable[[], Any] = (lambda: Kvd(model, data, env)) if kind == "kvd" else (lambda: MlxServer(model))
    out: dict[str, Any] = {"first": [], "next": [], "restart": [], "decode": [], "ready": [], "device": ""}
    with running(start) as s:
        out["ready"].append(getattr(s, "ready_s", 0.0))
        out["device"] = getattr(s, "device", "")
        stream(s.base_url, s.key, [{"role": "user", "content": "hi"}], 2, s.model)  # warm-up, untimed
        ttft, tps, answer, out["prompt"] = stream(s.base_url, s.key, messages, new, s.model)
        out["first"].append(ttft)
        out["decode"].append(tps)
        for i in range(repeat):
            if kind == "kvd":
                s.settle()
            messages = next_turn(messages, answer, i)
            ttft, tps, answer, _ = stream(s.base_url, s.key, messages, new, s.model)
            out["next"].append(ttft)
            out["decode"].append(tps)
        if kind == "kvd":
            s.settle()
    if kind == "kvd" and env is None:
        with running(start) as s:
            out["ready"].append(s.ready_s)
            messages = next_turn(messages, answer, repeat)
            ttft, tps, answer, _ = stream(s.base_url, s.key, messages, new, s.model)
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


def table(device_line: str, rows: list[dict[str, Any]], argv: list[str]) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = os.getloadavg()[0]
    version = getattr(mx, "__version__", "?")
    lines = [f"{MARK} {device_line} -->",
             f"Device: **{device_line}** (MLX {version}). `python bench/gpu.py {' '.join(argv)}`, "
             f"{stamp}, load {load:.1f}. Medians (range) of the timed turns; time to first token at the client.",
             "",
             "| model | prompt | runner | ready after start | first turn TTFT | next turn TTFT | "
             "next turn after restart | decode tok/s |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        p, m, k, sp = r["mlx_lm"], r["server"], r["kvd"], r.get("kvd_spec")
        lines.append(f"| {r['shape']} | {p['prompt']} tok | in-process mlx-lm | - | {ms(p['ttft'])} | "
                     f"{ms(p['next'])} ({p['new_tokens']} new tok) | - | {tps(p['decode'])} |")
        lines.append(f"| {r['shape']} | {m.get('prompt', '?')} tok | mlx_lm.server | - | {ms(m['first'])} | "
                     f"{ms(m['next'])} | - | {tps(m['decode'])} |")
        lines.append(f"| {r['shape']} | {k.get('prompt', '?')} tok | kvd | {ms(k['ready'])} | {ms(k['first'])} | "
                     f"{ms(k['next'])} | {ms(k['restart'])} | {tps(k['decode'])} |")
        if sp is not None:
            lines.append(f"| {r['shape']} | {sp.get('prompt', '?')} tok | kvd, KVD_SPECULATE=on | - | "
                         f"{ms(sp['first'])} | {ms(sp['next'])} | - | {tps(sp['decode'])} |")
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
    parser.add_argument("--shapes", nargs="+", help="of " + ", ".join(SHAPES))
    parser.add_argument("--prompt", type=int, default=4500, help="conversation tokens before the first answer")
    parser.add_argument("--new", type=int, help="tokens per answer (default 128; --small 32)")
    parser.add_argument("--repeat", type=int, default=3, help="timed turns per measurement")
    parser.add_argument("--no-speculation", action="store_true", help="skip the KVD_SPECULATE=on decode run")
    parser.add_argument("--out", help="markdown file for the table ('-': stdout only); default "
                        "docs/benchmarks.md, or stdout only with --small")
    parser.add_argument("--dir", help="where the models and data dirs go (default a temp dir)")
    args = parser.parse_args()
    shapes = args.shapes or (["tiny"] if args.small else ["1b", "8b"])
    new = args.new or (32 if args.small else 128)
    out = args.out or ("-" if args.small else str(ROOT / "docs" / "benchmarks.md"))
    root = Path(args.dir or tempfile.mkdtemp(prefix="kvd-gpu-bench-"))
    device = describe()
    pol = policy(device)
    device_line = pol.line("bf16" if device.gpu else "float32")
    print(f"{device_line}; {BLAS.reason}; models and data in {root}", flush=True)
    t_all = time.perf_counter()
    rows = []
    for shape in shapes:
        t0 = time.perf_counter()
        model = write_model(root, shape)
        messages, tokenizer = conversation(model, args.prompt)
        print(f"[{shape}] model written in {time.perf_counter() - t0:.1f} s", flush=True)
        row: dict[str, Any] = {"shape": shape}
        row["mlx_lm"] = in_process(model, messages, tokenizer, new, args.repeat)
        print(f"[{shape}] in-process mlx-lm: {row['mlx_lm']}", flush=True)
        row["server"] = served("server", model, messages, new, args.repeat, root)
        print(f"[{shape}] mlx_lm.server: {row['server']}", flush=True)
        row["kvd"] = served("kvd", model, messages, new, args.repeat, root)
        print(f"[{shape}] kvd: {row['kvd']}", flush=True)
        if not args.no_speculation:
            row["kvd_spec"] = served("kvd", model, messages, new, 1, root, env={"KVD_SPECULATE": "on"})
            print(f"[{shape}] kvd, KVD_SPECULATE=on: {row['kvd_spec']}", flush=True)
        rows.append(row)
        print(f"[{shape}] done at {time.perf_counter() - t_all:.0f} s", flush=True)
    line = rows[0]["kvd"]["device"] or device_line
    text = table(line.removeprefix("device: "), rows, sys.argv[1:])
    print(text)
    if out != "-":
        write_table(Path(out), line.removeprefix("device: "), text)
        print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
