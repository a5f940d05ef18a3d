"""kvd's configuration: defaults stated once, a TOML file, then command-line flags.

The defaults here are the ones config.toml at the repository root documents;
tests/test_config.py keeps the two equal.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.sizes import BLOCK_TOKENS
from protocol import DEFAULT_HOST, DEFAULT_PORT, default_data_dir
from protocol import PARAMS as SAMPLING  # [generation]'s keys, validated as a request's sampling values are

if TYPE_CHECKING:  # protocol.shapes imports pydantic: loaded with a config file, so `kvd status` starts without it
    from protocol.shapes import Limits, Sampling

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(Exception):
    """The configuration file or a flag is wrong; the message says which key and why."""


@dataclass(frozen=True)
class Config:
    # Model
    model: str = "builtin:smollm2"
    blas: str = "auto"  # "auto", "off" or a library's path (daemon/service/blas.py)
    blas_threads: int = 0  # 0: the CPUs this process may use
    # Models: several in one daemon, loaded by name on first use (daemon/engine/registry.py)
    keep_alive: float = 300.0  # seconds an idle model stays loaded (inf: until another needs its memory)
    models_memory: int = 0  # bytes the models' weights and their caches in memory may take together; 0: the device's
    aliases: tuple[tuple[str, str], ...] = ()  # (alias, model) pairs: names a request may use for a model
    # Where kvd keeps its database, token, caches and built-in models
    data_dir: Path = field(default_factory=default_data_dir)
    log_file: Path | None = None  # None: <data_dir>/kvd.log
    # Server
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    allowed_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()
    # The HTTP API: other model names a request may give the served model ("*": every name)
    model_aliases: tuple[str, ...] = ()
    # Who may use Ollama's API (/api/...) without the token: "loopback" (a client on this machine that sends
    # none; pull and delete still need it) or "required" (every request, as on the other doors): guards.py
    ollama_token: str = "loopback"
    metrics_public: bool = False  # GET /metrics without the token (a scraper that cannot send one)
    # Generation defaults (a request may override them)
    max_tokens: int = 512
    temperature: float = 0.2  # config.toml says why
    top_p: float = 0.9
    prefill_step_size: int = 0  # 0: the device's (daemon/device.py: 512 on the CPU, 2048 on a GPU)
    prefill_slice: float = 0.5
    # Decode: "auto" speculates (prompt-lookup drafts, verified exactly) where it pays; "off" never
    speculate: str = "auto"
    profile: bool = False  # log each answer's decode steps split into sections (engine/profile.py; KVD_PROFILE=1)
    # Cache tiers: byte budgets (hard limits) and idle times
    resident_bytes: int | None = None  # None: from the machine's memory (daemon/device.py, docs/caches.md)
    warm_bytes: int | None = None
    disk_bytes: int = 20 << 30
    resident_idle: float = 600.0
    warm_idle: float = 3600.0
    max_segments: int = 16
    block_tokens: int = BLOCK_TOKENS
    max_resident_sessions: int = 32
    warm_bits: int = 0
    prefetch: bool = True
    # Quantized KV caches: 0 off, or 4 / 8 bits
    kv_bits: int = 0
    # Limits
    max_message_bytes: int = 1 << 20
    max_text_chars: int = 32_000
    max_tokens_limit: int = 4096
    send_timeout: float = 10.0
    max_generations: int = 8
    max_queued: int = 64
    max_connections: int = 64
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    max_unauthenticated: int = 256
    # Ranks (not in config.toml: set at start from mlx.launch's environment; docs/distributed.md)
    rank: int = 0
    world_size: int = 1

    def request_limits(self) -> Limits:
        """The [limits] a client's request is checked against (protocol/shapes.py)."""
        from protocol.shapes import Limits

        return Limits(max_text_chars=self.max_text_chars, max_tokens_limit=self.max_tokens_limit)

    def sampling(self) -> Sampling:
        """[generation]: the values a turn runs with when neither its request nor its session sets them."""
        from protocol.shapes import Sampling

        return Sampling.of(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p)

    @property
    def db_path(self) -> Path:
        return self.data_dir / "kvd.sqlite"

    @property
    def log_path(self) -> Path:
        return self.log_file if self.log_file is not None else self.data_dir / "kvd.log"

    @property
    def backups_dir(self) -> Path:
        return self.data_dir / "backups"

    @property
    def models_dir(self) -> Path:
        return self.data_dir / "models"

    @property
    def rank_dir(self) -> Path:
        """This rank's own files when the model is sharded: its share of every cache, its log."""
        return self.data_dir / f"rank-{self.rank}"

    @property
    def cache_dir(self) -> Path:
        """One rank: <data_dir>/cache, as always; a sharded model: every rank, 0 too, in its rank dir."""
        return self.rank_dir / "cache" if self.world_size > 1 else self.data_dir / "cache"


