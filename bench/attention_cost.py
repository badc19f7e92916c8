"""The cost of attention against sequence length: full causal O(T²) against a
sliding window O(T·W), for each backend, forward and forward+backward.

    python bench/attention_cost.py                       # quick: T up to 2,048, a minute or two
    python bench/attention_cost.py --full                # T up to 16,384: over 10 minutes on 2 cores
    python bench/attention_cost.py --lengths 256 1024 4096 --window 256 --plot cost.png

On a CPU it runs the cases twice (times here, memory in a child process, see below).
bench/out/attention_cost.json is written after every case, so `python -m attnlab.figures
cost` draws what has been measured even from a sweep stopped part way.

Time is the best of a few repetitions. Memory is the extra peak over what was in use
before the call: on CUDA torch's allocator statistics, on a CPU the process's peak
resident memory (VmHWM, reset before each case through /proc/self/clear_refs), with
glibc told to return every block over 64 KiB to the system when freed, so that
memory a previous case freed cannot hide a new peak. That setting makes every large
allocation a fresh mapping and slows allocation-heavy code, so on a CPU the memory is
measured in a second process of its own and the times in this one, with the usual
allocator.
"""
from __future__ import annotations

import capability  # noqa: F401  (first: refuses an ATEN_CPU_CAPABILITY this CPU cannot run)

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from model.attention import ATTENTION_BACKENDS, Mask  # noqa: E402

# (label, backend, uses the window); eager is only run while its T×T scores fit.
CASES = [("sdpa causal", "sdpa", False), ("eager causal", "eager", False),
         ("sdpa + window mask", "sdpa", True), ("eager + window mask", "eager", True),
         ("banded window", "banded", True), ("flex window", "flex", True),
         ("flex causal", "flex", False)]
QUICK_LENGTHS = [256, 512, 1024, 2048]
FULL_LENGTHS = [256, 512, 1024, 2048, 4096, 8192, 16384]
EAGER_MAX_T = 4096           # eager keeps T×T scores and weights (and their gradients)
DENSE_MASK_MAX_T = 8192      # sdpa with a T×T mask falls back to its math path


def _status(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    return 0


def measure(backend, T, window, device, backward, B, H, D, repeats, timing=True, memory=True,
            dtype=torch.float32):
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, generator=g).to(device, dtype).requires_grad_(backward)
               for _ in range(3))
    fn = ATTENTION_BACKENDS[backend]

    def call():
        mask = Mask.over(0, T, T, device=device, window=window)
        out, _ = fn(q, k, v, mask)
        if backward:
            out.sum().backward()
        return out

    call()                                                    # warm-up (and flex compile)
    gc.collect()
    if not memory:
        extra = 0
    elif device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        for t in (q, k, v):
            t.grad = None
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = _status("VmRSS")
    if memory:
        call()
        if device.type == "cuda":
            torch.cuda.synchronize()
            extra = torch.cuda.max_memory_allocated() - base
        else:
            extra = _status("VmHWM") - base
    best = float("inf")
    for _ in range(repeats if timing else 0):
        for t in (q, k, v):
            t.grad = None
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best, extra


