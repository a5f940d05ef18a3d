"""kvd across ranks on this machine: bytes exchanged per decode step, and decode tok/s at 1 and 2 ranks.

Run: .venv/bin/python bench/distributed.py [--model builtin:tiny] [--ranks 1,2] [--turns 3] [--max-tokens 128]

Two measurements, both of real processes on loopback (the ring backend):

1. Bytes per decode step. The model's own collectives: two ranks (this
   script again, with mlx.launch's environment) load the model, shard it as
   kvd does, count every `mx.distributed.all_sum` the sharded layers make
   (by wrapping it) during one decode step of one sequence, and report the
   count and bytes. kvd's control channel: rank 0's lockstep counters
   (`kvd status` -> ranks) before and after the turns of part 2, over the
   tokens decoded.
2. Decode tok/s: `kvd serve --ranks N` for each N, greedy turns of
   --max-tokens in fresh sessions; the median of the Done events' decode_tps.

The cores are shared (2 here, with other jobs): these are not speed-ups.
A tensor-parallel split pays off when one machine lacks the memory or the
bandwidth, which a 4-layer toy model on one host never does; what transfers
to real hardware is the bytes per step (docs/distributed.md).
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

PROMPT = "Tell me a long story about a river, a bridge and a town by the sea."


def count_rank(model: str, data_dir: Path, steps: int) -> None:
    """One rank of part 1 (run under the ring's environment): print its counts as JSON."""
    from daemon.service.blas import preload_blas

    preload_blas(threads=1)
    import mlx.core as mx

    from daemon.engine.modelload import load_model
    from daemon.engine.quantized import make_cache
    from daemon.engine.shard import shard
    from daemon.models.sources import prepare_model

    group = mx.distributed.init(strict=True)
    loaded = load_model(model, prepare_model(model, data_dir / "models"))
    shard(model, loaded, group)
    cache = make_cache(loaded.model, None)
    calls: list[int] = []
    real = mx.distributed.all_sum

    def counted(x: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(x.nbytes)
        return real(x, *args, **kwargs)

    mx.eval(loaded.model(mx.array([list(range(1, 33))]), cache=cache))
    mx.distributed.all_sum = counted
    token = mx.array([[5]])
    t0 = time.perf_counter()
    for _ in range(steps):
        token = mx.argmax(loaded.model(token, cache=cache)[:, -1:, :], axis=-1)
        mx.eval(token)
    seconds = time.perf_counter() - t0
    mx.distributed.all_sum = real
    print(json.dumps({"rank": group.rank(), "calls": len(calls) / steps, "bytes": sum(calls) / steps,
                      "model_steps_per_s": steps / seconds}), flush=True)


def model_bytes(model: str, data_dir: Path, ranks: int, steps: int = 16) -> dict[str, Any]:
    from daemon.models.sources import prepare_model
    from daemon.service.ranks import free_ports, hostfile

    prepare_model(model, data_dir / "models")  # once, before the ranks (as kvd serve --ranks does)
    hosts = hostfile(data_dir / "ranks.json", ranks, free_ports(ranks))
    procs = [subprocess.Popen([sys.executable, __file__, "--count-rank", "--model", model, "--data-dir",
                               str(data_dir), "--steps", str(steps)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "MLX_RANK": str(r), "MLX_HOSTFILE": str(hosts)})
             for r in range(ranks)]
    outs = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
    out: dict[str, Any] = outs[0]
    return out


def decode_runs(model: str, data_dir: Path, ranks: int, turns: int, max_tokens: int) -> dict[str, Any]:
    from daemonproc import DaemonProcess

    args = ("--model", model, *(("--ranks", str(ranks)) if ranks > 1 else ()))
    d = DaemonProcess(data_dir, *args)
    try:
        with d.client() as c:
            before = c.request("status").get("ranks", {})
            tps, tokens = [], 0
            for _ in range(turns):
                sid = c.request("session.create")["session"]["id"]
                _, done = c.chat(sid, PROMPT, max_tokens=max_tokens, temperature=0)
                tps.append(done["usage"]["decode_tps"])
                tokens += done["usage"]["completion_tokens"]
            after = c.request("status").get("ranks", {})
    finally:
        d.terminate()
    control = (after.get("bytes", 0) - before.get("bytes", 0)) / max(tokens, 1)
    return {"decode_tps": statistics.median(tps), "all": tps, "tokens": tokens,
            "control_bytes_per_token": round(control, 1),
            "control_messages_per_token": round((after.get("messages", 0) - before.get("messages", 0))
                                                / max(tokens, 1), 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin:tiny")
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--count-rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--data-dir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=16, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.count_rank:
        count_rank(a.model, a.data_dir, a.steps)
        return
    print("uptime:", os.getloadavg())
    with tempfile.TemporaryDirectory() as tmp:
        for n in [int(x) for x in a.ranks.split(",")]:
            data = Path(tmp) / f"ranks-{n}"
            data.mkdir(mode=0o700)
            row: dict[str, Any] = {"model": a.model, "ranks": n}
            if n > 1:
                row["model_collectives_per_step"] = model_bytes(a.model, data, n)
            row.update(decode_runs(a.model, data, n, a.turns, a.max_tokens))
            print(json.dumps(row), flush=True)
    print("uptime:", os.getloadavg())


if __name__ == "__main__":
    main()
