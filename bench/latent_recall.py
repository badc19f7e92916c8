"""What latent attention needs to learn recall at the frontier's size: multi-head
attention, latent attention as built (its latent RMS-normalised, as DeepSeek-V2 does),
and latent attention without that norm, at the default latent and at one as wide as
multi-head attention's keys and values together (no compression at all), each trained
on MQAR with the frontier's settings (attnlab/frontier.py: 32 keys, 32 values, 1-8
pairs, 64 tokens, the recall lab's optimizer and schedule) and scored on 256 examples
per pair count.

    python bench/latent_recall.py
    python bench/latent_recall.py --steps 300 --variants mha mla
"""
from __future__ import annotations

import capability  # noqa: F401  (first: refuses an ATEN_CPU_CAPABILITY this CPU cannot run)

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from attnlab.frontier import Settings  # noqa: E402
from attnlab.mqar_task import MQARTask, score  # noqa: E402
from attnlab.recall import BASE  # noqa: E402
from capability import cpu_model  # noqa: E402
from engine.config import TrainConfig  # noqa: E402
from engine.loop import lr_at  # noqa: E402
from engine.optim import configure_optimizer  # noqa: E402
from model import GPT, ModelConfig  # noqa: E402


def without_norm(model):
    for block in model.blocks:
        block.attn.kv_norm = nn.Identity()


# name: (model fields over the frontier's base model, a change made once it is built)
VARIANTS = {
    "mha": ({}, None),
    "mla": ({"mechanism": "mla"}, None),
    "mla, no norm": ({"mechanism": "mla"}, without_norm),
    "mla, no norm, r = 2·H·d_h": ({"mechanism": "mla", "mla_kv_rank": 2 * BASE["n_embd"]},
                                  without_norm),
}


def trained(fields: dict, change, s: Settings, task: MQARTask, seed: int = 0) -> tuple[GPT, float]:
    """The frontier's MQAR training (recall.train_variant's loop), with `change` applied."""
    torch.manual_seed(seed)
    model = GPT(ModelConfig(**{**BASE, **fields, "vocab_size": task.tokenizer.vocab_size,
                               "block_size": s.mqar_length}))
    if change:
        change(model)
    lr = 3e-3
    t = TrainConfig(lr=lr, min_lr=lr / 10, max_iters=s.steps, warmup_iters=min(50, s.steps // 5),
                    weight_decay=0.0)
    opt = configure_optimizer(model, t, torch.device("cpu"))
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    g = torch.Generator().manual_seed(seed + 1)
    for step in range(s.steps):
        opt.set_lr(lr_at(step, t) / t.lr)
        x, y = task.batch(32, s.mqar_length, g)
        loss = model(x, y).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(scaler)
        opt.zero_grad()
    return model.eval(), loss.item()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=Settings.steps, help="training steps of each model")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                   metavar="NAME", help="of: " + "; ".join(VARIANTS))
    p.add_argument("--examples", type=int, default=256, help="examples per pair count")
    args = p.parse_args()
    if args.steps < 1 or args.examples < 1:
        raise SystemExit("error: give --steps and --examples of at least 1")
    torch.set_num_threads(1)
    s = Settings(steps=args.steps)
    task = MQARTask(s.keys, s.keys, max(s.pairs))
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"machine: {cpu_model()}; torch {torch.__version__}, 1 thread; load average {load}")
    print(f"| {args.steps} steps | last loss | " + " | ".join(f"mqar_{n}" for n in s.pairs) + " |")
    print("|---|---|" + "---|" * len(s.pairs))
    for name in args.variants:
        started = time.perf_counter()
        model, loss = trained(*VARIANTS[name], s, task)
        cells = " | ".join(f"{score(model, task, s.mqar_length, n, args.examples):.0%}" for n in s.pairs)
        print(f"| {name} | {loss:.3f} | {cells} |  ({time.perf_counter() - started:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
