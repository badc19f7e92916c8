"""Length extrapolation: evaluate trained models at 1x, 2x, 4x and 8x the context they
were trained at, and plot validation loss against length, one line per position
scheme; a RoPE model is also evaluated with position interpolation, NTK and YaRN.

    python -m attnlab.extrapolate --from runs/compare-20261129-1000
    python -m attnlab.extrapolate --runs runs/rope runs/alibi --factors 1 2 4 8 16

Learned positions have no vectors past their table: they are reported as not
applicable there, not run. Writes extrapolation.md, .csv and .png.
"""
from __future__ import annotations

import csv
import io
import sys
from dataclasses import replace
from pathlib import Path

import torch

from common.errors import AttnlabError
from common.files import removed_if_left_empty, write_text_atomic
from attnlab.options import add_run_options, find_run, learners_code, out_option, whole
from attnlab.plotting import pyplot, save_figure
from engine.cli import Parser, errors_as_lines


# Tokens in one evaluation batch (--batch_size x factor x context): each holds a row of
# logits over the vocabulary, so a batch past this needs more memory than a laptop has.
MAX_BATCH_TOKENS = 1 << 16


def find_runs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if (p / "config.json").is_file()
                  and (p / "checkpoints").is_dir())


@torch.no_grad()
def val_loss(model, tokens, length: int, batches: int, batch_size: int) -> float:
    from data.tokens import Batches
    total, device = 0.0, next(model.parameters()).device
    for x, y in Batches(tokens, batch_size, length, split="val").spaced(batches):
        total += model(x.to(device), y.to(device)).loss.item()
    return total / batches


def schemes(cfg, factor: int):
    """(label, model config) pairs to evaluate a trained model with at this factor:
    as trained, and with each RoPE scaling when its positions rotate."""
    from model.positions import POSITION_ENCODINGS
    from model.rope_scaling import ROPE_SCALINGS
    yield cfg.position, cfg
    if POSITION_ENCODINGS[cfg.position].rotary:          # at 1x each scaling is plain RoPE
        for kind, scaling in ROPE_SCALINGS.items():
            if scaling.stretches:
                yield scaling.label, replace(cfg, rope_scaling=kind, rope_factor=float(factor),
                                             rope_original_context=cfg.block_size)


def evaluate_run(run: Path, factors, batches: int, batch_size: int, which: str = "best",
                 device="cpu", exercises: str | None = None) -> list[dict]:
    from engine import checkpoint
    from engine.inference import load_run
    from data.tokens import load_tokens
    from model import GPT
    from model.positions import POSITION_ENCODINGS
    model, cfg, _, ckpt = load_run(run, which, device, before_build=learners_code(run, exercises))
    weights, _, _ = checkpoint.load(ckpt, train_state=False)
    data_cfg = cfg.data
    data = load_tokens(data_cfg.path, data_cfg.tokenizer, data_cfg.vocab_size, data_cfg.val_fraction, data_cfg.cache_dir, log=lambda *a: None)
    T = cfg.model.block_size
    if batch_size * max(factors) * T > MAX_BATCH_TOKENS:
        raise AttnlabError(f"{run}: --batch_size {batch_size} x --factors {max(factors)} x its "
                           f"context of {T:,} tokens is {batch_size * max(factors) * T:,} tokens "
                           f"a batch; this tool reads at most {MAX_BATCH_TOKENS:,}: give a "
                           "smaller --batch_size or smaller --factors")
    rows = []
    for f in factors:
        for label, mcfg in schemes(cfg.model, f):
            row = {"run": run.name, "scheme": label, "factor": f, "length": f * T}
            if POSITION_ENCODINGS[mcfg.position].has_length_limit and f * T > T:
                row["val_loss"] = None                     # no position vectors that far
            else:
                m = GPT(mcfg)
                checkpoint.load_weights(m, weights, ckpt)
                m = m.to(device)
                row["val_loss"] = val_loss(m.eval(), data.val, f * T, batches, batch_size)
            rows.append(row)
            shown = "n/a (past its table)" if row["val_loss"] is None else f"{row['val_loss']:.4f}"
            print(f"  {run.name:<16} {label:<14} {f}x ({f * T:>5} tokens): {shown}", flush=True)
    return rows


