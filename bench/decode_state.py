"""Decoding one token after a long context: a state of fixed size (linear attention,
the delta rule) or a latent (MLA) against softmax attention's growing KV cache, at the
same width, in the same process. The frontier (python -m attnlab.frontier) times its
one small model, 64 wide, where the per-token cost of the layers themselves hides the
cache's; this table adds the widths where the cache's read is most of the cost.

    python bench/decode_state.py
    python bench/decode_state.py --contexts 1024 16384 --sizes 2x256 6x384
    python bench/decode_state.py --mechanisms mla --sizes 2x64x4 4x128x4 --repeats 5

Each cell is the frontier's own measurement (attnlab/frontier.py decode_columns: a
cache filled with the context, then tokens decoded one at a time, 2 untimed), on one
thread. With --repeats the mechanisms take turns, mha first, so a change in the
machine's load falls on all of them alike; a cell is the median of its repeats, and the
ratio, mha's time over the mechanism's, the median of the repeats' own ratios. The
machine line gives the load average before and after.
"""
from __future__ import annotations

import capability  # noqa: F401  (first: refuses an ATEN_CPU_CAPABILITY this CPU cannot run)

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from attnlab.frontier import Mechanism, Settings, decode_columns  # noqa: E402
from engine.machine import describe_cpu  # noqa: E402
from capability import cpu_model  # noqa: E402


def shape_of(size: str) -> dict:
    """LAYERSxWIDTH (a head of 64; 4 heads at 64 wide) or LAYERSxWIDTHxHEADS."""
    parts = size.lower().split("x")
    if len(parts) not in (2, 3) or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise SystemExit(f"error: --sizes {size!r}: write LAYERSxWIDTH or LAYERSxWIDTHxHEADS, "
                         "as 2x256 or 4x128x4")
    layers, width = int(parts[0]), int(parts[1])
    heads = int(parts[2]) if len(parts) == 3 else (4 if width == 64 else max(1, width // 64))
    if width % heads:
        raise SystemExit(f"error: --sizes {size!r}: the width must be a multiple of the heads")
    return {"n_layer": layers, "n_embd": width, "n_head": heads}


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 16384],
                   help="cache lengths decoded after; the table shows the longest")
    p.add_argument("--sizes", nargs="+", default=["2x64", "2x256", "6x384"],
                   help="LAYERSxWIDTH, with a head of 64 (the frontier's is 2x64, 4 heads of "
                        "16), or LAYERSxWIDTHxHEADS (the cpu preset's is 4x128x4)")
    p.add_argument("--mechanisms", nargs="+", default=["linear", "deltanet"],
                   help="model.mechanism values timed against mha (default: the fixed states)")
    p.add_argument("--steps", type=int, default=12, help="tokens decoded at each context")
    p.add_argument("--repeats", type=int, default=1,
                   help="turns each mechanism takes, interleaved (the medians are shown)")
    args = p.parse_args()
    if args.repeats < 1 or args.steps < 3:
        raise SystemExit("error: give --repeats of at least 1 and --steps of at least 3")
    shapes = {size: shape_of(size) for size in args.sizes}
    torch.set_num_threads(1)
    s = Settings(contexts=tuple(args.contexts), decode_steps=args.steps)
    last = max(s.contexts)
    names = ("mha", *args.mechanisms)
    print(f"machine: {cpu_model()} ({describe_cpu()}); torch {torch.__version__}, 1 thread, "
          f"{args.repeats} repeat(s); load average {load()}")
    print(f"| size | mha ms at {last} | " + " | ".join(f"{n} ms (x)" for n in args.mechanisms)
          + " |")
    print("|---|---|" + "---|" * len(args.mechanisms))
    for size, shape in shapes.items():
        runs = {name: [] for name in names}
        for _ in range(args.repeats):
            for name in names:
                row = decode_columns(Mechanism(name, {**shape, "mechanism": name}), s, vocab_size=65)
                runs[name].append(row[f"decode_ms_at_{last}"])
        ms = {n: statistics.median(t) for n, t in runs.items()}
        ratio = {n: statistics.median(a / b for a, b in zip(runs["mha"], runs[n])) for n in names}
        cells = " | ".join(f"{ms[n]:.2f} ({ratio[n]:.2f}x)" for n in args.mechanisms)
        print(f"| {size} | {ms['mha']:.2f} | {cells} |", flush=True)
    print(f"load average after: {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
