"""Does this CPU compute in bf16 natively? The one fact every precision choice on a CPU
follows: autocast (engine/device.py), Muon's Newton-Schulz iterations (engine/optim.py),
the CPU attention routes (model/cpu_kernels.py), sampling and the --budget probes.

Without native bf16 (AVX2 CPUs: most laptops' Intel Core chips, AMD Zen 2 and 3) torch
emulates a bf16 matmul element by element, some 30 times slower than in fp32, so there
nothing is computed in bf16 at all. docs/benchmarks.md has the figures.
The same settings that stand an AVX-512 machine in for an AVX2 one decide the vector
width of what torch.compile builds, so each gets a compile cache of its own here.
"""
from __future__ import annotations

import functools
import os

import torch

# Settings that hold torch to AVX2 or less on any CPU, the way bench/cpu_kinds.py makes
# an AVX-512 machine stand in for an AVX2 one: ATen's kernels (ATEN_CPU_CAPABILITY) and
# oneDNN's (ONEDNN_MAX_CPU_ISA, formerly DNNL_MAX_CPU_ISA).
ATEN_BELOW_AVX512 = ("default", "avx2")
ONEDNN_BELOW_AVX512 = ("sse41", "avx", "avx2", "avx2_vnni", "avx2_vnni_2")


def held_below_avx512(env=os.environ) -> bool:
    """Whether the environment holds torch's CPU kernels to AVX2 or less."""
    aten = env.get("ATEN_CPU_CAPABILITY", "")        # torch reads it exactly: "AVX2" is ignored
    onednn = (env.get("ONEDNN_MAX_CPU_ISA") or env.get("DNNL_MAX_CPU_ISA") or "").strip().lower()
    return aten in ATEN_BELOW_AVX512 or onednn in ONEDNN_BELOW_AVX512


# The tail given to torch.compile's cache folder under ATEN_CPU_CAPABILITY=VALUE.
CACHE_TAIL = "-aten-"


def separate_compile_cache(env=os.environ) -> str:
    """Point torch.compile's cache (TORCHINDUCTOR_CACHE_DIR) at a folder of its own for each
    ATEN_CPU_CAPABILITY, and return it. The compiler writes its CPU kernels for the
    vector width that setting asks for, but its cache does not tell them apart: a kernel
    built under `avx2` (bench/cpu_kinds.py's second kind) and then loaded by a run without
    it corrupted memory and killed that run ("double free or corruption"). A folder given
    in TORCHINDUCTOR_CACHE_DIR keeps its place, with the capability's tail added
    (`-aten-auto` without the setting)."""
    import getpass
    import re
    import tempfile
    base = env.get("TORCHINDUCTOR_CACHE_DIR")
    if not base:
        # torch's own default (torch._inductor.runtime.cache_dir_utils.default_cache_dir),
        # written out: importing that module costs a second.
        try:
            user = getpass.getuser()
        except (KeyError, ModuleNotFoundError, OSError):
            user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
        base = os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))
    base = re.sub(re.escape(CACHE_TAIL) + r"[A-Za-z0-9_]+$", "", base)   # a parent's tail
    asked = env.get("ATEN_CPU_CAPABILITY")
    # A tail without the setting too: a cache shared before this was done may hold
    # kernels built under avx2, and is not read again.
    env["TORCHINDUCTOR_CACHE_DIR"] = f"{base}{CACHE_TAIL}{asked or 'auto'}"
    return env["TORCHINDUCTOR_CACHE_DIR"]


@functools.cache
def cpu_has_native_bf16() -> bool:
    """True where torch sends bf16 matmuls to oneDNN's bf16 kernels: the test ATen
    itself makes before it does (torch.ops.mkldnn._is_mkldnn_bf16_supported, which is
    also what torch.compile's CPU backend asks), and False where the environment holds
    torch to AVX2 (held_below_avx512). Decided once per process, as torch decides it."""
    if held_below_avx512():
        return False
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        return bool(torch.backends.mkldnn.is_available() and check is not None and check())
    except RuntimeError:              # a build without oneDNN's ops
        return False


def cpu_kind() -> str:
    """The kernels torch runs on this CPU and its bf16, for the set-up line: "AVX2, no
    native bf16"."""
    native = "native bf16" if cpu_has_native_bf16() else "no native bf16"
    return f"{torch.backends.cpu.get_cpu_capability()}, {native}"


def cpu_compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision to compute in on this CPU for work asked of in `dtype`: fp32 in place
    of bf16 where bf16 would be emulated."""
    if dtype == torch.bfloat16 and not cpu_has_native_bf16():
        return torch.float32
    return dtype
