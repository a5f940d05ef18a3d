"""What a model's first use costs in a running daemon: the request that loads it, against the next one.

Run: .venv/bin/python bench/firstuse.py [--models builtin:tiny-swa builtin:smollm2] [--rounds 3]

A real `kvd serve` on builtin:tiny (the default, loaded at start) is asked, in a
fresh session each, for every model of --models by name: the first request
loads that model (prepared already: the fetch and the GGUF conversion are done
once, before, into the bench's model store, as `kvd models pull` would), the
second finds it loaded. Client-side TTFT of both (request sent to first delta,
a 16-token message, greedy), and the daemon's own "loaded in" line. Each round
is a fresh daemon and data directory. `uptime` before and after: other work on
the machine shows in it.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import daemonproc  # noqa: E402
from daemon.models.sources import prepare_model  # noqa: E402
from daemonproc import DaemonProcess, SyncClient  # noqa: E402

daemonproc.EVENT_TIMEOUT = 300.0
STORE = Path(tempfile.gettempdir()) / "kvd-bench-real" / "models"  # bench/realmodel.py's store


def ttft(c: SyncClient, model: str) -> float:
    """A new session on `model`, one short greedy turn: ms from the request to its first delta."""
    sid = c.request("session.create", model=model)["session"]["id"]
    t0 = time.perf_counter()
    rid = c.send(type="chat.send", session=sid, text="Hello, who are you today?", temperature=0, max_tokens=4)
    first = None
    while True:
        e = c.recv()
        if e.get("id") != rid:
            continue
        if e["type"] == "chat.delta" and first is None:
            first = (time.perf_counter() - t0) * 1000
        elif e["type"] == "chat.done":
            return first if first is not None else float("nan")
        elif e["type"] == "error":
            raise SystemExit(f"kvd: {e}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["builtin:tiny-swa", "builtin:smollm2"])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print("before:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    for model in args.models:
        prepare_model(model, STORE)  # fetched and converted once, kept across runs
    print("| model | first request (loads it) | next request | kvd's log: loaded in |")
    print("| --- | ---: | ---: | ---: |")
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="kvd-bench-firstuse-") as tmp:
            data = Path(tmp) / "kvd"
            shutil.copytree(STORE, data / "models", copy_function=os.link)
            d = DaemonProcess(data, "--model", "builtin:tiny")
            try:
                with d.client() as c:
                    for model in args.models:
                        first, then = ttft(c, model), ttft(c, model)
                        log = "".join(d.log)
                        m = re.search(rf"model {re.escape(model)} loaded in ([\d.]+) s", log)
                        print(f"| {model} | {first:.0f} ms | {then:.0f} ms | {m.group(1) if m else '?'} s |",
                              flush=True)
            finally:
                d.terminate()
    print("after:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
