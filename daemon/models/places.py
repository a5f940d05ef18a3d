"""Models where people already keep them: Ollama's store and the Hugging Face cache.

- ``ollama:NAME[:TAG]`` reads Ollama's manifest
  (``$OLLAMA_MODELS`` or ``~/.ollama/models``, then
  ``manifests/registry.ollama.ai/library/NAME/TAG``; ``NAMESPACE/NAME`` and
  ``HOST/NAMESPACE/NAME`` as Ollama writes them) and returns the GGUF blob its
  model layer names (``blobs/sha256-…``).
- ``hf:ORG/NAME`` is a model the Hugging Face cache already holds
  (``$HF_HUB_CACHE``, ``$HF_HOME/hub`` or ``~/.cache/huggingface/hub``, then
  ``models--ORG--NAME/snapshots/<the revision refs/main names>``): an mlx-lm
  or safetensors folder, or the one GGUF file in it.

kvd never fetches from a hub here: a name that is not on disk is an error
that says where it looked.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["HF_PREFIX", "OLLAMA_PREFIX", "Found", "PlaceError", "hf_cache", "ollama_models", "resolve",
           "walk_hf", "walk_ollama"]

OLLAMA_PREFIX = "ollama:"
HF_PREFIX = "hf:"
OLLAMA_REGISTRY = "registry.ollama.ai"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"


class PlaceError(Exception):
    """The name is not on this machine (or its manifest is unreadable); says where kvd looked."""


@dataclass(frozen=True)
class Found:
    name: str  # as --model takes it: ollama:llama3.2:1b, hf:org/name
    path: Path  # the GGUF file or the model folder


def ollama_models() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models").expanduser()


def hf_cache() -> Path:
    if cache := os.environ.get("HF_HUB_CACHE"):
        return Path(cache).expanduser()
    home = os.environ.get("HF_HOME")
    return (Path(home).expanduser() if home else Path.home() / ".cache" / "huggingface") / "hub"


def resolve(model: str) -> Path | None:
    """The file or folder an ``ollama:`` or ``hf:`` name stands for; None for any other setting."""
    if model.startswith(OLLAMA_PREFIX):
        return _ollama(model[len(OLLAMA_PREFIX):])
    if model.startswith(HF_PREFIX):
        return _hf(model[len(HF_PREFIX):])
    return None


def _ollama_parts(name: str) -> tuple[str, str]:
    """(the manifest's path under manifests/, the tag) for NAME[:TAG]."""
    base, _, tag = name.partition(":")
    parts = [p for p in base.split("/") if p]
    if not parts or any(p in (".", "..") for p in parts) or "/" in tag or tag in (".", ".."):
        raise PlaceError(f"{OLLAMA_PREFIX}{name} is not an Ollama model name (NAME[:TAG], as `ollama list` shows)")
    if len(parts) == 1:
        parts = [OLLAMA_REGISTRY, "library", *parts]
    elif len(parts) == 2:
        parts = [OLLAMA_REGISTRY, *parts]
    return "/".join(parts), tag or "latest"


def _ollama(name: str) -> Path:
    root = ollama_models()
    base, tag = _ollama_parts(name)
    manifest = root / "manifests" / base / tag
    try:
        layers = json.loads(manifest.read_text(encoding="utf-8"))["layers"]
        digest = next(layer["digest"] for layer in layers if layer.get("mediaType") == OLLAMA_MODEL_LAYER)
    except FileNotFoundError:
        raise PlaceError(f"Ollama has no model {name!r} here (no {manifest}); `ollama list` shows what it "
                         f"has, `kvd models` what kvd can find") from None
    except (OSError, ValueError, KeyError, TypeError, StopIteration) as e:
        raise PlaceError(f"{manifest} is not a readable Ollama manifest with a model layer ({e!r})") from None
    blob = root / "blobs" / str(digest).replace(":", "-")
    if not blob.is_file():
        raise PlaceError(f"Ollama's manifest for {name!r} names {blob}, which is missing; `ollama pull {name}` "
                         "fetches it again")
    return blob


def _hf(repo: str) -> Path:
    org, _, name = repo.partition("/")
    if not org or not name or "/" in name or ".." in (org, name):
        raise PlaceError(f"{HF_PREFIX}{repo} is not a Hugging Face model name (ORG/NAME)")
    folder = hf_cache() / f"models--{org}--{name}"
    snapshot = _snapshot(folder)
    if snapshot is None:
        raise PlaceError(f"the Hugging Face cache has no {repo} ({folder} has no snapshot); kvd never "
                         "downloads: fetch it with `hf download` (or huggingface-cli) first")
    if (snapshot / "config.json").exists():
        return snapshot
    ggufs = sorted(snapshot.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        raise PlaceError(f"{snapshot} holds {len(ggufs)} GGUF files; name one with --model PATH")
    raise PlaceError(f"{snapshot} has neither a config.json (an mlx-lm or safetensors model) nor a GGUF file")


def _snapshot(folder: Path) -> Path | None:
    """The revision refs/main names, or the newest snapshot if there is no ref."""
    try:
        revision = (folder / "refs" / "main").read_text().strip()
        if (folder / "snapshots" / revision).is_dir():
            return folder / "snapshots" / revision
    except OSError:
        pass
    snapshots = sorted((p for p in (folder / "snapshots").glob("*") if p.is_dir()),
                       key=lambda p: p.stat().st_mtime) if (folder / "snapshots").is_dir() else []
    return snapshots[-1] if snapshots else None


def walk_ollama() -> Iterator[Found]:
    """Every model Ollama's manifests name (that resolves), as ollama:NAME:TAG."""
    manifests = ollama_models() / "manifests"
    if not manifests.is_dir():
        return
    for manifest in sorted(p for p in manifests.rglob("*") if p.is_file()):
        parts = manifest.relative_to(manifests).parts
        if len(parts) < 3:
            continue
        if parts[0] == OLLAMA_REGISTRY and parts[1] == "library":
            name = "/".join(parts[2:-1])
        elif parts[0] == OLLAMA_REGISTRY:
            name = "/".join(parts[1:-1])
        else:
            name = "/".join(parts[:-1])
        full = f"{name}:{parts[-1]}"
        try:
            yield Found(f"{OLLAMA_PREFIX}{full}", _ollama(full))
        except PlaceError:
            continue


def walk_hf() -> Iterator[Found]:
    """Every model the Hugging Face cache holds that kvd could load, as hf:ORG/NAME."""
    cache = hf_cache()
    if not cache.is_dir():
        return
    for folder in sorted(cache.glob("models--*--*")):
        org, _, name = folder.name[len("models--"):].partition("--")
        try:
            yield Found(f"{HF_PREFIX}{org}/{name}", _hf(f"{org}/{name}"))
        except PlaceError:
            continue