# Where each key lives in config.toml: (table or None for top level, key).
_LAYOUT: dict[str, tuple[str | None, str]] = {
    "model": (None, "model"),
    "blas": (None, "blas"),
    "blas_threads": (None, "blas_threads"),
    "keep_alive": ("models", "keep_alive"),
    "models_memory": ("models", "memory"),
    "aliases": ("models", "aliases"),
    "data_dir": (None, "data_dir"),
    "log_file": (None, "log_file"),
    "host": ("server", "host"),
    "port": ("server", "port"),
    "allowed_origins": ("server", "allowed_origins"),
    "allowed_hosts": ("server", "allowed_hosts"),
    "model_aliases": ("api", "model_aliases"),
    "ollama_token": ("api", "ollama_token"),
    "metrics_public": ("api", "metrics_public"),
    "max_tokens": ("generation", "max_tokens"),
    "temperature": ("generation", "temperature"),
    "top_p": ("generation", "top_p"),
    "prefill_step_size": ("generation", "prefill_step_size"),
    "prefill_slice": ("generation", "prefill_slice"),
    "speculate": ("decode", "speculate"),
    "profile": ("decode", "profile"),
    "resident_bytes": ("cache", "resident_bytes"),
    "warm_bytes": ("cache", "warm_bytes"),
    "disk_bytes": ("cache", "disk_bytes"),
    "resident_idle": ("cache", "resident_idle"),
    "warm_idle": ("cache", "warm_idle"),
    "max_segments": ("cache", "max_segments"),
    "block_tokens": ("cache", "block_tokens"),
    "max_resident_sessions": ("cache", "max_resident_sessions"),
    "warm_bits": ("cache", "warm_bits"),
    "prefetch": ("cache", "prefetch"),
    "kv_bits": ("cache", "kv_bits"),
    "max_message_bytes": ("limits", "max_message_bytes"),
    "max_text_chars": ("limits", "max_text_chars"),
    "max_tokens_limit": ("limits", "max_tokens_limit"),
    "send_timeout": ("limits", "send_timeout"),
    "max_generations": ("limits", "max_generations"),
    "max_queued": ("limits", "max_queued"),
    "max_connections": ("limits", "max_connections"),
    "header_timeout": ("limits", "header_timeout"),
    "body_timeout": ("limits", "body_timeout"),
    "max_unauthenticated": ("limits", "max_unauthenticated"),
}


def _flatten(doc: dict[str, Any], source: str) -> dict[str, Any]:
    known = {where: name for name, where in _LAYOUT.items()}
    tables = {t for t, _ in _LAYOUT.values() if t}
    flat: dict[str, Any] = {}
    for key, value in doc.items():
        if key in tables:
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: [{key}] must be a table")
            for sub, subvalue in value.items():
                if (key, sub) not in known:
                    raise ConfigError(f"{source}: unknown key {key}.{sub}")
                flat[known[(key, sub)]] = subvalue
        elif (None, key) in known:
            flat[known[(None, key)]] = value
        else:
            raise ConfigError(f"{source}: unknown key {key}")
    return flat


class _Bad(ValueError):
    """What a value must be: the end of the config's error line, after the key."""


Check = Callable[[Any], Any]


def _path(value: Any) -> Path:
    if not isinstance(value, (str, Path)) or not str(value):
        raise _Bad("must be a path")
    return Path(value).expanduser()


def _strings(value: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise _Bad("must be a list of strings")
    return tuple(value)


def _alias_table(value: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) and k and v
                                              for k, v in value.items()):
        raise _Bad('must be a table of names to models, e.g. {code = "builtin:gemma3"}')
    return tuple(sorted(value.items()))
def _other_names(value: Any) -> tuple[str, ...]:
    if value == "*":
        return ("*",)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise _Bad('must be a list of model names, or "*" for every name')
    return tuple(value)


def _kind(kind: type | tuple[type, ...], name: str, words: str | None = None, *,
          ok: Callable[[Any], bool] = lambda v: True) -> Check:
    """A value of exactly `kind` (true is not 1) for which `ok` holds, else `words`."""

    def check(value: Any) -> Any:
        if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
            raise _Bad(f"must be {name}")
        if not ok(value):
            raise _Bad(words or f"must be {name}")
        return value

    return check


def _integer(low: int = 1, words: str = "must be positive", *, high: int | None = None) -> Check:
    return _kind(int, "an integer", words, ok=lambda v: low <= v and (high is None or v <= high))


