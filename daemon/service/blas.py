"""Put an optimized BLAS under MLX's Linux CPU backend, chosen so that no library can crash kvd.

The MLX Linux CPU wheel links the *reference* BLAS (netlib): a 1024^3 float32
matmul takes ~0.5 s. Loading an OpenBLAS with ``RTLD_GLOBAL`` *before*
``mlx.core`` is first imported puts its ``cblas_sgemm`` & co. into the
process's global symbol scope, which the dynamic linker searches before
libmlx's own dependencies: the same matmul then takes ~0.012 s. Once
``mlx.core`` is imported its symbols are bound, so this module must never
import mlx, and `kvd serve` calls :func:`preload_blas` first thing.

An OpenBLAS built for one CPU family only (cmeel-openblas's wheel is built
for Skylake-X, AVX-512) dies with SIGILL on any CPU without it. So every
candidate is *probed in a child process* (daemon/service/blasprobe.py):
loaded, asked what it is, refused if its core needs instructions this CPU
lacks, and made to multiply two small matrices, compared with numpy. A
crash, a hang or a wrong answer costs the probe, never the daemon. The
verdict is kept in a small cache keyed by the library (path, size, mtime)
and the CPU (model and flags), so a normal start does not pay for it.

A DYNAMIC_ARCH OpenBLAS picks its kernels by the CPU's model, and on a CPU
it does not know (0.3.21 on a virtual "Intel Xeon Processor" with AVX-512) it
falls back to a generic core (Prescott: SSE3, matmuls 3-7x slower). kvd then
names the core the CPU's flags allow in OPENBLAS_CORETYPE, probed first like
any candidate; one the user set is left alone (blasprobe.better_core).

Candidates, in order: the library named by ``blas = "/path/..."``; an
OpenBLAS from the system (a DYNAMIC_ARCH build picks its kernels for this
CPU at load time: Debian/Ubuntu's libopenblas0-pthread, Fedora's
openblas-pthreads); cmeel-openblas's wheel; else the reference BLAS, with one
warning line that says what it costs and what fixes it.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from . import blasprobe

__all__ = ["BlasResult", "BlasVerdict", "Candidate", "candidates", "choose", "cpu_flags", "find_openblas",
           "preload_blas", "probe"]

#: OpenBLAS's own: the core a DYNAMIC_ARCH build uses (kvd names one when the build fell back to a
#: generic core; one set by the user is left alone).
CORETYPE_ENV = "OPENBLAS_CORETYPE"
#: Environment override: ``KVD_BLAS=off`` disables interposition.
ENV_VAR = "KVD_BLAS"
PROBE = Path(__file__).with_name("blasprobe.py")
PROBE_VERSION = 2  # part of every cached verdict's key: a new probe decides again
PROBE_TIMEOUT = 60.0
MAX_SGEMM_ERROR = 1e-4  # relative, float32 against float64
SLOWER = "about 40x slower matmuls than OpenBLAS"
FIX = ("on Debian/Ubuntu: apt-get install libopenblas0-pthread; on Fedora: dnf install openblas-pthreads; "
       "or name a library with blas = \"/path/to/libopenblas.so.0\" in config.toml")

# System OpenBLAS sonames, threaded builds first (Fedora ships three flavours under three names).
SONAMES = ("libopenblasp.so.0", "libopenblas.so.0", "libopenblaso.so.0")
_CMEEL_LIB = Path("cmeel.prefix") / "lib"


@dataclass(frozen=True)
class Candidate:
    path: Path
    origin: str  # "config", "system" or "cmeel-openblas"

    def name(self) -> str:
        return f"{self.origin} {self.path}" if self.origin != "cmeel-openblas" else "cmeel-openblas"


@dataclass(frozen=True)
class BlasVerdict:
    """What the probe found: usable, or why not."""

    ok: bool
    why: str = ""  # when not ok
    version: str = ""
    core: str = ""
    config: str = ""
    max_threads: int | None = None


@dataclass(frozen=True)
class BlasResult:
    """What :func:`preload_blas` did: one line for the start log and `kvd status`."""

    loaded: bool
    path: str | None
    reason: str
    rejected: tuple[str, ...] = ()
    threads: int | None = None


# The first decision that loaded a library sticks for the life of the process (RTLD_GLOBAL cannot be undone).
_result: BlasResult | None = None


# --- the machine ----------------------------------------------------------------------------------------


def _cpuinfo() -> dict[str, str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    info: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in info:
            info[key.strip()] = value.strip()
    return info


def cpu_flags() -> set[str]:
    info = _cpuinfo()
    return set((info.get("flags") or info.get("Features") or "").split())


def cpu_model() -> str:
    info = _cpuinfo()
    return info.get("model name") or info.get("CPU part") or sys.platform


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# --- where libraries are --------------------------------------------------------------------------------


def _ldconfig() -> list[Path]:
    """Sonames the dynamic linker's cache knows, threaded builds first."""
    for exe in ("ldconfig", "/sbin/ldconfig", "/usr/sbin/ldconfig"):
        try:
            out = subprocess.run([exe, "-p"], capture_output=True, text=True, timeout=10).stdout
            break
        except (OSError, subprocess.SubprocessError):
            continue
    else:
        return []
    arch = {"x86_64": "x86-64", "aarch64": "AArch64"}.get(os.uname().machine)  # skip other ABIs' copies
    found: dict[str, list[Path]] = {}
    for line in out.splitlines():
        m = re.match(r"\s*(\S+)\s+\(([^)]*)\)\s+=>\s+(\S+)", line)
        if m and m.group(1) in SONAMES and (arch is None or arch in m.group(2)):
            found.setdefault(m.group(1), []).append(Path(m.group(3)))
    return [p for name in SONAMES for p in found.get(name, [])]


