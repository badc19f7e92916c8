"""Train a small GPT.

    python train.py                         # a preset chosen for this machine
    python train.py --config cpu --train.max_iters=500
    python train.py --data.path=my.txt --model.position=learned
    python train.py --resume                # continue the latest run
    python train.py --budget 5m             # the best model this machine trains in 5 minutes
    python train.py --help                  # every option, with its default

Several processes or GPUs: torchrun --standalone --nproc_per_node=N train.py ...
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import textwrap
import time
from pathlib import Path

from common.cpu import refuse_unrunnable_capability, wait_passively_if_busy
from common.errors import interrupt_at_start, terminate_as_interrupt
from common.shell import options, word

refuse_unrunnable_capability()      # before torch loads, which would die of it: common/cpu.py
WAITING = wait_passively_if_busy()  # before torch loads, which reads it once: common/cpu.py
with interrupt_at_start():          # torch loads here
    from engine.cli import Parser, add_config_options, errors_as_lines


def parser(shown=None) -> Parser:
    """`shown`: (preset name, its config), whose values --help gives as the defaults."""
    instead = ("train.py takes a run to continue as --resume RUN_DIR, and a run, checkpoint "
               "or transformers folder to start from as --init_from SRC")
    p = Parser("python train.py", __doc__, usage="python train.py [--config PRESET|FILE] "
               "[--resume [RUN_DIR]] [--budget TIME] [--section.key=VALUE ...]",
               hints={"--run": instead, "--checkpoint": instead})
    p.add_argument("--config", "--preset", dest="preset", metavar="PRESET|FILE",
                   help="a preset from configs/ (cpu, gpu, mps, ...) or a .toml file; default: "
                        "chosen from the device found (cuda -> gpu, mps -> mps, else cpu)")
    p.add_argument("--resume", nargs="?", const="", metavar="RUN_DIR",
                   help="continue a run (its directory, or its name in runs/) from its latest "
                        "checkpoint (default: the latest run, "
                        "the one in runs/ whose newest checkpoint was written last); from an "
                        "older checkpoint, or with a new --train.run_name, training goes on in a "
                        "new run that records it as its parent, and the old run stays as it was")
    p.add_argument("--budget", metavar="TIME", help="measure this machine, then pick the model "
                   "size and steps that fit TIME (90s, 5m, 1h) and stop on time with a final "
                   "evaluation")
    p.add_argument("--exercises", metavar="DIR", default=None,
                   help="where --model.attention=yours, --model.position=yours and "
                        "--model.mechanism=yours find your code (python -m attnlab.exercises; "
                        "default: my_attention where yours is named on this command line; a "
                        "run resumed or started from that uses yours needs it given)")
    if shown is not None:
        note = (f"The defaults shown are the {shown[0]} preset's (a field it does not set, the "
                "built-in value): what this command trains; --config NAME --help shows another's.")
        p.epilog = "\n\n".join(filter(None, [p.epilog, textwrap.fill(note, 92)]))
    add_config_options(p, shown=None if shown is None else shown[1])
    p.add_argument("--init_from", dest="train.init_from", metavar="SRC", help="the same as "
                   "--train.init_from: start from a run, checkpoint or transformers folder",
                   default=argparse.SUPPRESS)
    return p


def main(argv: list[str]) -> int:
    started = time.perf_counter()
    from attnlab.exercises import plug
    plug.install()                        # `yours`: the learner's code, as a registry entry
    args = parser(help_preset(argv)).parse_args(budget_joined(argv))
    from engine import distributed
    from engine.config import describe
    from engine.loop import train
    from engine.rundir import stopped_line
    from engine.run import setup_run

    # --- the run's config: a resumed run's own, or a preset with the options on top ---
    refuse_clashes(args)
    found = resumed_config(args) if args.resume is not None else new_config(args, started)
    if isinstance(found, str):            # said before set-up, which would rewrite its files
        print(found)
        return 0
    cfg, run_dir, resuming, source, changes = found
    exercises = exercises_folder(args, cfg, resuming)
    for note in plug.prepare(cfg.model, exercises):
        print(note)

    # --- set up (threads, device, precision, data, model) and train ---
    dist = distributed.setup()
    try:
        with terminate_as_interrupt(dist.world == 1):    # a SIGTERM in set-up: as Ctrl-C
            run = setup_run(cfg, run_dir=run_dir, resume=resuming, dist=dist, source=source)
            # Said only now that the checkpoint has loaded and config.json holds the changes:
            # a checkpoint refused above leaves the run as it was.
            if changes and dist.is_main:
                print(f"resume changes {'; '.join(changes)} (from the first step after "
                      f"{resuming.name}; recorded in the run's config.json)")
            try:
                if dist.is_main and WAITING:      # said once work starts, not before an error line
                    print(WAITING, file=sys.stderr)
                for line in (f"config:\n{describe(cfg)}", run.describe_setup(), run.summary(),
                             f"run directory: {run.run_dir}"):
                    run.log(line)
                result = train(run)
            except KeyboardInterrupt as err:      # before the loop's own handler: name the run
                if err.args:
                    raise
                raise type(err)(stopped_line(run, "stopped")) from None
    finally:
        distributed.cleanup(dist)
    return finished(run, result, exercises) if dist.is_main else 0


def exercises_folder(args, cfg, resuming) -> Path | None:
    """Where the learner's code for a `yours` in the config comes from: --exercises; else
    my_attention where this command line named every `yours` itself. A `yours` that comes
    from a file (the run resumed, the run started from, a preset file) needs --exercises:
    a run someone shares must never choose the code it runs (attnlab/exercises/plug.py)."""
    from attnlab.exercises import plug
    from engine.cli import overrides_of
    read_from = None if plug.typed(cfg.model, overrides_of(args).get("model", {})) else \
        (resuming or cfg.train.init_from or f"--config {args.preset or cfg.preset}")
    return plug.folder_for(cfg.model, args.exercises, read_from)


def refuse_clashes(args) -> None:
    """Options that cannot go together, refused before any work."""
    from common.errors import ConfigError
    from engine import distributed
    from engine.cli import overrides_of
    from engine.resume import resume_config
    if args.preset == "":
        raise ConfigError("--config needs a preset name or a .toml path (see configs/)")
    if args.resume is not None and args.preset is not None:  # else silently dropped
        # The run meant is found first: one that is not there is said as such, and the
        # way on names the run, or the checkpoint given, found.
        out_dir = overrides_of(args).get("train", {}).get("out_dir", "runs")
        _, run_dir, ckpt = resume_config(args.resume, out_dir, {})
        weights = ckpt if args.resume and (Path(args.resume) / "state.json").is_file() else run_dir
        raise ConfigError(f"--config {args.preset} chooses a new run's preset, and a resumed run "
                          "keeps the config it was trained with; resume with only the options "
                          "to change (e.g. --train.max_iters=N), or start a new run from its "
                          f"weights: python train.py --config {word(args.preset)} "
                          f"{' '.join([word(f'--train.init_from={weights}'), *options(overrides_of(args))])}")
    if args.budget is not None and args.resume is not None:
        raise ConfigError("--budget plans a new run, and a resumed run keeps its model; to "
                          "stop it on time give --train.time_limit=SECONDS instead (the "
                          "seconds trained in all, counted over resumes)")
    if args.budget is not None and distributed.world_size() > 1:
        raise ConfigError("--budget plans a single-process run from a measure of this "
                          "machine; under torchrun give the model and train.max_iters "
                          "yourself (python train.py --help lists them)")


def resumed_config(args):
    """(cfg, run_dir, checkpoint, None, changes) of the run to go on with, its config as
    recorded (train.threads included) with the options given on top; or the line that
    says it has nothing left to train."""
    from engine.cli import overrides_of
    from engine.resume import nothing_to_train, resume_changes, resume_config
    out_dir = overrides_of(args).get("train", {}).get("out_dir", "runs")
    cfg, run_dir, ckpt = resume_config(args.resume, out_dir, overrides_of(args))
    done = nothing_to_train(cfg, ckpt, args.resume or str(ckpt.parent.parent), overrides_of(args))
    return done or (cfg, run_dir, ckpt, None, resume_changes(cfg, ckpt))


def new_config(args, started: float):
    """(cfg, None, False, source, []) of a new run: the preset, the options, and with
    --budget the plan (written into the config, so the run is as reproducible as any)."""
    from engine import config
    from engine.cli import apply_overrides, overrides_of
    from engine.pretrained import adopt_source
    if args.budget is not None:               # refused before any work where it cannot plan
        from engine.budget import budget_seconds, plan
        budget_s = budget_seconds(args.budget, overrides_of(args))
    cfg, source = config.RunConfig(), None
    config.load_preset(cfg, args.preset or default_preset(args))
    apply_overrides(cfg, args)
    if cfg.train.init_from and args.budget is not None:
        from common.errors import ConfigError
        raise ConfigError("--budget picks a model size, and --train.init_from brings "
                          "its own model; use one or the other")
    if cfg.train.init_from:
        given = overrides_of(args)
        source = adopt_source(cfg, given.get("model", {}), given.get("train", {}),
                              given.get("data", {}))
    if args.budget is not None:
        cfg = plan(cfg, budget_s, started, given=overrides_of(args))
    return cfg, None, False, source, []


def finished(run, result: dict, exercises: Path | None = None) -> int:
    """The last line and the exit status; the sampling command names the exercises
    folder the run's `yours` came from, which sample.py needs to be told."""
    if result.get("interrupted"):
        # The shell's convention, 128 + the signal: 130 for Ctrl-C, 143 for a SIGTERM
        # (a scheduler's or a CI's stop), so a caller can tell the two apart.
        signum = run.stop_signal
        return 128 + signum if isinstance(signum, int) else 130
    objective = run.objective
    if objective.writes:
        print(f"done at step {result['step']}: best val loss {result['best_val']:.4f} "
              f"({run.data.bits(result['best_val']):.3f} {run.data.bits_unit}); "
              f"sample with: python sample.py --run {word(run.run_dir)}"
              + (f" --exercises {word(exercises.resolve())}" if exercises else ""))
    else:
        print(f"done at step {result['step']}: best {objective.loss_name} "
              f"{result['best_val']:.4f}; fill in blanks with: python -m attnlab.fill "
              f"--run {word(run.run_dir)} --text \"To be, or not to [MASK]\"")
    return 0