def cpu_memory_pass(argv: list[str]) -> dict:
    """Extra CPU memory of every case, measured in a child process whose glibc returns
    freed blocks (see the docstring): {(label, pass, T): bytes}."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    proc = subprocess.run([sys.executable, __file__, *argv, "--devices", "cpu", "--memory-pass"],
                          env=env, capture_output=True, text=True, check=True)
    return {(r["backend"], r["pass"], r["T"]): r["extra_bytes"]
            for r in json.loads(proc.stdout.strip().splitlines()[-1])}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=None,
                        help="sequence lengths T to time (default: " + " ".join(map(str, QUICK_LENGTHS))
                        + ", a minute or two on 2 quiet CPU cores)")
    parser.add_argument("--full", action="store_true", help="the full sweep, T = "
                        + " ".join(map(str, FULL_LENGTHS)) + ": over 10 minutes on a 2-core CPU")
    parser.add_argument("--window", type=int, default=256, help="the window W of the windowed rows")
    parser.add_argument("--batch", type=int, default=1, help="batch size B")
    parser.add_argument("--heads", type=int, default=6, help="attention heads H")
    parser.add_argument("--head_dim", type=int, default=64, help="each head's width d_k")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per figure (the best counts)")
    parser.add_argument("--devices", nargs="+", default=None,
                        help="devices to time on (default: cpu, and cuda where there is a GPU)")
    parser.add_argument("--plot", default="bench/out/attention_cost.png",
                        help="where to save the figure (empty: no figure)")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="auto: bfloat16 on CUDA (what training uses there), float32 on CPU")
    parser.add_argument("--memory-pass", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.full and args.lengths:
        parser.error("--full is a set of lengths of its own; give --full or --lengths, not both")
    args.lengths = args.lengths or (FULL_LENGTHS if args.full else QUICK_LENGTHS)
    memory_pass = args.memory_pass
    passed = [a for a in sys.argv[1:] if a != "--memory-pass"]
    if "--devices" in passed:                    # the child gets --devices cpu of its own
        i = passed.index("--devices")
        j = i + 1
        while j < len(passed) and not passed[j].startswith("--"):
            j += 1
        passed = passed[:i] + passed[j:]
    devices = args.devices or (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
    if not memory_pass:
        print(f"T = {' '.join(map(str, args.lengths))} on {', '.join(devices)}: "
              + ("over 10 minutes on a 2-core CPU" if max(args.lengths) > 4096 else
                 "a minute or two on 2 quiet CPU cores" if max(args.lengths) <= 2048 else
                 "a few minutes on a 2-core CPU")
              + f"; each case is added to {OUT_JSON} as it is timed", flush=True)
    rows = []
    for dev in devices:
        device = torch.device(dev)
        for label, backend, windowed in CASES:
            for backward in (False, True):
                if backward and device.type == "cpu" and not ATTENTION_BACKENDS[backend].trains_on_cpu:
                    continue                                  # no backward on CPU (flex)
                for T in args.lengths:
                    # the backend that forms the T×T weights, limited to where they fit
                    if ATTENTION_BACKENDS[backend].returns_weights and T > EAGER_MAX_T:
                        continue
                    if label == "sdpa + window mask" and T > DENSE_MASK_MAX_T:
                        continue
                    W = args.window if windowed else 0
                    if W and W > T:
                        continue
                    on_cpu = device.type == "cpu"
                    dtype = (torch.bfloat16 if device.type == "cuda" else torch.float32) \
                        if args.dtype == "auto" else getattr(torch, args.dtype)
                    t, mem = measure(backend, T, W, device, backward, args.batch, args.heads,
                                     args.head_dim, args.repeats, timing=not memory_pass,
                                     memory=memory_pass or not on_cpu, dtype=dtype)
                    rows.append((dev, label, "fwd+bwd" if backward else "fwd", T, t, mem))
                    if not memory_pass:
                        print(f"{dev:>4} {label:<20} {rows[-1][2]:<7} T={T:>6}: "
                              f"{t * 1e3:9.2f} ms", flush=True)
                        write_rows(rows)
    if memory_pass:
        print(json.dumps([{"backend": l, "pass": m, "T": T, "extra_bytes": mem}
                          for d, l, m, T, t, mem in rows]))
        return
    if "cpu" in devices:
        print("measuring CPU memory in a separate process ...", flush=True)
        cpu_memory = cpu_memory_pass(passed)
        rows = [(d, l, m, T, t, cpu_memory[(l, m, T)] if d == "cpu" else mem)
                for d, l, m, T, t, mem in rows]
    print(f"\nB={args.batch}, H={args.heads}, d_k={args.head_dim}, window {args.window}, "
          f"dtype {args.dtype} (auto: bfloat16 on CUDA, float32 on CPU)")
    print("| device | backend | pass | T | time (ms) | extra memory (MiB) |")
    print("|---|---|---|---|---|---|")
    for dev, label, mode, T, t, mem in rows:
        print(f"| {dev} | {label} | {mode} | {T} | {t * 1e3:.2f} | {mem / 2**20:.1f} |")
    for dev in devices:
        for mode in ("fwd", "fwd+bwd"):
            ref = {T: (t, m) for d, l, md, T, t, m in rows if d == dev and md == mode
                   and l == "sdpa causal"}
            band = {T: (t, m) for d, l, md, T, t, m in rows if d == dev and md == mode
                    and l == "banded window"}
            for label in ("banded window", "flex window"):
                window = {T: t for d, l, md, T, t, m in rows if d == dev and md == mode and l == label}
                wins = [T for T in sorted(set(ref) & set(window)) if window[T] < ref[T][0]]
                print(f"{dev} {mode}: {label} beats sdpa causal from T={wins[0]}" if wins else
                      f"{dev} {mode}: {label} never beats sdpa causal at these lengths")
            flex = {T: t for d, l, md, T, t, m in rows if d == dev and md == mode
                    and l == "flex causal"}
            for T in sorted(set(ref) & set(flex)):                 # the same T²/2 scores
                print(f"{dev} {mode} T={T}: flex causal / sdpa causal = {flex[T] / ref[T][0]:.2f}x time")
            for T in sorted(set(ref) & set(band)):
                if T >= 4 * args.window:
                    print(f"{dev} {mode} T={T}: banded window / sdpa causal = "
                          f"{band[T][0] / ref[T][0]:.3f}x time, "
                          f"{band[T][1] / max(ref[T][1], 1):.3f}x extra memory")
    write_rows(rows)
    if args.plot:
        plot(rows, args)


OUT_JSON = Path(__file__).resolve().parent / "out" / "attention_cost.json"


def write_rows(rows) -> None:
    """Every case measured so far, replacing the file whole (a reader never meets half
    of it); on a CPU the memory column is 0 until the memory pass has run."""
    OUT_JSON.parent.mkdir(exist_ok=True)
    part = OUT_JSON.with_suffix(".json.part")
    part.write_text(json.dumps([{"device": d, "backend": l, "pass": m, "T": T, "seconds": t,
                                 "extra_bytes": mem} for d, l, m, T, t, mem in rows], indent=1))
    os.replace(part, OUT_JSON)


def plot(rows, args):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, (index, what) in zip(axes, [(4, "time (s)"), (5, "extra memory (bytes)")]):
        for key in sorted({(r[0], r[1], r[2]) for r in rows}):
            pts = [(r[3], r[index]) for r in rows if (r[0], r[1], r[2]) == key]
            ax.plot(*zip(*pts), marker="o", label=" ".join(key))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
    axes[0].set_title(f"O(T²) full causal against O(T·W) window (W={args.window})")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
