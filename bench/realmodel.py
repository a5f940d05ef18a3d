"""A real model (the default, SmolLM2-135M-Instruct, or --model builtin:gemma3) in kvd against mlx-lm alone.

Run: .venv/bin/python bench/realmodel.py [--model builtin:gemma3] [--prompt-tokens 1024] [--history 2048]
                                         [--parts speed resume] [--settle SECONDS]

1. Speed. A real `kvd serve` (subprocess, websocket client, greedy) answers a
   message of about --prompt-tokens tokens; then, with kvd stopped, mlx-lm's
   own `stream_generate` runs in this process on the same converted float32
   weights, fed the exact prompt ids kvd fed (read from kvd's database) and
   asked for the same number of tokens. Prefill tok/s: kvd's prefill_tokens /
   prefill_ms (arrival of the prompt in the engine to the first token) against
   mlx-lm's prompt_tps; decode tok/s: kvd's decode_tps against mlx-lm's
   generation_tps (both: tokens after the first / time since the first).
2. Resume. A conversation of about --history tokens is built, kvd is stopped,
   the data dir is copied (hard links) and in the copy the cache files are
   deleted. Each copy is started again and asked a short next question: TTFT
   as the client sees it (request sent to first delta) with the cache
   restored from disk, against the copy that must prefill it all again.

`uptime` is printed before and after: other work on the machine shows in it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from daemon.service.blas import preload_blas  # noqa: E402

BLAS = preload_blas()

import daemonproc  # noqa: E402
from daemon.models.sources import DEFAULT_MODEL, prepare_model  # noqa: E402
from daemonproc import DaemonProcess, SyncClient  # noqa: E402

MODEL = DEFAULT_MODEL  # --model
daemonproc.EVENT_TIMEOUT = 900.0  # a 2k-token prefill on a busy 2-core machine takes minutes

PARAGRAPH = (
    "Section {i}. The river town kept its records in a stone house by the bridge. Every spring the "
    "clerks copied the old ledgers, counted the boats that came up from the coast, and wrote down "
    "the price of salt, wool and timber. Travellers said the town was quiet, but its books were full. "
)


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def text_of(tokenizer: Any, n_tokens: int) -> str:
    """Plain English of about n_tokens tokens."""
    text, i = "", 0
    while len(tokenizer.encode(text)) < n_tokens:
        i += 1
        text += PARAGRAPH.format(i=i)
    ids = tokenizer.encode(text)[:n_tokens]
    return str(tokenizer.decode(ids))


def chat_timed(c: SyncClient, session: str, text: str, **fields: Any) -> tuple[str, dict[str, Any], float]:
    """(answer, chat.done, client-side TTFT in ms: request sent to first delta)."""
    t0 = time.perf_counter()
    rid = c.send(type="chat.send", session=session, text=text, temperature=0, **fields)
    out, ttft = "", None
    while True:
        e = c.recv()
        if e.get("id") != rid:
            continue
        if e["type"] == "chat.delta":
            if ttft is None:
                ttft = (time.perf_counter() - t0) * 1000
            out += e["text"]
        elif e["type"] == "chat.done":
            return out, e, ttft or float("nan")
        elif e["type"] == "error":
            raise SystemExit(f"kvd: {e}")


def fed(db: Path, session: str) -> list[int]:
    import sqlite3

    from common.tokenids import unpack_tokens

    con = sqlite3.connect(db)
    try:
        (blob,) = con.execute("SELECT tokens FROM session_tokens WHERE session_id = ?", [session]).fetchone()
    finally:
        con.close()
    return unpack_tokens(blob)


def speed(data: Path, model_dir: Path, prompt_tokens: int, max_tokens: int) -> None:
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    message = "Summarize this text in a few sentences.\n\n" + text_of(tokenizer, prompt_tokens)
    d = DaemonProcess(data, "--model", MODEL)
    try:
        with d.client() as c:
            sid = c.request("session.create")["session"]["id"]
            _, done, ttft = chat_timed(c, sid, message, max_tokens=max_tokens)
    finally:
        d.terminate()
    u = done["usage"]
    ids = fed(data / "kvd.sqlite", sid)
    prompt, kvd_out = ids[: u["prompt_tokens"]], ids[u["prompt_tokens"]:]

    import mlx.core as mx
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler
    from mlx_lm.utils import load

    model, tok = load(str(model_dir))[:2]
    model.set_dtype(mx.float32)
    last: Any = None
    out: list[int] = []
    for r in stream_generate(model, tok, mx.array(prompt), max_tokens=u["completion_tokens"],
                             sampler=make_sampler(0.0), prefill_step_size=512):
        out.append(int(r.token))
        last = r
    kvd_prefill = u["prefill_tokens"] / (u["prefill_ms"] / 1000)
    print(f"\nprompt {len(prompt)} tokens, {u['completion_tokens']} generated "
          f"(mlx-lm: {len(out)}; same tokens: {out == kvd_out[:len(out)]})")
    print("| | prefill | decode | TTFT |")
    print("| --- | ---: | ---: | ---: |")
    print(f"| kvd (`kvd serve`, websocket) | {kvd_prefill:.0f} tok/s | {u['decode_tps']:.1f} tok/s | "
          f"{ttft:.0f} ms |")
    print(f"| mlx-lm `stream_generate`, in process | {last.prompt_tps:.0f} tok/s | "
          f"{last.generation_tps:.1f} tok/s | {len(prompt) / last.prompt_tps * 1000:.0f} ms |")


def resume(data: Path, model_dir: Path, history: int, settle: float = 0.0) -> None:
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    d = DaemonProcess(data, "--model", MODEL)
    try:
        with d.client() as c:
            sid = c.request("session.create")["session"]["id"]
            _, first, _ = chat_timed(c, sid, "Read this.\n\n" + text_of(tokenizer, history - 100), max_tokens=48)
            _, second, same = chat_timed(c, sid, "What did the clerks count?", max_tokens=40)
    finally:
        d.terminate()
    held = second["usage"]["prompt_tokens"] + second["usage"]["completion_tokens"]
    cold = data.parent / "cold"
    shutil.copytree(data, cold, copy_function=os.link)
    shutil.rmtree(cold / "cache")  # no cache on disk: the next turn prefills the whole history
    print(f"\nconversation of {held} tokens; its next turn in the same process, then after a restart:")
    print("| next turn | restored from | prefilled | TTFT (client) |")
    print("| --- | --- | ---: | ---: |")
    v = second["usage"]
    print(f"| same process (the turn that built it) | {v['restored_from']} ({v['restored_tokens']} tok) | "
          f"{v['prefill_tokens']} tok | {same:.0f} ms |")
    for label, where in (("after a restart, kvd's disk cache", data), ("after a restart, cache deleted", cold)):
        d = DaemonProcess(where, "--model", MODEL)
        try:
            with d.client() as c:
                time.sleep(settle)
                _, done, ttft = chat_timed(c, sid, "And what did they write down?", max_tokens=8)
        finally:
            d.terminate()
        u = done["usage"]
        print(f"| {label} | {u['restored_from']} ({u['restored_tokens']} tok) | {u['prefill_tokens']} tok | "
              f"{ttft:.0f} ms |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--history", type=int, default=2048)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a built-in model or any --model kvd serve takes")
    ap.add_argument("--parts", nargs="+", choices=("speed", "resume"), default=["speed", "resume"])
    ap.add_argument("--settle", type=float, default=0.0,
                    help="seconds between a restarted kvd's ready and the next turn (a person's pause)")
    args = ap.parse_args()
    global MODEL
    MODEL = args.model
    print(f"before: {uptime()}")
    print(BLAS.reason)
    store = Path(tempfile.gettempdir()) / "kvd-bench-real" / "models"
    model_dir = prepare_model(MODEL, store)  # fetched and converted once, kept across runs
    weights = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    print(f"model {MODEL}: weights {weights / 1e6:.0f} MB (float32) in {model_dir}")
    with tempfile.TemporaryDirectory(prefix="kvd-bench-real-") as tmp:
        for name in ("speed", "resume"):
            shutil.copytree(store, Path(tmp) / name / "kvd" / "models", copy_function=os.link)
        if "speed" in args.parts:
            speed(Path(tmp) / "speed" / "kvd", model_dir, args.prompt_tokens, args.max_tokens)
        if "resume" in args.parts:
            resume(Path(tmp) / "resume" / "kvd", model_dir, args.history, args.settle)
    print(f"\nafter: {uptime()}")


if __name__ == "__main__":
    main()
