"""How torch's CPU threads wait for each other, set before torch loads (OpenMP reads it
once, when the library is loaded).

By default OpenMP threads spin for a while at the end of each parallel piece of work,
waiting for the others. On a quiet machine that is what makes a small model's many short
operations fast. On a machine whose other cores are busy (a laptop with a browser
working, a shared server) the thread they wait for may not be running at all, and the
spinning takes the core it needs: a training step then costs several times what it does
on one thread. So the scripts look at what the CPU is doing for a tenth of a second
before torch loads, and only where other work holds at least half a core do they make the
threads wait asleep (OMP_WAIT_POLICY=PASSIVE), and say so once the run has started (a
mistyped option still gets its one error line). docs/benchmarks.md has the
measurements both ways; `python bench/cpu_kinds.py --busy` measures them. A wait policy
or spin count set by the user always wins.
"""
from __future__ import annotations

import os
import sys
import time

WAIT_POLICY = "PASSIVE"
BUSY_CORES = 0.5            # other work, in cores, from which passive waiting pays
_USER_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
_pending: list[str] = []    # what wait_passively chose, said by report() when work starts


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


def cores_busy_between(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """Cores' worth of work the whole machine did between two cpu_ticks() readings."""
    if before is None or after is None:
        return None
    return (os.cpu_count() or 1) * (after[0] - before[0]) / max(after[1] - before[1], 1)


def busy_cores(seconds: float = 0.1, stat: str = "/proc/stat") -> float | None:
    """Cores' worth of work the machine did over `seconds` (this process sleeps through
    them, so it is other programs' work); None where /proc/stat cannot be read."""
    before = cpu_ticks(stat)
    time.sleep(seconds)
    return cores_busy_between(before, cpu_ticks(stat))


def wait_passively(env=os.environ, busy=busy_cores, say=_pending.append) -> None:
    """OMP_WAIT_POLICY=PASSIVE when other work holds at least BUSY_CORES of the CPU, unless
    the environment already says how OpenMP threads wait."""
    if any(env.get(name, "").strip() for name in _USER_SETTINGS):
        return
    load = busy()
    if load is not None and load >= BUSY_CORES:
        env["OMP_WAIT_POLICY"] = WAIT_POLICY
        say(f"threads: other work holds {load:.1f} of {os.cpu_count()} cores, so torch's "
            "threads wait asleep instead of spinning (OMP_WAIT_POLICY=PASSIVE; set "
            "OMP_WAIT_POLICY=ACTIVE to keep them spinning)")


def report(say=lambda line: print(line, file=sys.stderr)) -> None:
    """Say what wait_passively chose, once: called when the run's work begins."""
    while _pending:
        say(_pending.pop(0))