def _positive_number(value: Any) -> float:
    return float(_kind((int, float), "a number", "must be positive", ok=lambda v: v > 0)(value))


_STRING = _kind(str, "a str")
_BITS = _kind(int, "an integer", "must be 0 (off), 4 or 8", ok=lambda v: v in (0, 4, 8))
_TIER = _integer(0, "must be >= 0 (0 turns the tier off)")

# Every key but [generation]'s, which validates through the shared request shapes (protocol/shapes.py).
_CHECKS: dict[str, Check] = {
    "model": _STRING,
    "blas": _kind(str, '"auto", "off" or the path of a BLAS library', ok=bool),
    "blas_threads": _integer(0, "must be >= 0 (0: the CPUs kvd may use)"),
    "keep_alive": _positive_number,
    "models_memory": _integer(0, "must be >= 0 (0: what the device has)"),
    "aliases": _alias_table,
    "data_dir": _path,
    "log_file": _path,
    "host": _STRING,
    "port": _integer(0, "must be 0-65535 (0 picks a free port)", high=65535),
    "allowed_origins": _strings,
    "allowed_hosts": _strings,
    "model_aliases": _other_names,
    "ollama_token": _kind(str, '"loopback" or "required"', ok=lambda v: v in ("loopback", "required")),
    "metrics_public": _kind(bool, "a bool"),
    "prefill_step_size": _integer(0, "must be >= 0 (0: the device's own, 512 on the CPU, 2048 on a GPU)"),
    "prefill_slice": _positive_number,
    "speculate": _kind(str, '"auto" or "off"', ok=lambda v: v in ("auto", "off")),
    "profile": _kind(bool, "a bool"),
    "resident_bytes": _TIER,
    "warm_bytes": _TIER,
    "disk_bytes": _TIER,
    "resident_idle": _positive_number,
    "warm_idle": _positive_number,
    "max_segments": _integer(),
    "block_tokens": _integer(),
    "max_resident_sessions": _TIER,
    "warm_bits": _BITS,
    "prefetch": _kind(bool, "a bool"),
    "kv_bits": _BITS,
    "max_message_bytes": _integer(),
    "max_text_chars": _integer(),
    "max_tokens_limit": _integer(),
    "send_timeout": _positive_number,
    "max_generations": _integer(),
    "max_queued": _integer(),
    "max_connections": _integer(),
    "header_timeout": _positive_number,
    "body_timeout": _positive_number,
    "max_unauthenticated": _integer(),
}


def _dotted(name: str) -> str:
    table, key = _LAYOUT[name]
    return f"{table}.{key}" if table else key


def _check(name: str, value: Any) -> Any:
    """Coerce and validate one value; raise ConfigError naming the key."""
    try:
        return _CHECKS[name](value)
    except _Bad as e:
        raise ConfigError(f"{_dotted(name)} {e}") from None


def _generation(given: dict[str, Any], limits: Limits) -> dict[str, Any]:
    """[generation] through the shape every request's sampling values take, the limits as its context."""
    from pydantic import ValidationError

    from protocol.shapes import ABOVE_LIMIT, TYPE_ERRORS, Sampling, bounds

    defaults = Config()
    try:
        valid = Sampling.model_validate({**{k: getattr(defaults, k) for k in SAMPLING}, **given}, context=limits)
    except ValidationError as e:
        error = e.errors()[0]
        name = str(error["loc"][0])
        if error["type"] in TYPE_ERRORS:
            words = "must be an integer" if name == "max_tokens" else "must be a number"
        elif error["type"] == ABOVE_LIMIT:
            words = f"must not exceed limits.max_tokens_limit ({limits.max_tokens_limit})"
        else:
            words = f"must be {bounds(name, limits)}"
        raise ConfigError(f"{_dotted(name)} {words}") from None
    return {k: getattr(valid, k) for k in given}


def load_config(path: Path | None = None, **overrides: Any) -> Config:
    """Defaults, then the TOML file at `path` (if given), then non-None overrides."""
    values: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                doc = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: {e}") from None
        values.update(_flatten(doc, str(path)))
    values.update({k: v for k, v in overrides.items() if v is not None})
    unknown = set(values) - {f.name for f in dataclasses.fields(Config)}
    if unknown:
        raise ConfigError(f"unknown settings: {', '.join(sorted(unknown))}")
    checked = {k: _check(k, v) for k, v in values.items() if k not in SAMPLING}
    limits = dataclasses.replace(Config(), **checked).request_limits()
    return Config(**checked, **_generation({k: v for k, v in values.items() if k in SAMPLING}, limits))
