"""Device and precision, decided once and shared by train.py, sample.py and bench/."""
from __future__ import annotations

import contextlib
import functools
import os
import platform
import time
from pathlib import Path

import torch

from common.cpu import BUSY_CORES, ISA_SETTINGS
from common.errors import ConfigError
from common.files import read_json, write_json_atomic
from engine.machine import DTYPES, other_cores, pick_dtype, read_machine

__all__ = ["DTYPES", "pick_dtype"]      # kept here too: decided in engine/machine.py


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bfloat16' (the name the config uses)."""
    return str(dtype).removeprefix("torch.")


def pick_device(name: str = "auto") -> torch.device:
    """auto: CUDA, then Apple's MPS, then the CPU."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"unknown device {name!r}; valid: auto, cpu, cuda, cuda:N, mps") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name} asked for, but torch sees no CUDA GPU; use auto or cpu")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("device mps asked for, but this torch has no MPS support; use auto or cpu")
    return device


def autocast(device: torch.device, dtype: torch.dtype):
    """Matmuls in dtype, master weights and reductions in fp32; a no-op for fp32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def setup_backends(device: torch.device) -> None:
    if device.type == "cuda":
        # TF32 matmuls on Ampere and newer: fp32 range, ~10-bit mantissa, much faster.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


# Dense peak matmul throughput (FLOP/s) by GPU name and precision, from the vendors'
# data sheets (no sparsity). fp32 entries are the TF32 tensor-core rates.
GPU_PEAKS = {
    "H200": {"bfloat16": 989e12, "float16": 989e12, "float32": 494e12},
    "H100": {"bfloat16": 989e12, "float16": 989e12, "float32": 494e12},
    "A100": {"bfloat16": 312e12, "float16": 312e12, "float32": 156e12},
    "A10G": {"bfloat16": 125e12, "float16": 125e12, "float32": 62.5e12},
    "L4": {"bfloat16": 121e12, "float16": 121e12, "float32": 60e12},
    "RTX 4090": {"bfloat16": 165e12, "float16": 165e12, "float32": 82.6e12},
    "RTX 3090": {"bfloat16": 71e12, "float16": 71e12, "float32": 35.6e12},
    "T4": {"float16": 65e12, "float32": 8.1e12},
    "V100": {"float16": 125e12, "float32": 15.7e12},
}


@functools.lru_cache(maxsize=None)
def peak_flops(device_type: str, dtype_name: str, device_name: str = "") -> float | None:
    """The device's peak matmul FLOP/s in this precision: from the table for known
    GPUs, measured by a matmul probe on a CPU (cpu_peak); None when unknown (no MFU
    shown)."""
    if device_type == "cuda":
        for name, peaks in GPU_PEAKS.items():
            if name in device_name:
                return peaks.get(dtype_name)
        return None
    if device_type != "cpu":
        return None
    return cpu_peak(dtype_name)


# A probe runs on every core torch uses, so other programs' work while it runs makes it
# read low (a busy machine can read a tenth of its quiet peak), and every later run on
# the quiet machine would show an MFU of several hundred percent. So only a probe during
# which other programs held less than BUSY_CORES is kept (the machine's load as
# engine/machine.py reads it), and the kept figure only ever rises: it is a peak.
PEAKS_FILE = "cpu_peak_flops.json"
PEAKS_FORMAT = 2                # entries {"flops", "other_cores"}; older files' bare numbers
#                                 recorded nothing about the machine's load, so they are measured again


def cpu_peak_key(dtype_name: str) -> str:
    """What a kept peak is a peak of: the CPU, the instruction set torch runs its kernels
    at and the settings that lower it (ISA_SETTINGS: a peak measured under them is not
    the CPU's own), threads, precision and torch."""
    held = " ".join(f"{name}={os.environ[name]}" for name in ISA_SETTINGS if os.environ.get(name))
    return (f"{cpu_name()} | {torch.backends.cpu.get_cpu_capability()}"
            f"{' ' + held if held else ''} | {torch.get_num_threads()} threads | {dtype_name} | "
            f"torch {torch.__version__}")


