"""When does torch.compile pay? Eager against compiled training steps, same process.

    python bench/compile_report.py                  # CPU: the cpu preset's model and the baby GPT
    python bench/compile_report.py --sizes baby --dtypes bfloat16

For each size and precision: the first step (where compilation happens), the steady
step time after it, the speed-up, and the break-even point, the number of steps after
which the compiled run has caught up the time its compilation cost. A run shorter than
that is faster without --train.compile.
"""
from __future__ import annotations

import capability  # noqa: F401  (first: refuses an ATEN_CPU_CAPABILITY this CPU cannot run)

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.device import autocast, pick_device, synchronize  # noqa: E402
from model import GPT, ModelConfig  # noqa: E402
from engine.machine import native_bf16 as cpu_has_native_bf16  # noqa: E402

SIZES = {  # name: (n_layer, n_head, n_embd, block_size, batch_size, extra config)
    "cpu": (4, 4, 128, 64, 32, {}),
    "baby": (6, 6, 384, 256, 64, {}),
    "baby-relu2": (6, 6, 384, 256, 64, {"mlp": "relu2"}),
}
VOCAB = 65


def time_run(size, dtype, compiled, steps, device):
    L, H, C, T, B, extra = SIZES[size]
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=VOCAB, n_layer=L, n_head=H, n_embd=C, block_size=T,
                            **extra)).to(device)
    run = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ctx = autocast(device, dtype)
    x = torch.randint(0, VOCAB, (B, T), device=device)

    def step():
        with ctx:
            loss = run(x, x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        synchronize(device)

    start = time.perf_counter()
    step()
    first = time.perf_counter() - start
    step()                                   # allocator and caches settle
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    times.sort()
    return first, times[len(times) // 2], B * T


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["cpu", "baby", "baby-relu2"], choices=list(SIZES),
                        help="models to time: cpu (4 x 128, context 64), baby (6 x 384, context "
                             "256), baby-relu2 (the same with a ReLU² MLP)")
    parser.add_argument("--dtypes", nargs="+", default=None,
                        help="float32, bfloat16 (default: both where bf16 is native, else float32)")
    parser.add_argument("--steps", type=int, default=0, help="timed steps (default per size)")
    parser.add_argument("--device", default="auto",
                        help="auto (CUDA, then MPS, then the CPU), cpu, cuda, cuda:N or mps")
    args = parser.parse_args()
    device = pick_device(args.device)
    bf16 = device.type == "cuda" or cpu_has_native_bf16()
    dtypes = args.dtypes or (["float32", "bfloat16"] if bf16 else ["float32"])
    print(f"torch {torch.__version__}, {device}, {torch.get_num_threads()} threads")
    print("| model | precision | eager step | compiled step | speed-up | compile cost "
          "(first step, extra) | break-even |")
    print("|---|---|---|---|---|---|---|")
    for size in args.sizes:
        steps = args.steps or (20 if size == "cpu" else 3)
        for name in dtypes:
            dtype = getattr(torch, name)
            e_first, e_step, tokens = time_run(size, dtype, False, steps, device)
            c_first, c_step, _ = time_run(size, dtype, True, steps, device)
            extra = (c_first - c_step) - (e_first - e_step)
            gain = e_step - c_step
            even = f"{extra / gain:,.0f} steps ({extra / gain * c_step:,.0f} s)" if gain > 0 else "never"
            print(f"| {size} | {name} | {e_step * 1e3:,.0f} ms ({tokens / e_step:,.0f} tok/s) | "
                  f"{c_step * 1e3:,.0f} ms ({tokens / c_step:,.0f} tok/s) | {e_step / c_step:.2f}x | "
                  f"{c_first:.1f} s, +{extra:.1f} s | {even} |", flush=True)


if __name__ == "__main__":
    main()
