"""The device policy (daemon/device.py): every branch decided from a described device, on any machine."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon import device
from daemon.device import CPU_SPECULATION, GPU_SPECULATION, Device, LoadedModel, LoadRoom, Policy, policy, room_to_load
from daemon.engine import draft, modelload, speculate

GiB = 1 << 30
MiB = 1 << 20
CPU = Device("cpu", "AMD EPYC")
METAL = Device("metal", "Apple M2 Max", memory_total=64 * GiB, memory_free=48 * GiB)
H200 = Device("cuda", "NVIDIA H200", memory_total=141 * GiB, memory_free=139 * GiB)


def test_the_cpu_branch_is_what_kvd_always_did() -> None:
    p = policy(CPU, env={})
    assert (p.weights_dtype, p.kvd_attention, p.gguf_mode, p.probe_blas) == ("float32", True, "float32", True)
    assert (p.prefill_step, p.prefill_clear_cache, p.warm_up_tokens) == (512, True, (modelload.WARM_UP_TOKENS,))
    assert p.heap_keep == device.CPU_HEAP_KEEP  # every array is malloc's: freed memory kept (engine/heap.py)
    assert p.speculation == CPU_SPECULATION and p.speculation.auto
    # The CPU's limits are the ones draft.py and speculate.py measured and still name.
    assert (CPU_SPECULATION.start_k, CPU_SPECULATION.max_k, CPU_SPECULATION.min_rate,
            CPU_SPECULATION.pause_steps, CPU_SPECULATION.position_budget) == (
        draft.START_K, draft.MAX_K, draft.MIN_RATE, draft.PAUSE_STEPS, speculate.POSITION_BUDGET)
    assert p.budgets(4 * GiB, 2 * GiB, in_use=100 * GiB) == (4 * GiB, 2 * GiB)  # host memory: as configured
    assert p.line("float32") == "device: cpu, float32 weights, kvd attention"


@pytest.mark.parametrize("gpu", [METAL, H200], ids=["metal", "cuda"])
def test_a_gpu_runs_like_mlx_lm(gpu: Device) -> None:
    """Metal and CUDA alike: the checkpoint's dtype, MLX's attention, quantized GGUF, no BLAS, 2048 chunks."""
    p = policy(gpu, env={})
    assert (p.weights_dtype, p.kvd_attention, p.gguf_mode, p.probe_blas) == (None, False, "quantized", False)
    assert (p.prefill_step, p.prefill_clear_cache) == (2048, False)
    assert p.heap_keep == 0  # a GPU's arrays are not malloc's: malloc left as it is
    assert p.warm_up_tokens[0] == p.prefill_step  # the first turn's chunk is built before `ready`
    assert p.speculation == GPU_SPECULATION and not p.speculation.auto


def test_the_device_line_names_the_gpu() -> None:
    assert policy(H200, env={}).line("bfloat16") == "device: NVIDIA H200 (cuda), bf16 weights, MLX attention"
    assert policy(METAL, env={}).line("4-bit") == "device: Apple M2 Max (metal), 4-bit weights, MLX attention"


def test_overrides_from_the_environment() -> None:
    assert not policy(CPU, env={"KVD_ATTENTION": "mlx"}).kvd_attention
    assert not policy(H200, env={"KVD_ATTENTION": "kvd"}).kvd_attention  # never kvd's CPU attention on a GPU
    on = policy(H200, env={"KVD_SPECULATE": "on"}).speculation
    assert on.auto and on.max_k == GPU_SPECULATION.max_k
    assert policy(CPU, env={"KVD_SPECULATE": "on"}).speculation == CPU_SPECULATION


def test_cuda_budgets_never_pass_what_the_gpu_has_free() -> None:
    small = Device("cuda", "NVIDIA L4", memory_total=24 * GiB, memory_free=22 * GiB)
    p = policy(small, env={})
    weights = 16 * GiB
    resident, warm = p.budgets(4 * GiB, 2 * GiB, in_use=weights)
    room = int((22 * GiB - weights) * device.GPU_CACHE_SHARE)
    assert resident + warm == room and abs(resident - 2 * warm) <= 2  # cut to fit, in the configured proportion
    assert p.budgets(4 * GiB, 2 * GiB, in_use=30 * GiB) == (0, 0)  # nothing free: no tier in device memory
    # Room enough: as configured.
    assert policy(H200, env={}).budgets(4 * GiB, 2 * GiB, in_use=16 * GiB) == (4 * GiB, 2 * GiB)
    # A GPU whose free memory MLX does not report keeps the configured budgets.
    assert policy(Device("cuda", "?"), env={}).budgets(4 * GiB, 2 * GiB, in_use=0) == (4 * GiB, 2 * GiB)


def test_metal_budgets_fit_the_recommended_working_set() -> None:
    mac = Device("metal", "Apple M1", memory_total=8 * GiB, memory_free=5 * GiB)
    resident, warm = policy(mac, env={}).budgets(4 * GiB, 2 * GiB, in_use=2 * GiB)
    assert 0 < resident + warm <= int(3 * GiB * device.GPU_CACHE_SHARE)


def test_describe_reads_this_machine() -> None:
    """The device MLX computes on is the one read before MLX loads, and the policy is that device's
    (CI's machine: the CPU build; the GPU machine: cuda)."""
    d = device.describe()
    assert d.kind == device.installed_backend() and d.name
    assert isinstance(device.current(), Policy) and device.current().device.kind == d.kind


def test_an_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="device kind"):
        Device("rocm", "?")


