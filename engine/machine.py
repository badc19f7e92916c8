"""The machine in one room: every choice that depends on the hardware a run is on.

model/ holds the mathematics and runs as written wherever torch runs. What makes it fast
here is chosen in this module, once, when a run starts, from its config and the kind of
machine, never from a timing or the load: the same command gives the same numbers on a
quiet machine and a busy one.

* the CPU's kind (`CPU_KINDS`): whether it computes bf16 natively, and from what model
  width bf16 pays to train and to sample; `pick_dtype` reads it;
* the thread count (`fix_threads`): decided at the start, recorded in the run's config
  (train.threads) and reused on resume; it never changes while a run trains; torch's
  thread count is set through `use_threads` only;
* the attention backend `auto` runs: an entry of model/attention.py's ATTENTION_BACKENDS,
  named in the config a run builds its model from (`built_for`), so each layer takes it
  when it is built; a model that exists already (loaded to sample, or resumed in another
  precision) is set through model.attention.use_backend (`fit_attention`);
* torch.compile and the folder its kernels are cached in (`compiled`);
* the machine's load, read by --budget to plan (`read_machine`), never to decide numerics.

What must be settled before torch loads is common/cpu.py's, on the ground floor: the
ATEN_CPU_CAPABILITY check each script makes before anything else
(`refuse_unrunnable_capability`), how threads wait, the instruction-set settings
(`ISA_SETTINGS`) and the load from which the machine counts as busy (`BUSY_CORES`).
"""
from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass, replace
from typing import Callable, NamedTuple

import torch

from common.cpu import cpu_flags, cpu_ticks
from common.errors import ConfigError
from model.attention import ATTENTION_BACKENDS, use_backend
from model.flex import CUDA_MIN_HEAD_DIM
from model.layers import MLPS
from model.mechanisms import MECHANISMS, names_used
from model.registry import check

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# --- The CPU's kind ----------------------------------------------------------------------
# The values of common/cpu.py's ISA_SETTINGS that hold torch to AVX2 or less on any CPU,
# the way bench/cpu_kinds.py makes an AVX-512 machine stand in for an AVX2 one: ATen's
# kernels and oneDNN's (read under either of its names).
ATEN_BELOW_AVX512 = ("default", "avx2")
ONEDNN_BELOW_AVX512 = ("sse41", "avx", "avx2", "avx2_vnni", "avx2_vnni_2")


def held_below_avx512(env=os.environ) -> bool:
    """Whether the environment holds torch's CPU kernels to AVX2 or less."""
    aten = env.get("ATEN_CPU_CAPABILITY", "")        # torch reads it exactly: "AVX2" is ignored
    onednn = (env.get("ONEDNN_MAX_CPU_ISA") or env.get("DNNL_MAX_CPU_ISA") or "").strip().lower()
    return aten in ATEN_BELOW_AVX512 or onednn in ONEDNN_BELOW_AVX512


@functools.cache
def native_bf16() -> bool:
    """True where torch sends bf16 matmuls to oneDNN's bf16 kernels: the test ATen makes
    itself (torch.ops.mkldnn._is_mkldnn_bf16_supported), and False where the environment
    holds torch to AVX2. Decided once per process, as torch decides it."""
    if held_below_avx512():
        return False
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        return bool(torch.backends.mkldnn.is_available() and check is not None and check())
    except RuntimeError:              # a build without oneDNN's ops
        return False


@dataclass(frozen=True)
class CpuKind:
    """A kind of CPU and the precision facts measured on it (docs/benchmarks.md, `numbers`)."""
    native_bf16: bool
    train_bf16_from: int | None     # bf16 autocast from this model width (n_embd); None: never
    decode_bf16_from: int | None    # bf16 weights to sample from this width; None: never
    why: str                        # the sentence the device line gives
    numbers: str                    # the docs/benchmarks.md section with the measurements


