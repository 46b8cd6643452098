"""Telemetry: timed training steps -> the measured columns of ``train_metrics`` (speed split, memory, MFU, energy).

MFU (model FLOPs utilisation) = model FLOPs per token (6 x params + attention, see
``trainer.model.llama.flops_per_token``) x tokens/s, divided by the peak FLOP/s of all devices. The peak of
one device comes from ``train.peak_tflops`` when set, else from a table of known GPUs (dense bf16/fp16
tensor-core and fp32 figures from the vendors' data sheets), else from a matmul probe of the device
(CPUs, other GPUs), cached in ``metrics/device_peak.json`` so every resume of a run divides by the same number.
"""

from __future__ import annotations

import contextlib
import functools
import math
import resource
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from core.files.atomic import read_json
from core.rundir import RunPaths

KNOWN_GPU_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    # Dense (no sparsity) peaks per GPU; fp32 is plain FP32 (TF32 is off by default in torch).
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp32": 51.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
}
"""GPU name fragment -> precision -> peak TFLOP/s; the first fragment found in the device name wins."""

PROBE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class DevicePeak:
    """Peak TFLOP/s of one device and where the number comes from (config, table or probe)."""

    tflops: float
    source: str


def gpu_table_peak(device_name: str, precision: str) -> float | None:
    """The data-sheet peak of a known GPU (A100/H100/H200) for ``precision``, or None."""
    for fragment, peaks in KNOWN_GPU_PEAK_TFLOPS.items():
        if fragment in device_name:
            return peaks[precision]
    return None


def probe_matmul_tflops(precision: str, device: torch.device | None = None, max_size: int = 4096,
                        num_trials: int = 12) -> float:
    """Best TFLOP/s of square matmuls on ``device`` (default CPU, with torch's current thread count).

    The size doubles from 256 while one matmul stays quick (a half-precision matmul without native
    CPU support can take seconds at 1024). The fastest of ``num_trials`` single matmuls counts (a peak
    is a best case); on a CPU so does one thread's rate times the thread count: on a shared machine
    another process can stall a multi-threaded matmul at every OpenMP barrier for a long while.
    """
    device = device or torch.device("cpu")
    dtype, size = PROBE_DTYPES[precision], 256
    while size < max_size and _fastest_matmul_s(size, dtype, device, 3) * 8 < 0.05:  # the next size costs ~8x
        size *= 2
    flops = 2.0 * size**3
    best = flops / _fastest_matmul_s(size, dtype, device, num_trials)
    if device.type == "cpu":
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            best = max(best, threads * flops / _fastest_matmul_s(size, dtype, device, max(3, num_trials // 4)))
        finally:
            torch.set_num_threads(threads)
    return best / 1e12


def _fastest_matmul_s(size: int, dtype: torch.dtype, device: torch.device, num_trials: int) -> float:
    # A generator of its own: how many sizes the probe tries depends on timing, and drawing from the global one would
    # leave training's RNG (dropout) in a timing-dependent state, so two runs of one recipe would differ.
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=generator).to(device, dtype) for _ in range(2))
    torch.mm(a, b)  # warm-up (thread pool, allocator, kernel selection)
    fastest = math.inf
    for _ in range(num_trials):
        _synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b)
        _synchronize(device)
        fastest = min(fastest, time.perf_counter() - start)
    return fastest


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@functools.cache
def cached_probe_tflops(key: str, precision: str, device: torch.device) -> float:
    """One probe per device key and process (tests and benchmarks build many loops)."""
    return probe_matmul_tflops(precision, device)