def test_the_backend_is_known_before_mlx_is_imported(tmp_path: Path) -> None:
    driver = (tmp_path / "absent", tmp_path / "version")
    driver[1].write_text("NVRM version: 580.65\n")
    none = (tmp_path / "absent",)

    def having(*dists: str) -> object:
        return lambda dist: dist in dists

    assert device.installed_backend("darwin", installed=having()) == "metal"
    assert device.installed_backend("linux", installed=having("mlx-cpu"), nvidia=driver) == "cpu"
    assert device.installed_backend("linux", installed=having("mlx-cuda-13"), nvidia=driver) == "cuda"
    assert device.installed_backend("linux", installed=having("mlx-cuda-12"), nvidia=none) == "cpu"
    assert device.installed_backend("linux", installed=having(), nvidia=driver) is None
    assert device.installed_backend("linux") == device.describe().kind  # this machine's own (CI: mlx[cpu])


def test_a_linux_install_without_a_backend_says_how_to_fix_it() -> None:
    line = device.missing_backend("linux", installed=lambda dist: False)
    assert line is not None and "\n" not in line
    assert "make serve" in line and "kvd[cpu]" in line
    assert device.missing_backend("linux", installed=lambda dist: dist == "mlx-cpu") is None
    assert device.missing_backend("darwin", installed=lambda dist: False) is None
    assert device.missing_backend() is None  # this machine has one


