"""`train.py --budget` with its ladder held to one rung at a time: the val loss each size
reaches in the same time, beside the rung the planner picks from the whole ladder.

    python bench/budget_rungs.py --budget 68s --rungs 3x96 2x128 3x128 --seeds 1337 1 2

Each run is `python train.py --budget TIME` in a subprocess on tiny Shakespeare, with
engine.budget.LADDER replaced by the one rung (`planner`: the ladder as it is); the
plan, probes and evaluations are the budget run's own, so each row pays the same start-up.
The ratio is the rung's mean val loss over the planner's. Give --budget the seconds
nanoGPT's CPU recipe takes on the machine (bench/cpu_speedrun.py prints them).
"""
from __future__ import annotations

import capability  # noqa: F401  (first: refuses an ATEN_CPU_CAPABILITY this CPU cannot run)

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from capability import cpu_model
from cpu_recipe import DEFAULT_CORPUS

ROOT = Path(__file__).resolve().parent.parent
# Runs train.main in a child whose ladder is the rung given (argv[1]: "[]" keeps it).
CHILD = """import json, sys
import engine.budget as budget
budget.LADDER = [tuple(r) for r in json.loads(sys.argv[1])] or budget.LADDER
import train
from engine.cli import errors_as_lines
with errors_as_lines():
    sys.exit(train.main(sys.argv[2:]))"""


def run(rung: str, budget: str, seed: int, corpus: Path, workdir: Path) -> tuple[float, int]:
    """(final val loss, steps) of one budget run on `rung` ('planner' or 'LxW')."""
    ladder = [] if rung == "planner" else [list(map(int, rung.split("x")))]
    out = workdir / f"{rung}-{seed}"
    cmd = [sys.executable, "-c", CHILD, json.dumps(ladder), "--budget", budget,
           f"--train.seed={seed}", f"--data.path={corpus}", f"--data.cache_dir={out / 'cache'}",
           f"--train.out_dir={out}", "--train.run_name=run"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "WANDB_MODE": "disabled"})
    if proc.returncode:
        said = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
        raise SystemExit(f"{said} ({rung}, seed {seed})")
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "val_loss" in r][-1]
    return last["val_loss"], last["step"]


def refuse_bad_input(p: argparse.ArgumentParser, args) -> None:
    """A mistyped budget or rung is refused before the first run, not minutes later."""
    from common.errors import ConfigError
    from engine.budget import budget_seconds, sized
    from model.config import ModelConfig, ModelError
    try:
        budget_seconds(args.budget, {})
    except ConfigError as e:
        p.error(str(e))
    for rung in args.rungs:
        if not re.fullmatch(r"[1-9][0-9]*x[1-9][0-9]*", rung):
            p.error(f"--rungs {rung}: give each as LAYERSxWIDTH, such as 2x128")
        try:
            sized(ModelConfig(), *map(int, rung.split("x"))).validate()
        except ModelError as e:            # the model's own refusal, in its words
            p.error(f"--rungs {rung}: {e}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget", default="68s",
                   help="the time each run is given, as train.py --budget takes it; a minute or "
                        "more, since the plan's probes take seconds (default: 68s)")
    p.add_argument("--rungs", nargs="+", default=["3x96", "2x128", "3x128"],
                   help="LAYERSxWIDTH sizes, each run alone; the planner's own pick runs first "
                        "(default: 3x96 2x128 3x128)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1337, 1],
                   help="train.seed of each run; every rung runs once per seed (default: 1337 1)")
    p.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS,
                   help="the text each run trains on (default: tiny Shakespeare)")
    args = p.parse_args()
    refuse_bad_input(p, args)
    runs = (1 + len(args.rungs)) * len(args.seeds)
    from engine.machine import describe_cpu
    print(f"machine: {cpu_model()} ({describe_cpu()}); "
          f"{runs} runs of {args.budget}", flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rung in ["planner", *args.rungs]:
            results[rung] = [run(rung, args.budget, s, args.corpus, Path(tmp)) for s in args.seeds]
            print(f"{rung}: " + ", ".join(f"{v:.4f} ({n} steps)" for v, n in results[rung]), flush=True)
    base = sum(v for v, _ in results["planner"]) / len(args.seeds)
    print(f"\n| rung, --budget {args.budget} | val loss, seeds {' / '.join(map(str, args.seeds))} | mean | vs planner |")
    print("|---|---|---|---|")
    for rung, got in results.items():
        mean = sum(v for v, _ in got) / len(got)
        print(f"| {rung} | {' / '.join(f'{v:.4f}' for v, _ in got)} | {mean:.4f} | {mean / base:.3f}x |")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit("stopped: no table; the runs so far are printed above")
