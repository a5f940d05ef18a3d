"""Speculative decoding on the real default model: decode tok/s with and without it, per task.

Run: .venv/bin/python bench/speculate.py [--max-tokens 192] [--tasks rewrite,typos,regenerate,chat,concurrent]
                                         [--model builtin:smollm2 | PATH]

On any device (speculation is forced on as `[decode] speculate = "auto"` drafts, whatever the
device's policy): the last line is the figure daemon/device.py's SPECULATION_MEASURED keeps for
the device's kind, the median of the tasks' speedups, and what "auto" should do there. A model
with random weights (bench/llamas.py, where no hub is reachable) still answers `regenerate`
exactly as it did (greedy): its drafts are all right, the best case; `chat` is the worst.

One kvd engine (the real engine thread's code, driven step by step in this
process, greedy) loads SmolLM2-135M-Instruct once; every task runs twice in
the same run, speculation off then on (`[decode] speculate`), each turn in a
fresh session so neither reuses the other's cache. Reported per task: decode
tok/s off and on (the Done event's `decode_tps`: tokens after the first over
the time since the first), the speedup, the drafted and accepted tokens, the
acceptance rate, the mean draft length k, and whether the two answers are the
same tokens (they must be: greedy speculation is exact).

The tasks (the issue's): rewrite a 60-line function with one variable
renamed; repeat a paragraph fixing its typos; regenerate a long answer (the
first answer is made with speculation off, then the same prompt is answered
again off and on: the regenerate drafts from the answer it replaces); plain
open-ended chat; four sessions decoding at once (two repeating, two open
chat), aggregate tok/s = all their tokens over the wall time from the first
token to the last answer's end.

The machine is shared: `uptime` is printed before and after, and A/B are
measured back to back within one run so both see the same load.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from daemon.service.blas import preload_blas  # noqa: E402

BLAS = preload_blas()

from common.ids import new_session_id  # noqa: E402
from daemon.config import load_config  # noqa: E402
from daemon.engine import speculate  # noqa: E402
from daemon.engine.jobs import Done, EngineEvent  # noqa: E402
from daemon.engine.running import Answer  # noqa: E402
from daemon.engine.thread import Engine  # noqa: E402
from daemon.events import AnswerDelta, AnswerError  # noqa: E402
from daemon.models.sources import DEFAULT_MODEL, prepare_model  # noqa: E402
from daemon.prompt import prompt_tokens  # noqa: E402
from protocol.shapes import Sampling  # noqa: E402

FUNCTION = '''def summarize_orders(orders, customers, tax_rate, discount_codes):
    """Build a per-customer summary of the given orders."""
    summary = {}
    for order in orders:
        customer_id = order["customer_id"]
        if customer_id not in customers:
            continue
        customer = customers[customer_id]
        if customer_id not in summary:
            summary[customer_id] = {
                "name": customer["name"],
                "email": customer["email"],
                "orders": 0,
                "items": 0,
                "subtotal": 0.0,
                "discount": 0.0,
                "tax": 0.0,
                "total": 0.0,
            }
        entry = summary[customer_id]
        entry["orders"] += 1
        subtotal = 0.0
        for item in order["items"]:
            quantity = item["quantity"]
            price = item["price"]
            entry["items"] += quantity
            subtotal += quantity * price
        discount = 0.0
        code = order.get("discount_code")
        if code is not None and code in discount_codes:
            rule = discount_codes[code]
            if rule["kind"] == "percent":
                discount = subtotal * rule["value"] / 100.0
            elif rule["kind"] == "fixed":
                discount = min(subtotal, rule["value"])
        taxable = subtotal - discount
        tax = taxable * tax_rate
        entry["subtotal"] += subtotal
        entry["discount"] += discount
        entry["tax"] += tax
        entry["total"] += taxable + tax
    for customer_id, entry in summary.items():
        entry["subtotal"] = round(entry["subtotal"], 2)
        entry["discount"] = round(entry["discount"], 2)
        entry["tax"] = round(entry["tax"], 2)
        entry["total"] = round(entry["total"], 2)
        if entry["orders"] > 0:
            entry["average"] = round(entry["total"] / entry["orders"], 2)
        else:
            entry["average"] = 0.0
    ranked = sorted(
        summary.items(),
        key=lambda pair: pair[1]["total"],
        reverse=True,
    )
    result = []
    for customer_id, entry in ranked:
        entry["customer_id"] = customer_id
        result.append(entry)
    return result
'''

TYPOS = ("The river town kept its recods in a stone house by the bridge. Every sprng the clerks "
         "copied the old ledgers, counted the boats that came up from the cost, and wrote down the "
         "price of salt, wool and timbre. Travellers said the town was quite, but its books were "
         "full. In the long winter the clerks read the ledgers again by candle light, and each year "
         "they found a few more mistakes in the sums their grandfathers had made.")

TASKS = {
    "rewrite": "Rewrite this function with the variable `entry` renamed to `row`. "
               "Output only the code.\n\n" + FUNCTION,
    "typos": "Repeat this paragraph exactly, fixing only the spelling mistakes:\n\n" + TYPOS,
    "regenerate": "Write a detailed explanation of how a bicycle works: the frame, the wheels, the "
                  "chain, the gears and the brakes, with a paragraph for each.",
    "chat": "What would you do with a free afternoon in a city you have never visited?",
}
CONCURRENT = ["rewrite", "typos", "chat", "regenerate"]


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


class Turn:
    """One submitted job and what came back."""

    def __init__(self, engine: Engine, session: str, text: str, max_tokens: int):
        self.events: list[EngineEvent] = []
        self.first_delta: float | None = None
        self.ended: float | None = None
        tokens, retokenized = prompt_tokens(engine.tokenizer, [{"role": "user", "content": text}], None, [],
                                            fed_covers=0)  # as the turn core's tokenizer stage does
        engine.submit(Answer(session_id=session, tokens=tokens, retokenized=retokenized,
                              fed_before=0, sampling=Sampling.of(max_tokens, 0.0, 1.0),
                              emit=self.emit))

    def emit(self, e: EngineEvent) -> None:
        now = time.perf_counter()
        if isinstance(e, AnswerDelta) and self.first_delta is None:
            self.first_delta = now
        if isinstance(e, (Done, AnswerError)):
            self.ended = now
        self.events.append(e)

    @property
    def done(self) -> Done | None:
        last = self.events[-1] if self.events else None
        if isinstance(last, AnswerError):
            raise SystemExit(f"kvd: {last}")
        return last if isinstance(last, Done) else None


def run(engine: Engine, turns: list[Turn]) -> list[Done]:
    while any(t.done is None for t in turns):
        engine.step()
    return [t.done for t in turns if t.done is not None]


def with_speculation(engine: Engine, mode: str) -> None:
    engine.config = replace(engine.config, speculate=mode)


SPEEDUPS: list[float] = []  # each task's, for the verdict


def row(name: str, off: list[Done], on: list[Done], tps_off: float, tps_on: float, k: list[float]) -> str:
    drafted = sum(d.usage["drafted_tokens"] for d in on)
    accepted = sum(d.usage["accepted_tokens"] for d in on)
    same = all(a.tokens == b.tokens for a, b in zip(off, on))
    tokens = sum(d.usage["completion_tokens"] for d in on)
    rate = f"{accepted / drafted:.0%}" if drafted else "-"
    mean_k = f"{sum(k) / len(k):.1f}" if k else "-"
    SPEEDUPS.append(tps_on / tps_off)
    return (f"| {name} | {tokens} | {tps_off:.1f} | {tps_on:.1f} | {tps_on / tps_off:.2f}x | "
            f"{accepted}/{drafted} | {rate} | {mean_k} | {'yes' if same else 'NO'} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--tasks", default="rewrite,typos,regenerate,chat,concurrent")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a model kvd serves (a built-in name or a path)")
    args = ap.parse_args()
    model = args.model
    print(f"before: {uptime()}")
    print(BLAS.reason)
    store = Path(tempfile.gettempdir()) / "kvd-bench-real" / "models"
    if not Path(model).is_dir():
        prepare_model(model, store)  # fetched and converted once, kept across runs

    ks: list[float] = []
    usage = speculate.Speculation.usage

    def usage_with_k(self: speculate.Speculation) -> dict[str, Any]:
        if self.mean_k is not None:
            ks.append(self.mean_k)
        return usage(self)

    speculate.Speculation.usage = usage_with_k  # type: ignore[method-assign]  # the bench's k column

    with tempfile.TemporaryDirectory(prefix="kvd-bench-spec-") as tmp:
        data = Path(tmp) / "kvd"
        shutil.copytree(store, data / "models", copy_function=os.link)
        engine = Engine(load_config(None, data_dir=data, model=model, resident_idle=3600.0),
                        Path(model) if Path(model).is_dir() else None)
        engine.load()
        n = args.max_tokens
        print(f"\n{model} on {engine.device}, greedy, max_tokens {n}; tok/s = decode_tps (after the first token)\n")
        print("| task | tokens | off tok/s | on tok/s | speedup | accepted/drafted | rate | mean k | same answer |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
        notes: list[str] = []
        for name in args.tasks.split(","):
            ks.clear()
            if name == "concurrent":
                result = {}
                for mode in ("off", "auto"):
                    with_speculation(engine, mode)
                    turns = [Turn(engine, new_session_id(), TASKS[t], n) for t in CONCURRENT]
                    dones = run(engine, turns)
                    start = min(t.first_delta or 0.0 for t in turns)
                    end = max(t.ended or 0.0 for t in turns)
                    tps = sum(d.usage["completion_tokens"] for d in dones) / (end - start)
                    result[mode] = (dones, tps)
                print(row("4 sessions at once (aggregate)", result["off"][0], result["auto"][0],
                          result["off"][1], result["auto"][1], ks), flush=True)
                each = {m: [d.usage["decode_tps"] for d in result[m][0]] for m in result}
                notes.append("4 sessions, each session's tok/s off -> on: " + ", ".join(
                    f"{t} {a} -> {b}" for t, a, b in zip(CONCURRENT, each["off"], each["auto"])))
                continue
            single: dict[str, Done] = {}
            for mode in ("off", "auto"):
                with_speculation(engine, mode)
                session = new_session_id()
                if name == "regenerate":
                    with_speculation(engine, "off")
                    run(engine, [Turn(engine, session, TASKS[name], n)])  # the answer to regenerate
                    with_speculation(engine, mode)
                (single[mode],) = run(engine, [Turn(engine, session, TASKS[name], n)])
            off, on = single["off"], single["auto"]
            print(row(name, [off], [on], off.usage["decode_tps"], on.usage["decode_tps"], ks), flush=True)
        for note in notes:
            print(f"\n{note}")
        if SPEEDUPS:
            import statistics

            from daemon.device import current

            kind = current().device.kind
            mid = statistics.median(SPEEDUPS)
            print(f"\nverdict for daemon/device.py's SPECULATION_MEASURED[{kind!r}]: median speedup {mid:.2f}x over "
                  f"{len(SPEEDUPS)} tasks: \"auto\" should {'draft' if mid > 1.0 else 'not draft'} on {engine.device}")
        assert engine.caches is not None
        engine.caches.close()
    print(f"\nafter: {uptime()}")


if __name__ == "__main__":
    main()
