"""`kvd models`: what kvd can find on this machine, one line each.

Its built-in models, the GGUF files and converted models in its own store,
Ollama's models and the Hugging Face cache (places.py). For each: the name
`--model` takes, the architecture, the size on disk, the encoding, the
cache kinds the model needs (``plain`` KV caches; ``rotating`` for
sliding-window layers; ``recurrent`` for recurrent or linear-attention
layers, a hybrid model's), and whether kvd can run it, or why not. Only file
headers and config.json are read: listing never converts or loads weights.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import gguf as gguf_convert
from . import places
from .builtintok import MAX_LEN
from .footprint import context_length
from .ggufinfo import GGUFError, read_info
from .untrusted import StoreError, printable, read_json

#: bytes of config.json read at most: real ones are a few KB, the largest a few hundred.
CONFIG_CAP = 16 << 20
#: The fetched built-ins' context lengths, for the listing before their first fetch (their GGUFs say so).
FETCHED_CONTEXT = {"builtin:smollm2": 8192, "builtin:gemma3": 32768}

__all__ = ["SERVED_ALIAS", "CatalogEntry", "entries", "model_names", "render"]

SERVED_ALIAS = "kvd"  # the one name that always means the default model (docs/openai.md's examples use it)


def model_names(model: str) -> set[str]:
    """The names a request may give `model`: the name itself, a path's file or folder name, and a
    prefixed name without its prefix (Ollama's name for it, llama3.2:1b; the repo's; smollm2)."""
    names = {model}
    for prefix in ("ollama:", "hf:", "builtin:"):
        if model.startswith(prefix):
            return names | {model[len(prefix):]}
    if "/" in model or model.endswith(".gguf"):
        tail = model.rstrip("/").rsplit("/", 1)[-1]
        names |= {tail, tail.removesuffix(".gguf")}
    return names


@dataclass(frozen=True)
class CatalogEntry:
    name: str  # what --model takes
    where: str  # built-in, kvd's store, Ollama, Hugging Face cache
    architecture: str
    size: int | None  # bytes on disk (None: not on this machine yet)
    encoding: str
    caches: str  # "plain", "plain + rotating", "plain + recurrent", "recurrent"
    runs: str  # "yes", or why not
    context: int | None = None  # its context length in tokens, as its files say (None: they do not)
    path: Path | None = None  # its file or folder on this machine (None: not there yet)


def _file_type(meta: dict[str, Any]) -> str:
    value = meta.get("general.file_type")
    try:
        from gguf import LlamaFileType

        return LlamaFileType(int(value)).name.removeprefix("MOSTLY_") if value is not None else "?"
    except (ValueError, TypeError):
        return str(value)


def gguf_entry(name: str, where: str, path: Path) -> CatalogEntry:
    try:
        info = read_info(path)
    except (GGUFError, OSError) as e:
        return CatalogEntry(name, where, "?", _size(path), "?", "?", f"no: {e}", path=path)
    arch = info.architecture
    rotating = f"{arch}.attention.sliding_window" in info.metadata
    try:
        gguf_convert.check_supported(info, path)
        runs = "yes"
    except gguf_convert.UnsupportedGGUF as e:
        runs = f"no: {e}"
    context = info.metadata.get(f"{arch}.context_length")
    return CatalogEntry(name, where, str(arch), info.file_size, _file_type(info.metadata),
                 "plain + rotating" if rotating else "plain", runs,
                 context=int(context) if isinstance(context, int) and context > 0 else None, path=path)


def folder_entry(name: str, where: str, path: Path) -> CatalogEntry:
    try:
        config = read_json(path / "config.json", None, CONFIG_CAP)
    except (OSError, StoreError) as e:
        return CatalogEntry(name, where, "?", _size(path), "?", "?", f"no: config.json unreadable ({e})", path=path)
    arch = str(config.get("model_type", "?"))
    quant = config.get("quantization") or config.get("quantization_config") or {}
    encoding = f"{quant['bits']}-bit" if isinstance(quant, dict) and "bits" in quant else str(
        config.get("torch_dtype") or config.get("dtype") or "?")
    rotating = arch.startswith(("gemma2", "gemma3")) or "sliding_attention" in (config.get("layer_types") or [])
    caches = "plain + rotating" if rotating else "plain"
    try:
        from mlx_lm.utils import _get_classes

        caches = _recurrent(_get_classes(config)[0], caches)
        runs = "yes"
    except (ValueError, KeyError, ImportError) as e:
        runs = f"no: mlx-lm has no {arch!r} model ({e})"
    return CatalogEntry(name, where, arch, _size(path), encoding, caches, runs, context=context_length(config),
                 path=path)


def _recurrent(model_class: type, caches: str) -> str:
    """`caches` with recurrent layers where mlx-lm's model keeps state in an `ArraysCache` (its module's source,
    or a base class's, makes one: Qwen3.5, Nemotron-H, LFM2, Mamba...), read without building the model."""
    sources = []
    for cls in model_class.__mro__:
        module = sys.modules.get(cls.__module__)
        if module is not None and module.__name__.startswith("mlx_lm.models."):
            try:
                sources.append(inspect.getsource(module))
            except (OSError, TypeError):
                continue
    if not any("ArraysCache(" in s for s in sources):
        return caches
    return f"{caches} + recurrent" if any("KVCache(" in s for s in sources) else "recurrent"