def device_key(device: torch.device, precision: str) -> str:
    """What a cached probe is valid for: device name, precision and thread count."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu:{sys.platform}"
    return f"{name}|{precision}|threads={torch.get_num_threads()}"


def device_peak(device: torch.device, precision: str, configured_tflops: float | None,
                paths: RunPaths | None) -> DevicePeak:
    """Peak TFLOP/s of one device: the recipe's value, a known GPU's data sheet, or a matmul probe.

    The probe is cached in the run's ``metrics/device_peak.json`` (``paths``; None: not cached, a benchmark).
    """
    if configured_tflops is not None:
        return DevicePeak(configured_tflops, "train.peak_tflops")
    if device.type == "cuda":
        table = gpu_table_peak(torch.cuda.get_device_name(device), precision)
        if table is not None:
            return DevicePeak(table, "gpu table")
    key = device_key(device, precision)
    cached = read_json(paths.device_peak) if paths is not None and paths.device_peak.is_file() else {}
    if cached.get("key") == key:
        return DevicePeak(float(cached["tflops"]), "probe (cached)")
    tflops = cached_probe_tflops(key, precision, device)
    if paths is not None:
        paths.write_json(paths.device_peak, {"key": key, "tflops": tflops})
    return DevicePeak(tflops, "probe")


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: allocated CUDA memory on a GPU, resident set size (RSS) on a CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB, macOS bytes


class EnergyMeter:
    """Cumulative energy of this process's NVIDIA GPU through NVML; ``joules()`` is None where unavailable.

    On a GPU without NVML (most often: nvidia-ml-py not installed) it warns once per process and
    reports None, so ``energy_j_per_token`` is null; on a CPU it is None without a word.
    """

    def __init__(self, device: torch.device) -> None:
        self._handle: Any = None
        error = self._open_nvml(device) if device.type == "cuda" else None
        message = energy_unavailable_message(device.type, error)
        if message is not None:
            warn_once(message)

    def _open_nvml(self, device: torch.device) -> Exception | None:
        try:
            import pynvml  # the [gpu] extra: only on an NVIDIA GPU

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
            self.joules()
        except Exception as error:  # pynvml absent, no driver, or a GPU without an energy counter (pre-Volta)
            self._handle = None
            return error
        return None

    def joules(self) -> float | None:
        if self._handle is None:
            return None
        return self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) / 1000.0  # NVML counts mJ


def energy_unavailable_message(device_type: str, nvml_error: Exception | None) -> str | None:
    """The warning for a GPU whose energy NVML cannot read (``nvml_error``); None on a CPU or when NVML works."""
    if device_type != "cuda" or nvml_error is None:
        return None
    if isinstance(nvml_error, ImportError):
        return ("energy_j_per_token will be null: the NVML bindings (module pynvml, package nvidia-ml-py) are not "
                'installed; pip install -e ".[gpu]" to measure the GPU\'s energy per token.')
    return (f"energy_j_per_token will be null: NVML cannot read this GPU's energy counter ({nvml_error!r}); it "
            'needs the NVIDIA driver\'s NVML library and a Volta or newer GPU (nvidia-ml-py: pip install -e ".[gpu]").')


@functools.cache
def warn_once(message: str) -> None:
    """``warnings.warn`` once per process and message (every loop built in a process makes an EnergyMeter)."""
    warnings.warn(message, stacklevel=3)


@dataclass
class PhaseTimer:
    """Wall seconds per named phase of one step; waits for queued GPU work so time lands in the right phase."""

    device: torch.device
    seconds: dict[str, float] = field(default_factory=dict)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())


class Telemetry:
    """Turns a window of timed steps into train_metrics columns; rank 0 measures, for the whole world."""

    def __init__(self, device: torch.device, num_processes: int, flops_per_token: float, peak: DevicePeak) -> None:
        self.device, self.num_processes = device, num_processes
        self.flops_per_token, self.peak = flops_per_token, peak
        self.energy = EnergyMeter(device)
        self._energy_mark: float | None = None

    def start_window(self) -> None:
        """Call before the first step of a logging window (so evaluation and checkpoints are not counted)."""
        self._energy_mark = self.energy.joules()

    def window_columns(self, phase_seconds: list[dict[str, float]], tokens: int) -> dict[str, Any]:
        """Speed, step-time split, memory, MFU and energy for ``tokens`` (all ranks) processed in these steps."""
        seconds = sum(sum(phases.values()) for phases in phase_seconds)
        tokens_per_s = tokens / max(seconds, 1e-9)
        model_tflops_per_s = tokens_per_s * self.flops_per_token / 1e12
        split = {name: sum(phases.get(name, 0.0) for phases in phase_seconds) / len(phase_seconds)
                 for name in ("data_wait_s", "fwd_bwd_s", "optimizer_s")}
        return {"tokens_per_s": tokens_per_s, "step_time_s": seconds / len(phase_seconds), **split,
                "peak_memory_bytes": peak_memory_bytes(self.device), "model_tflops_per_s": model_tflops_per_s,
                "mfu": model_tflops_per_s / (self.peak.tflops * self.num_processes),
                "device_peak_tflops": self.peak.tflops, "energy_j_per_token": self._energy_per_token(tokens)}

    def _energy_per_token(self, tokens: int) -> float | None:
        now = self.energy.joules()
        if now is None or self._energy_mark is None:
            return None
        # This rank's GPU only; the ranks do the same work, so the world spends num_processes times as much.
        return (now - self._energy_mark) * self.num_processes / max(tokens, 1)
