"""Which sampling defaults suit the default model: how often its answer holds a plain fact.

Run: .venv/bin/python bench/sampling.py [--model builtin:smollm2] [--samples 8] [--max-tokens 40]

A real `kvd serve` on the model, asked five plain questions through the
official `openai` client, `--samples` times each, at each (temperature,
top_p) pair of `--settings`; an answer counts when it contains the fact
(a regular expression per question). The model's files are kept in
$TMPDIR/kvd-bench-real/models across runs (as bench/realmodel.py keeps them).

config.toml's [generation] defaults come from this: on SmolLM2-135M, 30 and
28 of 40 at 0.2/0.9 against 20 and 23 of 40 at 0.7/1.0 (two runs, 2026-11-25;
docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import openai  # noqa: E402

from daemon.models.sources import DEFAULT_MODEL, prepare_model  # noqa: E402
from daemonproc import DaemonProcess  # noqa: E402

QUESTIONS = [
    ("What is the capital of France?", r"paris"),
    ("How many legs does a spider have?", r"\beight\b|\b8\b"),
    ("What color is the sky on a clear day?", r"\bblue\b"),
    ("What is 2 + 3?", r"\bfive\b|\b5\b"),
    ("Who wrote Romeo and Juliet?", r"shakespeare"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--samples", type=int, default=8, help="answers per question and setting")
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--settings", nargs="+", default=["0.7/1.0", "0.2/0.9", "0/1.0"],
                    help="temperature/top_p pairs")
    args = ap.parse_args()
    store = Path(tempfile.gettempdir()) / "kvd-bench-real" / "models"
    prepare_model(args.model, store)  # fetched once, kept across runs
    with tempfile.TemporaryDirectory(prefix="kvd-bench-sampling-") as tmp:
        data = Path(tmp) / "kvd"
        shutil.copytree(store, data / "models", copy_function=os.link)
        d = DaemonProcess(data, "--model", args.model)
        try:
            api = openai.OpenAI(base_url=d.base_url, api_key=d.token)
            for setting in args.settings:
                temperature, top_p = (float(x) for x in setting.split("/"))
                samples = 1 if temperature == 0 else args.samples  # greedy: one answer each
                right = 0
                for question, fact in QUESTIONS:
                    for _ in range(samples):
                        r = api.chat.completions.create(
                            model=args.model, messages=[{"role": "user", "content": question}],
                            temperature=temperature, top_p=top_p, max_tokens=args.max_tokens)
                        answer = r.choices[0].message.content or ""
                        if re.search(fact, answer, re.IGNORECASE):
                            right += 1
                        else:
                            print(f"  {setting}: {question!r} -> {answer[:90]!r}", flush=True)
                print(f"temperature {temperature} top_p {top_p}: {right}/{samples * len(QUESTIONS)} answers "
                      "hold the fact", flush=True)
        finally:
            d.terminate()


if __name__ == "__main__":
    main()
