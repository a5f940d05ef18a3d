"""Each BLAS kvd could put under MLX on this machine: sgemm GFLOP/s and the default model's decode tok/s.

    .venv/bin/python bench/blas.py                 # every candidate found here, plus the reference BLAS
    .venv/bin/python bench/blas.py --model DIR     # decode on another mlx-lm directory

Each candidate runs in its own process (a library, once loaded, cannot be
unloaded, and one that crashes must not take the benchmark with it), through
kvd's own probe: a rejected library is reported with the probe's reason. The
decode figure is mlx-lm's `stream_generate` in that process, greedy, on the
converted default model (`make serve` converts it once).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from daemon.service.blas import candidates, cpu_flags, cpu_model, usable_cpus  # noqa: E402

CHILD = r"""
import ctypes, json, statistics, sys, time
from pathlib import Path
from daemon.service.blas import Candidate, choose, preload_blas, usable_cpus
mode, model, cache = sys.argv[1], sys.argv[2], Path(sys.argv[3])
if mode in ("auto", "off"):  # what kvd itself would do
    r = preload_blas(mode, cache=cache)
    out = {"reason": r.reason, "rejected": list(r.rejected)}
else:  # this library alone, through kvd's probe
    chosen, verdict, rejected = choose([Candidate(Path(mode), "bench")], cache=cache)
    out = {"reason": verdict and f"OpenBLAS {verdict.version}, core {verdict.core}", "rejected": rejected}
    if chosen is None:
        print(json.dumps(out)); sys.exit(0)
    lib = ctypes.CDLL(mode, mode=ctypes.RTLD_GLOBAL)
    lib.openblas_set_num_threads(usable_cpus())
import mlx.core as mx
a = mx.random.normal((1024, 1024)); b = mx.random.normal((1024, 1024)); mx.eval(a, b)
times = []
for _ in range(7):
    t = time.perf_counter(); mx.eval(a @ b); times.append(time.perf_counter() - t)
out["sgemm_gflops"] = 2 * 1024**3 / statistics.median(times[2:]) / 1e9
if model:
    from mlx_lm import load, stream_generate
    from mlx_lm.sample_utils import make_sampler
    m, tok = load(model)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Tell me about the history of Rome."}],
                                     add_generation_prompt=True)
    last = None
    for resp in stream_generate(m, tok, prompt, max_tokens=64, sampler=make_sampler(0.0)):
        last = resp
    out["decode_tps"] = last.generation_tps if last else None
print(json.dumps(out))
"""


def default_model() -> str:
    from daemon.models.sources import prepare_model
    from protocol import default_data_dir

    return str(prepare_model("builtin:smollm2", default_data_dir() / "models"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="an mlx-lm directory for the decode column (default: the converted SmolLM2)")
    ap.add_argument("--no-decode", action="store_true", help="sgemm only")
    args = ap.parse_args()
    model = "" if args.no_decode else (args.model or default_model())
    flags = cpu_flags()
    simd = [f for f in ("avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "asimd", "sve") if f in flags]
    print(f"CPU: {cpu_model()}, {usable_cpus()} usable CPUs, flags {' '.join(simd)}")
    rows = [(c.name(), str(c.path)) for c in candidates("auto")] + [("reference BLAS (the MLX wheel's)", "off")]
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "KVD_BLAS")}
        auto = subprocess.run([sys.executable, "-c", CHILD, "auto", "", str(Path(tmp) / "v.json")], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=600)
        chosen = json.loads(auto.stdout.strip().splitlines()[-1])["reason"]
        print(f"kvd's choice (blas = \"auto\"): {chosen}\n")
        print("| library | verdict | sgemm 1024³ | decode, default model |")
        print("| --- | --- | ---: | ---: |")
        for name, mode in rows:
            proc = subprocess.run([sys.executable, "-c", CHILD, mode, model, str(Path(tmp) / "v.json")], cwd=ROOT,
                                  env=env, capture_output=True, text=True, timeout=1200)
            if proc.returncode != 0:
                print(f"| {name} | the benchmark process died ({proc.returncode}) | | |")
                continue
            out = json.loads(proc.stdout.strip().splitlines()[-1])
            if "sgemm_gflops" not in out:
                why = out["rejected"][-1].split(": ", 1)[-1] if out["rejected"] else out["reason"]
                print(f"| {name} | rejected: {why} | | |")
                continue
            verdict = out["reason"] if mode != "off" else "reference"
            decode = f"{out['decode_tps']:.1f} tok/s" if out.get("decode_tps") else ""
            print(f"| {name} | {verdict} | {out['sgemm_gflops']:.1f} GFLOP/s | {decode} |")


if __name__ == "__main__":
    main()
