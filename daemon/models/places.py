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

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .untrusted import StoreError, inside, printable, read_json, read_small

__all__ = ["HF_PREFIX", "OLLAMA_PREFIX", "Broken", "Found", "PlaceError", "hf_cache", "ollama_models", "resolve",
           "walk_hf", "walk_ollama"]

OLLAMA_PREFIX = "ollama:"
HF_PREFIX = "hf:"
OLLAMA_REGISTRY = "registry.ollama.ai"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
MANIFEST_CAP = 1 << 20  # bytes: Ollama's manifests are about 1 KB
REF_CAP = 256  # bytes: refs/main holds one commit hash
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_COMMIT = re.compile(r"[0-9a-f]{40}")


class PlaceError(Exception):
    """The name is not on this machine (or its manifest is unreadable); says where kvd looked."""


@dataclass(frozen=True)
class Found:
    name: str  # as --model takes it: ollama:llama3.2:1b, hf:org/name
    path: Path  # the GGUF file or the model folder


@dataclass(frozen=True)
class Broken:
    name: str  # as --model would take it, control characters escaped
    reason: str  # why it does not resolve (a PlaceError's message)


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
        raise PlaceError(f"{OLLAMA_PREFIX}{printable(name)} is not an Ollama model name "
                         "(NAME[:TAG], as `ollama list` shows)")
    if len(parts) == 1:
        parts = [OLLAMA_REGISTRY, "library", *parts]
    elif len(parts) == 2:
        parts = [OLLAMA_REGISTRY, *parts]
    return "/".join(parts), tag or "latest"


def _ollama(name: str) -> Path:
    root = ollama_models()
    base, tag = _ollama_parts(name)
    manifest = root / "manifests" / base / tag
    shown = printable(name)
    try:
        digest = model_digest(read_json(manifest, root, MANIFEST_CAP))
    except FileNotFoundError:
        raise PlaceError(f"Ollama has no model {shown!r} here (no {printable(str(manifest))}); `ollama list` "
                         "shows what it has, `kvd models` what kvd can find") from None
    except StoreError as e:
        raise PlaceError(f"Ollama's manifest for {shown!r} is refused: {e}") from None
    blob = root / "blobs" / digest.replace(":", "-")
    try:
        real = inside(blob, root)
    except StoreError as e:
        raise PlaceError(f"Ollama's manifest for {shown!r} names a blob kvd does not follow: {e}; kvd follows "
                         "symlinks only inside Ollama's store (pass the file itself with --model PATH)") from None
    if not real.is_file():
        raise PlaceError(f"Ollama's manifest for {shown!r} names {printable(str(blob))}, which is "
                         f"{'missing' if not real.exists() else 'not a regular file'}; `ollama pull {shown}` "
                         "fetches it again")
    return real


def model_digest(manifest: dict[str, Any]) -> str:
    """The digest of the manifest's model layer, checked to be ``sha256:`` and 64 hex digits."""
    layers = manifest.get("layers")
    if not isinstance(layers, list) or not all(isinstance(layer, dict) for layer in layers):
        raise StoreError("its \"layers\" is not a list of objects")
    models = [layer for layer in layers if layer.get("mediaType") == OLLAMA_MODEL_LAYER]
    if not models:
        raise StoreError(f"it has no {OLLAMA_MODEL_LAYER} layer")
    digest = models[0].get("digest")
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise StoreError(f"its model layer's digest {printable(repr(digest))[:100]} is not sha256: and 64 hex digits")
    return digest


def _hf(repo: str) -> Path:
    org, _, name = repo.partition("/")
    if not org or not name or "/" in name or ".." in (org, name) or org == ".":
        raise PlaceError(f"{HF_PREFIX}{printable(repo)} is not a Hugging Face model name (ORG/NAME)")
    folder = hf_cache() / f"models--{org}--{name}"
    try:
        inside(folder, hf_cache())
        snapshot = _snapshot(folder)
        if snapshot is not None:
            _check_snapshot(snapshot, folder)
    except StoreError as e:
        raise PlaceError(f"the Hugging Face cache's {printable(repo)} is refused: {e}") from None
    if snapshot is None:
        raise PlaceError(f"the Hugging Face cache has no {printable(repo)} ({printable(str(folder))} has no "
                         "snapshot); kvd never downloads: fetch it with `hf download` (or huggingface-cli) first")
    if (snapshot / "config.json").exists():
        return snapshot
    ggufs = sorted(snapshot.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    where = printable(str(snapshot))
    if ggufs:
        raise PlaceError(f"{where} holds {len(ggufs)} GGUF files; name one with --model PATH")
    raise PlaceError(f"{where} has neither a config.json (an mlx-lm or safetensors model) nor a GGUF file")


def _snapshot(folder: Path) -> Path | None:
    """The revision refs/main names (a commit hash), or the newest snapshot if there is no ref."""
    snapshots = folder / "snapshots"
    try:
        ref = read_small(folder / "refs" / "main", folder, REF_CAP).decode("ascii", "replace").strip()
    except FileNotFoundError:
        ref = None
    if ref is not None:
        if not _COMMIT.fullmatch(ref):
            raise StoreError(f"its refs/main {printable(repr(ref))[:100]} is not a commit hash")
        found = snapshots / ref
        if inside(found, folder).is_dir():
            return found
    try:
        names = sorted(os.listdir(snapshots)) if inside(snapshots, folder).is_dir() else []
    except OSError:
        names = []
    dirs = [snapshots / n for n in names if _COMMIT.fullmatch(n) and inside(snapshots / n, folder).is_dir()]
    return max(dirs, key=lambda p: p.stat().st_mtime) if dirs else None


def _check_snapshot(snapshot: Path, folder: Path) -> None:
    """Every file in the snapshot resolves inside the repo's folder (the cache links them into
    ``../../blobs``) and is a regular file: mlx-lm opens them all, and a FIFO would hang it."""
    if not inside(snapshot, folder).is_dir():
        raise StoreError(f"{printable(str(snapshot))} is not a directory")
    for top, dirs, files in os.walk(snapshot):
        for entry in (*dirs, *files):
            path = Path(top) / entry
            real = inside(path, folder)
            if entry in dirs and path.is_symlink():
                raise StoreError(f"{printable(str(path))} is a linked folder")
            if entry in files and not real.is_file():
                raise StoreError(f"{printable(str(path))} is not a regular file")


def walk_ollama() -> Iterator[Found | Broken]:
    """Every model Ollama's manifests name, as ollama:NAME:TAG; one that does not resolve as Broken.
    Links are not followed while walking: a manifest is a regular file under manifests/."""
    manifests = ollama_models() / "manifests"
    if not manifests.is_dir():
        return
    found: list[Path] = []
    for top, dirs, files in os.walk(manifests):
        dirs.sort()
        found += (Path(top) / f for f in files)
    for manifest in sorted(found):
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
        except PlaceError as e:
            yield Broken(f"{OLLAMA_PREFIX}{printable(full)}", str(e))


def walk_hf() -> Iterator[Found | Broken]:
    """Every model the Hugging Face cache holds, as hf:ORG/NAME; one kvd cannot use as Broken."""
    cache = hf_cache()
    if not cache.is_dir():
        return
    for folder in sorted(cache.glob("models--*--*")):
        org, _, name = folder.name[len("models--"):].partition("--")
        try:
            yield Found(f"{HF_PREFIX}{org}/{name}", _hf(f"{org}/{name}"))
        except PlaceError as e:
            yield Broken(f"{HF_PREFIX}{printable(org)}/{printable(name)}", str(e))
