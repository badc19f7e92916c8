"""CPU speedrun on tiny Shakespeare (character level, first 90% train, last 10% val):
how fast to val loss 1.886 (nanoGPT's CPU recipe: 102 s), and how low in 100 s.

    python bench/cpu_speedrun.py
    python bench/cpu_speedrun.py --target "--config speedrun-cpu --train.seed=7" --repeats 1

Each recipe runs `python train.py` in a subprocess; wall time includes start-up,
tokenization and evaluations. The target runs (the speedrun-cpu preset, three times)
stop at their first evaluation at or below the target (train.target_val_loss). Writes
bench/out/cpu_speedrun.png.

nanoGPT's own validation curve goes beside ours when given: `--nanogpt DIR` (a nanoGPT
checkout) runs its README's CPU recipe there, in this sitting, and stamps each line of
its output with the seconds since start (saved as bench/out/nanogpt_cpu.log);
`--nanogpt-log FILE` reads such a log again, or a plain nanoGPT log, whose times then
come from its per-iteration timings (evaluations not counted).

The target for `--budget` is stated at nanoGPT's wall time in the same sitting, so
`{nanogpt}` in `--planned` becomes those seconds, and `--planned-seeds` repeats the
planned run once per seed (a seed moves it by about as much as the target's margin):

    python bench/cpu_speedrun.py --nanogpt DIR --repeats 1 --planned "--budget {nanogpt}s" --planned-seeds 1337 1
"""
from __future__ import annotations

import capability  # noqa: F401  (first: refuses an ATEN_CPU_CAPABILITY this CPU cannot run)

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cpu_recipe import DEFAULT_CORPUS, run, text_of  # noqa: E402

# The preset reads 8 validation batches of 32 × 64 tokens per evaluation: 16,384 tokens,
# more than the 20 × 12 × 64 = 15,360 of nanoGPT's CPU recipe it is compared with.
TARGET_RECIPE = "--config speedrun-cpu"
# 100 s planned by train.py itself from the default CPU preset: size, steps and a
# clock-following schedule.
PLANNED_RECIPE = "--budget 100s"


NANOGPT_CPU = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False",
               "--eval_iters=20", "--log_interval=1", "--block_size=64", "--batch_size=12",
               "--n_layer=4", "--n_head=4", "--n_embd=128", "--max_iters=2000",
               "--lr_decay_iters=2000", "--dropout=0.0"]          # nanoGPT README's CPU recipe


