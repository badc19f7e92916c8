"""The three ways model/cpu_kernels.py can compute attention on a CPU in bf16, timed side
by side: two bf16 matmuls (the "matmul" route), torch's kernel on fp32 copies ("fp32")
and torch's kernel in bf16 ("fused"), forward + backward, and one-query decoding steps.

    python bench/cpu_attention_routes.py                 # the shapes behind the thresholds
    python bench/cpu_attention_routes.py --repeats 5 --shapes 16,3,128,32

The thresholds in model/cpu_kernels.py (CPU_MATMUL_MAX_SCORES, CPU_FP32_MAX_DECODE_KEYS,
CPU_FP32_MAX_QUERIES) come from these figures on a CPU with native bf16; docs/benchmarks.md
("CPU attention routes") has them with their machine and date. On a CPU without native
bf16 (AVX2) every bf16 column is emulated and the fp32 route is taken at any length.
"""
from __future__ import annotations

import capability  # noqa: F401  (first: refuses an ATEN_CPU_CAPABILITY this CPU cannot run)

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from model.cpu_kernels import matmul_sdpa  # noqa: E402
from model.precision import cpu_has_native_bf16  # noqa: E402

ROUTES = {
    "matmul": lambda q, k, v, **kw: matmul_sdpa(q, k, v, **kw),
    "fp32": lambda q, k, v, **kw: F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                                 **kw).bfloat16(),
    "fused": lambda q, k, v, **kw: F.scaled_dot_product_attention(q, k, v, **kw),
}
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
    kw = dict(is_causal=True) if Tq == Tk else {}

    def call():
        out = ROUTES[route](q, k, v, **kw)
        if backward:
            out.sum().backward()

    with torch.no_grad() if not backward else torch.enable_grad():
        return best_of(call, repeats)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed calls per route and shape (the best counts)")
    parser.add_argument("--shapes", nargs="*", default=None,
                        help="B,H,T,d_k (training) or B,H,1,Tk,d_k (a decoding step)")
    args = parser.parse_args()
    shapes = TRAINING + DECODING
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes]
        shapes = [(s[0], s[1], s[2], s[2], s[3]) if len(s) == 4 else s for s in shapes]
    print(f"torch {torch.__version__}, native bf16: {cpu_has_native_bf16()}, "
          f"{torch.get_num_threads()} threads; best of {args.repeats}, forward + backward "
          "(decoding steps: forward)")
    print("| B, H, queries, keys, d_k | matmul | fp32 kernel | bf16 kernel |")
    print("|---|---|---|---|")
    for shape in shapes:
        unit, scale = ("us", 1e6) if shape[2] == 1 else ("ms", 1e3)
        cells = [f"{time_route(r, shape, args.repeats) * scale:.1f} {unit}" for r in ROUTES]
        print(f"| {', '.join(map(str, shape))} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
