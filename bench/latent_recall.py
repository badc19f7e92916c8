"""What latent attention needs to learn recall at the frontier's size: multi-head
attention, latent attention as built (its latent RMS-normalised, as DeepSeek-V2 does),
and latent attention without that norm, at the default latent and at one as wide as
multi-head attention's keys and values together (no compression at all), each trained
on MQAR as the frontier trains its models (attnlab/frontier.py: Zoology's task, the
frontier's width, short convolution, steps and curriculum) and scored in the frontier's
cells at 128 tokens, each beside its key-blind floor.

    python bench/latent_recall.py
    python bench/latent_recall.py --steps 300 --variants mha mla
"""
from __future__ import annotations

import capability  # noqa: F401  (first: refuses an ATEN_CPU_CAPABILITY this CPU cannot run)

import argparse
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from attnlab import frontier  # noqa: E402
from attnlab.mqar_task import score, train  # noqa: E402
from capability import cpu_model  # noqa: E402

VARIANTS = {                          # name -> (model fields over the frontier's, latent normed)
    "mha": ({}, True),
    "mla": ({"mechanism": "mla"}, True),
    "mla, no norm": ({"mechanism": "mla"}, False),
    "mla, no norm, r = 2·H·d_h": ({"mechanism": "mla", "mla_kv_rank": 2 * frontier.BASE["n_embd"]},
                                  False),
}
LENGTH = 128


@contextmanager
def latent_norm(kept: bool):
    """Latent attention built with its latent's RMS norm, or (kept False) without it."""
    from model.latent_attention import LatentAttention
    real = LatentAttention.__init__

    def without(self, *args, **kwargs):
        real(self, *args, **kwargs)
        self.kv_norm = nn.Identity()
    LatentAttention.__init__ = real if kept else without
    try:
        yield
    finally:
        LatentAttention.__init__ = real


def main() -> int:
    s = frontier.Settings()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=s.mqar_steps, help="MQAR training steps of each model")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                   metavar="NAME", help="of: " + "; ".join(VARIANTS))
    p.add_argument("--examples", type=int, default=s.examples, help="examples per cell")
    args = p.parse_args()
    if not 1 <= args.steps <= 10**6 or not 1 <= args.examples <= 10**5:
        raise SystemExit("error: give --steps from 1 to 1,000,000 and --examples from 1 to 100,000")
    torch.set_num_threads(1)
    task = frontier.mqar_task(s)
    pairs = [n for length, n in frontier.mqar_cells(s) if length == LENGTH]
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"machine: {cpu_model()}; torch {torch.__version__}, 1 thread; load average {load}")
    print(f"| {args.steps} steps, {LENGTH} tokens | " + " | ".join(f"{n} pairs" for n in pairs) + " |")
    print("|---|" + "---|" * len(pairs))
    for name in args.variants:
        fields, normed = VARIANTS[name]
        started = time.process_time()
        with latent_norm(normed):
            model = train(task, {**frontier.BASE, **fields}, LENGTH, args.steps, batch=s.mqar_batch,
                          lr=s.mqar_lr, log=lambda line: None).eval()
        cells = " | ".join("{:.0%} ({:.0%})".format(*score(model, task, LENGTH, n, args.examples))
                           for n in pairs)                       # each beside its floor
        print(f"| {name} | {cells} |  ({time.process_time() - started:.0f} CPU s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
