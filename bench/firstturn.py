"""The first turn after a start against the same turn in a running daemon, its cache prefetched.

Run: .venv/bin/python bench/firstturn.py [--model builtin:smollm2] [--history 2048] [--new 95]
                                         [--restarts 4] [--turns 4]

A real `kvd serve` (kvd's defaults: prefetch on) holds one conversation of
about --history tokens, built by long messages. Then, --restarts
times: kvd is stopped and started, the bench waits until the start's prefetch
has paged the conversation back into memory (a user coming back a moment
after the start, not racing it), and sends the next message (about --new
tokens, a 4-token greedy answer): the *first turn*; then --turns more
messages of the same size: *running turns*. Each cycle's ratio is its first
turn over the median of its running turns, so the ratio is measured within one
daemon's life and the machine's other work weighs on both sides alike.

Per turn: kvd's own TTFT (from the turn core starting the turn to its first
token), its prefill (from the engine taking the turn), where the cache came
from, and the page faults the daemon took during the turn (every thread:
/proc/PID/stat's minflt): fresh memory touched for the first time costs this
project's VM ~0.7 ms a MB, so a turn that faults in tens of MB shows it.

Models come from the bench's model store (bench/realmodel.py's, fetched and
converted once); `uptime` is printed before and after.
"""

from __future__ import annotations

import argparse
import os
import shutil
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

import daemonproc  # noqa: E402
from daemon.models.sources import prepare_model  # noqa: E402
from daemonproc import DaemonProcess, SyncClient  # noqa: E402

daemonproc.EVENT_TIMEOUT = 300.0
STORE = Path(tempfile.gettempdir()) / "kvd-bench-real" / "models"  # bench/realmodel.py's store
WORDS = ("the engine keeps each conversation's cache between turns so the next message reads only its own "
         "tokens and a restart pages the cache back before anyone asks").split()


def text(tokens: int, seed: int) -> str:
    """About `tokens` tokens of plain words (a word is about a token on these tokenizers)."""
    return " ".join(WORDS[(seed * 7 + i) % len(WORDS)] for i in range(tokens))


def minflt(pid: int) -> int:
    """The process's minor page faults so far, all threads (proc(5): field 10 of /proc/PID/stat)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[7])


def cpu_ms(pid: int) -> float:
    """CPU time the process's threads have run so far, in ms (proc(5): /proc/PID/task/*/schedstat)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):  # a thread that ended meanwhile
            continue
    return total / 1e6


def turn(d: DaemonProcess, c: SyncClient, sid: str, words: str) -> dict[str, Any]:
    """One greedy 4-token turn: kvd's figures for it, with the daemon's page faults and CPU time during it."""
    f0, c0 = minflt(d.proc.pid), cpu_ms(d.proc.pid)
    t0 = time.perf_counter()
    _, done = c.chat(sid, words, temperature=0, max_tokens=4)
    if done["type"] != "chat.done":
        raise SystemExit(f"kvd: {done}")
    u = dict(done["usage"])
    u["client_ms"] = (time.perf_counter() - t0) * 1000
    c.request("status")  # the turn's write-behind is done before the faults are read
    u["faults"] = minflt(d.proc.pid) - f0
    u["cpu_ms"] = cpu_ms(d.proc.pid) - c0
    return u


def started(data: Path, model: str, *, restart: bool) -> DaemonProcess:
    d = DaemonProcess(data, "--model", model, prefetch=True)
    with d.client() as c:
        deadline = time.monotonic() + 300
        while restart and c.request("status")["prefetched"].get("sessions", 0) < 1:
            if time.monotonic() > deadline:
                raise SystemExit("kvd's prefetch did not finish within 300 s")
            time.sleep(0.05)
    return d


def row(kind: str, u: dict[str, Any]) -> str:
    return (f"  {kind:>7}: TTFT {u['ttft_ms']:7.1f} ms (prefill {u['prefill_ms']:7.1f} ms, restore "
            f"{u['restore_ms']:5.1f} ms), {u['prefill_tokens']:4d} new over {u['restored_tokens']:5d}, "
            f"from {u['restored_from']}, {u['faults']:6d} page faults, CPU {u['cpu_ms']:6.0f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin:smollm2")
    ap.add_argument("--history", type=int, default=2048)
    ap.add_argument("--new", type=int, default=95)
    ap.add_argument("--restarts", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    args = ap.parse_args()
    print("before:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(), flush=True)
    prepare_model(args.model, STORE)
    ratios, cpu, faults = [], [], []
    with tempfile.TemporaryDirectory(prefix="kvd-bench-firstturn-") as tmp:
        data = Path(tmp) / "kvd"
        shutil.copytree(STORE, data / "models", copy_function=os.link)
        d = started(data, args.model, restart=False)
        try:
            with d.client() as c:
                sid = c.request("session.create")["session"]["id"]
                held = words = 0
                while held < args.history:  # a message is at most 32,000 characters
                    n = min(2000, int((args.history - held) * (words / held if held else 0.7)) + 1)
                    u = turn(d, c, sid, text(n, held))
                    held, words = u["context_tokens"], words + n
                per_token = words / held
                print(f"history: {held} tokens", flush=True)
                before = [turn(d, c, sid, text(int(args.new * per_token), i)) for i in range(args.turns)]
                print(f"before any restart: running turns' median "
                      f"{statistics.median(u['ttft_ms'] for u in before):.1f} ms", flush=True)
                for u in before:
                    print(row("running", u))
            n = 1
            for cycle in range(1, args.restarts + 1):
                assert d.terminate() == 0
                d = started(data, args.model, restart=True)
                with d.client() as c:
                    us = []
                    for _ in range(args.turns + 1):
                        n += 1
                        us.append(turn(d, c, sid, text(int(args.new * per_token), n)))
                first, running = us[0], us[1:]
                mid = statistics.median(u["ttft_ms"] for u in running)
                ratios.append(first["ttft_ms"] / mid)
                cpu.append(first["cpu_ms"] / statistics.median(u["cpu_ms"] for u in running))
                faults.append((first["faults"], statistics.median(u["faults"] for u in running)))
                print(f"restart {cycle}: first turn {first['ttft_ms']:.1f} ms, running turns' median "
                      f"{mid:.1f} ms: {ratios[-1]:.2f}x", flush=True)
                print(row("first", first))
                for u in running:
                    print(row("running", u))
        finally:
            d.terminate()
    print(f"{args.model}, {args.history}-token history, {args.new}-token turns: first turn / running turn, "
          f"median of {len(ratios)} restarts: {statistics.median(ratios):.2f}x "
          f"({', '.join(f'{r:.2f}' for r in ratios)}); its CPU time: {statistics.median(cpu):.2f}x "
          f"({', '.join(f'{r:.2f}' for r in cpu)}); page faults first / running: "
          f"{', '.join(f'{a}/{b:.0f}' for a, b in faults)}")
    print("after:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