def budget_joined(argv: list[str]) -> list[str]:
    """`--budget -5s` as `--budget=-5s`: argparse takes a value that starts with a minus
    for an option, and would say --budget has none instead of that it is no duration.
    `--budget 30 s` as `--budget=30s`: argparse would call the unit an unknown argument."""
    out = list(argv)
    if "--budget" not in out[:-1]:
        return out
    i = out.index("--budget")
    if re.match(r"-[\d.]", out[i + 1]):
        out[i:i + 2] = [f"--budget={out[i + 1]}"]
    elif re.fullmatch(r"[\d.]+", out[i + 1]) and re.fullmatch(r"[hms]", "".join(out[i + 2:i + 3])):
        out[i:i + 3] = [f"--budget={out[i + 1]}{out[i + 2]}"]
    return out


def help_preset(argv: list[str]):
    """(name, config) of the preset the command would train with, for --help to show its
    values as the defaults; None when no help is asked for or the preset cannot be read
    (the command itself then says why)."""
    if not {"-h", "--help"} & set(argv):
        return None
    from engine import config
    from engine.device import pick_device
    given = [a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else "")
             for i, a in enumerate(argv) if a.split("=", 1)[0] in ("--config", "--preset")]
    name = given[-1] if given else {"cuda": "gpu", "mps": "mps"}.get(pick_device().type, "cpu")
    cfg = config.RunConfig()
    try:
        config.load_preset(cfg, name)
    except Exception:                     # noqa: BLE001 - help still shows the built-in defaults
        return None
    return name, cfg


def default_preset(args) -> str:
    """The preset for the device train.device picks: gpu, mps or cpu."""
    from engine.device import pick_device
    device = pick_device(getattr(args, "train.device", "auto"))
    preset = {"cuda": "gpu", "mps": "mps"}.get(device.type, "cpu")
    print(f"preset: {preset} (chosen for the {device.type} found; --config NAME for another)")
    return preset


if __name__ == "__main__":
    # A Ctrl-C during training is the loop's, and one during set-up setup_run's: each
    # says which run to go on with. One with nothing to say came before the run's folder
    # was locked (a plan's probes, the text read and tokenized, the model built), when
    # nothing of the run is written yet.
    with errors_as_lines("stopped before the run's folder was made, so nothing of it was "
                         "written; run the same command again"):
        code = main(sys.argv[1:])
    # Checkpoints and metrics are written, fsynced and closed (wandb finished) by now:
    # skip the interpreter's teardown of torch's modules, most of a second on a 2-core
    # CPU, a visible share of a speedrun's wall time, and it buys nothing.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:               # a closed pipe (train.py | head): nothing to lose
            pass
    os._exit(code)
