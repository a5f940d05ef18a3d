"""Two models under one pair of memory budgets: where resumes come from, what the caches hold, peak RSS.

Run: .venv/bin/python bench/shared_budgets.py [--sessions 20] [--rounds 2] [--resident-mib 16] [--warm-mib 8]

A real `kvd serve` on builtin:tiny, with builtin:tiny-swa loaded on first use,
and --sessions conversations, every other one on each model, each sent one
long message (about 1,050 tokens) per round, in turn, greedy, 16 tokens out.
The budgets every loaded model shares (docs/caches.md) are set in the daemon's
config. Printed: each round's turns by where their cache came from, the
seconds they took together, the bytes each model holds in each budget at the
end (`status`'s `budgets`, and disk's `by_model`), and the daemon's peak RSS
(VmHWM, Linux). `uptime` before and after: other work on the machine shows
in it.
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from daemonproc import DaemonProcess  # noqa: E402

MODELS = ("builtin:tiny", "builtin:tiny-swa")
MiB = 1 << 20
LONG = "tell me about the weather, the sea and the hills. " * 60  # ~1,050 tokens of builtin:tiny's


def peak_rss(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM"):
            return f"{int(line.split()[1]) / 1024:.0f} MiB"
    return "?"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--resident-mib", type=int, default=16)
    ap.add_argument("--warm-mib", type=int, default=8)
    args = ap.parse_args()
    print("before:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    with tempfile.TemporaryDirectory(prefix="kvd-bench-budgets-") as tmp:
        config = Path(tmp) / "kvd.toml"
        config.write_text(f"[cache]\nprefetch = false\nresident_bytes = {args.resident_mib * MiB}\n"
                          f"warm_bytes = {args.warm_mib * MiB}\n")
        d = DaemonProcess(Path(tmp) / "kvd", "--config", str(config), "--model", MODELS[0])
        try:
            with d.client() as c:
                ids = [c.request("session.create", model=MODELS[i % 2])["session"]["id"]
                       for i in range(args.sessions)]
                print("| round | turns from (tier: count) | seconds |")
                print("| --- | --- | ---: |")
                for r in range(args.rounds):
                    where: collections.Counter[str] = collections.Counter()
                    t0 = time.perf_counter()
                    for i, sid in enumerate(ids):
                        text = f"Conversation {i}, round {r}: " + LONG
                        _, done = c.chat(sid, text, max_tokens=16, temperature=0)
                        assert done["type"] == "chat.done", done
                        where[done["usage"]["restored_from"]] += 1
                    tiers = ", ".join(f"{k}: {n}" for k, n in sorted(where.items()))
                    print(f"| {r + 1} | {tiers} | {time.perf_counter() - t0:.1f} |", flush=True)
                status = c.request("status")
            held = {**status["budgets"], "disk": status["tiers"]["disk"]}
            for tier, t in held.items():
                each = ", ".join(f"{m} {n / MiB:.1f}" for m, n in sorted(t["by_model"].items()))
                print(f"{tier}: {t['bytes'] / MiB:.1f} MiB of {t['budget'] / MiB:.0f} MiB ({each})")
            print("peak RSS:", peak_rss(d.proc.pid))
        finally:
            d.terminate()
    print("after:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
