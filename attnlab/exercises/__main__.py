"""Build the article yourself: twelve exercises that check your code and name your mistake.

    python -m attnlab.exercises list               # the twelve, in order, and where each is taught
    python -m attnlab.exercises start [DIR]        # copy the stubs into DIR (my_attention)
    python -m attnlab.exercises check              # a table of every exercise, and what next
    python -m attnlab.exercises check attention    # one exercise (a name or its number)
    python -m attnlab.exercises check --exercises DIR   # another folder (also: check DIR)
    python train.py --config exercise --model.attention=yours   # exercise 1 alone is enough
    python train.py --config exercise --model.attention=yours --model.position=yours
    python train.py --config gpt-oss --model.mechanism=yours_sinks --model.mlp=yours   # 10, 11
    python train.py --config qwen3-next --model.mechanism=gated_deltanet,gated_deltanet,gated_deltanet,yours_gated

Each stub names the article's sentence it implements (or the model card's piece), the
shapes, its section of docs/walkthrough.md (or docs/after_the_article.md) and the
project's own implementation to read once it passes.
`start` never overwrites a file already in DIR."""
from __future__ import annotations

import sys
from pathlib import Path

from common.shell import word
from engine.cli import Parser, errors_as_lines
from attnlab.exercises.checks import EXERCISES, Result, find
from attnlab.exercises.learner import (DEFAULT_FOLDER, ExerciseError, check, no_exercise_files,
                                      start)

# The preset sized for the learner's code (configs/exercise.toml): tiny writes no words.
TRAIN_YOURS = "python train.py --config exercise"


def parser() -> Parser:
    p = Parser("python -m attnlab.exercises", __doc__,
               usage="python -m attnlab.exercises {list | start [DIR] | check [NAME] [--exercises DIR]}")
    p.add_argument("command", choices=("list", "start", "check"), help="list: the exercises; "
                   "start: copy the stubs in; check: run the checks")
    p.add_argument("target", nargs="?", default=None, metavar="DIR|NAME",
                   help=f"start: the folder (default {DEFAULT_FOLDER}); check: one exercise "
                        "by name or number (default: all, as a table)")
    # --exercises, as train.py and sample.py name the same folder; --dir is kept as an alias.
    p.add_argument("--exercises", "--dir", dest="dir", metavar="DIR", default=None,
                   help=f"the exercises folder (default {DEFAULT_FOLDER})")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "list":
        print(listing())
        return 0
    if args.command == "start":
        folder = Path(args.dir or args.target or DEFAULT_FOLDER)
        copied, kept = start(folder)
        if copied:
            print(f"copied into {folder}: {', '.join(copied)}")
        if kept:
            print(f"kept (already there, not overwritten): {', '.join(kept)}")
        # A folder with work in it: point at the first exercise not yet passed.
        print(next_step([check(ex, folder) for ex in EXERCISES], folder))
        return 0
    folder = Path(args.dir or DEFAULT_FOLDER)
    if args.target and find(args.target) is None and Path(args.target).exists():
        folder, args.target = Path(args.target), None     # `check DIR`, as `start DIR` takes it
    if folder.exists() and not folder.is_dir():
        raise ExerciseError(f"{folder} is a file, not an exercises folder; give a folder "
                            f"(python -m attnlab.exercises start DIR makes one)")
    if not folder.is_dir():
        raise ExerciseError(f"no exercises folder at {folder}; start with python -m "
                            f"attnlab.exercises start {folder}")
    none_there = no_exercise_files(folder)
    if none_there:
        raise ExerciseError(none_there)
    if args.target is None:
        results = [check(ex, folder) for ex in EXERCISES]
        print(table(results, folder))
        return 0 if all(r.passed for r in results) else 1
    ex = find(args.target)
    if ex is None:
        names = ", ".join(f"{e.number} {e.name}" for e in EXERCISES)
        raise ExerciseError(f"no exercise {args.target!r}; the exercises are: {names}")
    result = check(ex, folder)
    print(one_line(result))
    if result.passed:
        print(f"read the project's own: {ex.answer}")
        if ex.trains:
            print(f"train with yours: python train.py --config {ex.preset} {ex.trains}"
                  f"{_dir_flag(folder)}")
    elif result.status in ("failed", "not started"):
        verb = "write" if result.status == "not started" else "fix"
        print(f"{verb} {ex.function} in {folder / ex.filename} ({ex.doc} {ex.section}), "
              "then check again")
    return 0 if result.passed else 1


def listing() -> str:
    """The exercises in order: number, name, what it builds, its file and its section."""
    width = max(len(ex.name) for ex in EXERCISES)
    lines = [f" {ex.number:>2}  {ex.name.ljust(width)}  {ex.title} ({ex.filename}, "
             f"{ex.doc} {ex.section})" for ex in EXERCISES]
    return "\n".join(["the exercises, in order (python -m attnlab.exercises start copies "
                      f"them into {DEFAULT_FOLDER}/):", *lines])


def _dir_flag(folder: Path) -> str:
    return "" if folder == Path(DEFAULT_FOLDER) else f" --exercises {word(folder)}"


SAYS_WHY = ("failed", "missing", "empty", "not a file")     # statuses whose message is shown


def one_line(r: Result) -> str:
    ex = r.exercise
    text = f"exercise {ex.number} ({ex.name}, {ex.title}): {r.status}"
    return text + (f": {r.message}" if r.status in SAYS_WHY else "")


def table(results: list[Result], folder: Path) -> str:
    width = max(len(r.exercise.name) for r in results)
    lines = [f"exercises in {folder}:", f"  #  {'exercise'.ljust(width)}  status"]
    for r in results:
        detail = f": {r.message}" if r.status in SAYS_WHY else ""
        lines.append(f" {r.exercise.number:>2}  {r.exercise.name.ljust(width)}  {r.status}{detail}")
    done = sum(r.passed for r in results)
    lines.append(f"{done} of {len(results)} passed.")
    lines.append(next_step(results, folder))
    return "\n".join(lines)


def next_step(results: list[Result], folder: Path) -> str:
    """What to try next: the first failing (or missing, or empty) exercise, else the first
    not started."""
    todo = next((r for r in results if r.status in SAYS_WHY), None) \
        or next((r for r in results if r.status == "not started"), None)
    if todo is None:
        return (f"next: every exercise passes. Train with your own code: {TRAIN_YOURS} "
                "--model.attention=yours --model.position=yours"
                f"{' --exercises ' + str(folder) if _dir_flag(folder) else ''}; the project's own "
                "answer to each is named at the top of its file")
    ex = todo.exercise
    if todo.status in ("missing", "empty", "not a file"):
        return f"next: {todo.message}"
    verb = "fix" if todo.status == "failed" else "write"
    return (f"next: {verb} {ex.function} in {folder / ex.filename} ({ex.doc} {ex.section}), "
            f"then python -m attnlab.exercises check {ex.name}{_dir_flag(folder)}")


if __name__ == "__main__":
    with errors_as_lines():
        sys.exit(main())
