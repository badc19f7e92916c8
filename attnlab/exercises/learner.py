"""The learner's folder: copying the stubs in, loading the learner's own functions from
it, and checking them. Only the learner's exercise files are run (the learner's own
code), each by its path; nothing else in the folder is read."""
from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import stat
import sys
from pathlib import Path

from common.errors import AttnlabError
from common.files import file_kind
from common.shell import word
from engine.machine import use_threads
from attnlab.exercises import apart
from attnlab.exercises.checks import EXERCISES, Exercise, Result, run_check

DEFAULT_FOLDER = "my_attention"
HERE = Path(__file__).resolve().parent
STUBS = HERE / "stubs"
SOLUTIONS = HERE / "solutions"


class ExerciseError(AttnlabError):
    """An exercises folder or file that cannot be used, explained."""


def start(folder: Path) -> tuple[list[str], list[str]]:
    """Copy every stub into `folder`; a file already there is kept, never overwritten.
    Returns (copied, kept) file names."""
    if folder.exists() and not folder.is_dir():
        raise ExerciseError(f"{folder} is a file; give a folder for the exercises")
    folder.mkdir(parents=True, exist_ok=True)
    copied, kept = [], []
    for ex in EXERCISES:
        target = folder / ex.filename
        if target.exists() or target.is_symlink():
            kept.append(ex.filename)
            continue
        tmp = folder / f".{ex.filename}.tmp"
        shutil.copyfile(STUBS / ex.filename, tmp)
        tmp.replace(target)                      # whole or not at all
        copied.append(ex.filename)
    return copied, kept


# Bytes an exercise file may hold: a solution is a few KB, and the file is read whole
# (a sparse file of 12 GB took the checker down with a MemoryError).
FILE_LIMIT = 1 << 20


def refuse_a_huge_file(path: Path) -> None:
    """ExerciseError when the plain file at `path` holds more than FILE_LIMIT bytes;
    told by its size, before a byte is read."""
    try:
        size = os.stat(path).st_size
    except OSError:
        return                                  # missing or unreadable: said elsewhere
    if size > FILE_LIMIT:
        raise ExerciseError(f"{path} is {size:,} bytes, more than the {FILE_LIMIT:,} an exercise "
                            "file may be; move it away, then python -m attnlab.exercises start "
                            f"{word(path.parent)} puts the stub back")


def load(ex: Exercise, folder: Path):
    """The learner's function for `ex` from `folder`, or None when its file is missing.
    Raises LearnerCodeError when the file cannot be imported."""
    path = folder / ex.filename
    if not path.is_file():
        return None
    refuse_a_huge_file(path)
    spec = importlib.util.spec_from_file_location(f"my_attention_{ex.number:02d}_{ex.name}", path)
    module = importlib.util.module_from_spec(spec)
    saved, sys.dont_write_bytecode = sys.dont_write_bytecode, True   # no __pycache__ in their folder
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        line = str(err).strip().splitlines()[0] if str(err).strip() else ""
        where = f" line {err.lineno}" if isinstance(err, SyntaxError) and err.lineno else ""
        raise LearnerCodeError(f"{ex.filename}{where} does not import: "
                               f"{type(err).__name__}: {line}") from None
    finally:
        sys.dont_write_bytecode = saved
    fn = getattr(module, ex.function, None)
    if not callable(fn):
        raise LearnerCodeError(f"{ex.filename} has no function {ex.function}(); keep the "
                               "stub's name and signature")
    return fn


class LearnerCodeError(Exception):
    """The learner's file does not import or lacks its function."""


STATUSES = ("passed", "failed", "not started", "missing", "empty", "not a file")
# Seconds one exercise's check may take; the reference answers take well under one.
LIMIT_S = 60.0
# Characters of a check's message shown (an exception's message may be any length).
MESSAGE_LIMIT = 2000


def check(ex: Exercise, folder: Path) -> Result:
    """Run exercise `ex` on the learner's code in `folder`, apart from the checker and with
    a time limit (attnlab/exercises/apart.py): a loop that never ends, an exit, a crash or
    a signal from the learner's file is a failed check that says which, never a checker
    that hangs or ends with it."""
    path = folder / ex.filename
    refused = not_a_file(ex, folder)
    if refused is not None:
        return refused
    refuse_a_huge_file(path)
    if path.is_file() and not path.read_bytes().strip():
        return Result(ex, "empty", f"{ex.filename} is empty; write {ex.function} in it, or "
                      f"delete it and run python -m attnlab.exercises start {word(folder)} to get "
                      "the stub back")
    # Forked, not started afresh: the child has torch and the checks imported already.
    ended = apart.run_apart(lambda: _check_in_child(ex, folder), LIMIT_S)
    said = ended.said or {}
    if said.get("status") in STATUSES and isinstance(said.get("message"), str):
        return Result(ex, said["status"][:40], apart.printable(said["message"][:MESSAGE_LIMIT]))
    return Result(ex, "failed", _how_it_ended(ex, ended))


