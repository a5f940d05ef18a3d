"""OpenBLAS interposition, checked in fresh subprocesses.

Each check runs in its own interpreter: whether the trick works depends on
whether ``mlx.core`` was imported first, and pytest may already have imported
it here through another test module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from daemon.service.blas import BlasResult, find_openblas, preload_blas

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="OpenBLAS interposition is Linux-only"
)

_MATMUL = """
import numpy as np
import mlx.core as mx
rng = np.random.default_rng(0)
a = rng.standard_normal((256, 192), dtype=np.float32)
b = rng.standard_normal((192, 128), dtype=np.float32)
c = np.array(mx.array(a) @ mx.array(b))
ok = bool(np.allclose(c, a @ b, rtol=1e-4, atol=1e-3))
"""


def _run(code: str, env: dict[str, str] | None = None) -> tuple[dict[str, object], str]:
    """Run ``code`` in a fresh interpreter; it must print one JSON line last."""
    full_env = {k: v for k, v in os.environ.items() if k != "KVD_BLAS"}
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_find_openblas_prefers_soname() -> None:
    path = find_openblas()
    assert path is not None, "cmeel-openblas is a Linux dependency of kvd"
    assert path.name == "libopenblas.so.0"
    assert path.parent.parts[-2:] == ("cmeel.prefix", "lib")


def test_preload_then_import_binds_mlx_to_openblas() -> None:
    # LD_DEBUG=bindings makes the dynamic linker report which library each of
    # libmlx's BLAS symbols resolved to: proof without timing anything.
    code = (
        "import json\n"
        "from daemon.service.blas import preload_blas\n"
        "r = preload_blas()\n"
        "again = preload_blas()\n"
        + _MATMUL
        + "print(json.dumps({'loaded': r.loaded, 'path': r.path, 'reason': r.reason,"
        " 'same': again == r, 'ok': ok}))\n"
    )
    out, stderr = _run(code, env={"LD_DEBUG": "bindings"})
    assert out["loaded"] is True
    assert out["same"] is True
    assert out["ok"] is True
    assert str(out["path"]).endswith("libopenblas.so.0")
    assert "OpenBLAS interposed" in str(out["reason"])
    sgemm = [
        line
        for line in stderr.splitlines()
        if "libmlx" in line and "`cblas_sgemm'" in line
    ]
    assert sgemm, "libmlx never bound cblas_sgemm"
    assert all("libopenblas" in line for line in sgemm)


def test_too_late_after_mlx_import() -> None:
    code = (
        "import json\n"
        "import mlx.core\n"
        "from daemon.service.blas import preload_blas\n"
        "r = preload_blas()\n"
        + _MATMUL
        + "print(json.dumps({'loaded': r.loaded, 'reason': r.reason, 'ok': ok}))\n"
    )
    out, _ = _run(code)
    assert out["loaded"] is False
    assert "mlx.core was imported before" in str(out["reason"])
    assert out["ok"] is True


@pytest.mark.parametrize(
    ("env", "call", "needle"),
    [
        ({"KVD_BLAS": "off"}, "preload_blas()", "KVD_BLAS=off"),
        ({}, "preload_blas('off')", 'blas = "off"'),
    ],
)
def test_disabled(env: dict[str, str], call: str, needle: str) -> None:
    code = (
        "import json, sys\n"
        "from daemon.service.blas import preload_blas\n"
        f"r = {call}\n"
        "maps = open('/proc/self/maps').read()\n"
        "print(json.dumps({'loaded': r.loaded, 'reason': r.reason,"
        " 'mapped': 'libopenblas' in maps, 'mlx': 'mlx.core' in sys.modules}))\n"
    )
    out, _ = _run(code, env=env)
    assert out == {"loaded": False, "reason": out["reason"], "mapped": False, "mlx": False}
    assert needle in str(out["reason"])


def test_bad_mode_is_rejected() -> None:
    # Raises before anything is loaded, so it is safe in-process.
    with pytest.raises(ValueError, match="auto"):
        preload_blas("fast")


def test_result_is_frozen() -> None:
    r = BlasResult(loaded=False, path=None, reason="x")
    with pytest.raises(AttributeError):
        r.loaded = True  # type: ignore[misc]
