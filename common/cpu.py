"""What the scripts settle about the CPU before torch loads, and so without torch.

Whether this CPU can run the kernels ATEN_CPU_CAPABILITY asks torch for: asked for by
name, torch takes the setting without a look at the CPU, and the first kernel the CPU
lacks kills the process (SIGILL, exit status 132) with nothing said, so the scripts
refuse it first with one line.

How torch's OpenMP threads wait, which OpenMP reads once, when torch loads: by default
they spin a while at the end of each parallel piece of work, which makes a small model's
many short operations fast on a quiet machine; where other programs hold a core, the
thread they wait for may not be running and the spinning takes its core, and a step
costs several times more (docs/benchmarks.md, "The machine room"). Either way the
threads compute the same numbers; only the time differs.

The settings that hold torch below the instruction set the CPU has (ISA_SETTINGS), which
torch also reads once, when it loads.
"""
from __future__ import annotations

import os
import sys
import time

# The CPU flags torch requires before it picks each capability for itself
# (aten/src/ATen/native/DispatchStub.cpp, compute_cpu_capability); "fma" is Linux's name
# for FMA3. torch compares the setting's value case-sensitively and ignores any other.
NEEDS = {"avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"),
         "avx2": ("avx2", "fma")}

# The settings that hold torch's kernels below what the CPU can do: ATen's own, oneDNN's
# (under its former name too) and MKL's. Each with the value that holds it to AVX2, which
# makes an AVX-512 machine run the code a CPU without AVX-512 and native bf16 runs
# (bench/cpu_kinds.py, .ci/run); None: read where it is set, never set here.
ISA_SETTINGS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                "DNNL_MAX_CPU_ISA": None, "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def held_to_avx2() -> dict[str, str]:
    """The environment that holds torch, oneDNN and MKL to AVX2 (set before torch loads)."""
    return {name: value for name, value in ISA_SETTINGS.items() if value}


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str] | None:
    """The first core's x86 flags; None where /proc/cpuinfo cannot be read or has no flags
    line (macOS, ARM)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def vector_flags(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The flags that decide a CPU's kind (vector, FMA, AMX and bf16 ones), for the bench
    scripts' headers; "?" where they cannot be read."""
    flags = cpu_flags(cpuinfo)
    if flags is None:
        return "?"
    return " ".join(sorted(f for f in flags if f.startswith(("avx", "amx", "fma")) or "bf16" in f))


def capability_problem(env=os.environ, cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """What is wrong with ATEN_CPU_CAPABILITY on this CPU, with what to do; None where
    nothing is (or the CPU's flags cannot be read)."""
    asked = env.get("ATEN_CPU_CAPABILITY")
    if asked is None or asked == "default":
        return None
    flags = cpu_flags(cpuinfo)
    if asked not in NEEDS:
        if flags is None:       # not x86: its values (vsx, zvector, sve256) are torch's to judge
            return None
        # torch would warn in two lines and pick for itself: a typo, said once, with the
        # values this CPU can run
        runnable = [name for name, needs in NEEDS.items() if flags.issuperset(needs)]
        return (f"ATEN_CPU_CAPABILITY={asked} is not a value torch knows on this CPU, so it "
                f"would be ignored; set it to {', '.join(runnable)}"
                f"{' or ' if runnable else ''}default (lower case), or unset it")
    lacking = [flag for flag in NEEDS[asked] if flags is not None and flag not in flags]
    if not lacking:
        return None
    runs = next((name for name, needs in NEEDS.items() if flags.issuperset(needs)), "default")
    return (f"ATEN_CPU_CAPABILITY={asked} asks torch for kernels this CPU cannot run (it lacks "
            f"{', '.join(lacking)}), and torch would die at the first one; unset "
            f"ATEN_CPU_CAPABILITY, or set it to {runs}")


def refuse_unrunnable_capability(env=os.environ, cpuinfo: str = "/proc/cpuinfo") -> None:
    """One error line and exit status 2 where capability_problem finds something."""
    problem = capability_problem(env, cpuinfo)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)


def check_tool_start(argv=None, env=os.environ, cpuinfo: str = "/proc/cpuinfo",
                     busy=None) -> None:
    """For a package's __init__ (attnlab, data): where `python -m PACKAGE.TOOL` is starting
    that tool, what train.py and sample.py do before torch loads (refuse a capability this
    CPU cannot run; threads that wait asleep beside other work, said by no line, since a
    tool's first line may be its answer or its error); imported by other code (a notebook,
    a test) it does nothing: importing changes nothing and checks nothing."""
    if (sys.argv if argv is None else argv)[:1] == ["-m"]:
        refuse_unrunnable_capability(env, cpuinfo)
        wait_passively_if_busy(env, busy=busy or busy_cores)


WAIT_POLICY = "PASSIVE"
# Other programs' work, in cores, from which the machine counts as busy: torch's threads
# then wait asleep (passive waiting pays), and a matmul probe of the CPU's peak reads low
# and is not kept (engine/device.py).
BUSY_CORES = 0.5
WAIT_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def cpu_ticks(stat: str = "/proc/stat") -> tuple[int, int] | None:
    """(busy, all) clock ticks of every core since boot; None where /proc/stat cannot be
    read (not Linux)."""
    try:
        with open(stat) as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)       # idle + iowait
    except (OSError, ValueError, IndexError):
        return None
    return sum(fields) - idle, sum(fields)


def busy_cores(seconds: float = 0.1, stat: str = "/proc/stat") -> float | None:
    """Cores' worth of work the machine did over `seconds` (this process sleeps through
    them, so it is other programs' work); None where /proc/stat cannot be read."""
    before = cpu_ticks(stat)
    time.sleep(seconds)
    after = cpu_ticks(stat)
    if before is None or after is None:
        return None
    return (os.cpu_count() or 1) * (after[0] - before[0]) / max(after[1] - before[1], 1)


def wait_passively_if_busy(env=os.environ, busy=busy_cores) -> str | None:
    """OMP_WAIT_POLICY=PASSIVE where other work holds at least BUSY_CORES of the CPU as the
    script starts, unless the environment says how threads wait or torch uses one thread;
    returns the line that says so. It changes how long a step takes, never its numbers:
    the thread count, and so every sum's order, is the run's own (engine/machine.py)."""
    first = env.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if any(env.get(name, "").strip() for name in WAIT_SETTINGS) or first == "1" \
            or (os.cpu_count() or 1) == 1:
        return None
    load = busy()
    if load is None or load < BUSY_CORES:
        return None
    env["OMP_WAIT_POLICY"] = WAIT_POLICY
    return (f"threads: other work holds {load:.1f} of {os.cpu_count()} cores, so torch's threads "
            "wait asleep instead of spinning (OMP_WAIT_POLICY=PASSIVE; the same numbers, "
            "only the time differs; set OMP_WAIT_POLICY=ACTIVE to keep them spinning)")
