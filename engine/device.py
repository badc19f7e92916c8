"""Device and precision, decided once and shared by train.py, sample.py and bench/."""
from __future__ import annotations

import contextlib
import functools
import os
import platform
import time
from pathlib import Path

import torch

from common.errors import ConfigError
from common.files import read_json, write_json_atomic
from model import precision

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


# Whether bf16 autocast pays on a CPU depends on the width (small matmuls are bound by
# overhead, not arithmetic) and on how much faster the CPU's bf16 matmuls are than its
# fp32 ones, which differs between CPUs that both have AVX-512 BF16 (docs/benchmarks.md,
# "bf16 autocast on a CPU").
CPU_BF16_MIN_WIDTH = 256        # bf16 from here on any CPU with native bf16
CPU_FAST_BF16_MIN_WIDTH = 64    # and from here where bf16 matmuls run at least ...
CPU_FAST_BF16 = 3.0             # ... this many times as fast as fp32 (cached probes)


def cpu_bf16_pays(n_embd: int) -> bool:
    if not precision.cpu_has_native_bf16() or n_embd < CPU_FAST_BF16_MIN_WIDTH:
        return False
    if n_embd >= CPU_BF16_MIN_WIDTH:
        return True
    fp32, bf16 = peak_flops("cpu", "float32"), peak_flops("cpu", "bfloat16")
    return bool(fp32 and bf16 and bf16 >= CPU_FAST_BF16 * fp32)


# Decoding at batch 1 is another matter: each token is a row of matrix-vector products,
# and bf16 weights only pay where reading the weights dominates (docs/benchmarks.md,
# "bf16 weights to sample").
CPU_DECODE_BF16_MIN_WIDTH = 384


def pick_dtype(name: str, device: torch.device, n_embd: int = 0,
               decoding: bool = False) -> torch.dtype:
    """The autocast precision (or, for `decoding`, the precision weights are held in
    to sample). auto: bf16 on GPUs that have it (fp16 on older ones); on a CPU, bf16
    where the CPU has native bf16 (model/precision.py) and the model is wide enough for
    it to pay (cpu_bf16_pays; to decode, from CPU_DECODE_BF16_MIN_WIDTH), else fp32;
    fp32 on MPS. bfloat16 asked for by name is kept even where it is emulated (to study
    its rounding), and precision_note says what it costs."""
    if name != "auto":
        dtype = DTYPES[name]
        if dtype == torch.float16 and device.type == "cpu":
            raise ConfigError("float16 autocast is for GPUs; on the CPU use bfloat16 or float32")
        if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ConfigError("this GPU has no bfloat16; use train.dtype=float16 or float32")
        return dtype
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "cpu" and decoding:
        return torch.bfloat16 if precision.cpu_has_native_bf16() and n_embd >= CPU_DECODE_BF16_MIN_WIDTH \
            else torch.float32
    if device.type == "cpu" and cpu_bf16_pays(n_embd):
        return torch.bfloat16
    return torch.float32


def precision_note(device: torch.device, dtype: torch.dtype) -> str:
    """A warning for the run's set-up line where bf16 was asked for on a CPU that would
    emulate it; empty otherwise."""
    if device.type == "cpu" and precision.cpu_compute_dtype(dtype) != dtype:
        return (" (emulated: this CPU has no native bf16, so its bf16 matmuls run many times "
                "slower than fp32; train.dtype=auto uses float32 here)")
    return ""


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
    GPUs, measured by a matmul probe on a CPU (once per machine, thread count and torch
    version: the probe takes 0.3 s, a noticeable share of a 20-second run, so its result
    is kept in the user's cache folder); None when unknown (no MFU shown)."""
    if device_type == "cuda":
        for name, peaks in GPU_PEAKS.items():
            if name in device_name:
                return peaks.get(dtype_name)
        return None
    if device_type != "cpu":
        return None
    key = f"{cpu_name()} | {torch.get_num_threads()} threads | {dtype_name} | torch {torch.__version__}"
    try:
        path = cache_dir() / "cpu_peak_flops.json"
    except RuntimeError:              # no home folder to keep it in: measure every time
        return probe_cpu_flops(dtype_name)
    known = read_json(path) or {}
    if isinstance(known.get(key), (int, float)) and known[key] > 0:
        return float(known[key])
    peak = probe_cpu_flops(dtype_name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {**known, key: peak})
    except OSError:                   # a read-only home: measure again next time
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


def probe_cpu_flops(dtype_name: str) -> float:
    """FLOP/s of a 1024 x 1024 matmul in this precision, over 0.3 s."""
    dtype = DTYPES[dtype_name]
    n = 1024
    # A private generator: drawing from the global one would shift a resumed run's
    # dropout masks (tests/test_train.py::test_killed_run_resumes... catches that).
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=g).to(dtype) for _ in range(2))
    a @ b                                                  # warm-up
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < 0.3:
        a @ b
        runs += 1
    return 2 * n ** 3 * runs / (time.perf_counter() - start)


def mfu(flops_per_token: float, tokens_per_s: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: the share of the device's peak the model's own
    arithmetic uses (PaLM, arXiv:2204.02311, appendix B)."""
    return None if not peak else flops_per_token * tokens_per_s / peak
