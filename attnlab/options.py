"""The options every tool that reads a model shares, spelt, defaulted and refused the
same way in each (sample.py and every `python -m attnlab.<tool>`):

  --run DIR        a run directory (runs/NAME), a run's name (NAME, looked up in runs/),
                   one checkpoint folder, or a transformers folder (GPT-2, Llama, a BERT
                   such as all-MiniLM-L6-v2); default: the latest run in runs/ that
                   trained (evaluated past step 0), not one stopped before that
  --checkpoint     best (default): the step best.json names, the lowest validation loss;
                   latest; or a step number. Where best names nothing that trained, the
                   latest is used and one line says so (engine.checkpoint.choose)
  --device         auto (default: CUDA, then Apple's MPS, then the CPU), cpu, cuda,
                   cuda:N or mps
  --exercises DIR  the learner's folder, for a run trained with `yours`: given here
                   or refused, never read from the run

A tool adds them and loads its model in two lines:

    add_run_options(parser)
    model, cfg, tokenizer, ckpt = load(parser.parse_args(argv))
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from common.errors import CheckpointError, ConfigError

RUNS = Path("runs")
CHECKPOINTS = ("best", "latest")
DEFAULT_CHECKPOINT = "best"
DEFAULT_DEVICE = "auto"


def checkpoint_choice(text: str) -> str:
    """best, latest, or a step number (500, or step_500 as the folders are named)."""
    step = re.fullmatch(r"(?:step_?)?0*(\d+)", text.strip().lower())
    if text in CHECKPOINTS:
        return text
    if step:
        return str(int(step.group(1)))
    raise argparse.ArgumentTypeError(f"{text!r} is not best, latest or a step number")


def device_choice(text: str) -> str:
    """A device torch has here, refused while parsing (before a model is loaded)."""
    from engine.device import pick_device
    try:
        pick_device(text)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return value


def whole(low: int, high: int):
    """An option's type: a whole number from `low` to `high`, refused while parsing, so
    that a value no run could hold (a context of 10^12 tokens) is one line, not an
    allocation that fails deep inside."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number from {low:,} to {high:,}")
        return value
    parse.__name__ = "whole number"
    return parse


def out_option(text: str) -> str:
    """An --out path; an empty one is refused rather than read as 'not given', which
    would write to the default place the user meant to avoid."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path names no file or folder; give one, "
                                         "or leave --out out for the default")
    return text


def add_run_options(parser: argparse.ArgumentParser, what: str = "run directory or name, "
                    "checkpoint folder, or transformers folder", run: bool = True,
                    aliases: tuple[str, ...] = (), without: str = f"the latest run in {RUNS}/ that trained, past step 0") -> None:
    """--run and --exercises (unless run=False: a tool that names its models otherwise),
    --checkpoint and --device. `aliases` are older spellings of --run the tool still accepts; `without`
    says what the tool does when --run is not given."""
    group = parser.add_argument_group("the model read")
    if run:
        group.add_argument("--run", *aliases, dest="run", default="", metavar="DIR",
                           help=f"{what} (default: {without})")
    # The learner's code of a run trained with `yours` comes from here alone: a run's own
    # files never say where code is (attnlab/exercises/plug.py).
    group.add_argument("--exercises", metavar="DIR", default=None,
                       help="your exercises folder, for a run trained with your own code "
                            "(model.attention, position or mechanism `yours`); no default: "
                            "a run never chooses the code it runs")
    group.add_argument("--checkpoint", type=checkpoint_choice, default=DEFAULT_CHECKPOINT,
                       metavar="WHICH", help="best (lowest validation loss; the latest where "
                       "nothing after step 0 was evaluated), latest, or a step number "
                       f"(default: {DEFAULT_CHECKPOINT})")
    group.add_argument("--device", type=device_choice, default=DEFAULT_DEVICE, metavar="D",
                       help=f"auto, cpu, cuda, cuda:N or mps (default: {DEFAULT_DEVICE}: CUDA, "
                       "then MPS, then the CPU)")


def find_run(given: str | Path = "", runs: Path = RUNS, log=None) -> Path:
    """The folder --run names: as given where it exists, else runs/GIVEN (a run's name);
    nothing given: the latest run that trained (not one stopped before its first
    evaluation), named in one line with the way to choose another."""
    from engine.checkpoint import latest_run
    if not str(given):
        return latest_run(runs, log=log, trained=True)
    path = Path(given)
    if path.exists():
        return path
    named = runs / path
    if not path.is_absolute() and named.is_dir():
        return named
    raise CheckpointError(f"--run {given}: no run, checkpoint or transformers folder there, nor "
                          f"a run of that name in {runs}/; give one of those, or leave --run out "
                          "for the latest run")


def load(args: argparse.Namespace, before_build=None, log=None):
    """(model in eval mode on --device, its RunConfig, its tokenizer, the checkpoint
    folder) for the options add_run_options added. `log` gets the line saying which
    run and checkpoint were used (default: stderr, only where the choice was not the
    one asked for)."""
    from engine.device import pick_device
    from engine.inference import load_run
    device = pick_device(args.device)
    run = find_run(args.run, log=log)
    build = learners_code(run, getattr(args, "exercises", None), before_build, log)
    return load_run(run, args.checkpoint, device, before_build=build, log=log)


def learners_code(run: Path, exercises: str | None, before_build=None, log=None):
    """load_run's before_build for `run`: the learner's code a run trained with `yours`
    asks for, bound from --exercises (`exercises`) alone, then `before_build`."""
    from attnlab.exercises import plug
    plug.install()          # a run trained with your attention (`yours`) opens here too

    def build(cfg):
        for note in plug.prepare(cfg.model, plug.folder_for(cfg.model, exercises, run)):
            (log or (lambda line: print(line, file=sys.stderr)))(note)
        if before_build is not None:
            before_build(cfg)
    return build
