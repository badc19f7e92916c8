"""Train several variants side by side and compare them: same data, seed, steps and
budget, one process each, then one table and one plot.

    python -m attnlab.compare                                  # the CPU matrix (< 15 min)
    python -m attnlab.compare --base cpu --steps 2000 --variants positions
    python -m attnlab.compare --variant "rope=--model.position=rope" \\
                              --variant "alibi=--model.position=alibi"

Writes <out>/results.md, results.csv and loss_curves.png, and keeps every run
directory, so `python -m attnlab.extrapolate --from <out>` can evaluate them further.
"""
from __future__ import annotations

import csv
import io
import json
import os
import shlex
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from common.errors import AttnlabError
from common.files import write_text_atomic
from attnlab.plotting import pyplot, save_figure
from attnlab.options import out_option
from engine.cli import Parser, errors_as_lines

ROOT = Path(__file__).resolve().parent.parent

# Named lists of variants: name -> extra train.py arguments on top of the base preset.
MATRICES = {
    "cpu": {
        "rope": "",
        "none": "--model.position=none",
        "sinusoidal": "--model.position=sinusoidal",
        "learned": "--model.position=learned",
        "alibi": "--model.position=alibi",
        "eager": "--model.attention=eager",
        "banded-w16": "--model.attention=banded --model.sliding_window=16",
        "mqa": "--model.n_kv_head=1",
        "rmsnorm-swiglu": "--model.norm=rmsnorm --model.mlp=swiglu",
    },
    "positions": {
        "none": "--model.position=none", "sinusoidal": "--model.position=sinusoidal",
        "learned": "--model.position=learned", "rope": "--model.position=rope",
        "alibi": "--model.position=alibi",
    },
}


def run_variant(name: str, args: str, base: str, steps: int, out: Path, common: list[str],
                resume: bool = False) -> dict:
    """train.py for one variant, its figures read from its run folder; with `resume`, the
    folder's own run continued (or, already at its last step, only read)."""
    train = str(ROOT / "train.py")
    cmd = ([sys.executable, train, "--resume", str(out / name)] if resume else
           [sys.executable, train, "--config", base, *shlex.split(args), *common,
            f"--train.max_iters={steps}", f"--train.out_dir={out}", f"--train.run_name={name}"])
    start = time.perf_counter()
    # In this command's folder, as a user's own train.py would run: the folders a config
    # file names (below the one the command runs from) and a relative --out are where the
    # user meant, not below the project.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "WANDB_MODE": "disabled"})
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)        # this child's own peak memory
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise AttnlabError(f"variant {name} failed:\n{output[-1500:]}")
    run_dir = out / name
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "val_loss" in r]
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    unit = "bpc" if "val_bpc" in evals[-1] else "bpb"
    from model import GPT, ModelConfig
    saved = json.loads((run_dir / "config.json").read_text())["model"]
    params = GPT(ModelConfig(**saved)).num_params()
    peak = usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return {"variant": name, "args": args or "(base)", "params": params,
            "val_loss": min(r["val_loss"] for r in evals), f"val_{unit}": min(r[f"val_{unit}"] for r in evals),
            "unit": unit, "tokens_per_s": sum(rates) / max(len(rates), 1),
            "peak_memory_mb": peak / 2**20, "wall_s": wall,
            "curve": [(r["step"], r["val_loss"]) for r in evals],
            "train_curve": [(r["step"], r["loss"]) for r in records if "loss" in r]}


def write_results(rows: list[dict], out: Path) -> None:
    unit = rows[0]["unit"]
    columns = ["variant", "args", "params", "val_loss", f"val_{unit}", "tokens_per_s",
               "peak_memory_mb", "wall_s"]
    table = io.StringIO(newline="")
    writer = csv.writer(table)
    writer.writerow(columns)
    for r in rows:
        writer.writerow([r[c] for c in columns])
    write_text_atomic(out / "results.csv", table.getvalue())
    lines = [f"| variant | arguments | params | best val loss | {unit} | tokens/s | peak memory | wall time |",
             "|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: r["val_loss"]):
        lines.append(f"| {r['variant']} | `{r['args']}` | {r['params'] / 1e6:.2f}M | {r['val_loss']:.4f} "
                     f"| {r[f'val_{unit}']:.3f} | {r['tokens_per_s']:,.0f} | "
                     f"{r['peak_memory_mb']:,.0f} MB | {r['wall_s']:.0f} s |")
    write_text_atomic(out / "results.md", "\n".join(lines) + "\n")
    write_text_atomic(out / "results.json", json.dumps(rows, indent=1))
    print("\n".join(lines))

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in rows:
        axes[0].plot(*zip(*r["train_curve"]), label=r["variant"], alpha=0.8, linewidth=0.8)
        axes[1].plot(*zip(*r["curve"]), marker="o", label=r["variant"])
    for ax, title in zip(axes, ["training loss", "validation loss"]):
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats per token)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    if all(len(r["curve"]) > 1 for r in rows):      # hide the step-0 loss, ~ln(vocab)
        axes[1].set_ylim(top=min(r["curve"][1][1] for r in rows) + 0.2)
    axes[1].legend(fontsize=8)
    save_figure(fig, out / "loss_curves.png", dpi=110)


def main(argv=None) -> int:
    parser = Parser("python -m attnlab.compare", __doc__)
    parser.add_argument("--base", default="compare-cpu", help="preset every variant starts from")
    parser.add_argument("--variants", default="cpu", choices=sorted(MATRICES),
                        help="a named list of variants")
    parser.add_argument("--variant", action="append", default=[],
                        help="NAME=ARGS (train.py overrides); replaces --variants when given")
    parser.add_argument("--steps", type=int, default=0, help="steps per variant (default: the preset's)")
    parser.add_argument("--data", default="", help="corpus for every variant (data.path)")
    parser.add_argument("--out", type=out_option, default=None, help="output folder (default runs/compare-<time>)")
    args = parser.parse_args(argv)
    variants = dict(v.split("=", 1) if "=" in v else (v, "") for v in args.variant) \
        or MATRICES[args.variants]
    from engine import cli
    base = cli.build(args.base, [])
    steps = args.steps or base.train.max_iters
    out = Path(args.out or f"runs/compare-{datetime.now():%Y%m%d-%H%M%S}")
    out.mkdir(parents=True, exist_ok=True)
    common = [f"--data.path={args.data}"] if args.data else []
    for name, extra in variants.items():       # check every variant before training any
        cli.build(args.base, shlex.split(extra))
    rows = []
    for i, (name, extra) in enumerate(variants.items(), 1):
        print(f"[{i}/{len(variants)}] {name}: {extra or '(base)'}", flush=True)
        rows.append(run_variant(name, extra, args.base, steps, out, common))
        r = rows[-1]
        print(f"    val loss {r['val_loss']:.4f}, {r['tokens_per_s']:,.0f} tokens/s, "
              f"{r['wall_s']:.0f} s", flush=True)
    write_results(rows, out)
    print(f"\nwrote {out}/results.md, results.csv and loss_curves.png")
    return 0


if __name__ == "__main__":
    with errors_as_lines():
        sys.exit(main())
