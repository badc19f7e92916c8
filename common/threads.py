"""How many threads torch uses and how they wait, looked at before torch loads (OpenMP
reads its wait policy once, when the library is loaded) and again while a run trains.

By default OpenMP threads spin for a while at the end of each parallel piece of work,
waiting for the others. On a quiet machine that is what makes a small model's many short
operations fast. On a machine whose other cores are busy (a laptop with a browser
working, a shared server) the thread they wait for may not be running at all, and the
spinning takes the core it needs: a training step then costs several times what it does
on one thread. So the scripts look at what the CPU is doing for a tenth of a second
before torch loads. Where other work holds a core, train.py starts on the cores it leaves
free (start_on_free_cores), and sample.py, which does not watch, makes the threads wait
asleep (wait_passively, OMP_WAIT_POLICY=PASSIVE); each says so once the run has started (a
mistyped option still gets its one error line). docs/benchmarks.md has the measurements
both ways; `python bench/cpu_kinds.py --busy` measures them. A thread count, wait policy
or spin count set by the user always wins.

That first look misses load that comes and goes, or starts once training runs, and the
wait policy cannot change after torch loads; the number of threads torch uses can. So
while a run trains on a CPU, ThreadWatch looks again every LOOK_EVERY seconds and, where
other work holds a core, goes on with the cores left free (on 2 cores, 1 thread, which
has no one to spin against), and back to the full count once the machine is free again:
a burst at the start costs seconds, not the whole run.
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, replace
from typing import Callable, NamedTuple

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


def one_thread(env=os.environ) -> bool:
    """Whether torch will use one thread (OMP_NUM_THREADS=1, or a one-core machine): then
    no thread ever waits for another, and how they wait means nothing."""
    first = env.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return first == "1" or (os.cpu_count() or 1) == 1


def wait_passively(env=os.environ, busy=busy_cores, say=_pending.append) -> None:
    """OMP_WAIT_POLICY=PASSIVE when other work holds at least BUSY_CORES of the CPU, unless
    the environment already says how OpenMP threads wait, or torch uses one thread."""
    if any(env.get(name, "").strip() for name in _USER_SETTINGS) or one_thread(env):
        return
    load = busy()
    if load is not None and load >= BUSY_CORES:
        env["OMP_WAIT_POLICY"] = WAIT_POLICY
        say(f"threads: other work holds {load:.1f} of {os.cpu_count()} cores, so torch's "
            "threads wait asleep instead of spinning (OMP_WAIT_POLICY=PASSIVE; set "
            "OMP_WAIT_POLICY=ACTIVE to keep them spinning)")


_start: dict[str, int] = {}   # {"threads": n} where start_on_free_cores chose fewer threads


def start_on_free_cores(env=os.environ, busy=busy_cores, say=_pending.append) -> None:
    """For train.py, whose ThreadWatch changes the thread count while it trains: where other
    work holds a core at the start, torch starts on the cores it leaves free (on 2 cores, 1
    thread, which has no one to spin against) and the watch gives the rest back once the
    machine is free. The wait policy is left as it is, so a burst of load at the start no
    longer makes the whole run wait asleep (slower once the machine is quiet:
    docs/benchmarks.md, "Threads on a busy machine").
    Several processes (torchrun), which the watch does not look after, wait passively."""
    if env.get("WORLD_SIZE", "").strip() not in ("", "1"):
        return wait_passively(env, busy, say)
    if any(env.get(name, "").strip() for name in ("OMP_NUM_THREADS", *_USER_SETTINGS)):
        return
    cores = os.cpu_count() or 1
    load = busy() if cores > 1 else None
    fewer = choose_threads(ThreadState(cores), load, cores, cores).threads
    if load is not None and fewer < cores:
        _start["threads"] = fewer
        say(f"threads: other work holds {load:.1f} of {cores} cores, so torch starts on "
            f"{fewer} thread{'s' if fewer > 1 else ''} and takes the others back once the "
            "machine is free (set OMP_NUM_THREADS to choose)")


def apply_start(get_threads: Callable[[], int], set_threads: Callable[[int], None]) -> None:
    """Once torch has loaded: the thread count start_on_free_cores chose, the full count
    kept for the watch (or free_again) to give back."""
    if _start and "full" not in _start:
        _start["full"] = get_threads()
        set_threads(min(_start["threads"], _start["full"]))


def free_again(set_threads: Callable[[int], None], busy=busy_cores) -> bool:
    """Back to the full thread count where the load seen at the start has gone (a look of
    a tenth of a second, this process idle): before --budget measures the machine, so that
    a burst at the start does not size the whole run. Whether it went back."""
    if "full" not in _start:
        return False
    load = busy()
    if load is None or load >= HELD:
        return False
    full = _start.pop("full")
    set_threads(full)
    _start.clear()
    _pending.append(f"threads: the machine is free again: torch goes back to {full} threads")
    return True


def report(say=lambda line: print(line, file=sys.stderr)) -> None:
    """Say what the first look chose (wait_passively, start_on_free_cores, free_again), once:
    called when the run's work begins."""
    while _pending:
        say(_pending.pop(0))


