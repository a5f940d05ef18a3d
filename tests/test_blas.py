"""The BLAS under MLX: every candidate probed in a child process; a library that crashes costs only the probe.

Real libraries only: two fakes compiled here with `cc` (one whose sgemm raises
SIGILL, one that returns wrong numbers), the system's OpenBLAS (installed by
scripts/sysdeps.sh), and none at all. Which core a single-CPU build may run on
is a pure function, tested with both flag sets, so nothing here depends on the
CPU it runs on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from daemon.service.blas import BlasVerdict, Candidate, choose, cpu_flags, probe, run_probe, system_libraries
from daemon.service.blasprobe import better_core, core_misfit
from daemonproc import DaemonProcess

ROOT = Path(__file__).resolve().parents[1]

_HEAD = """
#include <signal.h>
const char *openblas_get_config(void) { return "OpenBLAS 9.9.9 DYNAMIC_ARCH NO_AFFINITY Haswell MAX_THREADS=64"; }
const char *openblas_get_corename(void) { return "Haswell"; }
void openblas_set_num_threads(int n) { (void)n; }
int openblas_get_num_threads(void) { return 1; }
"""
FAKES = {
    # What a build for a CPU family this machine is not runs into: an illegal instruction.
    "sigill": _HEAD + """
void cblas_sgemm(int o, int ta, int tb, int m, int n, int k, float al, const float *a, int lda,
                 const float *b, int ldb, float be, float *c, int ldc) { raise(SIGILL); }
void sgemm_(void) { raise(SIGILL); }
""",
    "wrong": _HEAD + """
