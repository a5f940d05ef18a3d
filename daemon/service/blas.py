"""Interpose OpenBLAS under MLX's Linux CPU backend.

The MLX Linux CPU wheel links the *reference* BLAS (netlib, bundled as
``mlx_cpu.libs/libblas-*.so``): a 1024^3 float32 matmul takes 0.5-0.9 s. The
PyPI package ``cmeel-openblas`` ships an optimized OpenBLAS; loading it with
``RTLD_GLOBAL`` *before* ``mlx.core`` is first imported puts its ``sgemm_`` &
co. into the process's global symbol scope, which the dynamic linker searches
before libmlx's own dependencies. The same matmul then takes ~0.015 s.

The trick only works if it happens first: once ``mlx.core`` is imported,
libmlx's BLAS symbols are already bound. So the daemon calls
:func:`preload_blas` at the very top of start-up and logs its ``reason``.
This module must therefore never import mlx itself.
"""

from __future__ import annotations

import ctypes
import os
import site
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BlasResult", "find_openblas", "preload_blas"]

#: Environment override: ``KVD_BLAS=off`` disables interposition.
ENV_VAR = "KVD_BLAS"

_CMEEL_LIB = Path("cmeel.prefix") / "lib"


@dataclass(frozen=True)
class BlasResult:
    """What :func:`preload_blas` did, for one line of the daemon's start log."""

    loaded: bool
    path: str | None
    reason: str


# The outcome of the first call that actually tried (or decided not) to load;
# later calls return it so the answer never changes within one process.
_result: BlasResult | None = None


def _site_dirs() -> list[Path]:
    """Every directory that may hold installed packages, in search order."""
    candidates: list[str] = []
    for key in ("purelib", "platlib"):
        try:
            candidates.append(sysconfig.get_paths()[key])
        except KeyError:
            pass
    try:
        candidates.extend(site.getsitepackages())
    except AttributeError:  # some virtualenv builds lack it
        pass
    try:
        candidates.append(site.getusersitepackages())
    except AttributeError:
        pass
    candidates.extend(p for p in sys.path if p)
    seen: set[Path] = set()
    dirs: list[Path] = []
    for c in candidates:
        p = Path(c)
        if p not in seen:
            seen.add(p)
            dirs.append(p)
    return dirs


def find_openblas() -> Path | None:
    """Locate cmeel-openblas's ``libopenblas.so*``, preferring the SONAME file.

    ``libopenblas.so.0`` is the name the library was linked as; the unversioned
    ``.so`` is a dev symlink that may be missing, the fully versioned one a
    fallback.
    """
    for d in _site_dirs():
        libdir = d / _CMEEL_LIB
        if not libdir.is_dir():
            continue
        preferred = libdir / "libopenblas.so.0"
        if preferred.is_file():
            return preferred
        others = sorted(libdir.glob("libopenblas.so*"))
        for other in others:
            if other.is_file():
                return other
    return None


def preload_blas(mode: str = "auto") -> BlasResult:
    """Load OpenBLAS globally so MLX's CPU matmuls use it; never raises.

    ``mode`` is ``"auto"`` or ``"off"`` (the config's ``blas`` key);
    ``KVD_BLAS=off`` in the environment also disables it. Idempotent: the
    first decision sticks for the life of the process, because a library
    loaded with ``RTLD_GLOBAL`` cannot be taken back.
    """
    global _result
    if mode not in ("auto", "off"):
        raise ValueError(f'blas must be "auto" or "off", not {mode!r}')
    if _result is not None:
        return _result

    if not sys.platform.startswith("linux"):
        if sys.platform == "darwin":
            reason = "not needed: macOS uses Metal/Accelerate"
        else:
            reason = f"not needed: no OpenBLAS interposition on {sys.platform}"
        # Not cached: nothing was decided that a later call could contradict.
        return BlasResult(loaded=False, path=None, reason=reason)

    if mode == "off":
        return BlasResult(False, None, 'reference BLAS: disabled by blas = "off"')
    if os.environ.get(ENV_VAR, "").strip().lower() == "off":
        return BlasResult(False, None, f"reference BLAS: disabled by {ENV_VAR}=off")

    if "mlx.core" in sys.modules:
        # Too late: libmlx's BLAS symbols are already bound. Not cached, so a
        # caller can see this reason every time it asks.
        return BlasResult(
            False,
            None,
            "reference BLAS: mlx.core was imported before kvd could interpose OpenBLAS",
        )

    path = find_openblas()
    if path is None:
        return BlasResult(
            False,
            None,
            "reference BLAS: OpenBLAS not found (pip install cmeel-openblas)",
        )

    try:
        ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        return BlasResult(
            False,
            str(path),
            f"reference BLAS: could not load {path}: {exc} "
            "(on Debian/Ubuntu: apt-get install libgfortran5)",
        )

    _result = BlasResult(
        True, str(path), f"OpenBLAS interposed for MLX's CPU backend: {path}"
    )
    return _result
