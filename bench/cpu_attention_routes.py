"""The backends engine/machine.py can pick for attention on a CPU in bf16, timed side by
side: the formula as written (`eager`, model/attention.py's eager_attention, what `auto`
runs on a CPU with native bf16) and torch's kernel in bf16 (`sdpa`), forward + backward,
and one-query decoding steps.

    python bench/cpu_attention_routes.py                 # the shapes behind the thresholds
    python bench/cpu_attention_routes.py --repeats 5 --shapes 16,3,128,32
    python bench/cpu_attention_routes.py --steps         # and whole training steps

A kernel timed alone can mislead (its inputs hot in cache, no casts around it), so
`--steps` also times training steps of the --budget rungs and presets under bf16
autocast with each backend set on the model (model.attention.use_backend), and in fp32
as the reference, interleaved round by round.

engine/machine.py's choice of `eager` for bf16 on a CPU comes from these figures on a CPU
with native bf16; docs/benchmarks.md has them with their machine and date. On a CPU
without native bf16 (AVX2) every bf16 column is emulated, and `auto` trains in fp32.
"""
from __future__ import annotations

import capability  # noqa: F401  (first: refuses an ATEN_CPU_CAPABILITY this CPU cannot run)

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.machine import native_bf16  # noqa: E402
from model.attention import ATTENTION_BACKENDS, Mask  # noqa: E402

ROUTES = {name: ATTENTION_BACKENDS[name].attend for name in ("eager", "sdpa")}
# (batch, heads, queries, keys, d_k): training shapes, then decoding steps over a cache
TRAINING = [(16, 3, 128, 128, 32), (64, 6, 256, 256, 64), (8, 6, 512, 512, 64), (8, 6, 1024, 1024, 64)]
DECODING = [(1, 6, 1, 256, 64), (1, 6, 1, 1024, 64), (1, 12, 1, 512, 64), (8, 12, 1, 1024, 64)]


def best_of(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def time_route(route, shape, repeats):
    B, H, Tq, Tk, D = shape
    g = torch.Generator().manual_seed(0)
    backward = Tq > 1
    q = torch.randn(B, H, Tq, D, generator=g).bfloat16().requires_grad_(backward)
    k, v = (torch.randn(B, H, Tk, D, generator=g).bfloat16().requires_grad_(backward)
            for _ in range(2))
    mask = Mask.over(Tk - Tq, Tq, Tk)

    def call():
        out = ROUTES[route](q, k, v, mask)[0]
        if backward:
            out.sum().backward()

    with torch.no_grad() if not backward else torch.enable_grad():
        return best_of(call, repeats)


# (layers, width, context, batch): the speedrun, the --budget rung it mostly picks, the cpu preset
STEP_SHAPES = [(3, 64, 64, 32), (3, 96, 128, 16), (4, 128, 128, 16)]


def step_times(shapes, rounds: int = 3, steps: int = 20) -> None:
    """ms a training step (Muon, the cpu preset's optimizer) for each shape: bf16
    autocast with each backend set on the model, and fp32 throughout."""
    from dataclasses import replace
    from engine import cli
    from engine.budget import sized
    from engine.device import autocast
    from engine.optim import configure_optimizer
    from model import GPT
    from model.attention import use_backend
    cpu = torch.device("cpu")
    kernels = [(name, name, torch.bfloat16) for name in ROUTES] + [("fp32", "sdpa", torch.float32)]
    print(f"\ntraining steps, ms (best of {rounds} rounds of {steps}, interleaved):")
    print("| layers x width, context, batch | " + " | ".join(n for n, _, _ in kernels) + " |")
    print("|---|" + "---|" * len(kernels))
    for L, W, T, B in shapes:
        cfg = cli.build("cpu", [])
        cfg.model = sized(replace(cfg.model, vocab_size=65, block_size=T), L, W)
        cfg.train.batch_size = B
        g = torch.Generator().manual_seed(0)
        x, y = (torch.randint(0, 65, (B, T), generator=g) for _ in range(2))
        runs = {}
        for name, kernel, dtype in kernels:
            torch.manual_seed(0)
            model = GPT(cfg.model)
            use_backend(model, kernel)
            runs[name] = (model, configure_optimizer(model, cfg.train, cpu), dtype)
        best = dict.fromkeys(runs, float("inf"))
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        for r in range(rounds + 1):                      # round 0 warms up
            for name, (model, opt, dtype) in runs.items():
                start = time.perf_counter()
                for _ in range(steps):
                    with autocast(cpu, dtype):
                        loss = model(x, y).loss
                    loss.backward()
                    opt.step(scaler)
                    opt.zero_grad()
                if r:
                    best[name] = min(best[name], (time.perf_counter() - start) / steps)
        print(f"| {L} x {W}, {T}, {B} | " + " | ".join(f"{best[n] * 1e3:.1f}" for n in runs) + " |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed calls per route and shape (the best counts)")
    parser.add_argument("--shapes", nargs="*", default=None,
                        help="B,H,T,d_k (training) or B,H,1,Tk,d_k (a decoding step)")
    parser.add_argument("--steps", action="store_true",
                        help="also time training steps with each training route (a few minutes)")
    args = parser.parse_args()
    shapes = TRAINING + DECODING
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes]
        shapes = [(s[0], s[1], s[2], s[2], s[3]) if len(s) == 4 else s for s in shapes]
    print(f"torch {torch.__version__}, native bf16: {native_bf16()}, "
          f"{torch.get_num_threads()} threads; best of {args.repeats}, forward + backward "
          "(decoding steps: forward)")
    print("| B, H, queries, keys, d_k | " + " | ".join(ROUTES) + " |")
    print("|---|" + "---|" * len(ROUTES))
    for shape in shapes:
        unit, scale = ("us", 1e6) if shape[2] == 1 else ("ms", 1e3)
        cells = [f"{time_route(r, shape, args.repeats) * scale:.1f} {unit}" for r in ROUTES]
        print(f"| {', '.join(map(str, shape))} | " + " | ".join(cells) + " |")
    if args.steps:
        step_times(STEP_SHAPES)


if __name__ == "__main__":
    main()