def run_nanogpt(checkout: Path, corpus: Path, log: Path, extra: tuple[str, ...] = ()) -> None:
    """nanoGPT's CPU recipe in its own checkout, every output line time-stamped;
    `extra` adds its own command-line settings."""
    data = checkout / "data" / "shakespeare_char"
    (data / "input.txt").write_text(text_of(corpus), encoding="utf-8")   # its prepare.py would download it
    subprocess.run([sys.executable, "prepare.py"], cwd=data, check=True, capture_output=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with subprocess.Popen([sys.executable, "train.py", *NANOGPT_CPU, *extra], cwd=checkout, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc, \
            open(log, "w") as out:
        for line in proc.stdout:
            out.write(f"{time.perf_counter() - start:.2f}\t{line}")
    if proc.returncode:
        raise SystemExit(f"nanoGPT failed; see {log}")


def nanogpt_curve(log: Path) -> list[tuple[float, int, float]]:
    """(seconds, step, val loss) of each evaluation in a nanoGPT log."""
    curve, clock = [], 0.0
    for raw in log.read_text().splitlines():
        stamp, tab, line = raw.partition("\t")
        stamped = bool(tab) and re.fullmatch(r"[0-9.]+", stamp)
        line = line if stamped else raw
        step = re.match(r"step (\d+): train loss [0-9.]+, val loss ([0-9.]+)", line)
        it = re.match(r"iter \d+: loss [0-9.]+, time ([0-9.]+)ms", line)
        if it and not stamped:
            clock += float(it.group(1)) / 1000
        if step:
            curve.append((float(stamp) if stamped else clock, int(step.group(1)), float(step.group(2))))
    return curve


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=TARGET_RECIPE, help="train.py arguments for the 1.886 run")
    parser.add_argument("--repeats", type=int, default=3, help="runs of the target recipe")
    parser.add_argument("--planned", default=PLANNED_RECIPE, help="train.py arguments for the --budget run")
    parser.add_argument("--planned-seeds", type=int, nargs="+", default=[],
                        help="run the planned recipe once per seed (train.seed)")
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS,
                        help="the text both projects train on (default: tiny Shakespeare, "
                             "data/tinyshakespeare/input.txt.gz)")
    parser.add_argument("--nanogpt", type=Path, help="a nanoGPT checkout: run its CPU recipe beside ours")
    parser.add_argument("--nanogpt-log", type=Path, help="a nanoGPT log to draw instead of running it")
    args = parser.parse_args()
    # On a busy machine nanoGPT's process, which nothing watches, waits asleep, and so do
    # our runs started from here (they inherit the setting): both wait alike
    # (common/cpu.py).
    from common.cpu import wait_passively_if_busy
    wait_passively_if_busy()
    nano = None
    if args.nanogpt:
        args.nanogpt_log = Path("bench/out/nanogpt_cpu.log")
        run_nanogpt(args.nanogpt, args.corpus, args.nanogpt_log)
    if args.nanogpt_log:
        nano = nanogpt_curve(args.nanogpt_log)
        print(f"nanoGPT: val {nano[-1][2]:.4f} at step {nano[-1][1]}, {nano[-1][0]:.1f} s; curve "
              + " ".join(f"{s}:{v:.3f}@{t:.0f}s" for t, s, v in nano))
    nano_s = nano[-1][0] if nano else None
    if "{nanogpt}" in args.planned:
        if nano_s is None:
            raise SystemExit("error: --planned names {nanogpt}: give --nanogpt DIR or --nanogpt-log FILE")
        args.planned = args.planned.replace("{nanogpt}", f"{nano_s:.0f}")
    recipes = [f"{args.planned} --train.seed={seed}" for seed in args.planned_seeds] or [args.planned]
    with tempfile.TemporaryDirectory() as tmp:
        fast = [run(f"to-1.886-{i + 1}", args.target, args.corpus, Path(tmp)) for i in range(args.repeats)]
        plans = [(recipe, run(f"planned-{i + 1}", recipe, args.corpus, Path(tmp)))
                 for i, recipe in enumerate(recipes)]
    print("| run | train.py arguments | steps | wall time | val loss | vs nanoGPT's time |")
    print("|---|---|---|---|---|---|")
    for i, r in enumerate(fast):
        reached = any(v <= 1.886 for _, v in r["curve"])
        ratio = f"{r['wall'] / nano_s:.2f}x" if nano_s and reached else "-"
        print(f"| to 1.886, run {i + 1} | `{args.target}` | {r['steps']} | {r['wall']:.1f} s | "
              f"{r['val']:.4f}{'' if reached else ' (target not reached)'} | {ratio} |")
    for recipe, planned in plans:
        print(f"| planned by train.py | `{recipe}` | {planned['steps']} | "
              f"{planned['wall']:.1f} s | {planned['val']:.4f} | - |")
    if nano:
        print(f"| nanoGPT's CPU recipe (its own train.py) | `{' '.join(NANOGPT_CPU[1:])}` | "
              f"{nano[-1][1]} | {nano_s:.1f} s | {nano[-1][2]:.4f} | 1.00x |")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r, label in ((fast[0], args.target), (plans[0][1], plans[0][0])):
        steps, vals = zip(*r["curve"])
        ax.plot([s * r["wall"] / max(r["steps"], 1) for s in steps], vals, marker="o", label=label)
    if nano:
        ax.plot([t for t, _, _ in nano], [v for _, _, v in nano], marker="s", color="black",
                label="nanoGPT's CPU recipe (its own run)")
    ax.axhline(1.886, color="grey", linestyle="--", label="nanoGPT's final val loss (1.886)")
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
