"""The BLAS probe: run in a child process, so a library that crashes kills only the probe.

    python -m daemon.service.blasprobe /path/to/libopenblas.so.0 [avx2,fma,...]

Loads the library, reads what OpenBLAS says of itself (version, build
options, the core it was built or dispatched for, MAX_THREADS), refuses a
core the CPU cannot run (when the CPU's flags are given), then multiplies two
small float32 matrices with its `cblas_sgemm` and compares the result with
numpy's. Prints one JSON line. A SIGILL (an instruction this CPU lacks), a
crash or a hang shows up in the parent as this process's exit status.

Standard library and numpy only: never mlx (the point is to decide before
mlx.core is first imported).
"""

from __future__ import annotations

import ctypes
import json
import re
import sys
from typing import Any

# The cores a build may be made for that need instruction sets not every x86 CPU has: the first flag
# missing from /proc/cpuinfo rules the library out before its sgemm runs. A DYNAMIC_ARCH build picks its
# core at load time for this CPU, so it always fits; the check is for single-core builds (cmeel's wheel).
CORE_NEEDS: dict[str, tuple[str, ...]] = {
    "sapphirerapids": ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"),
    "cooperlake": ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"),
    "skylakex": ("avx512f", "avx512bw", "avx512vl"),
    "zen": ("avx2", "fma"),
    "haswell": ("avx2", "fma"),
    "sandybridge": ("avx",),
}
_ISA = {"avx512f": "AVX-512", "avx512bw": "AVX-512", "avx512vl": "AVX-512", "avx512_bf16": "AVX-512 BF16",
        "avx2": "AVX2", "fma": "FMA", "avx": "AVX"}

# What a DYNAMIC_ARCH build falls back to on a CPU it does not know (OpenBLAS 0.3.21 on a virtual
# "Intel Xeon Processor" with AVX-512: Prescott, SSE3 kernels). Named by `better_core`'s caller in
# OPENBLAS_CORETYPE, the core the CPU's flags allow ran a (16 x 576) @ (576 x 1536) float32 matmul in
# 0.57 ms against Prescott's 1.64, and a 1024^3 one in 15 ms against 105 (2-core Xeon, AVX-512).
GENERIC_CORES = ("prescott", "core2", "penryn", "dunnington", "nehalem", "atom", "katmai", "coppermine",
                 "northwood", "banias", "athlon", "opteron", "opteron_sse3", "barcelona", "bobcat")
# The cores to ask for instead, best first, each with the flags it needs (OpenBLAS's own names).
BETTER_CORES = (("SkylakeX", CORE_NEEDS["skylakex"]), ("Haswell", CORE_NEEDS["haswell"]),
                ("Sandybridge", CORE_NEEDS["sandybridge"]))

M, N, K = 67, 45, 31  # odd sizes: every kernel's edge handling runs
_ROW_MAJOR, _NO_TRANS = 101, 111


def core_misfit(config: str, core: str, cpu_flags: set[str]) -> str | None:
    """Why a library built for `core` cannot run on a CPU with `cpu_flags`, or None when it can.

    Pure: tested with both flag sets, so no test depends on the CPU it runs on.
    """
    if "DYNAMIC_ARCH" in config.split():
        return None
    needs = CORE_NEEDS.get(core.lower(), ())
    missing = [flag for flag in needs if flag not in cpu_flags]
    if not missing:
        return None
    return f"built for {core} ({_ISA.get(missing[0], missing[0])}); this CPU has no {missing[0]}"


def better_core(config: str, core: str, cpu_flags: set[str]) -> str | None:
    """The core to name in OPENBLAS_CORETYPE when a DYNAMIC_ARCH build fell back to a generic one this
    CPU's flags outdo, or None (a core it chose for this CPU, a single-core build, no better one).

    Pure: tested with several flag sets, so no test depends on the CPU it runs on.
    """
    if "DYNAMIC_ARCH" not in config.split() or core.lower() not in GENERIC_CORES:
        return None
    return next((name for name, needs in BETTER_CORES if all(f in cpu_flags for f in needs)), None)


def describe(lib: Any) -> dict[str, Any]:
    """What an OpenBLAS says of itself; empty strings where a function is missing (not OpenBLAS)."""
    def text(name: str) -> str:
        fn = getattr(lib, name, None)
        if fn is None:
            return ""
        fn.restype = ctypes.c_char_p
        return (fn() or b"").decode(errors="replace").strip()

    config = text("openblas_get_config")
    core = text("openblas_get_corename")
    version = re.search(r"OpenBLAS\s+(\S+)", config)
    max_threads = re.search(r"MAX_THREADS=(\d+)", config)
    return {"config": config, "core": core, "version": version.group(1) if version else "",
            "max_threads": int(max_threads.group(1)) if max_threads else None}


def sgemm_error(lib: Any) -> float:
    """The largest relative error of the library's sgemm against numpy's, on fixed random matrices."""
    import numpy as np

    rng = np.random.default_rng(0)
    a = rng.standard_normal((M, K), dtype=np.float32)
    b = rng.standard_normal((K, N), dtype=np.float32)
    c = np.zeros((M, N), dtype=np.float32)
    f = ctypes.POINTER(ctypes.c_float)
    lib.cblas_sgemm.restype = None
    lib.cblas_sgemm(_ROW_MAJOR, _NO_TRANS, _NO_TRANS, M, N, K, ctypes.c_float(1.0),
                    a.ctypes.data_as(f), K, b.ctypes.data_as(f), N, ctypes.c_float(0.0), c.ctypes.data_as(f), N)
    want = a.astype(np.float64) @ b.astype(np.float64)
    return float(np.max(np.abs(c - want)) / max(float(np.max(np.abs(want))), 1e-30))


def main(argv: list[str]) -> int:
    path = argv[0]
    flags = set(argv[1].split(",")) if len(argv) > 1 and argv[1] else None
    lib = ctypes.CDLL(path)
    out: dict[str, Any] = describe(lib)
    if not hasattr(lib, "cblas_sgemm"):
        out["error"] = "has no cblas_sgemm (not a BLAS MLX can use)"
    elif flags is not None and (why := core_misfit(out["config"], out["core"], flags)):
        out["error"] = why
    else:
        out["sgemm_error"] = sgemm_error(lib)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