CPU_KINDS = {
    # AMX tiles make bf16 matmuls several times fp32's even for small models, but its bf16
    # matrix-vector products (one token at a time) gain on fp32's only at 2,048 wide.
    "amx": CpuKind(True, 64, 2048, "AMX: bf16 matmuls several times fp32's",
                   "bf16 autocast on a CPU"),
    # Zen 4's bf16 dot products: a speedrun-sized model (3 x 64) trains faster in bf16
    # with attention as two bf16 matmuls; a token's row of products pays from 384 wide.
    "avx512-bf16": CpuKind(True, 64, 384, "AVX-512 BF16: bf16 dot products in hardware",
                           "bf16 autocast on a CPU"),
    # A CPU with native bf16 of another kind (ARM's BF16), or a Zen 4 with slow bf16: bf16
    # only where arithmetic, not overhead, sets the time.
    "native-bf16": CpuKind(True, 256, None, "native bf16",
                           "bf16 autocast on a CPU"),
    # Without native bf16 torch emulates a bf16 matmul element by element, many times
    # slower than fp32 (docs/benchmarks.md, "Muon's Newton-Schulz iterations"): nothing is
    # computed in bf16 at all.
    "no-bf16": CpuKind(False, None, None, "no native bf16: torch would emulate it",
                       "Held to AVX2 against a real AVX2 CPU"),
}


def cpu_kind_name(flags: set[str] | None = None) -> str:
    """This CPU's entry in CPU_KINDS, from torch's bf16 check and the CPU's flags."""
    if not native_bf16():
        return "no-bf16"
    flags = cpu_flags() if flags is None else flags
    if flags and "amx_bf16" in flags:
        return "amx"
    if flags and "avx512_bf16" in flags:
        return "avx512-bf16"
    return "native-bf16"


