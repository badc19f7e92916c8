"""How long each model card's preset trains beside the cpu preset, as ratios, on this CPU.

    python bench/card_time.py                          # the seven presets, twice, interleaved
    python bench/card_time.py --presets cpu gemma3 --rounds 1

Each run is `python train.py --config PRESET` for --steps steps, niced, at --threads
threads, with wandb off and its run folder in a temporary folder. The presets run in
turn, then again (--rounds), so that a busy machine's load falls on them alike. A step's
time is the run's training time (metrics.jsonl's elapsed_s, evaluations left out) from
step --skip to the last step, per step; an evaluation's (its batches and the checkpoint)
is the mean of the run's evaluations after the first, timed around
engine.loop.evaluate_and_save. A preset's full run is its max_iters steps plus its
evaluations (step 0, every eval_interval, the last), each time the mean over the rounds;
printed as a ratio to the cpu preset's (docs/after_the_article.md, "The cards' training
time").
"""
from __future__ import annotations

import capability  # noqa: F401  (first: refuses an ATEN_CPU_CAPABILITY this CPU cannot run)

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CARDS = ("cpu", "gpt-oss", "qwen3-next", "deepseek-v3", "deepseek-v3.2", "gemma3", "kimi-linear")


def one_run(preset: str, steps: int, skip: int, threads: int, out: Path) -> None:
    """Train `preset` in this process and print one JSON line: its step and evaluation
    times and the set-up's device line."""
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)
    import runpy

    import engine.loop as loop
    evaluations = []
    evaluate_and_save = loop.evaluate_and_save

    def timed(*args, **kwargs):
        start = time.perf_counter()
        value = evaluate_and_save(*args, **kwargs)
        evaluations.append(time.perf_counter() - start)
        return value

    loop.evaluate_and_save = timed
    train = runpy.run_path(str(ROOT / "train.py"), run_name="card_time")
    code = train["main"](["--config", preset, f"--train.max_iters={steps}", f"--train.threads={threads}",
                          f"--train.eval_interval={steps // 2}", f"--train.log_interval={math.gcd(skip, steps)}",
                          "--train.wandb=disabled", f"--train.out_dir={out}", "--train.run_name=run"])
    if code:
        raise SystemExit(f"error: train.py --config {preset} stopped with exit code {code}")
    elapsed = {r["step"]: r["elapsed_s"] for r in map(json.loads, (out / "run" / "metrics.jsonl").open())
               if "elapsed_s" in r}
    last = max(elapsed)
    print(json.dumps({"preset": preset, "step_s": (elapsed[last] - elapsed[skip]) / (last - skip),
                      "eval_s": sum(evaluations[1:]) / max(len(evaluations) - 1, 1)}), flush=True)


def full_run(preset: str, step_s: float, eval_s: float) -> tuple[int, int, float]:
    """(steps, evaluations, seconds) of the preset's whole run at these times: an
    evaluation at step 0, at every eval_interval, and at the last step where it falls
    between."""
    sys.path.insert(0, str(ROOT))
    from engine import cli
    train = cli.build(preset, []).train
    steps, every = train.max_iters, train.eval_interval
    evaluations = 1 + steps // every + (steps % every != 0)
    return steps, evaluations, steps * step_s + evaluations * eval_s


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=list(CARDS),
                        help="presets to time, the cpu preset first as the base (default: the "
                             "cpu preset and the six cards)")
    parser.add_argument("--rounds", type=int, default=2, help="times each preset runs, in turn "
                        "with the others (default: 2)")
    parser.add_argument("--steps", type=int, default=40, help="training steps a run (default: 40)")
    parser.add_argument("--skip", type=int, default=10, help="first steps left out of a step's "
                        "time, the warm-up (default: 10)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads a run (default: 1)")
    parser.add_argument("--one", metavar="PRESET", help="train this one preset in this process "
                        "and print its times as JSON (what each run of the others is)")
    args = parser.parse_args()
    if not 0 <= args.skip < args.steps - 1 or args.rounds < 1 or args.threads < 1:
        raise SystemExit("error: give --rounds and --threads of at least 1 and --skip below "
                         "--steps - 1")
    missing = [p for p in args.presets if not (ROOT / "configs" / f"{p}.toml").is_file()]
    if missing or args.presets[0] != "cpu":
        raise SystemExit(f"error: --presets must start with cpu and name presets in configs/ "
                         f"(no such preset: {', '.join(missing) or 'none'})")
    if args.one:
        with tempfile.TemporaryDirectory() as out:
            one_run(args.one, args.steps, args.skip, args.threads, Path(out))
        return
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "WANDB_MODE": "disabled"}
    times: dict[str, list[tuple[float, float]]] = {p: [] for p in args.presets}
    for _ in range(args.rounds):
        for preset in args.presets:
            proc = subprocess.run(["nice", "-n", "10", sys.executable, __file__, "--one", preset,
                                   f"--steps={args.steps}", f"--skip={args.skip}",
                                   f"--threads={args.threads}"],
                                  capture_output=True, text=True, env=env)
            if proc.returncode:
                raise SystemExit(f"error: {preset} failed:\n{proc.stderr[-2000:]}")
            found = json.loads(proc.stdout.strip().splitlines()[-1])
            times[preset].append((found["step_s"], found["eval_s"]))
    mean = {p: tuple(sum(t[i] for t in rows) / len(rows) for i in (0, 1)) for p, rows in times.items()}
    base_step, base_eval = mean["cpu"]
    base_full = full_run("cpu", base_step, base_eval)[2]
    for preset, (step_s, eval_s) in mean.items():
        steps, evaluations, seconds = full_run(preset, step_s, eval_s)
        print(f"{preset:14} {steps:5} steps, {evaluations} evals: step {step_s / base_step:.2f}x the "
              f"cpu preset's, evaluation {eval_s / base_eval:.2f}x, full run {seconds / base_full:.2f}x")


if __name__ == "__main__":
    main()