def test_speculation_reads_the_device_limits() -> None:
    budget = draft.DraftBudget.within(GPU_SPECULATION)
    assert (budget.k, budget.max_k, budget.min_rate, budget.pause_steps) == (4, 8, 0.5, 64)
    # A window of refused drafts pauses for the device's pause_steps.
    for _ in range(draft.WINDOW // 4):
        budget.record(4, 1)  # a quarter accepted: below the GPU's 0.5 (the CPU's 0.3 would keep going)
    assert sum(budget.wanted() == 0 for _ in range(GPU_SPECULATION.pause_steps)) == GPU_SPECULATION.pause_steps
    assert budget.wanted() > 0
    assert draft.DraftBudget.within(CPU_SPECULATION) == draft.DraftBudget()


def test_what_the_config_leaves_to_the_device() -> None:
    from daemon.config import load_config

    default = load_config(None)
    assert default.prefill_step_size == 0  # the device's
    on_cpu = device.configured(default, policy(CPU, env={}))
    assert (on_cpu.prefill_step_size, on_cpu.speculate) == (512, "auto")
    on_gpu = device.configured(default, policy(H200, env={}))
    assert (on_gpu.prefill_step_size, on_gpu.speculate) == (2048, "off")
    forced = device.configured(default, policy(H200, env={"KVD_SPECULATE": "on"}))
    assert forced.speculate == "auto"
    chosen = load_config(None, prefill_step_size=1024, speculate="off")
    assert device.configured(chosen, policy(METAL, env={})).prefill_step_size == 1024  # an explicit size wins
    assert device.configured(chosen, policy(CPU, env={})).speculate == "off"


# --- how much memory the loaded models may take, and what loading one more takes ---


@pytest.mark.parametrize(("device", "configured", "expected"), [
    (Device("cpu", "AMD EPYC", memory_total=24 * GiB), 0, int(24 * GiB * 0.7)),  # 70% of the machine's
    (Device("cpu", "AMD EPYC", memory_total=24 * GiB), 3 * GiB, 3 * GiB),  # the configured one wins
    (CPU, 0, None),  # the machine did not say: no limit
    (METAL, 0, 48 * GiB),  # the recommended working set
    (METAL, 100 * GiB, 48 * GiB),  # never past what a GPU has free
    (H200, 10 * GiB, 10 * GiB),
    (Device("cuda", "GPU", memory_total=8 * GiB), 0, 8 * GiB),  # free unknown: its total
])
def test_models_memory_follows_the_device(device: Device, configured: int, expected: int | None) -> None:
    assert policy(device, env={}).models_memory(configured) == expected


@pytest.mark.parametrize("dev", [Device("cpu", "laptop", memory_total=16 * GiB, memory_free=12 * GiB), METAL, H200,
                                 Device("cuda", "NVIDIA L4", memory_total=24 * GiB, memory_free=22 * GiB)],
                         ids=["cpu", "metal", "cuda-h200", "cuda-l4"])
def test_the_caches_budgets_follow_the_weights_within_the_limit_on_every_device(dev: Device) -> None:
    """The memory decision-maker's rule (engine/memory.py): weights plus the caches' budgets never pass the
    limit (`models_memory`: on a GPU never past what it had free), down as weights load, back up as they go."""
    p = policy(dev, env={})
    limit = p.models_memory(0)
    assert limit is not None
    full = p.budgets(None, None, in_use=1 * GiB)
    for weights in (1 * GiB, limit // 2, limit - 1 * GiB, limit - 64 * MiB, limit, limit + GiB):
        resident, warm = p.cache_budgets(None, None, weights=weights, limit=limit)
        assert weights + resident + warm <= max(limit, weights) and resident >= 0 and warm >= 0
        assert (resident, warm) <= p.budgets(None, None, in_use=weights)  # never more than the device's rule
        if dev.gpu:  # never past what the GPU had free, whatever was configured
            configured = p.cache_budgets(64 * GiB, 64 * GiB, weights=weights, limit=limit)
            assert weights + sum(configured) <= max(dev.memory_free or 0, weights)
    squeezed = p.cache_budgets(None, None, weights=limit - 64 * MiB, limit=limit)
    left = int(64 * MiB * device.GPU_CACHE_SHARE) if dev.gpu else 64 * MiB  # a GPU's 60% of what is left
    assert left - 2 <= sum(squeezed) <= left and squeezed[0] > squeezed[1]  # resident the larger share
    assert p.cache_budgets(None, None, weights=1 * GiB, limit=limit) == full  # grown back as the weights went
    assert p.cache_budgets(None, None, weights=1 * GiB, limit=None) == full  # no limit known: the device's rule
    # Configured budgets are cut in their own proportion.
    resident, warm = p.cache_budgets(3 * GiB, 1 * GiB, weights=limit - 2 * GiB, limit=limit)
    assert resident + warm <= 2 * GiB and abs(resident - 3 * warm) <= 3


def test_a_model_that_fits_unloads_nothing() -> None:
    loaded = [LoadedModel("a", 2 * GiB, idle_s=50.0)]
    assert room_to_load("b", 1 * GiB, 4 * GiB, loaded) == LoadRoom()
    assert room_to_load("b", 10 * GiB, None, loaded) == LoadRoom()  # no limit known


def test_room_is_made_from_the_least_recently_used_idle_models_only() -> None:
    loaded = [LoadedModel("recent", 2 * GiB, idle_s=5.0), LoadedModel("old", 2 * GiB, idle_s=500.0),
              LoadedModel("busy", 2 * GiB, idle_s=None)]
    assert room_to_load("new", 2 * GiB, 7 * GiB, loaded) == LoadRoom(("old",))
    assert room_to_load("new", 4 * GiB, 7 * GiB, loaded) == LoadRoom(("old", "recent"))


def test_a_model_that_never_fits_is_refused_in_one_line() -> None:
    room = room_to_load("big", 5 * GiB, 4 * GiB, [LoadedModel("a", 1 * GiB, idle_s=1.0)])
    assert room.unload == () and room.refusal is not None and "\n" not in room.refusal
    assert room.refusal.startswith("big needs 5.00 GiB for its weights and the models may take 4.00 GiB")


def test_a_model_kept_out_by_busy_ones_is_refused_saying_so() -> None:
    room = room_to_load("b", 3 * GiB, 4 * GiB, [LoadedModel("a", 2 * GiB, idle_s=None)])
    assert room.unload == ()
    assert room.refusal is not None and "there is 2.00 GiB of the 4.00 GiB" in room.refusal
    assert "answering now" in room.refusal



@pytest.mark.parametrize("device, in_use, resident, warm, prefetch", [
    # The CPU: an eighth of the host resident, half that warm, within their floors and caps.
    (Device("cpu", "laptop", memory_total=8 * GiB, memory_free=5 * GiB), 1 * GiB, 1 * GiB, 512 * MiB, 256 * MiB),
    (Device("cpu", "this box", memory_total=24 * GiB, memory_free=20 * GiB), 0, 3 * GiB, 1536 * MiB, 1280 * MiB),
    (Device("cpu", "big", memory_total=256 * GiB, memory_free=200 * GiB), 0, 4 * GiB, 2 * GiB, 200 * GiB // 16),
    (Device("cpu", "tiny", memory_total=1 * GiB, memory_free=512 * MiB), 0, 256 * MiB, 128 * MiB, 32 * MiB),
    (CPU, 0, 4 * GiB, 2 * GiB, None),  # memory unknown: the caps, and no prefetch limit but the tiers'
    # A GPU: 60% of what is free after the weights, two thirds resident.
    (H200, 19 * GiB, 48 * GiB, 24 * GiB, 120 * GiB // 16),
    (Device("metal", "Apple M1", memory_total=8 * GiB, memory_free=5 * GiB), 2 * GiB,
     int(3 * GiB * 0.6) * 2 // 3, int(3 * GiB * 0.6) - int(3 * GiB * 0.6) * 2 // 3, 3 * GiB // 16),
    (Device("cuda", "?"), 0, 4 * GiB, 2 * GiB, None),
])  # fmt: skip
def test_unset_budgets_and_the_prefetch_follow_the_devices_memory(device: Device, in_use: int, resident: int,
                                                                  warm: int, prefetch: int | None) -> None:
    p = policy(device, env={})
    assert p.budgets(None, None, in_use=in_use) == (resident, warm)
    assert p.prefetch_bytes(in_use=in_use) == prefetch
    # One set, the other from the machine: a set budget is kept as it is where it fits.
    assert p.budgets(64 * MiB, None, in_use=in_use) == (64 * MiB, warm)


def test_the_host_memory_is_read_from_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24684092 kB\nMemFree:        13694012 kB\nMemAvailable:   20287388 kB\n")
    assert device.host_memory(meminfo) == (24684092 * 1024, 20287388 * 1024)
    total, available = device.host_memory(tmp_path / "missing")  # elsewhere: the pages sysconf counts
    assert total is None or total > 0
    assert available is None or available > 0


def test_a_quantized_cache_on_cuda_needs_bf16_or_fp16_weights() -> None:
    """MLX's CUDA backend has no float32 quantized_matmul (an H100, 2026-11-27): refused at load, in one line."""
    cuda, cpu = policy(H200, env={}), policy(Device("cpu", "EPYC"), env={})
    line = cuda.kv_bits_refusal(8, "float32")
    assert line is not None and "\n" not in line and "kv_bits" in line and "float32" in line
    assert cuda.kv_bits_refusal(4, "bfloat16") is None and cuda.kv_bits_refusal(8, "float16") is None
    assert cuda.kv_bits_refusal(0, "float32") is None  # no quantized cache asked for
    assert cpu.kv_bits_refusal(8, "float32") is None  # the CPU has the kernel (test_quantized)


def test_auto_speculation_drafts_only_where_a_measurement_shows_a_gain(monkeypatch: pytest.MonkeyPatch) -> None:
    """"auto" follows SPECULATION_MEASURED per kind of device; a kind never measured does not draft, and
    KVD_SPECULATE=on drafts anywhere (the benchmarks' A/B)."""
    for dev in (CPU, METAL, H200):
        measured = device.SPECULATION_MEASURED.get(dev.kind)
        assert policy(dev, env={}).speculation.auto == (measured is not None and measured[0] > 1.0)
        assert policy(dev, env={"KVD_SPECULATE": "on"}).speculation.auto
    assert device.speculation_pays("cpu") and not device.speculation_pays("cuda")
    assert not device.speculation_pays("metal")  # not measured yet
    monkeypatch.setitem(device.SPECULATION_MEASURED, "metal", (1.3, "a measurement"))
    assert policy(METAL, env={}).speculation.auto
    monkeypatch.setitem(device.SPECULATION_MEASURED, "cpu", (0.9, "a loss"))
    assert not policy(CPU, env={}).speculation.auto
