"""Whether this CPU can run the kernels ATEN_CPU_CAPABILITY asks torch for, checked before
torch loads. Asked for by name, torch takes the setting without a look at the CPU, and
the first kernel the CPU lacks kills the process (SIGILL, exit status 132) with nothing
said, so the scripts refuse it first with one line."""
from __future__ import annotations

import os
import sys

# The CPU flags torch requires before it picks each capability for itself
# (aten/src/ATen/native/DispatchStub.cpp, compute_cpu_capability); "fma" is Linux's name
# for FMA3. torch compares the setting's value case-sensitively and ignores any other.
NEEDS = {"avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"),
         "avx2": ("avx2", "fma")}


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


def refuse_on_import(env=os.environ, cpuinfo: str = "/proc/cpuinfo") -> None:
    """For a package's __init__ (attnlab, engine, data), before anything of it loads torch:
    under `python -m PACKAGE.TOOL` one error line and exit status 2; imported from other
    code (a notebook's cell), an ImportError that says the same."""
    if sys.argv[:1] == ["-m"]:      # `python -m PACKAGE.TOOL` is importing its package
        refuse_unrunnable_capability(env, cpuinfo)
    elif problem := capability_problem(env, cpuinfo):
        raise ImportError(problem)