def cpu_kind() -> CpuKind:
    return CPU_KINDS[cpu_kind_name()]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision this CPU computes work asked of in `dtype` in: fp32 in place of bf16
    where bf16 would be emulated (Muon's iterations and the decode probe follow it)."""
    return torch.float32 if dtype == torch.bfloat16 and not native_bf16() else dtype


def describe_cpu() -> str:
    """The kernels torch runs here and this CPU's kind, for the set-up line."""
    return f"{torch.backends.cpu.get_cpu_capability()}, {cpu_kind_name()} kind"


# --- Precision -----------------------------------------------------------------------------
def routes_experts(model_cfg) -> bool:
    """Does the model's MLP route tokens to experts (model/moe.py)?"""
    return getattr(MLPS[model_cfg.mlp], "routes_tokens", False)


def pick_dtype(name: str, device: torch.device, n_embd: int = 0,
               decoding: bool = False, experts: bool = False) -> torch.dtype:
    """The autocast precision (for `decoding`, the precision weights are held in to
    sample). auto: bf16 on GPUs that have it (fp16 on older ones); on a CPU, what its
    kind's entry says for this width, but fp32 to train a mixture of `experts` (under
    autocast its many small matmuls, one set an expert, take longer than fp32's:
    docs/after_the_article.md, "The cards' training time"); fp32 on MPS. A
    precision named is kept, even bf16 where it is emulated (why_dtype says what it costs)."""
    if name != "auto":
        dtype = DTYPES[name]
        if dtype == torch.float16 and device.type == "cpu":
            raise ConfigError("float16 autocast is for GPUs; on the CPU use bfloat16 or float32")
        if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ConfigError("this GPU has no bfloat16; use train.dtype=float16 or float32")
        return dtype
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type != "cpu":
        return torch.float32
    kind = cpu_kind()
    start = kind.decode_bf16_from if decoding else kind.train_bf16_from
    if experts and not decoding:
        start = None
    return torch.bfloat16 if start is not None and n_embd >= start else torch.float32


def why_dtype(device: torch.device, dtype: torch.dtype, name: str, n_embd: int,
              option: str = "train.dtype", experts: bool = False) -> str:
    """Why the precision is what it is, for the device line: the same words on any load."""
    if device.type != "cpu":
        return "" if name == "auto" else f" ({option}={name})"
    if name != "auto":
        emulated = compute_dtype(dtype) != dtype
        return (f" ({option}={name}" + ("; emulated: this CPU has no native bf16, so its bf16 "
                f"matmuls run many times slower than fp32; {option}=auto uses float32 here"
                if emulated else "") + ")")
    kind = cpu_kind()
    start = kind.train_bf16_from if option == "train.dtype" else kind.decode_bf16_from
    if experts and option == "train.dtype" and start is not None:
        return f" ({kind.why}, but a mixture of experts trains in fp32 on a CPU)"
    rule = f"bf16 from {start} wide" if start is not None else "never bf16"
    return f" ({kind.why}: {rule}; {n_embd} wide)"


# --- Threads ---------------------------------------------------------------------------------
# torch's thread count is set here and nowhere else (use_threads). Decoding one token reads
# every weight once and does little arithmetic: one thread decodes as fast as two, and a
# page that serves the model leaves the other cores to its server (docs/benchmarks.md,
# "bf16 weights to sample").
DECODE_THREADS = 1


def use_threads(count: int, env=None) -> int:
    """Set torch's thread count in this process to `count`; with `env` (os.environ), its
    OMP_NUM_THREADS too, so the scripts this process starts take the same count. Returns it."""
    if env is not None:
        env["OMP_NUM_THREADS"] = str(count)
    torch.set_num_threads(count)
    return count


def threads_from_env(env=os.environ) -> int | None:
    """The thread count OMP_NUM_THREADS asks for (its first number); None where unset."""
    first = env.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(first) if first.isdigit() and int(first) > 0 else None


def fix_threads(train_cfg, say: Callable[[str], None] = print, env=os.environ) -> int:
    """torch's thread count for the whole run. train.threads=0 is decided now, from
    OMP_NUM_THREADS or else the cores torch would use, and written into the config so the
    run records it; a number already there (a resumed run's, or given) is used as it is,
    because a sum split over another number of threads rounds differently and the losses
    would no longer be those of the run that never stopped. Returns the count."""
    asked = threads_from_env(env)
    if not train_cfg.threads:
        train_cfg.threads = asked or torch.get_num_threads()
    elif asked is not None and asked != train_cfg.threads:
        say(f"threads: {train_cfg.threads}, as the run's config records (train.threads), not "
            f"the {asked} OMP_NUM_THREADS asks for, so the numbers are the run's own; give "
            f"--train.threads={asked} to change it")
    return use_threads(train_cfg.threads)


# --- Attention ---------------------------------------------------------------------------------
# Banded attention pays once the band (2·W keys per block of W queries) is a small share
# of the T keys a masked dense kernel reads; at T = 4·W (context 128, a window of 32, the
# README's example) the dense path was faster, in fp32 and far more in bf16
# (docs/benchmarks.md, "The machine room").
BAND_PAYS_FROM = 16                 # T / W


def attention_backend(model_cfg, device: torch.device, dtype: torch.dtype) -> str:
    """The entry of model/attention.py's ATTENTION_BACKENDS that `auto` runs, chosen once
    for this model, device and precision."""
    window, T = model_cfg.sliding_window, model_cfg.block_size
    # With full layers among the windowed ones (model.full_attention_every) one kernel
    # serves both kinds, and a band would compute only the windowed layers' share.
    if window and T >= BAND_PAYS_FROM * window and not model_cfg.full_attention_every:
        if device.type == "cuda" and model_cfg.dropout == 0 and model_cfg.head_dim >= CUDA_MIN_HEAD_DIM:
            return "flex"                    # block-sparse: skips the tiles the window hides
        return "banded"
    if device.type == "cpu" and dtype == torch.bfloat16 and native_bf16():
        # The formula as written, in bf16: at a small model's lengths its matmuls run on
        # the CPU's bf16 units, where torch's fused CPU kernel does not pay
        # (docs/benchmarks.md, "CPU attention routes").
        return "eager"
    return "sdpa"


def built_for(model_cfg, device: torch.device, dtype: torch.dtype):
    """The model config a run builds its model from: `auto` replaced by the backend chosen
    for this machine and precision, so every layer takes its kernel when it is built
    (model/attention.py, MultiHeadAttention.__init__). The run's own config keeps `auto`,
    so a resume on another machine chooses again."""
    if (ATTENTION_BACKENDS.get(model_cfg.attention) is not ATTENTION_BACKENDS["auto"]
            or not any(MECHANISMS[n].uses_kernel for n in names_used(model_cfg))):
        return model_cfg                     # named by the user, or no layer runs a kernel
    built = replace(model_cfg, attention=attention_backend(model_cfg, device, dtype))
    check(built)                             # here, once, so building it checks nothing again
    return built


def fit_attention(model, model_cfg, device: torch.device, dtype: torch.dtype) -> str:
    """Set the model's attention backend for this machine where its config says `auto`
    (a backend named is kept as it is); returns its name for the device line.
    FlexAttention compiles when first called, so its cache folder is set here too."""
    compile_cache_folder()
    if ATTENTION_BACKENDS.get(model_cfg.attention) is not ATTENTION_BACKENDS["auto"]:
        return kernel_words(model_cfg, model_cfg.attention)
    name = attention_backend(model_cfg, device, dtype)
    use_backend(model, name)
    return kernel_words(model_cfg, name)


def sampling_kernel_why(model_cfg, train_cfg, device: torch.device, dtype: torch.dtype) -> str:
    """Why sampling runs another kernel than training, for sample.py's header: `auto`
    picks the kernel for the precision (attention_backend), and the weights sample in
    another precision than training's autocast (pick_dtype reads another width for each).
    "" where the kernel is named, no layer runs one, or both precisions pick the same."""
    if (ATTENTION_BACKENDS.get(model_cfg.attention) is not ATTENTION_BACKENDS["auto"]
            or not any(MECHANISMS[n].uses_kernel for n in names_used(model_cfg))):
        return ""
    try:
        trained = pick_dtype(train_cfg.dtype, device, model_cfg.n_embd,
                             experts=routes_experts(model_cfg))
    except ConfigError:                  # a precision this device has none of: no comparison
        return ""
    here, there = (attention_backend(model_cfg, device, d) for d in (dtype, trained))
    if here == there:
        return ""
    name = {d: str(d).removeprefix("torch.") for d in (dtype, trained)}
    return (f" (model.attention=auto picks the kernel for the precision: {here} for these "
            f"{name[dtype]} weights; training's {name[trained]} autocast runs {there} here)")


def kernel_words(model_cfg, kernel: str) -> str:
    """The kernel as the device line says it: a mechanism that computes its own maths (a
    recurrent state, a latent) runs no kernel, and the line must not say it does."""
    names = names_used(model_cfg)
    own = [n for n in names if not MECHANISMS[n].uses_kernel]
    if not own:
        return kernel
    theirs = f"{', '.join(own)}: {'its' if len(own) == 1 else 'their'} own maths"
    if len(own) == len(names):
        return theirs
    return f"{kernel} for {', '.join(n for n in names if n not in own)}; {theirs}"


# --- Compile ---------------------------------------------------------------------------------
# The tail given to torch.compile's cache folder under ATEN_CPU_CAPABILITY=VALUE.
CACHE_TAIL = "-aten-"


def compile_cache_folder(env=os.environ) -> str:
    """Point torch.compile's cache (TORCHINDUCTOR_CACHE_DIR) at a folder of its own for each
    ATEN_CPU_CAPABILITY, and return it. The compiler writes its CPU kernels for the vector
    width that setting asks for, but its cache does not tell them apart: a kernel built
    under `avx2` and then loaded by a run without it corrupted memory and killed that run
    ("double free or corruption"). A folder given keeps its place, with the tail added."""
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
    env["TORCHINDUCTOR_CACHE_DIR"] = f"{base}{CACHE_TAIL}{env.get('ATEN_CPU_CAPABILITY') or 'auto'}"
    return env["TORCHINDUCTOR_CACHE_DIR"]


def compiled(module, on: bool):
    """torch.compile(module) where `on`, after its cache folder is set; else the module."""
    if not on:
        return module
    compile_cache_folder()
    return torch.compile(module)


# --- The machine's load: read by --budget to plan, never to decide numerics -----------------
HELD = 0.4      # other work, in cores, that holds a core (a quiet machine reads about 0.1)


class Reading(NamedTuple):
    """One look: wall seconds, the machine's busy and all clock ticks, this process's CPU
    seconds (all its threads)."""
    wall: float
    busy: int
    total: int
    own: float


def read_machine(stat: str = "/proc/stat") -> Reading | None:
    """A Reading now; None where /proc/stat cannot be read (not Linux)."""
    ticks = cpu_ticks(stat)
    return None if ticks is None else Reading(time.perf_counter(), *ticks, time.process_time())


def other_cores(before: Reading | None, after: Reading | None, cores: int | None = None) -> float | None:
    """Cores' worth of other programs' work between two readings: the machine's work less
    this process's own."""
    cores = cores or os.cpu_count() or 1
    if before is None or after is None or after.total <= before.total or after.wall <= before.wall:
        return None
    machine = cores * (after.busy - before.busy) / (after.total - before.total)
    return max(0.0, machine - (after.own - before.own) / (after.wall - before.wall))
