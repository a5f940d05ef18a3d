"""scripts/mlx-backend.sh: the MLX backend `make serve` and `make test` install, from what nvidia-smi says."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "mlx-backend.sh"


def choice(tmp_path: Path, smi: str | None) -> str:
    """The script's answer with `smi` as nvidia-smi's body (None: no nvidia-smi on PATH)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("uname", "grep", "head"):  # what the script uses besides nvidia-smi
        (bin_dir / tool).unlink(missing_ok=True)
        (bin_dir / tool).symlink_to(next(p for d in os.defpath.split(":") + ["/usr/bin", "/bin"]
                                         if (p := Path(d) / tool).exists()))
    (bin_dir / "nvidia-smi").unlink(missing_ok=True)
    if smi is not None:
        (bin_dir / "nvidia-smi").write_text("#!/bin/sh\n" + smi)
        (bin_dir / "nvidia-smi").chmod(0o755)
    out = subprocess.run(["/bin/bash", str(SCRIPT)], capture_output=True, text=True, check=True,
                         env={"PATH": str(bin_dir)})
    return out.stdout.strip()


GPU = ('case "$1" in -L) echo "GPU 0: NVIDIA H200 (UUID: GPU-1)";; '
       '*) echo "{driver}";; esac\n')


@pytest.mark.parametrize(("smi", "want"), [
    (None, "cpu"),
    ('echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver"; exit 9\n', "cpu"),
    (GPU.format(driver="580.65.06"), "cuda13"),
    (GPU.format(driver="590.10"), "cuda13"),
    (GPU.format(driver="550.54.14"), "cuda12"),
])
def test_the_backend_follows_the_gpu_and_its_driver(tmp_path: Path, smi: str | None, want: str) -> None:
    assert choice(tmp_path, smi) == (want if os.uname().sysname != "Darwin" else "metal")
