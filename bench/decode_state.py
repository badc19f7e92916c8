"""Decoding one token after a long context: a state of fixed size (linear attention,
the delta rule) against softmax attention's growing KV cache, at the same width, in
the same process. The frontier (python -m attnlab.frontier) times its one small model,
64 wide, where the per-token cost of the layers themselves hides the cache's; this
table adds the widths where the cache's read is most of the cost.

    python bench/decode_state.py
    python bench/decode_state.py --contexts 1024 16384 --sizes 2x256 6x384

Each cell is the frontier's own measurement (attnlab/frontier.py decode_columns: a
cache filled with the context, then tokens decoded one at a time, 2 untimed), on one
thread. The ratio is mha's time over the mechanism's.
"""
from __future__ import annotations

import capability  # noqa: F401  (first: refuses an ATEN_CPU_CAPABILITY this CPU cannot run)

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from attnlab.frontier import Mechanism, Settings, decode_columns  # noqa: E402
from engine.machine import describe_cpu  # noqa: E402
from capability import cpu_model  # noqa: E402

STATES = ("linear", "deltanet")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 16384],
                   help="cache lengths decoded after; the table shows the longest")
    p.add_argument("--sizes", nargs="+", default=["2x64", "2x256", "6x384"],
                   help="LAYERSxWIDTH, with a head of 64 (the frontier's is 2x64, 4 heads of 16)")
    p.add_argument("--steps", type=int, default=12, help="tokens decoded at each context")
    args = p.parse_args()
    torch.set_num_threads(1)
    s = Settings(contexts=tuple(args.contexts), decode_steps=args.steps)
    last = max(s.contexts)
    print(f"machine: {cpu_model()} ({describe_cpu()}); torch {torch.__version__}, 1 thread")
    print(f"| size | mha ms at {last} | " + " | ".join(f"{n} ms (x)" for n in STATES) + " |")
    print("|---|---|" + "---|" * len(STATES))
    for size in args.sizes:
        layers, width = map(int, size.split("x"))
        shape = {"n_layer": layers, "n_embd": width, "n_head": 4 if width == 64 else width // 64}
        ms = {name: decode_columns(Mechanism(name, {**shape, "mechanism": name}), s, vocab_size=65)
              [f"decode_ms_at_{last}"] for name in ("mha", *STATES)}
        cells = " | ".join(f"{ms[n]:.2f} ({ms['mha'] / ms[n]:.1f}x)" for n in STATES)
        print(f"| {size} | {ms['mha']:.2f} | {cells} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