def cpu_peak(dtype_name: str, at_least: float = 0.0) -> float:
    """This CPU's matmul peak in this precision: the highest quiet probe kept in the
    user's cache folder (the probe takes 0.3 s, a noticeable share of a 20-second run, so
    it runs once per cpu_peak_key: machine, instruction set, threads and torch), else a
    probe now. With `at_least` (a rate the model itself was seen to sustain, so the kept
    peak is stale), a probe now in any case. A probe taken while other programs were busy serves this
    process but is not kept."""
    key = cpu_peak_key(dtype_name)
    try:
        path = cache_dir() / PEAKS_FILE
    except RuntimeError:              # no home folder to keep it in: measure every time
        path = None
    known = (read_json(path) if path else None) or {}
    if known.get("format") != PEAKS_FORMAT:
        known = {"format": PEAKS_FORMAT}
    entry = known.get(key)
    kept = entry.get("flops") if isinstance(entry, dict) else None
    kept = float(kept) if isinstance(kept, (int, float)) and kept > 0 else 0.0
    if kept and kept >= at_least:
        return kept
    flops, other = probe_cpu_flops(dtype_name)
    peak = max(flops, kept)
    quiet = other is None or other < BUSY_CORES   # no /proc/stat (macOS): trusted, as before
    if path is not None and quiet and flops > kept:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(path, {**known, key: {"flops": peak, "other_cores": None if other is None
                                                    else round(other, 2)}})
        except OSError:               # a read-only home: measure again next time
            pass
    return peak


def cache_dir() -> Path:
    """Where measurements about this machine are kept: $ATTNLAB_CACHE, or
    $XDG_CACHE_HOME/attnlab, or ~/.cache/attnlab."""
    if os.environ.get("ATTNLAB_CACHE"):
        return Path(os.environ["ATTNLAB_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "attnlab"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def probe_cpu_flops(dtype_name: str) -> tuple[float, float | None]:
    """(FLOP/s of a 1024 x 1024 matmul in this precision over 0.3 s, cores' worth of other
    programs' work meanwhile: the machine's work less this process's; None where the
    machine's cannot be read)."""
    dtype = DTYPES[dtype_name]
    n = 1024
    # A private generator: drawing from the global one would shift a resumed run's
    # dropout masks (tests/test_train.py::test_killed_run_resumes... catches that).
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=g).to(dtype) for _ in range(2))
    a @ b                                                  # warm-up
    before = read_machine()
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < 0.3:
        a @ b
        runs += 1
    seconds = time.perf_counter() - start
    return 2 * n ** 3 * runs / seconds, other_cores(before, read_machine())


def mfu(flops_per_token: float, tokens_per_s: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: the share of the device's peak the model's own
    arithmetic uses (PaLM, arXiv:2204.02311, appendix B)."""
    return None if not peak else flops_per_token * tokens_per_s / peak


class Utilisation:
    """MFU against the peak of the precision the run computes in. A model cannot outrun
    the device's matmul peak, so a rate above a CPU's kept peak means the peak is stale
    (measured while the machine was busier, or on other hardware): it is measured again,
    once, and an MFU above 100% is never shown."""

    def __init__(self, device_type: str, dtype_name: str, device_name: str = ""):
        self.device_type, self.dtype_name = device_type, dtype_name
        self.peak = peak_flops(device_type, dtype_name, device_name)
        self.reprobed = False

    def __call__(self, flops_per_token: float, tokens_per_s: float) -> float | None:
        rate = flops_per_token * tokens_per_s
        if self.peak and rate > self.peak and self.device_type == "cpu" and not self.reprobed:
            self.reprobed = True
            self.peak = cpu_peak(self.dtype_name, at_least=rate)
            peak_flops.cache_clear()
        share = mfu(flops_per_token, tokens_per_s, self.peak)
        return None if share is None or share > 1 else share
