"""Device and precision, decided once and shared by train.py, sample.py and bench/."""
from __future__ import annotations

import contextlib
import functools
import os
import platform
import time
from pathlib import Path

import torch

from common import threads
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
CPU_FAST_BF16 = 2.5             # ... this many times as fast as fp32 (cached probes)


def cpu_bf16_pays(n_embd: int) -> bool:
    if not precision.cpu_has_native_bf16() or n_embd < CPU_FAST_BF16_MIN_WIDTH:
        return False
    if n_embd >= CPU_BF16_MIN_WIDTH:
        return True
    fp32, bf16 = peak_flops("cpu", "float32"), peak_flops("cpu", "bfloat16")
    return bool(fp32 and bf16 and bf16 >= CPU_FAST_BF16 * fp32)


# Decoding at batch 1 is another matter: each token is a row of matrix-vector products,
# and bf16 weights only pay where reading the weights dominates, and only on a CPU whose
# bf16 matrix-vector products are faster than its fp32 ones, which not every CPU with
# native bf16 has: an AMX Xeon's run several times slower up to 512 wide
# (docs/benchmarks.md, "bf16 weights to sample"). So from this width, where the CPU's own
# products at the model's width gain at least CPU_DECODE_BF16_GAIN.
CPU_DECODE_BF16_MIN_WIDTH = 384
CPU_DECODE_BF16_GAIN = 1.1


@functools.cache
def decode_matvec_speedup(n_embd: int) -> float:
    """How many times faster this CPU multiplies one token's row (1 x C) by an MLP's up
    projection (C x 4C, a block's largest) with bf16 weights than with fp32 ones: the best
    of five interleaved rounds each, so other work slows both alike; a small fraction of a
    second, once per width in a process."""
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(0)
    x32, w32 = torch.randn(1, n_embd, generator=g), torch.randn(4 * n_embd, n_embd, generator=g)
    pairs = {"float32": (x32, w32), "bfloat16": (x32.bfloat16(), w32.bfloat16())}
    best = dict.fromkeys(pairs, float("inf"))
    with torch.no_grad():
        for x, w in pairs.values():
            F.linear(x, w)                                # warm-up
        for _ in range(5):
            for name, (x, w) in pairs.items():
                start, reps = time.perf_counter(), 0
                while reps < 3 or time.perf_counter() - start < 0.005:
                    F.linear(x, w)
                    reps += 1
                best[name] = min(best[name], (time.perf_counter() - start) / reps)
    return best["float32"] / best["bfloat16"]


def cpu_bf16_decode_pays(n_embd: int) -> bool:
    return (precision.cpu_has_native_bf16() and n_embd >= CPU_DECODE_BF16_MIN_WIDTH
            and decode_matvec_speedup(n_embd) >= CPU_DECODE_BF16_GAIN)


def pick_dtype(name: str, device: torch.device, n_embd: int = 0,
               decoding: bool = False) -> torch.dtype:
    """The autocast precision (or, for `decoding`, the precision weights are held in
    to sample). auto: bf16 on GPUs that have it (fp16 on older ones); on a CPU, bf16
    where the CPU has native bf16 (model/precision.py) and the model is wide enough for
    it to pay (cpu_bf16_pays; to decode, cpu_bf16_decode_pays), else fp32;
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
        return torch.bfloat16 if cpu_bf16_decode_pays(n_embd) else torch.float32
    if device.type == "cpu" and cpu_bf16_pays(n_embd):
        return torch.bfloat16
    return torch.float32


def precision_note(device: torch.device, dtype: torch.dtype, option: str = "train.dtype") -> str:
    """A warning where bf16 was asked for (by `option`) on a CPU that would emulate it,
    the same words for training's set-up line and sample.py's; empty otherwise."""
    if device.type == "cpu" and precision.cpu_compute_dtype(dtype) != dtype:
        return (" (emulated: this CPU has no native bf16, so its bf16 matmuls run many times "
                f"slower than fp32; {option}=auto uses float32 here)")
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
# read low (a busy 2-core machine once read 8.5 GFLOP/s in fp32, a tenth of what it does
# quiet), and every later run on the quiet machine showed an MFU of several hundred
# percent. So only a probe during which other programs held less than half a core is
# kept (common/threads.py's measure of a busy machine), and the kept figure only ever
# rises: it is a peak.
PEAKS_FILE = "cpu_peak_flops.json"
PEAKS_FORMAT = 2                # entries {"flops", "other_cores"}; older files' bare numbers
#                                 recorded nothing about the machine's load, so they are measured again


# The settings that hold torch's kernels, oneDNN and MKL below what the CPU can do
# (bench/cpu_kinds.py's "avx2" kind): a peak measured under them is not the CPU's own.
ISA_SETTINGS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA",
                "MKL_ENABLE_INSTRUCTIONS")


def cpu_peak_key(dtype_name: str) -> str:
    """What a kept peak is a peak of: the CPU, the instruction set torch runs its kernels
    at and the settings that lower it, threads, precision and torch."""
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
    quiet = other is None or other < threads.BUSY_CORES   # no /proc/stat (macOS): trusted, as before
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
    ticks, cpu = threads.cpu_ticks(), time.process_time()
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < 0.3:
        a @ b
        runs += 1
    seconds = time.perf_counter() - start
    machine = threads.cores_busy_between(ticks, threads.cpu_ticks())
    other = None if machine is None else max(0.0, machine - (time.process_time() - cpu) / seconds)
    return 2 * n ** 3 * runs / seconds, other


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
