"""Ollama's store and the Hugging Face cache as untrusted input (issue 35): hostile stores laid out as
those tools lay them out, with canaries outside them that must never be opened or served.

Opens are watched with a Python audit hook (every ``open``/``os.open`` raises the "open" event), so
"opens nothing outside the stores" is checked, not assumed; the canaries are FIFOs where a read would
hang the test, and a valid GGUF file where serving it would be the failure.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from daemon.models import places
from daemon.models.builtin import ensure_builtin
from daemon.models.catalog import entries, render
from daemon.models.sources import ModelError, prepare_model
from ggufmake import write_llama
from test_model_places import ollama_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"

_watching = threading.local()
_opened: list[str] = []


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "open" and getattr(_watching, "on", False) and isinstance(args[0], (str, bytes, os.PathLike)):
        _opened.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)


@pytest.fixture
def opened() -> Iterator[list[str]]:
    """Every path this thread opens while the test runs."""
    _opened.clear()
    _watching.on = True
    try:
        yield _opened
    finally:
        _watching.on = False


def write_manifest(root: Path, name: str, body: str | bytes) -> Path:
    manifest = root / "manifests" / "registry.ollama.ai" / "library" / name / "latest"
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_bytes(body.encode() if isinstance(body, str) else body)
    return manifest


def model_layer(digest: str) -> str:
    return json.dumps({"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.model", "digest": digest, "size": 1}]})


@pytest.fixture
def hostile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """An Ollama store and an HF cache, each with one good model and every hostile entry the red team made,
    and `outside/` beside them: a GGUF kvd would happily serve, and a FIFO that hangs whoever reads it."""
    outside = tmp_path / "outside"
    outside.mkdir()
    write_llama(outside / "secret.gguf", "Q8_0")
    os.mkfifo(outside / "fifo")
    ollama, hf = tmp_path / "ollama", tmp_path / "hf"
    ollama_model(ollama, "good", "latest", write_llama(tmp_path / "good.gguf", "Q8_0"))
    write_manifest(ollama, "relative", model_layer("../../outside/secret.gguf"))
    write_manifest(ollama, "absolute", model_layer(str(outside / "secret.gguf")))
    write_manifest(ollama, "passwd", model_layer("/etc/passwd"))
    write_manifest(ollama, "fifo-digest", model_layer("sha256:../../outside/fifo"))
    write_manifest(ollama, "nested", "[" * 100_000)
    write_manifest(ollama, "layers-str", '{"layers": "abc"}')
    write_manifest(ollama, "layers-int", '{"layers": [1, 2]}')
    write_manifest(ollama, "not-object", "[1]")
    write_manifest(ollama, "quotes", b'"' + b'\\"' * 400_000)  # an unterminated string: the depth walk stays linear
    big = write_manifest(ollama, "big", b"")
    with open(big, "r+b") as f:
        f.truncate(165_000_000)  # sparse: 165 MB that a whole read would pull into memory
    zero = write_manifest(ollama, "zero", b"")
    zero.unlink()
    zero.symlink_to("/dev/zero")
    fifo = write_manifest(ollama, "fifo", b"")
    fifo.unlink()
    os.mkfifo(fifo)
    outside_manifest = write_manifest(ollama, "linked-manifest", b"")
    outside_manifest.unlink()
    (outside / "manifest").write_text(model_layer("sha256:" + "a" * 64))
    outside_manifest.symlink_to(outside / "manifest")
    linked_blob = "b" * 64
    (ollama / "blobs" / f"sha256-{linked_blob}").symlink_to(outside / "secret.gguf")
    write_manifest(ollama, "linked-blob", model_layer(f"sha256:{linked_blob}"))
    fifo_blob = "c" * 64
    os.mkfifo(ollama / "blobs" / f"sha256-{fifo_blob}")
    write_manifest(ollama, "fifo-blob", model_layer(f"sha256:{fifo_blob}"))
    write_manifest(ollama, "esc\x1b[2Jape", model_layer("x\n\x1b]0;owned\x07"))

    tiny = ensure_builtin("builtin:tiny", tmp_path / "builtin")
    good = hf / "models--kvd--good"
    shutil.copytree(tiny, good / "snapshots" / COMMIT)
    (good / "refs").mkdir()
    (good / "refs" / "main").write_text(COMMIT)
    shutil.copytree(tiny, outside / "hfmodel")

    def hf_repo(name: str, ref: str | None = None) -> Path:
        repo = hf / f"models--kvd--{name}"
        (repo / "refs").mkdir(parents=True)
        (repo / "snapshots").mkdir()
        if ref is not None:
            (repo / "refs" / "main").write_text(ref)
        return repo

    hf_repo("relative", "../../../outside/hfmodel")
    hf_repo("absolute", str(outside / "hfmodel"))
    (hf_repo("zero").joinpath("refs", "main")).symlink_to("/dev/zero")
    os.mkfifo(hf_repo("fifo").joinpath("refs", "main"))
    hf_repo("linked-snapshot", COMMIT).joinpath("snapshots", COMMIT).symlink_to(outside / "hfmodel")
    nested = hf_repo("nested", COMMIT) / "snapshots" / COMMIT
    shutil.copytree(tiny, nested)
    (nested / "config.json").write_text("[" * 100_000)
    linked = hf_repo("linked-file", COMMIT) / "snapshots" / COMMIT
    shutil.copytree(tiny, linked)
    (linked / "tokenizer.json").unlink()
    (linked / "tokenizer.json").symlink_to(outside / "fifo")
    monkeypatch.setenv("OLLAMA_MODELS", str(ollama))
    monkeypatch.setenv("HF_HUB_CACHE", str(hf))
    return {"ollama": ollama, "hf": hf, "outside": outside, "root": tmp_path}


HOSTILE_OLLAMA = {
    "relative": "not sha256: and 64 hex digits", "absolute": "not sha256: and 64 hex digits",
    "passwd": "not sha256: and 64 hex digits", "fifo-digest": "not sha256: and 64 hex digits",
    "nested": "nests deeper than", "layers-str": '"layers" is not a list of objects',
    "layers-int": '"layers" is not a list of objects', "not-object": "holds a JSON list, not an object",
    "quotes": "is not JSON",
    "big": "more than the", "zero": "outside", "fifo": "not a regular file", "linked-manifest": "outside",
    "linked-blob": "does not follow", "fifo-blob": "not a regular file",
}
HOSTILE_HF = {
    "relative": "not a commit hash", "absolute": "not a commit hash", "zero": "outside",
    "fifo": "not a regular file", "linked-snapshot": "outside", "linked-file": "outside",
}


def assert_outside_untouched(opened: list[str], root: Path) -> None:
    touched = [p for p in opened if os.path.realpath(p).startswith(str(root / "outside"))
               or os.path.realpath(p) in ("/etc/passwd", "/dev/zero")]
    assert touched == [], touched


@pytest.mark.parametrize("name", sorted(HOSTILE_OLLAMA))
def test_a_hostile_ollama_manifest_is_one_refusal_and_opens_nothing_outside(
        name: str, hostile: dict[str, Path], opened: list[str]) -> None:
    with pytest.raises(places.PlaceError) as refused:
        places.resolve(f"ollama:{name}")
    assert HOSTILE_OLLAMA[name] in str(refused.value), refused.value
    assert "\n" not in str(refused.value)
    assert_outside_untouched(opened, hostile["root"])


@pytest.mark.parametrize("name", sorted(HOSTILE_HF))
def test_a_hostile_hugging_face_repo_is_one_refusal_and_opens_nothing_outside(
        name: str, hostile: dict[str, Path], opened: list[str]) -> None:
    with pytest.raises(places.PlaceError) as refused:
        places.resolve(f"hf:kvd/{name}")
    assert HOSTILE_HF[name] in str(refused.value), refused.value
    assert_outside_untouched(opened, hostile["root"])


def test_a_config_json_nested_too_deep_is_refused_without_a_recursion_error(
        hostile: dict[str, Path], opened: list[str]) -> None:
    with pytest.raises(ModelError, match="nests deeper than 64 levels"):
        prepare_model("hf:kvd/nested", hostile["root"] / "kvd")


def test_the_good_models_still_resolve_inside_their_stores(hostile: dict[str, Path]) -> None:
    blob = places.resolve("ollama:good")
    assert blob is not None and blob.is_file() and blob.parent == hostile["ollama"].resolve() / "blobs"
    assert places.resolve("hf:kvd/good") == hostile["hf"] / "models--kvd--good" / "snapshots" / COMMIT


def test_kvd_models_lists_every_broken_entry_and_goes_on(hostile: dict[str, Path], opened: list[str]) -> None:
    found = {e.name: e for e in entries(hostile["root"] / "kvd" / "models")}
    assert found["ollama:good:latest"].runs == "yes"
    assert found["hf:kvd/good"].runs == "yes"
    for name, why in HOSTILE_OLLAMA.items():
        assert found[f"ollama:{name}:latest"].runs.startswith("no (broken): ") and why in found[
            f"ollama:{name}:latest"].runs, found[f"ollama:{name}:latest"]
    for name, why in HOSTILE_HF.items():
        assert found[f"hf:kvd/{name}"].runs.startswith("no (broken): ") and why in found[f"hf:kvd/{name}"].runs
    assert_outside_untouched(opened, hostile["root"])
    lines = render(list(found.values()))
    assert len(lines) == len(found) + 1 and not any("\x1b" in line or "\x07" in line for line in lines)
    assert any("ollama:esc\\x1b[2Jape:latest" in line for line in lines)


def run_kvd(*args: str, env: dict[str, Path]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "daemon.cli", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OLLAMA_MODELS": str(env["ollama"]), "HF_HUB_CACHE": str(env["hf"])})


def test_kvd_serve_refuses_a_hostile_store_with_one_escaped_line(hostile: dict[str, Path]) -> None:
    for i, model in enumerate(["ollama:relative", "hf:kvd/relative", "ollama:fifo", "ollama:esc\x1b[2Jape"]):
        out = run_kvd("serve", "--port", "0", "--model", model, "--data-dir", str(hostile["root"] / f"kvd{i}"),
                      env=hostile)
        errors = [line for line in out.stderr.splitlines() if line.startswith("kvd: error: ")]
        assert out.returncode == 1 and len(errors) == 1 and "Traceback" not in out.stderr, out.stderr
        assert "\x1b" not in out.stderr and "\x07" not in out.stderr, out.stderr
    assert "\\x1b[2J" in errors[0], errors


def test_kvd_models_with_a_hostile_store_exits_cleanly(hostile: dict[str, Path]) -> None:
    out = run_kvd("models", "--data-dir", str(hostile["root"] / "kvd"), env=hostile)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert "ollama:good:latest" in out.stdout and out.stdout.count("no (broken): ") == len(HOSTILE_OLLAMA) + len(
        HOSTILE_HF) + 1  # + the escaped name, whose digest is no digest