void cblas_sgemm(int o, int ta, int tb, int m, int n, int k, float al, const float *a, int lda,
                 const float *b, int ldb, float be, float *c, int ldc) {
    for (int i = 0; i < m; i++) for (int j = 0; j < n; j++) c[i * ldc + j] = 1.0f;
}
void sgemm_(void) {}
""",
}


@pytest.fixture(scope="module")
def fakes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    d = tmp_path_factory.mktemp("fakeblas")
    for name, source in FAKES.items():
        (d / f"{name}.c").write_text(source)
        lib = d / f"lib{name}blas.so.0"
        subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(d / f"{name}.c")], check=True)
        out[name] = lib
    return out


def system_openblas() -> Path:
    found = system_libraries()
    assert found, "no system OpenBLAS: scripts/sysdeps.sh installs libopenblas0-pthread"
    return found[0]


@pytest.mark.parametrize("config, core, flags, misfit", [
    ("OpenBLAS 0.3.31 NO_AFFINITY SKYLAKEX MAX_THREADS=4", "SKYLAKEX", {"avx2", "fma"},
     "built for SKYLAKEX (AVX-512); this CPU has no avx512f"),
    ("OpenBLAS 0.3.31 NO_AFFINITY SKYLAKEX MAX_THREADS=4", "SKYLAKEX", {"avx2", "fma", "avx512f", "avx512bw",
                                                                         "avx512vl"}, None),
    ("OpenBLAS 0.3.21 DYNAMIC_ARCH NO_AFFINITY SkylakeX MAX_THREADS=64", "SkylakeX", {"sse2"}, None),
    ("OpenBLAS 0.3.26 HASWELL MAX_THREADS=8", "Haswell", {"avx"}, "built for Haswell (AVX2); this CPU has no avx2"),
    ("OpenBLAS 0.3.26 HASWELL MAX_THREADS=8", "Haswell", {"avx", "avx2", "fma"}, None),
    ("OpenBLAS 0.3.26 PRESCOTT MAX_THREADS=8", "Prescott", set(), None),
])  # fmt: skip
def test_a_single_core_build_fits_only_cpus_with_its_instructions(config: str, core: str, flags: set[str],
                                                                   misfit: str | None) -> None:
    assert core_misfit(config, core, flags) == misfit


def test_a_library_that_raises_sigill_is_rejected_and_the_caller_lives(fakes: dict[str, Path]) -> None:
    verdict = run_probe(fakes["sigill"], {"avx2", "fma"})
    assert verdict == BlasVerdict(False, "its sgemm died with SIGILL (an instruction this CPU does not have)")


def test_a_library_that_computes_wrong_numbers_is_rejected(fakes: dict[str, Path]) -> None:
    verdict = run_probe(fakes["wrong"], {"avx2", "fma"})
    assert not verdict.ok
    assert verdict.why.startswith("its sgemm computed wrong numbers (relative error")
    assert (verdict.version, verdict.core, verdict.max_threads) == ("9.9.9", "Haswell", 64)


def test_a_missing_library_is_rejected(tmp_path: Path) -> None:
    assert run_probe(tmp_path / "libopenblas.so.0", set()) == BlasVerdict(False, "no such file")


def test_the_first_library_that_passes_is_chosen(fakes: dict[str, Path], tmp_path: Path) -> None:
    system = system_openblas()
    cands = [Candidate(fakes["sigill"], "config"), Candidate(fakes["wrong"], "system"), Candidate(system, "system")]
    chosen, verdict, rejected = choose(cands, cache=tmp_path / "verdicts.json")
    assert chosen == cands[2]
    assert verdict is not None and verdict.ok and verdict.version and verdict.core
    assert [r.split(":", 1)[0] for r in rejected] == [f"rejected config {fakes['sigill']}",
                                                      f"rejected system {fakes['wrong']}"]
    assert "SIGILL" in rejected[0] and "wrong numbers" in rejected[1]


def test_no_library_at_all_leaves_the_reference_blas_and_says_what_fixes_it() -> None:
    chosen, verdict, rejected = choose([])
    assert (chosen, verdict, rejected) == (None, None, [])
    code = ("import json, daemon.service.blas as b\n"
            "b.candidates = lambda mode: []\n"
            "r = b.preload_blas()\n"
            "import mlx.core as mx\n"
            "x = mx.ones((64, 64))\n"
            "print(json.dumps({'loaded': r.loaded, 'reason': r.reason, 'sum': (x @ x).sum().item()}))\n")
    out = _run(code)
    assert out["loaded"] is False and out["sum"] == 64.0**3
    assert str(out["reason"]).startswith("BLAS: reference, about 40x slower")
    assert "apt-get install libopenblas0-pthread" in str(out["reason"])


def test_a_verdict_is_cached_for_the_library_and_the_cpu(fakes: dict[str, Path], tmp_path: Path) -> None:
    cache = tmp_path / "verdicts.json"
    first = probe(fakes["wrong"], flags={"avx2"}, cache=cache)
    (key, stored), = json.loads(cache.read_text()).items()
    assert stored["why"] == first.why
    # What the cache says is what a later start believes, without probing again...
    cache.write_text(json.dumps({key: {**stored, "why": "from the cache"}}))
    assert probe(fakes["wrong"], flags={"avx2"}, cache=cache).why == "from the cache"
    # ...for that CPU and that file only.
    assert probe(fakes["wrong"], flags={"avx2", "fma"}, cache=cache).why == first.why
    os.utime(fakes["wrong"], ns=(1, 1))
    assert probe(fakes["wrong"], flags={"avx2"}, cache=cache).why == first.why


def _run(code: str, env: dict[str, str] | None = None) -> dict[str, object]:
    """Run `code` in a fresh interpreter (whether MLX is bound depends on what was imported first)."""
    full = {k: v for k, v in os.environ.items() if k not in ("KVD_BLAS", "LD_PRELOAD")}
    full.update(env or {})
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    out: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    out["stderr"] = proc.stderr
    return out


AVX512 = {"avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"}


@pytest.mark.parametrize("config, core, flags, better", [
    ("OpenBLAS 0.3.21 NO_LAPACKE DYNAMIC_ARCH NO_AFFINITY Prescott MAX_THREADS=64", "Prescott", AVX512, "SkylakeX"),
    ("OpenBLAS 0.3.21 DYNAMIC_ARCH Prescott MAX_THREADS=64", "Prescott", {"avx", "avx2", "fma"}, "Haswell"),
    ("OpenBLAS 0.3.21 DYNAMIC_ARCH Core2 MAX_THREADS=64", "Core2", {"avx"}, "Sandybridge"),
    ("OpenBLAS 0.3.21 DYNAMIC_ARCH Prescott MAX_THREADS=64", "Prescott", {"sse3"}, None),  # nothing better
    ("OpenBLAS 0.3.21 DYNAMIC_ARCH Zen MAX_THREADS=64", "Zen", AVX512, None),  # a core chosen for this CPU
    ("OpenBLAS 0.3.21 DYNAMIC_ARCH SkylakeX MAX_THREADS=64", "SkylakeX", AVX512, None),
    ("OpenBLAS 0.3.26 PRESCOTT MAX_THREADS=8", "Prescott", AVX512, None),  # a single-core build: its only one
])  # fmt: skip
def test_a_dynamic_build_on_a_generic_core_gets_the_core_the_flags_allow(config: str, core: str, flags: set[str],
                                                                         better: str | None) -> None:
    assert better_core(config, core, flags) == better


_CORE = ("import json, os\n"
         "from pathlib import Path\n"
         "from daemon.service.blas import preload_blas, probe\n"
         "r = preload_blas(cache=Path({cache!r}))\n"
         "v = probe(Path(r.path), cache=Path({cache!r}))\n"
         "print(json.dumps({{'reason': r.reason, 'config': v.config, 'core': v.core,"
         " 'env': os.environ.get('OPENBLAS_CORETYPE')}}))\n")


def test_the_system_openblas_never_runs_a_generic_core_this_cpu_outdoes(tmp_path: Path) -> None:
    """OpenBLAS 0.3.21 on a CPU it does not know (a virtual Xeon with AVX-512) chose Prescott's kernels."""
    out = _run(_CORE.format(cache=str(tmp_path / "v.json")), env={"OPENBLAS_CORETYPE": ""})
    assert out["core"] and f"core {out['core']}" in str(out["reason"])
    assert better_core(str(out["config"]), str(out["core"]), cpu_flags()) is None, out


