"""Latent attention's two forms over whole sequences, as training runs them: keys and
values rebuilt from the latent once (up-projected, the form training uses), against
W_UK and W_UV folded into the queries and the outputs (absorbed, the form decoding
uses), forward and backward of one layer, each form forced, on one thread. The
mechanism picks a form by counting multiplications (LatentAttention.absorbs); this
says whether the count's choice for a whole sequence is also the faster one here.

    python bench/latent_forms.py
    python bench/latent_forms.py --shapes 128x4x512x4 --repeats 9
"""
from __future__ import annotations

import capability  # noqa: F401  (first: refuses an ATEN_CPU_CAPABILITY this CPU cannot run)

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from capability import cpu_model  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from model.latent_attention import LatentAttention  # noqa: E402
from model.attention import Mask  # noqa: E402


def shape_of(text: str) -> tuple[int, int, int, int]:
    parts = text.lower().split("x")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise SystemExit(f"error: --shapes {text!r}: write WIDTHxHEADSxLENGTHxBATCH, as 64x4x64x32")
    return tuple(map(int, parts))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["64x4x64x32", "128x4x128x16", "128x4x512x4"],
                   help="WIDTHxHEADSxLENGTHxBATCH (the frontier's model trains 64x4x64x32, "
                        "the cpu preset 128x4x128x16)")
    p.add_argument("--repeats", type=int, default=7,
                   help="turns each form takes, interleaved (the medians are shown)")
    args = p.parse_args()
    shapes = [shape_of(s) for s in args.shapes]
    if args.repeats < 1:
        raise SystemExit("error: give --repeats of at least 1")
    torch.set_num_threads(1)
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"machine: {cpu_model()}; torch {torch.__version__}, 1 thread, fp32; load average {load}")
    print("| width x heads x length x batch | up-projected ms | absorbed ms (x up-projected) |")
    print("|---|---|---|")
    for C, H, T, B in shapes:
        layer = LatentAttention(ModelConfig(vocab_size=8, n_head=H, n_embd=C, block_size=T,
                                            mechanism="mla"), 0)
        x = torch.randn(B, T, C, requires_grad=True)
        times = {True: [], False: []}
        for _ in range(args.repeats):
            for absorbed in (False, True):
                layer.absorbs = lambda q_len, k_len, chosen=absorbed: chosen
                started = time.perf_counter()
                for _ in range(3):
                    y, _ = layer(x, None, Mask.over(0, T, T))
                    y.sum().backward()
                times[absorbed].append((time.perf_counter() - started) / 3 * 1000)
        up, absorbed = statistics.median(times[False]), statistics.median(times[True])
        print(f"| {C}x{H}x{T}x{B} | {up:.1f} | {absorbed:.1f} ({absorbed / up:.2f}x) |", flush=True)
    print(f"load average after: {'/'.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
