"""Training-step speed of attention mechanisms side by side: the tiny preset's model (2
layers, 2 heads, 32 wide, context 32, batch 8) with each mechanism, in one process.

    python bench/mechanism_step.py --mechanisms gated_deltanet kda

Each step is a forward and backward pass (no optimizer: the weights are the same size
but for a mechanism's own). The models take turns, one step each, and the best step of
each counts, which filters out noise from other processes.
"""
from __future__ import annotations

import capability  # noqa: F401  (first: refuses an ATEN_CPU_CAPABILITY this CPU cannot run)

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from model import GPT, ModelConfig  # noqa: E402
from model.mechanisms import MECHANISMS  # noqa: E402

VOCAB, LAYERS, HEADS, WIDTH, CONTEXT, BATCH = 84, 2, 2, 32, 32, 8   # the tiny preset's
WARMUP = 5


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mechanisms", nargs="+", default=["gated_deltanet", "kda"],
                        choices=sorted(MECHANISMS), help="model.mechanism of each model timed")
    parser.add_argument("--steps", type=int, default=40, help="steps per model, taken in turn")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    models = {}
    for name in args.mechanisms:
        torch.manual_seed(0)
        models[name] = GPT(ModelConfig(vocab_size=VOCAB, n_layer=LAYERS, n_head=HEADS,
                                       n_embd=WIDTH, block_size=CONTEXT, mechanism=name))
    idx = torch.randint(0, VOCAB, (BATCH, CONTEXT + 1), generator=torch.Generator().manual_seed(0))
    times = {name: [] for name in models}
    for _ in range(args.steps):
        for name, model in models.items():
            start = time.perf_counter()
            model(idx[:, :-1], idx[:, 1:]).loss.backward()
            times[name].append(time.perf_counter() - start)
    print(f"torch {torch.__version__}, 1 thread; best of {args.steps - WARMUP} steps each")
    print("| mechanism | parameters | tokens/s |\n|---|---|---|")
    for name, model in models.items():
        rate = BATCH * CONTEXT / min(times[name][WARMUP:])
        print(f"| {name} | {sum(p.numel() for p in model.parameters()):,} | {rate:,.0f} |")


if __name__ == "__main__":
    main()
