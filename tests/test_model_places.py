"""Models where people keep them: an Ollama store and a Hugging Face cache laid out here as those
tools lay them out, found by `kvd models`, served by `kvd serve --model ollama:…` / `hf:…`."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from daemon.models.builtin import ensure_builtin
from daemonproc import DaemonProcess
from ggufmake import write_llama


def ollama_model(root: Path, name: str, tag: str, gguf: Path) -> None:
    """What `ollama pull` leaves: a blob named by its digest, a manifest whose model layer names it."""
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    shutil.copy(gguf, root / "blobs" / f"sha256-{digest}")
    manifest = root / "manifests" / "registry.ollama.ai" / "library" / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "0" * 64, "size": 1},
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}",
         "size": gguf.stat().st_size}]}))


@pytest.fixture
def places(tmp_path: Path) -> dict[str, str]:
    ollama, hf = tmp_path / "ollama", tmp_path / "hf"
    ollama_model(ollama, "tinyllama", "latest", write_llama(tmp_path / "tiny.gguf", "Q8_0"))
    ollama_model(ollama, "odd", "1b", write_llama(tmp_path / "odd.gguf", "F32", arch="gpt2"))
    snapshot = hf / "models--kvd--tiny" / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(ensure_builtin("builtin:tiny", tmp_path / "builtin"), snapshot)
    (hf / "models--kvd--tiny" / "refs").mkdir()
    (hf / "models--kvd--tiny" / "refs" / "main").write_text("0123456789abcdef0123456789abcdef01234567")
    return {"OLLAMA_MODELS": str(ollama), "HF_HUB_CACHE": str(hf)}


def test_kvd_models_lists_what_is_here_and_why_a_model_cannot_run(places: dict[str, str], tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "daemon.cli", "models", "--data-dir", str(tmp_path / "kvd")],
                         capture_output=True, text=True, timeout=120, env={**os.environ, **places})
    assert out.returncode == 0, out.stderr
    lines = {line.split()[0]: line for line in out.stdout.splitlines()[1:]}
    assert set(lines) >= {"builtin:smollm2", "builtin:gemma3", "ollama:tinyllama:latest", "ollama:odd:1b",
                          "hf:kvd/tiny"}
    tiny = lines["ollama:tinyllama:latest"].split()
    # ... caches, context, loaded, runs: a plain cache, not loaded (no daemon runs here), and it can run
    assert tiny[1:3] == ["Ollama", "llama"] and tiny[-4] == "plain" and tiny[-2:] == ["-", "yes"], tiny
    assert "no: " in lines["ollama:odd:1b"] and "is a 'gpt2' model" in lines["ollama:odd:1b"]
    hf = lines["hf:kvd/tiny"].split()
    assert hf[1:5] == ["Hugging", "Face", "cache", "qwen2"] and hf[-4] == "plain" and hf[-2:] == ["-", "yes"], hf


def test_serve_an_ollama_model_and_a_hugging_face_cache_model_by_name(places: dict[str, str],
                                                                        tmp_path: Path) -> None:
    for i, model in enumerate(["ollama:tinyllama", "hf:kvd/tiny"]):
        d = DaemonProcess(tmp_path / f"kvd{i}", "--model", model, env=places)
        try:
            with d.client() as c:
                sid = c.request("session.create")["session"]["id"]
                _, done = c.chat(sid, "the the", max_tokens=3, temperature=0)
        finally:
            d.terminate()
        assert done["type"] == "chat.done", (model, done)
    missing = subprocess.run([sys.executable, "-m", "daemon.cli", "serve", "--port", "0", "--model",
                              "ollama:nothere:7b", "--data-dir", str(tmp_path / "kvd9")],
                             capture_output=True, text=True, timeout=120, env={**os.environ, **places})
    errors = [line for line in missing.stderr.splitlines() if line.startswith("kvd: error: ")]
    assert missing.returncode == 1 and len(errors) == 1 and "Traceback" not in missing.stderr
    assert "Ollama has no model 'nothere:7b'" in errors[0], errors


def test_a_built_in_models_own_download_is_not_listed_as_another_model(tmp_path: Path) -> None:
    """/v1/models listed the default model twice: as builtin:smollm2 and as its downloaded GGUF's path."""
    from daemon.models import gemma3, smollm2
    from daemon.models.catalog import entries

    downloads = tmp_path / "downloads"
    downloads.mkdir()
    for name in (smollm2.GGUF_NAME, gemma3.GGUF_NAME, "mine.gguf"):
        (downloads / name).write_bytes(b"GGUF")
    names = [e.name for e in entries(tmp_path)]
    assert str(downloads / "mine.gguf") in names, names  # a file the user put there is listed
    assert not [n for n in names if n.endswith((smollm2.GGUF_NAME, gemma3.GGUF_NAME))], names
