"""What each kind of rewind recomputes on a hybrid model, next to a plain-attention model of the same size.

Run: .venv/bin/python bench/hybrid.py [--history 2048] [--hidden 256] [--layers 8] [--reps 3]

Two random-weight models built from mlx-lm's own classes (tests/hybrids.py),
the same hidden size, layers, heads and MLP: Qwen3.5 (Gated DeltaNet linear
attention in three layers of four, full attention in the fourth) and Qwen3
(full attention in every layer). Each is served by a real `kvd serve`
(kvd's defaults, prefetch off so a restart restores on demand), which
holds one conversation of about --history tokens (a long system prompt and
long messages, 16-token greedy answers). Then, one after another:

- next turn: a new message (the cache as it was);
- regenerate: the last answer again (a hybrid comes back to the checkpoint
  at its prompt's end less one token);
- edit last: the last message edited (the checkpoint at the answer before it);
- edit earlier: a message halfway back edited (further back than the checkpoints
  memory keeps: disk's segment ends and block ends);
- API branch: over the OpenAI door, the same conversation diverging at its
  last message (a new session, from the first one's checkpoints);
- second conversation: the same system prompt, another first message
  (blocks of the first conversation's prefill);
- after restart: kvd stopped and started, the next message (from disk);
- regenerate after restart.

With --forwards, it measures instead what speculation would pay for and what
the checkpoint at a prompt's end costs: on each model, in this process, after
a 2,000-token prefill, a forward of 1 token and one of 5 (a draft of 4
verified at once), and a 235-token message read in one chunk and in two (all
but its last token, then that one), the median of 20 each.

Per kind, the median over --reps runs (each run a fresh daemon and data
directory): where the cache came from, tokens restored, whether at a
checkpoint, tokens computed again (the prompt's rest), and kvd's TTFT (from
the turn's start to its first token: the restore and the recompute).
`uptime` before and after (this machine may be shared).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import daemonproc  # noqa: E402
import hybrids  # noqa: E402
from daemonproc import DaemonProcess, SyncClient  # noqa: E402

daemonproc.EVENT_TIMEOUT = 600.0
ANSWER = 16
# This tokenizer (the built-in models') takes about 1.8 tokens a word of these.
SYSTEM_WORDS, SYSTEM_TOKENS = 160, 290
MESSAGE_WORDS, MESSAGE_TOKENS = 120, 235  # with the answer and the turn's template: ~250
WORDS = ("the keeper wrote down every ship that passed the weather at dawn and the colour of the sea in a ledger his "
         "grandfather had started long before the light was built").split()
KINDS = ("next turn", "regenerate", "edit last", "edit earlier", "API branch", "second conversation",
         "after restart", "regenerate after restart")


def text(words: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 7 + i) % len(WORDS)] for i in range(words))


def shapes(hidden: int, layers: int) -> dict[str, dict[str, Any]]:
    """The two models: the same hidden size, layers, heads and MLP; one hybrid, one plain attention."""
    heads = hidden // 32
    common = {"hidden_size": hidden, "num_hidden_layers": layers, "intermediate_size": 3 * hidden,
              "num_attention_heads": heads, "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-6,
              "max_position_embeddings": 32768, "tie_word_embeddings": False}
    return {
        "qwen3_5": {**common, "linear_num_value_heads": heads, "linear_num_key_heads": 2,
                    "linear_key_head_dim": 32, "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4,
                    "full_attention_interval": 4,
                    "rope_parameters": {"type": "default", "mrope_section": [4, 2, 2], "rope_theta": 100000,
                                        "partial_rotary_factor": 0.5}},
        "qwen3": {**common, "rope_theta": 100000.0},
    }


def turn(c: SyncClient, type: str, sid: str, **fields: Any) -> dict[str, Any]:
    rid = c.send(type=type, session=sid, max_tokens=ANSWER, temperature=0, **fields)
    while (e := c.recv())["id"] != rid or e["type"] not in ("chat.done", "error"):
        pass
    assert e["type"] == "chat.done", e
    return dict(e["usage"])


def figures(u: dict[str, Any]) -> dict[str, Any]:
    return {"from": u["restored_from"], "restored": u["restored_tokens"], "checkpoint": bool(u.get("checkpoint")),
            "recomputed": u["prefill_tokens"], "prefill_ms": u["prefill_ms"] or 0.0, "ttft_ms": u["ttft_ms"] or 0.0}


def one_run(model: Path, work: Path, history: int) -> dict[str, dict[str, Any]]:
    from openai import OpenAI

    data = work / "kvd"
    work.mkdir(parents=True)
    system = text(SYSTEM_WORDS, 1)
    messages = max(2, (history - SYSTEM_TOKENS) // MESSAGE_TOKENS)
    out: dict[str, dict[str, Any]] = {}
    d = DaemonProcess(data, "--model", str(model))
    try:
        with d.client() as c:
            sid = c.request("session.create", system=system)["session"]["id"]
            for i in range(messages):
                turn(c, "chat.send", sid, text=text(MESSAGE_WORDS, i + 2))
            out["next turn"] = figures(turn(c, "chat.send", sid, text=text(MESSAGE_WORDS, 90)))
            out["regenerate"] = figures(turn(c, "chat.regenerate", sid))
            last = 2 * messages  # the index of the last user message
            out["edit last"] = figures(turn(c, "chat.edit", sid, message_index=last, text=text(MESSAGE_WORDS, 91)))
            other = c.request("session.create", system=system)["session"]["id"]
            out["second conversation"] = figures(turn(c, "chat.send", other, text=text(MESSAGE_WORDS, 92)))
        api = OpenAI(base_url=d.base_url, api_key=d.token, max_retries=0)
        convo: list[Any] = [{"role": "system", "content": system}]
        for i in range(messages):
            convo.append({"role": "user", "content": text(MESSAGE_WORDS, i + 2)})
            r = api.chat.completions.create(model="kvd", messages=convo, max_tokens=ANSWER, temperature=0)
            convo.append({"role": "assistant", "content": r.choices[0].message.content or ""})
        convo[-2] = {"role": "user", "content": text(MESSAGE_WORDS, 93)}
        r = api.chat.completions.create(model="kvd", messages=convo[:-1], max_tokens=ANSWER, temperature=0)
        assert r.usage is not None and r.usage.model_extra is not None
        kvd = r.usage.model_extra["kvd"]
        details = r.usage.prompt_tokens_details
        cached = details.cached_tokens if details is not None and details.cached_tokens is not None else 0
        out["API branch"] = {"from": kvd["restored_from"], "restored": cached, "checkpoint": bool(kvd["checkpoint"]),
                             "recomputed": kvd["prefill_tokens"], "prefill_ms": None, "ttft_ms": kvd["ttft_ms"]}
        with d.client() as c:
            halfway = 2 * (messages // 2)  # a user message halfway back
            edit = turn(c, "chat.edit", sid, message_index=halfway, text=text(MESSAGE_WORDS, 94))
            out["edit earlier"] = figures(edit)
            c.request("status")  # (the writes behind the turns are on disk)
    finally:
        d.terminate()
    d = DaemonProcess(data, "--model", str(model))
    try:
        with d.client() as c:
            out["after restart"] = figures(turn(c, "chat.send", sid, text=text(MESSAGE_WORDS, 95)))
            out["regenerate after restart"] = figures(turn(c, "chat.regenerate", sid))
    finally:
        d.terminate()
    return out


def forwards(model_dir: Path, context: int = 2000, draft: int = 4, reps: int = 20) -> tuple[float, ...]:
    """Milliseconds of a 1-token forward, of a (1 + draft)-token one, of a 235-token message's prefill in one
    chunk and in two (234 tokens, then the last one: where kvd stops to keep a checkpoint), after `context`
    tokens, each taken back after (the KV layers trimmed, the recurrent ones restored from a checkpoint: kvd's
    own rewind)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load

    from cachestore.snapshot import checkpoint, rewind_to
    from daemon.engine import attention

    model = load(str(model_dir))[0]
    model.set_dtype(mx.float32)
    attention.install()
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[5 + i % 1500 for i in range(context)]]), cache=cache))
    point = checkpoint(cache, context)

    def timed(*chunks: int) -> float:
        nonlocal cache
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for n in chunks:
                mx.eval(model(mx.array([[7] * n]), cache=cache))
            times.append((time.perf_counter() - t0) * 1000)
            cache = rewind_to(cache, point)
        return statistics.median(times)

    return timed(1), timed(1 + draft), timed(MESSAGE_TOKENS), timed(MESSAGE_TOKENS - 1, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--history", type=int, default=2048, help="tokens of the conversation before the rewinds")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--forwards", action="store_true", help="measure a 1- and a 5-token forward instead")
    args = ap.parse_args()
    print(f"uptime before: {os.getloadavg()}, {os.cpu_count()} CPUs")
    if args.forwards:
        from daemon.service.blas import preload_blas

        print(preload_blas("auto").reason)  # before MLX is imported, as kvd serve does: the same kernels
        with tempfile.TemporaryDirectory(prefix="kvd-bench-hybrid-") as tmp:
            for arch, config in shapes(args.hidden, args.layers).items():
                one, five, whole, split = forwards(hybrids.build(arch, Path(tmp) / arch, config=config))
                print(f"{arch}: after 2,000 tokens, a 1-token forward {one:.1f} ms, a 5-token forward {five:.1f} ms "
                      f"({five / one:.1f}x); a {MESSAGE_TOKENS}-token message in one chunk {whole:.1f} ms, "
                      f"stopping before its last token {split:.1f} ms")
        print(f"uptime after: {os.getloadavg()}")
        return
    with tempfile.TemporaryDirectory(prefix="kvd-bench-hybrid-") as tmp:
        results: dict[str, list[dict[str, dict[str, Any]]]] = {}
        for arch, config in shapes(args.hidden, args.layers).items():
            model = hybrids.build(arch, Path(tmp) / "models" / arch, config=config)
            results[arch] = [one_run(model, Path(tmp) / f"{arch}-{k}", args.history) for k in range(args.reps)]
    print(f"uptime after: {os.getloadavg()}")
    print(f"\nhidden {args.hidden}, {args.layers} layers, ~{args.history}-token conversation, "
          f"medians of {args.reps} runs; restored / recomputed in tokens, times in ms\n")
    archs = list(results)
    print("| rewind | " + " | ".join(f"{a}: from, restored, recomputed, TTFT ms" for a in archs) + " |")
    print("| --- | " + " | ".join("---" for _ in archs) + " |")
    for kind in KINDS:
        cells = []
        for a in archs:
            runs = [r[kind] for r in results[a]]
            med = {k: statistics.median(r[k] for r in runs) for k in ("restored", "recomputed", "ttft_ms")}
            where = runs[0]["from"] + (" (checkpoint)" if runs[0]["checkpoint"] else "")
            cells.append(f"{where}, {med['restored']:.0f}, {med['recomputed']:.0f}, {med['ttft_ms']:.0f}")
        print(f"| {kind} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
