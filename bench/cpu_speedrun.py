"""CPU speedrun on tiny Shakespeare (character level, first 90% train, last 10% val):
how fast to val loss 1.886 (nanoGPT's CPU recipe: 102 s), and how low in 100 s.

    python bench/cpu_speedrun.py
    python bench/cpu_speedrun.py --target "--config cpu-quick --train.max_iters=220"

Each recipe runs `python train.py` in a subprocess; wall time includes start-up,
tokenization and evaluations. The target run stops at its first evaluation at or
below the target (train.target_val_loss). Writes bench/out/cpu_speedrun.png.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_recipe import DEFAULT_CORPUS, run  # noqa: E402

# Ten validation batches of 32 × 64 tokens per evaluation: 20,480 tokens, more than the
# 20 × 12 × 64 = 15,360 of nanoGPT's CPU recipe it is compared with.
TARGET_RECIPE = ("--config cpu-quick --train.max_iters=220 --train.warmup_iters=20 "
                 "--train.eval_interval=20 --train.eval_iters=10 --train.target_val_loss=1.886")
BUDGET_RECIPE = ("--config cpu-quick --model.block_size=128 --train.batch_size=16 --train.max_iters=740 "
                 "--train.warmup_iters=30 --train.min_lr=0 --train.eval_interval=740")
# The same 100 s, planned by train.py itself: size, steps and a clock-following schedule.
PLANNED_RECIPE = "--budget 100s --config cpu-quick"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=TARGET_RECIPE, help="train.py arguments for the 1.886 run")
    parser.add_argument("--budget", default=BUDGET_RECIPE, help="train.py arguments for the 100 s run")
    parser.add_argument("--planned", default=PLANNED_RECIPE, help="train.py arguments for the --budget run")
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fast = run("to-1.886", args.target, args.corpus, Path(tmp))
        budget = run("100-s", args.budget, args.corpus, Path(tmp))
        planned = run("planned", args.planned, args.corpus, Path(tmp))
    reached = [s for s, v in fast["curve"] if v <= 1.886]
    print("| run | train.py arguments | steps | wall time | val loss |")
    print("|---|---|---|---|---|")
    print(f"| to 1.886 | `{args.target}` | {fast['steps']} | {fast['wall']:.1f} s | "
          f"{fast['val']:.4f}{'' if reached else ' (target not reached)'} |")
    print(f"| 100 s budget | `{args.budget}` | {budget['steps']} | {budget['wall']:.1f} s | "
          f"{budget['val']:.4f} |")
    print(f"| 100 s, planned by --budget | `{args.planned}` | {planned['steps']} | "
          f"{planned['wall']:.1f} s | {planned['val']:.4f} |")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r, label in ((fast, "to 1.886"), (budget, "100 s budget"), (planned, "--budget 100s")):
        steps, vals = zip(*r["curve"])
        ax.plot([s * r["wall"] / max(r["steps"], 1) for s in steps], vals, marker="o", label=label)
    ax.axhline(1.886, color="grey", linestyle="--", label="nanoGPT CPU recipe at 102 s")
    ax.set_xlabel("seconds (steps scaled by the run's wall time)")
    ax.set_ylabel("val loss")
    ax.set_ylim(1.4, 2.6)
    ax.grid(alpha=0.3)
    ax.legend()
    out = Path(__file__).resolve().parent / "out"
    out.mkdir(exist_ok=True)
    fig.tight_layout()
    fig.savefig(out / "cpu_speedrun.png", dpi=110)
    print(f"plot: {out / 'cpu_speedrun.png'}")


if __name__ == "__main__":
    main()
