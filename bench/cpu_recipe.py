"""Wall time and final validation loss of CPU recipes on tiny Shakespeare.

    python bench/cpu_recipe.py                        # the cpu-quick and cpu presets
    python bench/cpu_recipe.py --recipe "lr3e3=--config cpu-quick --train.lr=3e-3"

Character level, first 90% train, last 10% val (nanoGPT's split). Each recipe runs
`python train.py` in a subprocess, so the wall time includes start-up, tokenization
(the token cache is cleared first) and every evaluation. Reference: nanoGPT's CPU
recipe (4 layers, 4 heads, 128 wide, context 64, batch 12, 2,000 iterations,
lr 1e-3) reaches val loss 1.886 in 102 s on the 2-core machine this was written on.
"""
from __future__ import annotations

import capability  # noqa: F401  (first: refuses an ATEN_CPU_CAPABILITY this CPU cannot run)

import argparse
import gzip
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# nanoGPT's benchmark text (its shakespeare_char input.txt), shipped with the project.
DEFAULT_CORPUS = ROOT / "data" / "tinyshakespeare" / "input.txt.gz"
RECIPES = {"cpu-quick": "--config cpu-quick", "cpu": "--config cpu"}


def text_of(corpus: Path) -> str:
    """The corpus's text, gzipped or not (train.py reads both; nanoGPT only plain text)."""
    opener = gzip.open if corpus.suffix == ".gz" else open
    with opener(corpus, "rt", encoding="utf-8") as f:
        return f.read()


def run(name: str, args: str, corpus: Path, workdir: Path) -> dict:
    cache = workdir / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    cmd = [sys.executable, "train.py", *shlex.split(args), f"--data.path={corpus}",
           f"--data.cache_dir={cache}", f"--train.out_dir={workdir}", f"--train.run_name={name}"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "WANDB_MODE": "disabled"})
    wall = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-2000:]}")
    evals = [json.loads(l) for l in (workdir / name / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in evals if "val_loss" in r]
    return {"name": name, "args": args, "wall": wall, "steps": evals[-1]["step"],
            "val": evals[-1]["val_loss"], "curve": [(r["step"], r["val_loss"]) for r in evals]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", action="append", default=[],
                        help="NAME=ARGS for train.py; default: the cpu-quick and cpu presets")
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS,
                        help="the text every recipe trains on (default: tiny Shakespeare, "
                             "data/tinyshakespeare/input.txt.gz)")
    args = parser.parse_args()
    recipes = dict(r.split("=", 1) for r in args.recipe) or RECIPES
    if not args.corpus.is_file():
        raise SystemExit(f"{args.corpus} not found; pass --corpus path/to/tinyshakespeare.txt")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, recipe in recipes.items():
            rows.append(run(name, recipe, args.corpus, Path(tmp)))
            r = rows[-1]
            print(f"{name}: {r['wall']:.1f} s, val loss {r['val']:.4f}; curve "
                  + " ".join(f"{s}:{v:.3f}" for s, v in r["curve"]), flush=True)
    print("\n| recipe | train.py arguments | steps | wall time | final val loss |")
    print("|---|---|---|---|---|")
    print("| nanoGPT CPU recipe (reference, measured separately) | 4/4/128, ctx 64, batch 12, "
          "lr 1e-3 | 2000 | 102 s | 1.886 |")
    for r in rows:
        print(f"| {r['name']} | `{r['args']}` | {r['steps']} | {r['wall']:.1f} s | {r['val']:.4f} |")


if __name__ == "__main__":
    main()