def not_a_file(ex: Exercise, folder: Path) -> Result | None:
    """A refusal naming folder/ex.filename when something other than a plain file stands
    there (a folder, a named pipe, a device, a link to nothing); None otherwise. `start`
    keeps whatever holds the name, so calling it missing would send the learner from
    `start` to `check` and back. Looked at, never opened: a named pipe would wait."""
    path = folder / ex.filename
    try:
        info = os.stat(path)
    except FileNotFoundError:
        if not os.path.islink(path):
            return None                                   # missing: the child says so
        what = "a link to nothing"
    except OSError as err:                                # a loop of links, no permission
        what = f"not readable ({err.strerror or err})"
    else:
        if stat.S_ISREG(info.st_mode):
            return None
        what = file_kind(info.st_mode)
    return Result(ex, "not a file", f"{path} is {what}, not an exercise file: move it away, "
                  f"then python -m attnlab.exercises start {word(folder)} puts the stub there")


def no_exercise_files(folder: Path) -> str | None:
    """What to say of a folder that holds none of the exercise files (a folder named by
    mistake, or one made by hand), or None when it holds any."""
    if any(os.path.lexists(folder / ex.filename) for ex in EXERCISES):
        return None
    return (f"{folder} holds no exercise files ({EXERCISES[0].filename} to "
            f"{EXERCISES[-1].filename}); make them with python -m attnlab.exercises start DIR "
            f"(a folder of your own, {DEFAULT_FOLDER} when left out), then check --exercises DIR")


def _how_it_ended(ex: Exercise, ended: apart.Ended) -> str:
    if ended.timed_out:
        return (f"{ex.filename} did not finish within {LIMIT_S:g} s and was stopped: a loop "
                f"that never ends, in {ex.function} or at import?")
    if ended.stopped:
        return (f"{ex.filename} stopped the process that checked it "
                f"({signal.Signals(ended.stopped).name}: os.kill(os.getpid(), signal.SIGSTOP) "
                "in it?); the check was ended")
    if "too_long" in (ended.said or {}):
        return (f"{ex.filename} gave the checker an answer of {ended.said['too_long']:,} bytes "
                "(a message that long?); the check was ended")
    if "raised" in (ended.said or {}):
        return (f"{ex.filename} raised {apart.printable(str(ended.said['raised'])[:40])}, which stops a program; "
                f"{ex.function} returns its result instead")
    code = ended.code
    if code is None:
        return (f"{ex.filename} killed the process that watched it (a signal to its parent?); "
                "the check was stopped")
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
        return f"{ex.filename} crashed the process that checked it ({name})"
    return (f"{ex.filename} ended the process that checked it (exit code {code}: sys.exit() or "
            f"os._exit() in it?); {ex.function} returns its result instead")


def _check_in_child(ex: Exercise, folder: Path) -> dict:
    """The check itself, in the child: its status and message, for the parent."""
    use_threads(1)                            # no thread pool of the parent's is used here
    status, message = _check_here(ex, folder)
    # The parent shows this much; cut here, a long exception message still fits the answer.
    return {"status": status, "message": message[:MESSAGE_LIMIT]}


def _check_here(ex: Exercise, folder: Path) -> tuple[str, str]:
    try:
        fn = load(ex, folder)
    except LearnerCodeError as err:
        return "failed", str(err)
    if fn is None:
        return "missing", (f"{ex.filename} is missing from {folder}; python -m attnlab.exercises "
                           f"start {word(folder)} restores its stub without touching the other files")
    result = run_check(ex, fn, folder.resolve())
    return result.status, result.message


def passed_function(ex: Exercise, folder: Path):
    """The learner's function for `ex` when it passes its check; otherwise an error that
    says what to do."""
    result = check(ex, folder)
    if not result.passed:
        why = result.message or result.status
        raise ExerciseError(f"exercise {ex.number} ({ex.name}) in {folder / ex.filename} has not "
                            f"passed ({result.status}: {why}); run python -m attnlab.exercises "
                            f"check {ex.name} --exercises {word(folder)}")
    return load(ex, folder)
