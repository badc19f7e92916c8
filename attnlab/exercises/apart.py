"""The one runner for the learner's code: a child process of its own session, started
through a watcher in another session of its own, with a time limit, a memory limit and a
cap on what it prints. The learner's code is their own, so this guards against mistakes,
not malice: a loop, an exit, a crash, a flood of prints, a signal sent to its own group,
to its parent or to its parent's group each end as a failed check that says which, and
the checker goes on. Nothing it starts outlives the check: on Linux the checker adopts
the orphans of what it started (a child subreaper) and kills every one left when the
check ends, even a process that left the learner's session with os.setsid()."""
from __future__ import annotations

import codecs
import ctypes
import json
import os
import re
import resource
import select
import signal
import sys
import time
from dataclasses import dataclass
from typing import Callable

# Characters of the learner's own prints shown per check; the rest is counted, not kept.
OUTPUT_LIMIT = 20_000
# Bytes the child may add to its address space: the exercises' tensors need megabytes.
MEMORY_HEADROOM = 4 << 30
_RESULT_LIMIT = 1 << 16           # the child's answer is one short JSON object
# prctl options (linux/prctl.h): adopt the orphans of this process's descendants.
_SET_CHILD_SUBREAPER, _GET_CHILD_SUBREAPER = 36, 37
# Rounds of the final sweep: each kills one generation of what is left (a tree that keeps
# forking faster than that is malice, which this does not claim to stop).
_SWEEP_ROUNDS = 1000


@dataclass
class Ended:
    """How the learner's code ended: what it answered when it got that far (or
    {"raised": name} for what stops a program, such as KeyboardInterrupt), whether the
    limit stopped it, its exit code (negative: the signal; None: the watcher was killed
    before it could say), how many printed characters were not shown, and the signal that
    stopped it (SIGSTOP: a process paused, not looping, then killed) or 0."""
    said: dict | None
    timed_out: bool
    code: int | None
    printed_more: int               # characters of output not shown
    stopped: int = 0


# Characters that steer a terminal rather than print: C0 and C1 controls (an ANSI escape
# starts with ESC, 0x1b; a carriage return overwrites the line) and Unicode's invisible
# and bidirectional marks. Shown as escapes, so the learner's output cannot clear the
# screen, recolour it, or hide or reorder the checker's own lines. Newline and tab stay.
_STEERING = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """`text` with every character that steers a terminal written as an escape (\\x1b)."""
    return _STEERING.sub(lambda m: f"\\x{ord(m[0]):02x}" if ord(m[0]) < 0x100
                         else f"\\u{ord(m[0]):04x}", text)


def run_apart(task: Callable[[], dict], limit_s: float) -> Ended:
    """`task()` in a child process, its JSON-able answer returned; its prints relayed to
    this process's stdout up to OUTPUT_LIMIT characters."""
    answer_r, answer_w = os.pipe()
    status_r, status_w = os.pipe()
    out_r, out_w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    before = _children(os.getpid())                    # this process's own, left alone
    adopted = _adopt_orphans()
    watcher = os.fork()
    if watcher == 0:                                   # never returns
        _watch(task, (answer_r, status_r, out_r), answer_w, out_w, status_w)
    for fd in (answer_w, status_w, out_w):
        os.close(fd)
    read = {answer_r: bytearray(), status_r: bytearray()}
    relay = _Relay()
    try:
        timed_out = _gather(read, answer_r, status_r, out_r, relay, time.monotonic() + limit_s)
    finally:
        child = _first_int(read[status_r], 0)
        code = _first_int(read[status_r], 1)
        stopped = _first_int(read[status_r], 2) or 0
        if child:                  # it, or anything it started, may still run: none outlives it
            _kill_group(child)
        _kill_and_reap(watcher)
        _sweep(before)             # what left the learner's group: adopted, so ours to end
        if adopted is not None:
            _set_subreaper(adopted)
        for fd in (answer_r, status_r, out_r):
            os.close(fd)
    relay.close()
    return Ended(_answer(read[answer_r]), timed_out, None if timed_out else code, relay.dropped,
                 0 if timed_out else stopped)


def _gather(read: dict, answer_r: int, status_r: int, out_r: int, relay: "_Relay",
            deadline: float) -> bool:
    """Read the pipes until the watcher ends (the learner's process has ended and the
    watcher has said how, or the watcher itself was killed), then what they still hold;
    True when the deadline came first. A process the learner's code left running cannot
    hold the check open: it is killed with its group afterwards."""
    open_fds = [answer_r, status_r, out_r]
    while status_r in open_fds:
        left = deadline - time.monotonic()
        if left <= 0:
            return True
        _read_ready(open_fds, read, out_r, relay, left)
    while time.monotonic() < deadline and _read_ready(open_fds, read, out_r, relay, 0):
        pass
    return False


def _read_ready(open_fds: list, read: dict, out_r: int, relay: "_Relay", wait: float) -> bool:
    """One read from each pipe that has data within `wait` seconds; whether any had."""
    if not open_fds:
        return False
    ready, _, _ = select.select(open_fds, [], [], wait)
    got = False
    for fd in ready:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            open_fds.remove(fd)
        elif fd == out_r:
            relay.write(chunk)
        elif len(read[fd]) < _RESULT_LIMIT:
            read[fd] += chunk
        got = got or bool(chunk)
    return got