def test_a_core_the_user_names_is_left_alone(tmp_path: Path) -> None:
    named = "Haswell" if {"avx2", "fma"} <= cpu_flags() else "Prescott"
    out = _run(_CORE.format(cache=str(tmp_path / "v.json")), env={"OPENBLAS_CORETYPE": named})
    assert out["env"] == named and str(out["core"]).lower() == named.lower(), out
    assert "it chose" not in str(out["reason"])


def test_the_system_openblas_is_what_mlx_binds(tmp_path: Path) -> None:
    # LD_DEBUG=bindings has the dynamic linker report where each of libmlx's BLAS symbols went.
    code = ("import json\n"
            "from pathlib import Path\n"
            "from daemon.service.blas import preload_blas\n"
            f"r = preload_blas(cache=Path({str(tmp_path / 'v.json')!r}))\n"
            "import numpy as np, mlx.core as mx\n"
            "a = np.random.default_rng(0).standard_normal((256, 192), dtype=np.float32)\n"
            "ok = bool(np.allclose(np.array(mx.array(a) @ mx.array(a.T)), a @ a.T, rtol=1e-4, atol=1e-3))\n"
            "print(json.dumps({'loaded': r.loaded, 'path': r.path, 'reason': r.reason, 'threads': r.threads,"
            " 'again': preload_blas() == r, 'ok': ok}))\n")
    out = _run(code, env={"LD_DEBUG": "bindings"})
    assert out["loaded"] is True and out["again"] is True and out["ok"] is True
    assert Path(str(out["path"])).resolve() == system_openblas().resolve()
    assert str(out["reason"]).startswith("BLAS: OpenBLAS ") and ", core " in str(out["reason"])
    assert out["threads"] == len(os.sched_getaffinity(0))
    sgemm = [line for line in str(out["stderr"]).splitlines() if "libmlx" in line and "`cblas_sgemm'" in line]
    assert sgemm, "libmlx never bound cblas_sgemm"
    assert all("libopenblas" in line for line in sgemm)


@pytest.mark.parametrize(("env", "config", "needle"), [
    ({"KVD_BLAS": "off"}, "", "disabled by KVD_BLAS=off"),
    ({}, 'blas = "off"\n', 'disabled by blas = "off"'),
])  # fmt: skip
def test_off_loads_nothing_and_kvd_still_answers(tmp_path: Path, env: dict[str, str], config: str,
                                                 needle: str) -> None:
    d = _daemon(tmp_path, config, env)
    try:
        assert any(needle in line for line in d.log)
        assert "libopenblas" not in Path(f"/proc/{d.proc.pid}/maps").read_text()
        _answers(d)
    finally:
        d.terminate()


@pytest.mark.parametrize("fake", ["sigill", "wrong"])
def test_kvd_serve_rejects_a_bad_library_with_one_line_and_answers(tmp_path: Path, fakes: dict[str, Path],
                                                                   fake: str) -> None:
    d = _daemon(tmp_path, f'blas = "{fakes[fake]}"\n', {})
    try:
        rejected = [line for line in d.log if f"rejected config {fakes[fake]}" in line]
        assert len(rejected) == 1, d.log
        assert ("SIGILL" if fake == "sigill" else "wrong numbers") in rejected[0]
        chosen = next(line for line in d.log if "BLAS: OpenBLAS" in line)
        assert "system" in chosen and "core" in chosen and " thread" in chosen
        assert "Traceback" not in "".join(d.log)
        _answers(d)
        with d.client() as c:
            status = c.request("status")
        assert status["blas"].startswith("BLAS: OpenBLAS")
    finally:
        d.terminate()


def _daemon(tmp_path: Path, config: str, env: dict[str, str]) -> DaemonProcess:
    toml = tmp_path / "kvd.toml"
    toml.write_text(config + "[cache]\nprefetch = false\n")
    clean = {"LD_PRELOAD": "", "XDG_CACHE_HOME": str(tmp_path / "cache"), **env}
    return DaemonProcess(tmp_path / "data", "--config", str(toml), env=clean)


def _answers(d: DaemonProcess) -> None:
    with d.client() as c:
        sid = c.request("session.create")["session"]["id"]
        text, done = c.chat(sid, "What is the capital of France?", max_tokens=4, temperature=0)
    assert done["type"] == "chat.done" and done["usage"]["completion_tokens"] >= 1
