"""Every choice that depends on the device MLX runs on, decided in one place from its description.

kvd was tuned on a 2-core CPU, where one forward costs hundreds of
milliseconds and float32 matmuls through an interposed OpenBLAS are ~20x
faster than bf16 ones. None of that holds on a GPU: there the checkpoint's
own dtype, MLX's fused attention and big prefill chunks are fastest, and
"not Metal" is not "CPU" (MLX's CUDA backend runs the same models on
NVIDIA). So the engine never asks MLX which device it has; it asks
:func:`policy` what to do on a :class:`Device`, and :func:`describe` is the
one place that reads MLX's device. Each decision is a pure function of the
description, so the unit tier checks the CPU, Metal and CUDA branches on
any machine (tests/test_device.py).

The CPU branch is exactly what kvd did before this module: float32 weights,
kvd's attention, GGUF files dequantized to float32, the BLAS probed,
512-token prefill chunks with the allocator's cache cleared after each, and
the speculation limits measured in bench/speculate.py.

Two questions are answered *before* MLX is imported, because the BLAS must
be interposed first (service/blas.py): which backend the installed MLX has
(:func:`installed_backend`, from package metadata) and whether a Linux
install has none at all (:func:`missing_backend`).
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import Config

__all__ = ["ATTENTION_ENV", "KINDS", "Device", "LoadRoom", "LoadedModel", "Policy", "SpeculationLimits", "configured",
           "current", "describe", "installed_backend", "missing_backend", "policy", "room_to_load", "speculation_pays"]

KINDS = ("cpu", "metal", "cuda")
#: `KVD_ATTENTION=mlx` keeps MLX's own attention on the CPU too (a benchmark's A/B, a suspected bug).
ATTENTION_ENV = "KVD_ATTENTION"
#: `KVD_SPECULATE=on` drafts on a device whose policy keeps speculation off (a benchmark's A/B).
SPECULATE_ENV = "KVD_SPECULATE"
# The share of a GPU's free memory (after the weights) the cache tiers may hold; the rest is the
# prefill's activations and the allocator's slack. MLX's CUDA allocator uses managed memory, and
# oversubscribing it can hang the GPU, so on CUDA this is a hard ceiling on any configured budget.
GPU_CACHE_SHARE = 0.6
GiB = 1 << 30
# The share of the machine's memory the loaded models' weights and their caches' memory tiers may take
# on the CPU when [models] memory is 0: the rest is the prefill's activations and everything else the
# machine runs.
CPU_MODELS_SHARE = 0.7  # (weights alone had 0.5, the tiers 1/8 + 1/16 beside them: about as much in all)
MiB = 1 << 20
# The memory tiers' default budgets where config.toml sets none, as a share of the memory the device
# has (the host's total on the CPU, GPU_CACHE_SHARE of what is free after the weights on a GPU), the
# warm tier half the resident one; on the CPU within [floor, cap], the cap being kvd's defaults
# before they followed the machine (4 and 2 GiB). Unknown memory: the caps.
CPU_RESIDENT_SHARE = 1 / 8
RESIDENT_DEFAULT = (256 * MiB, 4 * GiB)
WARM_DEFAULT = (128 * MiB, 2 * GiB)
# The prefetch after a start reads at most this share of the memory free then, after the weights:
# a restart pages back the sessions in use, never a machine's worth of old ones (a 135M model's
# daemon prefetched 1.6 GiB with the old constant budgets, whatever the machine).
PREFETCH_SHARE = 1 / 16
# On the CPU every array is malloc's: the freed memory glibc keeps for the next forward, touched before a
# first turn (engine/heap.py). It covers a next turn's working set at a long cache (builtin:tiny at 5k
# tokens faulted ~70 MB in a first turn after a start, SmolLM2 at 2k ~140 MB in any turn before).
CPU_HEAP_KEEP = 256 * MiB


@dataclass(frozen=True)
class Device:
    """What MLX runs on: its kind, its name, its memory (bytes; None where MLX does not say)."""

    kind: str  # "cpu" | "metal" | "cuda"
    name: str
    memory_total: int | None = None
    memory_free: int | None = None  # CUDA: free when described; Metal: the recommended working set

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"device kind must be one of {KINDS}, not {self.kind!r}")

    @property
    def gpu(self) -> bool:
        return self.kind != "cpu"

    def label(self) -> str:
        return "cpu" if self.kind == "cpu" else f"{self.name} ({self.kind})"


@dataclass(frozen=True)
class SpeculationLimits:
    """How prompt-lookup speculation sizes its drafts on a device (engine/draft.py, speculate.py)."""

    auto: bool  # whether `speculate = "auto"` drafts at all on this device
    start_k: int
    max_k: int
    min_rate: float  # below this acceptance over a window, drafting pauses
    pause_steps: int  # the first pause's length in decode steps (doubles while drafts keep failing)
    position_budget: int  # batch rows x (1 + k) one verifying forward may hold


# What speculation did to decode on each kind of device, measured: its decode tok/s over plain decoding's
# on the same turns (bench/speculate.py forces it on any device; bench/gpu.py's KVD_SPECULATE=on row).
# "auto" drafts only where that is above 1 (`speculation_pays`); a kind never measured (Metal, so far)
# does not draft. A new measurement on a device changes its line here.
SPECULATION_MEASURED: dict[str, tuple[float, str]] = {
    "cpu": (1.45, "the 2-core CPU, SmolLM2-135M: rewrite 1.45x, typos 2.59x, regenerate 4.60x, chat 0.88x "
                  "(0.99x over four pairs), 4 sessions 0.99x (bench/speculate.py, 2026-11-23)"),
    "cuda": (0.18, "an H100, the 1B shape: 32.6 against 184.7 tok/s (bench/gpu.py, 2026-11-27); an H200 "
                   "6-8x slower (issue 33)"),
}


def speculation_pays(kind: str) -> bool:
    """Whether "auto" speculation drafts on a device of `kind`: only where it measured faster (above)."""
    measured = SPECULATION_MEASURED.get(kind)
    return measured is not None and measured[0] > 1.0


# Measured on the loaded 2-core CPU (draft.py, bench/speculate.py): a 9-token forward cost 1.7x a
# 1-token one, 5 tokens 1.13x; 12 positions before a forward's compute shows beside its weight reads.
CPU_SPECULATION = SpeculationLimits(auto=speculation_pays("cpu"), start_k=2, max_k=6, min_rate=0.3, pause_steps=16,
                                    position_budget=12)
# On a GPU verifying k tokens costs about one decode step, so when drafting runs it may draft longer
# and batch wider (KVD_SPECULATE=on measures it where "auto" does not draft). A failed draft pauses
# longer than on the CPU.
GPU_SPECULATION = SpeculationLimits(auto=False, start_k=4, max_k=8, min_rate=0.5, pause_steps=64,
                                    position_budget=64)


@dataclass(frozen=True)
class Policy:
    """What kvd does on one device; :func:`policy` makes it."""

    device: Device
    # Weights
    weights_dtype: str | None  # cast the model to this; None keeps the checkpoint's own dtype
    kvd_attention: bool  # kvd's softmax attention and swiglu (engine/attention.py) instead of MLX's fused ones
    gguf_mode: str  # daemon/models/gguf.py: "float32" (dequantized) or "quantized" (MLX-native formats)
    probe_blas: bool  # interpose and probe an OpenBLAS under MLX (service/blas.py)
    # Prefill
    prefill_step: int  # tokens per prefill chunk when the config leaves it to the device (0)
    prefill_clear_cache: bool  # return the allocator's buffers after every chunk
    warm_up_tokens: tuple[int, ...]  # the prefills run before `ready` (engine/modelload.py's warm_up)
    # Memory: freed bytes malloc keeps, faulted in before a first turn (engine/heap.py; 0: malloc as it is)
    heap_keep: int
    # Decode
    speculation: SpeculationLimits

    def attention_name(self) -> str:
        return "kvd attention" if self.kvd_attention else "MLX attention"

    def line(self, dtype: str) -> str:
        """The start line's and `kvd status`'s word on the device: what runs where."""
        short = {"bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)
        return f"device: {self.device.label()}, {short} weights, {self.attention_name()}"

    def kv_bits_refusal(self, kv_bits: int, dtype: str) -> str | None:
        """Why a quantized KV cache (`cache.kv_bits`) cannot run here with weights of `dtype`; None if it can.

        MLX's CUDA backend has no `quantized_matmul` for float32 activations (an H100 with MLX
        0.32.4, 2026-11-27: "No implementation for problem shape … activation: float32"), and the
        cache's queries have the weights' dtype. Found as a load that failed at its warm-up; now
        refused before it, in one line.
        """
        if not kv_bits or self.device.kind != "cuda" or dtype in ("bfloat16", "float16"):
            return None
        return (f"cache.kv_bits = {kv_bits} needs bf16 or fp16 weights on {self.device.label()} (MLX has no "
                f"{dtype} quantized matmul there) and this model runs {dtype}: set kv_bits to 0, or serve a "
                "bf16 model")

    def budgets(self, resident: int | None, warm: int | None, in_use: int) -> tuple[int, int]:
        """The resident and warm tiers' byte budgets on this device, from the configured ones
        (None: not configured, so the device's default, `default_budgets`).

        The CPU's are the configured ones: host memory, which the operating system can page.
        On a GPU both tiers are MLX arrays in the device's memory (docs/caches.md), so together
        they get at most GPU_CACHE_SHARE of what was free less `in_use` (the weights, loaded since
        the device was described), shared in the configured proportion. On Metal "free" is the
        recommended working set; on CUDA it is what the GPU had free.
        """
        default_resident, default_warm = self.default_budgets(in_use)
        resident = default_resident if resident is None else resident
        warm = default_warm if warm is None else warm
        free = self.device.memory_free
        if not self.device.gpu or free is None:
            return resident, warm
        room = max(0, int((free - in_use) * GPU_CACHE_SHARE))
        if resident + warm <= room:
            return resident, warm
        share = resident / (resident + warm) if resident + warm else 0.5
        return int(room * share), room - int(room * share)

    def cache_budgets(self, resident: int | None, warm: int | None, *, weights: int,
                      limit: int | None) -> tuple[int, int]:
        """The resident and warm budgets beside `weights` bytes of model weights (every model loaded,
        loading, or unloading and not yet stopped), within `limit` (`models_memory`: the weights and the
        caches' memory tiers together; None: no limit known).

        `budgets` first (a GPU: at most GPU_CACHE_SHARE of what was free after the weights), then cut,
        in the same proportion, to what `limit` leaves beside the weights: so the weights and every
        model's caches never pass the limit, and the budgets grow back when a model's weights go.
        """
        resident, warm = self.budgets(resident, warm, in_use=weights)
        room = None if limit is None else max(0, limit - weights)
        if room is None or resident + warm <= room:
            return resident, warm
        share = resident / (resident + warm)
        return int(room * share), room - int(room * share)

    def default_budgets(self, in_use: int) -> tuple[int, int]:
        """The resident and warm budgets where none is configured, from the device's memory.

        The CPU: CPU_RESIDENT_SHARE of the host's memory, warm half that, each
        within its [floor, cap]. A GPU: the room GPU_CACHE_SHARE leaves of what was
        free after the weights (`in_use`), two thirds resident. Unknown memory: the caps.
        """
        d = self.device
        if d.gpu and d.memory_free is not None:
            room = max(0, int((d.memory_free - in_use) * GPU_CACHE_SHARE))
            return room * 2 // 3, room - room * 2 // 3
        if d.gpu or d.memory_total is None:
            return RESIDENT_DEFAULT[1], WARM_DEFAULT[1]
        resident = int(d.memory_total * CPU_RESIDENT_SHARE)
        return _within(resident, RESIDENT_DEFAULT), _within(resident // 2, WARM_DEFAULT)

    def prefetch_bytes(self, in_use: int) -> int | None:
        """At most how many bytes the prefetch after a start reads (None: no limit but the tiers' room):
        PREFETCH_SHARE of what the device had free, less `in_use` (the weights)."""
        free = self.device.memory_free
        return None if free is None else int(max(0, free - in_use) * PREFETCH_SHARE)

    def models_memory(self, configured: int) -> int | None:
        """The bytes the loaded models' weights and every model's caches in memory (the resident and warm
        tiers) may take together; None: no limit known.

        `configured` ([models] memory) wins where it is set, but on a GPU never past what it had
        free. Unset: a GPU's free memory (Metal: its recommended working set), or CPU_MODELS_SHARE
        of the machine's memory on the CPU.
        """
        free = self.device.memory_free if self.device.gpu else None
        if configured > 0:
            return configured if free is None else min(configured, free)
        if self.device.gpu:
            return free if free is not None else self.device.memory_total
        total = self.device.memory_total
        return int(total * CPU_MODELS_SHARE) if total is not None else None


def _within(n: int, bounds: tuple[int, int]) -> int:
    return min(max(n, bounds[0]), bounds[1])


@dataclass(frozen=True)
class LoadedModel:
    """A loaded (or loading) model as the memory decision sees it."""

    name: str
    nbytes: int  # its weights' bytes in memory (an estimate while it loads)
    idle_s: float | None  # seconds since its last answer ended; None: answering or loading now


@dataclass(frozen=True)
class LoadRoom:
    """What loading a model takes: the idle models to unload first, least recently used first, or a
    one-line refusal ("no room" is a return value, never an exception)."""

    unload: tuple[str, ...] = ()
    refusal: str | None = None


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB // 100 else f"{n / (1 << 20):.1f} MiB"


def room_to_load(name: str, need: int, budget: int | None, loaded: list[LoadedModel]) -> LoadRoom:
    """Whether `name`, whose weights take `need` bytes, fits beside the `loaded` models within `budget`
    (Policy.models_memory), and which idle ones go first if it does not.

    Idle models are unloaded least recently used first, only as many as make room; busy ones (answering,
    loading) are never touched. A model that cannot fit even with every idle one unloaded is refused.
    """
    if budget is None:
        return LoadRoom()
    used = sum(m.nbytes for m in loaded)
    if used + need <= budget:
        return LoadRoom()
    idle = sorted((m for m in loaded if m.idle_s is not None), key=lambda m: -(m.idle_s or 0.0))
    unload: list[str] = []
    for m in idle:
        unload.append(m.name)
        used -= m.nbytes
        if used + need <= budget:
            return LoadRoom(tuple(unload))
    busy = sum(m.nbytes for m in loaded if m.idle_s is None)
    if need > budget:
        why = f"the models may take {_gib(budget)} together"
    else:
        why = (f"there is {_gib(max(0, budget - busy))} of the {_gib(budget)} the models may take, "
               "the rest held by models answering now (try again when they finish)")
    return LoadRoom(refusal=f"{name} needs {_gib(need)} for its weights and {why}; raise [models] memory in "
                        "config.toml, or use a smaller model")


def policy(device: Device, *, env: dict[str, str] | None = None) -> Policy:
    """The policy for `device`. `env`: the environment's overrides (default os.environ).

    `KVD_ATTENTION=mlx` keeps MLX's attention on the CPU (a benchmark's A/B, a suspected bug);
    `KVD_SPECULATE=on` lets "auto" draft on a device that would not.
    """
    env = dict(os.environ) if env is None else env
    speculation = CPU_SPECULATION if device.kind == "cpu" else GPU_SPECULATION
    auto = speculation_pays(device.kind) or env.get(SPECULATE_ENV, "").lower() == "on"
    if auto != speculation.auto:
        speculation = SpeculationLimits(**{**speculation.__dict__, "auto": auto})
    if device.kind == "cpu":
        return Policy(device, weights_dtype="float32",
                      kvd_attention=env.get(ATTENTION_ENV, "").lower() != "mlx",
                      gguf_mode="float32", probe_blas=True, prefill_step=512, prefill_clear_cache=True,
                      warm_up_tokens=(16,), heap_keep=CPU_HEAP_KEEP, speculation=speculation)
    # Metal and CUDA alike: mlx-lm's own choices (its generate_step's 2048-token prefill chunks). The
    # warm-up runs a whole chunk too, so the kernels a long first turn needs are built before `ready`
    # (a GPU's first use of a shape compiles; a 2048-token forward costs it well under a second).
    return Policy(device, weights_dtype=None, kvd_attention=False, gguf_mode="quantized", probe_blas=False,
                  prefill_step=2048, prefill_clear_cache=False, warm_up_tokens=(2048, 16), heap_keep=0,
                  speculation=speculation)


def configured(config: Config, p: Policy) -> Config:
    """`config` with what it leaves to the device decided by `p`: the prefill chunk (0: the
    device's; an explicit size wins) and "auto" speculation, off where the device does not draft."""
    import dataclasses

    speculate = config.speculate if p.speculation.auto else "off"
    return dataclasses.replace(config, prefill_step_size=config.prefill_step_size or p.prefill_step,
                               speculate=speculate)


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and value > 0 else None


def describe() -> Device:
    """The device MLX computes on in this process (imports mlx: after service/blas.py's preload)."""
    import mlx.core as mx

    if mx.default_device() == mx.cpu:
        info: dict[str, Any] = dict(mx.device_info())
        total, available = host_memory()
        return Device("cpu", str(info.get("device_name") or "cpu"), memory_total=total, memory_free=available)
    info = dict(mx.device_info())
    if mx.metal.is_available():
        return Device("metal", str(info.get("device_name") or info.get("architecture") or "Apple GPU"),
                      memory_total=_int(info.get("memory_size")),
                      memory_free=_int(info.get("max_recommended_working_set_size")))
    if mx.cuda.is_available():
        return Device("cuda", str(info.get("device_name") or "NVIDIA GPU"),
                      memory_total=_int(info.get("total_memory") or info.get("memory_size")),
                      memory_free=_int(info.get("free_memory")))
    raise RuntimeError(f"MLX's default device is {mx.default_device()}, neither the CPU, Metal nor CUDA")


def host_memory(meminfo: Path = Path("/proc/meminfo")) -> tuple[int | None, int | None]:
    """The host's memory: (total, available now) in bytes; None where the system does not say.

    Linux's MemAvailable counts the page cache it would give back; elsewhere the
    free pages stand in for it.
    """
    fields: dict[str, int] = {}
    try:
        for line in meminfo.read_text().splitlines():
            name, _, value = line.partition(":")
            if value.strip().endswith("kB"):
                fields[name] = int(value.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        total = fields.get("MemTotal") or _int(os.sysconf("SC_PHYS_PAGES") * page)
        available = fields.get("MemAvailable") or _int(os.sysconf("SC_AVPHYS_PAGES") * page)
    except (OSError, ValueError, AttributeError):
        return fields.get("MemTotal"), fields.get("MemAvailable")
    return total, available


@functools.cache
def current() -> Policy:
    """This process's policy, described once (the engine thread's load is the first to ask)."""
    return policy(describe())


# --- before MLX is imported ---

# The distributions that give mlx its backend on Linux, by the backend they give (mlx's own extras).
BACKENDS = {"mlx-cpu": "cpu", "mlx-cuda-12": "cuda", "mlx-cuda-13": "cuda", "mlx-cuda": "cuda"}
FIX = "make serve (it installs the backend this machine has; MLX=cpu|cuda12|cuda13 to choose)"


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


NVIDIA_DRIVER = (Path("/proc/driver/nvidia/version"), Path("/dev/nvidiactl"))


def installed_backend(platform: str = sys.platform, *, installed: Any = _installed,
                      nvidia: tuple[Path, ...] = NVIDIA_DRIVER) -> str | None:
    """The device kind MLX will compute on, read without importing MLX; None: no backend installed.

    macOS: Metal. Linux: CUDA where an mlx-cuda wheel is installed and an NVIDIA driver is loaded
    (any of `nvidia`), else the CPU (the only question asked before MLX loads is whether to probe
    a BLAS, and a machine without a driver computes on its CPU).
    """
    if platform == "darwin":
        return "metal"
    kinds = {kind for dist, kind in BACKENDS.items() if installed(dist)}
    if "cuda" in kinds and any(p.exists() for p in nvidia):
        return "cuda"
    return "cpu" if kinds else None


def missing_backend(platform: str = sys.platform, *, installed: Any = _installed) -> str | None:
    """One line when this Linux install's MLX has no backend to run on, naming the command that fixes it."""
    if platform != "linux" or installed_backend(platform, installed=installed) is not None:
        return None
    return ("MLX has no backend installed here (none of mlx-cpu, mlx-cuda-12, mlx-cuda-13): run "
            f"{FIX}, or pip install 'kvd[cpu]' ('kvd[cuda12]' / 'kvd[cuda13]' with an NVIDIA GPU)")