# --- Watching the machine while training ---------------------------------------------
LOOK_EVERY = 2.0        # seconds of wall time between looks, checked at a step's end
HELD = 0.4              # other work, in cores, that holds a core (docs/benchmarks.md,
#                         "Threads on a busy machine": a process beside 2 spinning threads
#                         gets a third of 2 cores and reads about 0.7, a quiet machine 0.1)
FREE = 0.2              # and below which the machine counts as free again
FREE_LOOKS = 3          # free looks in a row before the threads come back; doubled at each
#                         return, so load that comes and goes keeps the run on fewer threads


class Reading(NamedTuple):
    """One look: wall seconds, the machine's busy and all clock ticks, this process's CPU
    seconds (all its threads, spinning ones included)."""
    wall: float
    busy: int
    total: int
    own: float


def read_machine(stat: str = "/proc/stat") -> Reading | None:
    """A Reading now (one line of /proc/stat: cheap enough for every few steps); None
    where /proc/stat cannot be read."""
    ticks = cpu_ticks(stat)
    return None if ticks is None else Reading(time.perf_counter(), *ticks, time.process_time())


def other_cores(before: Reading | None, after: Reading | None, cores: int) -> float | None:
    """Cores' worth of other programs' work between two readings: the machine's work less
    this process's own."""
    if before is None or after is None or after.total <= before.total or after.wall <= before.wall:
        return None
    machine = cores * (after.busy - before.busy) / (after.total - before.total)
    return max(0.0, machine - (after.own - before.own) / (after.wall - before.wall))


@dataclass(frozen=True)
class ThreadState:
    threads: int            # torch's threads now
    free: int = 0           # free looks in a row while on fewer threads than the full count
    returns: int = 0        # how often the full count came back


def choose_threads(state: ThreadState, other: float | None, full: int, cores: int) -> ThreadState:
    """The threads to go on with after a look that read `other` cores of other work, for a
    run that started on `full` threads on `cores` cores. Where other work holds a core,
    the cores it leaves free (at least 1): threads that fit beside it do not fight it."""
    if other is None:
        return state
    held = math.floor(other + 1 - HELD)       # cores held, counting from HELD of one
    if held >= 1:
        return replace(state, threads=min(state.threads, max(1, cores - held)), free=0)
    if state.threads >= full:
        return state
    if other >= FREE:
        return replace(state, free=0)
    if state.free + 1 < FREE_LOOKS * 2 ** state.returns:
        return replace(state, free=state.free + 1)
    return ThreadState(full, 0, state.returns + 1)


class ThreadWatch:
    """Looks at the machine every LOOK_EVERY seconds at a step's end and changes torch's
    thread count as choose_threads says, saying so in one line each time."""

    def __init__(self, get_threads: Callable[[], int], set_threads: Callable[[int], None],
                 say: Callable[[str], None], read: Callable[[], Reading | None] | None = None,
                 clock: Callable[[], float] = time.perf_counter, cores: int | None = None):
        self.full = _start.get("full") or get_threads()     # the count a start under load lowered
        self.state = ThreadState(get_threads())
        self.set_threads, self.say, self.clock = set_threads, say, clock
        self.read = read or read_machine
        self.cores = cores or os.cpu_count() or 1
        self.last = self.read()
        self.due = clock() + LOOK_EVERY

    def step(self) -> None:
        if self.clock() < self.due:
            return
        reading = self.read()
        other = other_cores(self.last, reading, self.cores)
        self.last, self.due = reading, self.clock() + LOOK_EVERY
        state = choose_threads(self.state, other, self.full, self.cores)
        if state.threads != self.state.threads:
            self.set_threads(state.threads)
            self.say(self.line(state.threads, other))
        self.state = state

    def line(self, threads: int, other: float) -> str:
        count = f"{threads} thread{'s' if threads > 1 else ''}"
        if threads < self.full:
            return (f"threads: other work now holds {other:.1f} of {self.cores} cores: torch goes "
                    f"on with {count}, spinning threads would fight it (set OMP_NUM_THREADS to "
                    "choose)")
        return f"threads: the machine is free again: torch goes back to {count}"


class _NoWatch:
    def step(self) -> None:
        pass


def watch(on_cpu: bool, processes: int, get_threads: Callable[[], int],
          set_threads: Callable[[int], None], say: Callable[[str], None], env=os.environ):
    """A ThreadWatch for a single process training on a CPU on more than one thread whose
    threads spin (the user set neither the thread count nor how they wait, and
    wait_passively did not make them wait asleep); else a watch that does nothing."""
    chosen = any(env.get(name, "").strip() for name in ("OMP_NUM_THREADS", *_USER_SETTINGS))
    full = _start.get("full") or get_threads()
    if not on_cpu or processes > 1 or chosen or full < 2 or read_machine() is None:
        if "full" in _start:                  # nothing will give them back: now, then
            set_threads(_start.pop("full"))
            _start.clear()
        return _NoWatch()
    return ThreadWatch(get_threads, set_threads, say)