def system_libraries() -> list[Path]:
    """Every system OpenBLAS, found by soname (ldconfig) and in the usual places, each once."""
    triplet = sysconfig.get_config_var("MULTIARCH") or f"{os.uname().machine}-linux-gnu"
    usual = [Path(f"/usr/lib/{triplet}/openblas-pthread/libopenblas.so.0"),
             Path(f"/usr/lib/{triplet}/libopenblas.so.0"), Path("/usr/lib64/libopenblasp.so.0"),
             Path("/usr/lib64/libopenblas.so.0"),
             Path("/usr/lib/libopenblas.so.0"), Path("/usr/local/lib/libopenblas.so.0")]
    seen: set[Path] = set()
    out = []
    for p in [*_ldconfig(), *usual]:
        try:
            real = p.resolve(strict=True)
        except OSError:
            continue
        if real not in seen and real.is_file():
            seen.add(real)
            out.append(p)
    return out


def find_openblas() -> Path | None:
    """cmeel-openblas's ``libopenblas.so.0`` in any site directory, or None."""
    dirs = [sysconfig.get_paths().get(k) for k in ("purelib", "platlib")] + list(sys.path)
    for d in dict.fromkeys(x for x in dirs if x):
        libdir = Path(d) / _CMEEL_LIB
        for name in ("libopenblas.so.0", *sorted(p.name for p in libdir.glob("libopenblas.so*"))):
            if (libdir / name).is_file():
                return libdir / name
    return None


def candidates(mode: str) -> list[Candidate]:
    """What to try, in order: the configured library, the system's, then the wheel's."""
    out = []
    if mode not in ("auto", "off"):
        out.append(Candidate(Path(mode).expanduser(), "config"))
    out += [Candidate(p, "system") for p in system_libraries()]
    if (wheel := find_openblas()) is not None:
        out.append(Candidate(wheel, "cmeel-openblas"))
    return out


# --- the probe and its cached verdicts --------------------------------------------------------------------