def _size(path: Path) -> int | None:
    try:
        if path.is_file():
            return path.stat().st_size
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    except OSError:
        return None


def entries(models_dir: Path) -> Iterator[CatalogEntry]:
    """Everything kvd can find, its built-in models first."""
    from .builtin import BUILTIN_NAMES
    from .sources import FETCHED, _converted_dir, default_mode

    for name, (sha, _) in FETCHED.items():
        done = _converted_dir(models_dir, sha, default_mode())
        if (done / "config.json").exists():
            yield folder_entry(name, "built-in (converted)", done)
        else:
            yield CatalogEntry(name, "built-in", "?", None, "?", "?", "yes (fetched from PyPI on first use)",
                        context=FETCHED_CONTEXT.get(name))
    for name in BUILTIN_NAMES:
        yield CatalogEntry(name, "built-in", "qwen2" if name == "builtin:tiny" else "gemma3_text", None, "float32",
                    "plain" if name == "builtin:tiny" else "plain + rotating", "yes (random weights, for tests)",
                    context=MAX_LEN)
    from . import gemma3, smollm2

    sources = {smollm2.GGUF_NAME, gemma3.GGUF_NAME}  # the built-ins' own downloads: listed by their names above
    for path in sorted((models_dir / "downloads").glob("*.gguf")):
        if path.name not in sources:
            yield gguf_entry(str(path), "kvd's downloads", path)
    for found in places.walk_ollama():
        if isinstance(found, places.Broken):
            yield _broken(found, "Ollama")
        else:
            yield gguf_entry(found.name, "Ollama", found.path)
    for found in places.walk_hf():
        if isinstance(found, places.Broken):
            yield _broken(found, "Hugging Face cache")
        elif found.path.is_file():
            yield gguf_entry(found.name, "Hugging Face cache", found.path)
        else:
            yield folder_entry(found.name, "Hugging Face cache", found.path)


def _broken(found: places.Broken, where: str) -> CatalogEntry:
    return CatalogEntry(found.name, where, "?", None, "?", "?", f"no (broken): {found.reason}")


def _human(size: int | None) -> str:
    if size is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000  # type: ignore[assignment]
    return "-"


def render(found: list[CatalogEntry], loaded: dict[str, str] | None = None) -> list[str]:
    """One line per model, in columns; the reason a model cannot run ends its line. `loaded`: the running
    daemon's models and their states (None: no daemon answered; the column says "-")."""
    rows: list[tuple[str, ...]] = [("model", "from", "architecture", "size", "encoding", "caches", "context",
                                    "loaded", "runs")]
    rows += [tuple(printable(cell) for cell in (
        e.name, e.where, e.architecture, _human(e.size), e.encoding, e.caches,
        str(e.context) if e.context else "-", "-" if loaded is None else loaded.get(e.name, "no"), e.runs))
        for e in found]
    widths = [max(len(r[i]) for r in rows) for i in range(8)]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r[:8], widths)) + "  " + r[8] for r in rows]
