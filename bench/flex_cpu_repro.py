"""torch.compile(flex_attention) against SDPA on this CPU: torch only, ready to report.

    python bench/flex_cpu_repro.py                    # d_k 8, 16 and 32; lengths 8..136
    python bench/flex_cpu_repro.py --dk 8 --lengths 8 16 24

A causal block mask, fp32, batch 2, 4 heads. Each length runs several random inputs,
each tensor allocated on its own, and before each call the allocator is handed blocks
filled with NaN and freed again, so a kernel that reads memory it should not (beside
its inputs or in its scratch buffers) shows it nearly every time rather than by chance. Prints the torch version, the CPU's vector flags, the ISA inductor picked,
and for each (d_k, length) the largest |flex - sdpa| and how many inputs were wrong.
On a Zen 3 (AVX2, no AVX-512) with torch 2.13.0+cpu: lengths 8, 24 and 72 wrong at
d_k 8 and 16, 40 and 56 at d_k 8; every multiple of 16 tried, and d_k 32, right.
"""
from __future__ import annotations

import argparse
import platform
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line for line in f if line.startswith("flags")).split(":")[1].split()
    except (OSError, StopIteration):
        return "unknown"
    return " ".join(sorted(f for f in flags if f.startswith(("avx", "fma", "amx"))))


def causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def poison_allocator():
    blocks = [torch.full((n,), float("nan")) for n in (64, 256, 1024, 4096, 16384, 65536) * 4]
    del blocks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dk", type=int, nargs="+", default=[8, 16, 32], help="head widths d_k to test")
    p.add_argument("--lengths", type=int, nargs="+",
                   default=[7, 8, 9, 15, 16, 17, 24, 32, 40, 48, 56, 64, 72, 128, 136],
                   help="sequence lengths to test (by default on both sides of multiples of 8)")
    p.add_argument("--inputs", type=int, default=4, help="random inputs per length")
    args = p.parse_args()
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    print(f"torch {torch.__version__}, python {platform.python_version()}, {platform.machine()}")
    print(f"cpu flags: {cpu_flags()}")
    print(f"aten capability: {torch.backends.cpu.get_cpu_capability()}, "
          f"inductor vec isa: {pick_vec_isa()}, threads: {torch.get_num_threads()}")
    warnings.filterwarnings("ignore")
    torch._dynamo.config.recompile_limit = 1000           # one static kernel per length
    kernel = torch.compile(flex_attention, dynamic=False)
    for dk in args.dk:
        for T in args.lengths:
            blocks = create_block_mask(causal, None, None, T, T, device="cpu")
            worst, wrong = 0.0, 0
            for seed in range(args.inputs):
                g = torch.Generator().manual_seed(seed)
                q, k, v = (torch.randn(2, 4, T, dk, generator=g) for _ in range(3))
                ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                poison_allocator()
                err = (kernel(q, k, v, block_mask=blocks) - ref).abs().max().item()
                bad = not err < 1e-4                             # NaN counts as wrong
                wrong += bad
                worst = float("nan") if err != err else max(worst, err)
            print(f"d_k {dk:>3}  T {T:>4}  max |flex - sdpa| {worst:.3g}  "
                  f"wrong for {wrong}/{args.inputs} inputs", flush=True)


if __name__ == "__main__":
    main()