class _Relay:
    """The learner's prints, passed on as they come, up to OUTPUT_LIMIT characters."""

    def __init__(self):
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.shown = self.dropped = 0

    def write(self, chunk: bytes) -> None:
        text = printable(self.decoder.decode(chunk))
        room = max(OUTPUT_LIMIT - self.shown, 0)
        if room:
            sys.stdout.write(text[:room])
            sys.stdout.flush()
        self.shown += min(room, len(text))
        self.dropped += len(text) - min(room, len(text))

    def close(self) -> None:
        if self.dropped:
            print(f"\n[{self.dropped:,} more characters printed by the learner's code, not shown]")


def _watch(task, read_ends, answer_w: int, out_w: int, status_w: int) -> None:
    """The watcher: starts the learner's process, waits for it, says its pid and its exit
    code. A signal the learner's code sends its parent, or its parent's group, reaches
    this process, not the checker; terminal signals are the checker's to act on."""
    try:
        # A session of its own: the learner's code reaching for its parent's group
        # (os.killpg(os.getpgid(os.getppid()), ...)) finds this process alone, never the
        # checker's group.
        os.setsid()
        for fd in read_ends:
            os.close(fd)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        child = os.fork()
        if child == 0:
            os.close(status_w)
            _learner(task, answer_w, out_w)
        os.close(answer_w)
        os.close(out_w)
        os.write(status_w, f"{child}\n".encode())
        # WUNTRACED: a process that stopped itself (SIGSTOP) would otherwise sit until the
        # time limit and be called a loop.
        _, status = os.waitpid(child, os.WUNTRACED)
        stopped = os.WSTOPSIG(status) if os.WIFSTOPPED(status) else 0
        if stopped:
            _kill_group(child)
            _, status = os.waitpid(child, 0)
        os.write(status_w, f"{os.waitstatus_to_exitcode(status)}\n{stopped}\n".encode())
    finally:
        os._exit(0)


def _learner(task, answer_w: int, out_w: int) -> None:
    """The learner's process: a session of its own (so a signal to its group reaches only
    it), its prints into the relay, its memory bounded; its answer as JSON (never a pickle:
    the checker reads it)."""
    code = 0
    try:
        os.setsid()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        os.dup2(out_w, 1)
        os.dup2(out_w, 2)
        os.close(out_w)
        _bound_memory()
        try:
            said = task()
        except SystemExit as err:
            code = 0 if err.code is None else err.code if isinstance(err.code, int) else 1
            return
        except BaseException as err:                       # KeyboardInterrupt and its kind
            said = {"raised": type(err).__name__}
        answer = json.dumps(said).encode()
        # Cut short, the JSON would not parse and the answer would read as an exit.
        os.write(answer_w, answer if len(answer) <= _RESULT_LIMIT else
                 json.dumps({"too_long": len(answer)}).encode())
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:      # a closed or broken stream: nothing more to show
                pass
        os._exit(code)


def _bound_memory() -> None:
    """An address-space limit MEMORY_HEADROOM above what the fork already holds, where
    the system reports it (Linux): a runaway allocation fails in the learner's code."""
    try:
        with open("/proc/self/statm") as f:
            size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (size + MEMORY_HEADROOM, resource.RLIM_INFINITY))
    except (OSError, ValueError):
        pass


def _first_int(data: bytearray, index: int) -> int | None:
    lines = bytes(data).split(b"\n")
    try:
        return int(lines[index]) if len(lines) > index + 1 else None
    except ValueError:
        return None


def _answer(data: bytearray) -> dict | None:
    try:
        said = json.loads(bytes(data)) if data else None
    except ValueError:
        return None
    return said if isinstance(said, dict) else None


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_and_reap(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


# -- what the learner's code leaves running ------------------------------------------

def _libc_prctl(option: int, value) -> bool:
    """prctl(option, value) where the C library has it (Linux); whether it succeeded."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    return prctl(option, value, 0, 0, 0) == 0


def _adopt_orphans() -> bool | None:
    """Make this process adopt the orphans of its descendants (Linux's child subreaper)
    while the learner's code runs: a process it starts in a session of its own then
    becomes this process's child when its parent ends, where the final sweep finds it
    (without this it would go to init and run on). Returns the setting to restore, or
    None where the system has no such setting: there a process that leaves the learner's
    session may outlive the check (docs/safety.md)."""
    was = ctypes.c_int(0)
    if not _libc_prctl(_GET_CHILD_SUBREAPER, ctypes.byref(was)):
        return None
    return bool(was.value) if _set_subreaper(True) else None


def _set_subreaper(on: bool) -> bool:
    return _libc_prctl(_SET_CHILD_SUBREAPER, int(on))


def _children(pid: int) -> set[int]:
    """The processes whose parent is `pid`, read from /proc (none where there is no /proc)."""
    found = set()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
            # "pid (name) state ppid ...": the name may hold spaces and parentheses.
            if int(stat[stat.rindex(b")") + 2:].split()[1]) == pid:
                found.add(int(entry))
        except (OSError, ValueError, IndexError):       # ended meanwhile
            continue
    return found


def _sweep(before: set[int]) -> None:
    """Kill and reap every child of this process but those in `before`, round after
    round: each one killed leaves its own children orphans, which this process adopts
    (see _adopt_orphans) and the next round kills, until none is left."""
    me = os.getpid()
    for _ in range(_SWEEP_ROUNDS):
        left = _children(me) - before
        if not left:
            return
        for pid in left:
            _kill_and_reap(pid)