def default_cache() -> Path:
    """Verdicts are facts about this machine, not about a data directory: one cache per user."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvd" / "blas-verdicts.json"


def _key(path: Path, flags: set[str]) -> str | None:
    try:
        st = path.resolve(strict=True).stat()
    except OSError:
        return None
    forced = os.environ.get(CORETYPE_ENV, "")
    raw = (f"{PROBE_VERSION}|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{cpu_model()}|{','.join(sorted(flags))}"
           f"|{forced}")
    return hashlib.blake2b(raw.encode(), digest_size=16).hexdigest()


def _read_cache(cache: Path | None) -> dict[str, Any]:
    if cache is None:
        return {}
    try:
        data = json.loads(cache.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(cache: Path | None, key: str, verdict: BlasVerdict) -> None:
    if cache is None:
        return
    data = _read_cache(cache)
    data[key] = asdict(verdict)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".{cache.name}.{os.getpid()}")
        tmp.write_text(json.dumps(data))
        tmp.replace(cache)  # a lost verdict only costs the next start a probe: no fsync
    except OSError:
        pass


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def run_probe(path: Path, flags: set[str]) -> BlasVerdict:
    """Probe `path` in a child process, uncached."""
    if not path.exists():
        return BlasVerdict(False, "no such file")
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["OPENBLAS_NUM_THREADS"] = "1"  # the probe's matrices are tiny; do not spin up a pool
    try:
        proc = subprocess.run([sys.executable, str(PROBE), str(path), ",".join(sorted(flags))],
                              capture_output=True, text=True, timeout=PROBE_TIMEOUT, env=env)
    except subprocess.TimeoutExpired:
        return BlasVerdict(False, f"its probe did not finish within {PROBE_TIMEOUT:.0f} s")
    if proc.returncode < 0:
        what = _signal_name(proc.returncode)
        hint = " (an instruction this CPU does not have)" if what == "SIGILL" else ""
        return BlasVerdict(False, f"its sgemm died with {what}{hint}")
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return BlasVerdict(False, f"could not be loaded: {last[:200]}")
    try:
        out = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return BlasVerdict(False, "its probe printed no verdict")
    info = {k: out.get(k) or d for k, d in (("version", ""), ("core", ""), ("config", ""))}
    max_threads = out.get("max_threads")
    if out.get("error"):
        return BlasVerdict(False, str(out["error"]), max_threads=max_threads, **info)
    err = float(out.get("sgemm_error", float("inf")))
    if not err <= MAX_SGEMM_ERROR:
        return BlasVerdict(False, f"its sgemm computed wrong numbers (relative error {err:.2g})",
                       max_threads=max_threads, **info)
    return BlasVerdict(True, max_threads=max_threads, **info)


def probe(path: Path, *, flags: set[str] | None = None, cache: Path | None = None) -> BlasVerdict:
    """The verdict on `path` for this CPU: from the cache when the library and the CPU are unchanged."""
    flags = cpu_flags() if flags is None else flags
    key = _key(path, flags)
    if key is not None and isinstance(hit := _read_cache(cache).get(key), dict):
        try:
            return BlasVerdict(**hit)
        except TypeError:
            pass
    verdict = run_probe(path, flags)
    if key is not None:
        _write_cache(cache, key, verdict)
    return verdict


def choose(cands: list[Candidate], *, flags: set[str] | None = None,
           cache: Path | None = None) -> tuple[Candidate | None, BlasVerdict | None, list[str]]:
    """The first candidate whose probe passes, its verdict, and a line for each one rejected before it."""
    rejected: list[str] = []
    for cand in cands:
        verdict = probe(cand.path, flags=flags, cache=cache)
        if verdict.ok:
            return cand, verdict, rejected
        rejected.append(f"rejected {cand.name()}: {verdict.why}")
    return None, None, rejected


# --- loading it ---------------------------------------------------------------------------------------


def _better_core(path: Path, verdict: BlasVerdict, cache: Path | None) -> tuple[BlasVerdict, str]:
    """Where a DYNAMIC_ARCH build fell back to a generic core (a CPU it does not know), name the core
    this CPU's flags allow in OPENBLAS_CORETYPE, probed like any library (its verdict cached apart);
    should that probe fail, the generic core stays. A core the user named is left alone. Also the
    words the BLAS line adds when kvd named one."""
    if os.environ.get(CORETYPE_ENV):
        return verdict, ""
    flags = cpu_flags()
    core = blasprobe.better_core(verdict.config, verdict.core, flags)
    if core is None:
        return verdict, ""
    os.environ[CORETYPE_ENV] = core
    forced = probe(path, flags=flags, cache=cache)
    if forced.ok and forced.core.lower() == core.lower():
        return forced, f" ({CORETYPE_ENV}={core}: it chose {verdict.core} for this CPU)"
    del os.environ[CORETYPE_ENV]
    return verdict, ""


def _set_threads(lib: Any, wanted: int) -> int | None:
    setter = getattr(lib, "openblas_set_num_threads", None)
    getter = getattr(lib, "openblas_get_num_threads", None)
    if setter is None:
        return None
    setter.argtypes = [ctypes.c_int]
    setter(wanted)
    return int(getter()) if getter is not None else wanted


def preload_blas(mode: str = "auto", *, threads: int = 0, cache: Path | None = None,
                 backend: str | None = None) -> BlasResult:
    """Choose and load a BLAS for MLX (before mlx.core is imported); never raises, never crashes.

    `mode` is the config's `blas`: "auto", "off" or a library's path.
    `threads` 0 means the CPUs this process may use. `cache` defaults to
    :func:`default_cache`. Idempotent once a library is loaded. `backend`: the
    device kind MLX will compute on (default: read from the installed packages,
    daemon/device.py); only the CPU's is probed, a GPU's matmuls never reach a BLAS.
    """
    global _result
    if _result is not None:
        return _result
    if not sys.platform.startswith("linux"):
        why = "macOS uses Accelerate and Metal" if sys.platform == "darwin" else f"nothing to do on {sys.platform}"
        return BlasResult(False, None, f"BLAS: not interposed ({why})")
    from ..device import Device, installed_backend, policy

    backend = backend or installed_backend() or "cpu"
    if not policy(Device(backend, backend)).probe_blas:
        return BlasResult(False, None, f"BLAS: not interposed (MLX computes on the {backend} GPU)")
    if mode == "off":
        return BlasResult(False, None, 'BLAS: reference (disabled by blas = "off")')
    if os.environ.get(ENV_VAR, "").strip().lower() == "off":
        return BlasResult(False, None, f"BLAS: reference (disabled by {ENV_VAR}=off)")
    if "blas" in os.environ.get("LD_PRELOAD", ""):
        return BlasResult(False, None, f"BLAS: left to LD_PRELOAD ({os.environ['LD_PRELOAD']})")
    if "mlx.core" in sys.modules:
        return BlasResult(False, None, "BLAS: reference (mlx.core was imported before kvd could choose one)")

    cache = cache if cache is not None else default_cache()
    cand, verdict, rejected = choose(candidates(mode), cache=cache)
    named = ""
    if cand is not None and verdict is not None:
        verdict, named = _better_core(cand.path, verdict, cache)
    if cand is None or verdict is None:
        return BlasResult(False, None, f"BLAS: reference, {SLOWER}: no usable OpenBLAS ({FIX})", tuple(rejected))
    try:
        lib = ctypes.CDLL(str(cand.path), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:  # passed its probe, yet will not load here: say so, stay on the reference BLAS
        return BlasResult(False, None, f"BLAS: reference, {SLOWER}: could not load {cand.path}: {e} ({FIX})",
                          tuple(rejected))
    cpus = usable_cpus()
    got = _set_threads(lib, threads or cpus)
    capped = ""
    if verdict.max_threads is not None and verdict.max_threads < (threads or cpus):
        capped = f" (capped by its MAX_THREADS={verdict.max_threads}; this process may use {cpus} CPUs)"
    what = f"OpenBLAS {verdict.version}".strip() if verdict.version else cand.path.name
    _result = BlasResult(True, str(cand.path),
                         f"BLAS: {what} ({cand.name()}), core {verdict.core or 'unknown'}{named}, "
                         f"{got if got is not None else '?'} thread{'' if got == 1 else 's'}{capped}",
                         tuple(rejected), got)
    return _result