def write(rows: list[dict], out: Path, factors) -> None:
    table = io.StringIO(newline="")
    w = csv.writer(table)
    w.writerow(["run", "scheme", "factor", "length", "val_loss"])
    for r in rows:
        w.writerow([r["run"], r["scheme"], r["factor"], r["length"], r["val_loss"]])
    write_text_atomic(out / "extrapolation.csv", table.getvalue())
    keys = list(dict.fromkeys((r["run"], r["scheme"]) for r in rows))
    lines = ["| run | scheme | " + " | ".join(f"{f}x" for f in factors) + " |",
             "|---|---|" + "---|" * len(factors)]
    for run, scheme in keys:
        cells = []
        for f in factors:
            hit = [r for r in rows if (r["run"], r["scheme"], r["factor"]) == (run, scheme, f)]
            value = hit[0]["val_loss"] if hit else None
            cells.append("n/a" if value is None else f"{value:.3f}")
        lines.append(f"| {run} | {scheme} | " + " | ".join(cells) + " |")
    write_text_atomic(out / "extrapolation.md", "\n".join(lines) + "\n")
    print("\n".join(lines))

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(11, 5.5))
    for run, scheme in keys:
        pts = [(r["length"], r["val_loss"]) for r in rows
               if (r["run"], r["scheme"]) == (run, scheme) and r["val_loss"] is not None]
        label = scheme if scheme == run else f"{run}: {scheme}"
        ax.plot(*zip(*pts), marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("evaluation context length (tokens)")
    ax.set_ylabel("validation loss (nats per token)")
    ax.set_title("Length extrapolation (trained at the leftmost length)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    save_figure(fig, out / "extrapolation.png", dpi=110)


def main(argv=None) -> int:
    parser = Parser("python -m attnlab.extrapolate", __doc__)
    parser.add_argument("--from", dest="folder", default="", help="a folder of runs (compare's output)")
    parser.add_argument("--runs", nargs="*", default=[], help="run directories (or names in runs/)")
    add_run_options(parser, run=False)
    parser.add_argument("--factors", type=whole(1, 64), nargs="+", default=[1, 2, 4, 8],
                        help="lengths to test, as multiples of each run's context (1 to 64)")
    parser.add_argument("--batches", type=whole(1, 1000), default=10,
                        help="validation batches per point (1 to 1,000; default 10)")
    parser.add_argument("--batch_size", type=whole(1, 256), default=8,
                        help="sequences per batch (1 to 256; default 8)")
    parser.add_argument("--out", type=out_option, default=None, help="output folder (default: --from, or "
                        "figures/, which git ignores)")
    args = parser.parse_args(argv)
    runs = [find_run(r) for r in args.runs if r] + (find_runs(Path(args.folder)) if args.folder else [])
    if not runs:
        raise AttnlabError("no runs to evaluate: give --from FOLDER (from attnlab.compare) "
                           "or --runs DIR [DIR ...]")
    out = Path(args.out or args.folder or "figures")
    from engine.device import pick_device
    device = pick_device(args.device)
    with removed_if_left_empty(out):          # a refused run leaves no empty --out
        out.mkdir(parents=True, exist_ok=True)
        rows = []
        for run in runs:
            rows.extend(evaluate_run(run, args.factors, args.batches, args.batch_size,
                                     args.checkpoint, device, args.exercises))
        write(rows, out, args.factors)
    print(f"\nwrote {out}/extrapolation.md, .csv and .png")
    return 0


if __name__ == "__main__":
    with errors_as_lines():
        sys.exit(main())
