"""Every CPU figure under both CPU kinds in one go: this CPU as it is ("native"), and
held to AVX2 ("avx2": common/cpu.py's ISA_SETTINGS at their AVX2 values, which make
torch's own kernels, oneDNN and MKL run their AVX2 code, as on a CPU without AVX-512 and
without native bf16).

    python bench/cpu_kinds.py                    # matmuls and training steps (a few minutes)
    python bench/cpu_kinds.py --busy             # and a step with the other cores busy
    python bench/cpu_kinds.py --runs             # and the runs of docs/benchmarks.md (half an hour)
    python bench/cpu_kinds.py --kinds avx2 --runs --nanogpt path/to/nanoGPT

On an AVX2 CPU both kinds are the same machine (the variables only lower a ceiling);
on an AVX-512 BF16 one, the avx2 column is the approximation, to be checked against
the real AVX2 figures in docs/benchmarks.md. Each kind runs in fresh processes (the
variables are read when torch loads), the micro-figures interleaved kind by kind, each
the best of `--repeats`, so that other work on the machine touches both alike.

The figures: the fp32 matmul rate (2048 x 128 @ 128 x 512, the size of a small model's
projections) and the 1024^3 probe engine/device.py uses for MFU, in fp32 and bf16; a
batched (8, 128 x 512) @ (8, 512 x 128) matmul in fp32 and bf16 (Muon's Newton-Schulz
shape for the cpu preset: where emulated bf16 shows); training steps of the cpu and
speedrun-cpu presets (Muon) and of the cpu preset with AdamW, in the precision the
project picks, and in CPU time on one thread (which a shared machine's load barely
moves); with --busy, a cpu-preset step on 1 thread and on all of them while
one process per other core spins; with --runs, `python train.py` (the cpu preset),
`--config speedrun-cpu` to val 1.886 and `--budget 145s`; with --nanogpt, nanoGPT's CPU
recipe first, and `--budget` then gets its wall time under the same kind.
"""
from __future__ import annotations

import capability  # noqa: F401  (first: refuses an ATEN_CPU_CAPABILITY this CPU cannot run)

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from common.cpu import held_to_avx2  # noqa: E402

KINDS = {"native": {}, "avx2": held_to_avx2()}
MICRO = ["capability", "matmul", "bmm", "step", "cputime"]
BUDGET = "145s"              # nanoGPT's CPU recipe's wall time on a 2-core AVX2 CPU


# --- the worker: one figure in this process, printed as one JSON line ----------------

def best_ms(fn, repeats: int, min_s: float = 0.3) -> float:
    """The best of `repeats` rounds, each timing fn over at least min_s, in ms per call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        n, start = 0, time.perf_counter()
        while n < 2 or time.perf_counter() - start < min_s:
            fn()
            n += 1
        best = min(best, (time.perf_counter() - start) / n * 1e3)
    return best


def figure(name: str, repeats: int) -> dict:
    import torch
    from engine.device import pick_dtype, probe_cpu_flops
    from engine.machine import native_bf16 as cpu_has_native_bf16
    cpu = torch.device("cpu")
    if name == "capability":
        from engine.optim import newton_schulz_dtype
        return {"torch": torch.__version__, "threads": torch.get_num_threads(),
                "ATen capability": torch.backends.cpu.get_cpu_capability(),
                "oneDNN bf16": torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                "native bf16 (attnlab)": cpu_has_native_bf16(),
                "autocast, cpu preset": str(pick_dtype("auto", cpu, 128)).removeprefix("torch."),
                "Newton-Schulz in": str(newton_schulz_dtype(cpu)).removeprefix("torch.")}
    if name == "matmul":
        g = torch.Generator().manual_seed(0)
        a, b = torch.randn(2048, 128, generator=g), torch.randn(128, 512, generator=g)
        ms = best_ms(lambda: a @ b, repeats)
        return {"fp32 2048x128 @ 128x512, GFLOP/s": 2 * 2048 * 128 * 512 / ms / 1e6,
                "fp32 1024^3 probe, GFLOP/s": max(probe_cpu_flops("float32")[0] for _ in range(repeats)) / 1e9,
                "bf16 1024^3 probe, GFLOP/s": max(probe_cpu_flops("bfloat16")[0] for _ in range(repeats)) / 1e9}
    if name == "bmm":
        g = torch.Generator().manual_seed(0)
        a, b = torch.randn(8, 128, 512, generator=g), torch.randn(8, 512, 128, generator=g)
        out = {}
        for dtype in (torch.float32, torch.bfloat16):
            x, y = a.to(dtype), b.to(dtype)
            out[f"bmm (8, 128x512 @ 512x128) {str(dtype)[6:]}, ms"] = best_ms(lambda: x @ y, repeats)
        return out
    if name == "step":
        from engine import cli
        from engine.budget import measure
        out = {}
        for label, preset, extra in (("cpu preset (Muon)", "cpu", []),
                                     ("cpu preset, AdamW", "cpu", ["--train.optimizer=adamw"]),
                                     ("speedrun-cpu preset", "speedrun-cpu", [])):
            cfg = cli.build(preset, ["--train.device=cpu", "--model.vocab_size=65", *extra])
            dtype = pick_dtype(cfg.train.dtype, cpu, cfg.model.n_embd)
            rate = max(measure(cfg, cpu, dtype, 2.0) for _ in range(repeats))
            out[f"step, {label}, ms"] = 1e3 / rate
        return out
    if name == "cputime":
        # CPU seconds a step on one thread: what a quiet core would take, nearly whatever
        # else the machine runs (a shared machine's wall times are not).
        from engine import cli
        from engine.optim import configure_optimizer
        from model import GPT
        torch.set_num_threads(1)
        out = {}
        for label, preset, extra, steps in (("cpu preset (Muon)", "cpu", [], 6),
                                            ("speedrun-cpu preset", "speedrun-cpu", [], 20)):
            cfg = cli.build(preset, ["--train.device=cpu", "--model.vocab_size=65", *extra])
            model = GPT(cfg.model)
            opt = configure_optimizer(model, cfg.train, cpu)
            scaler = torch.amp.GradScaler("cpu", enabled=False)
            x = torch.randint(0, 65, (cfg.train.batch_size, cfg.model.block_size),
                              generator=torch.Generator().manual_seed(0))

            def step():
                model(x, x).loss.backward()
                opt.step(scaler)
                opt.zero_grad()
            step()
            start = time.process_time()
            for _ in range(steps):
                step()
            out[f"step, {label}, 1 thread, CPU ms"] = (time.process_time() - start) / steps * 1e3
        return out
    if name.startswith("busy"):
        # One spinning process per other core, as a browser or a build would keep them.
        from engine import cli
        from engine.budget import measure
        threads = int(name.split(":")[1])
        spin = [subprocess.Popen([sys.executable, "-c", "while 1: pass"])
                for _ in range(max(1, (os.cpu_count() or 2) - 1))]
        try:
            torch.set_num_threads(threads)
            cfg = cli.build("cpu", ["--train.device=cpu", "--model.vocab_size=65"])
            dtype = pick_dtype(cfg.train.dtype, cpu, cfg.model.n_embd)
            rate = max(measure(cfg, cpu, dtype, 3.0) for _ in range(repeats))
        finally:
            for p in spin:
                p.kill()
                p.wait()
        wait = os.environ.get("OMP_WAIT_POLICY", "unset").lower()
        return {f"step, cpu preset, other cores busy, {threads} thread(s), wait {wait}, ms": 1e3 / rate}
    raise SystemExit(f"unknown figure {name!r}")


# --- the parent: each figure in a fresh process per kind, then one table -------------

def in_kind(kind: str, args: list[str], env_extra: dict | None = None) -> subprocess.CompletedProcess:
    """Run under the kind's settings, with torch's threads waiting as train.py has them."""
    from common.cpu import wait_passively_if_busy
    env = {**os.environ, **KINDS[kind], "WANDB_MODE": "disabled", **(env_extra or {})}
    wait_passively_if_busy(env)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True)


def worker(kind: str, name: str, repeats: int, env_extra: dict | None = None) -> dict:
    proc = in_kind(kind, [__file__, "--figure", name, "--repeats", str(repeats)], env_extra)
    if proc.returncode:
        raise SystemExit(f"{name} under {kind} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def train_runs(kind: str, corpus: Path, tmp: Path, budget: str = BUDGET) -> dict:
    """The CPU runs of docs/benchmarks.md under this kind: wall time and val loss of each;
    `budget` is nanoGPT's wall time under this kind when it ran first."""
    from cpu_recipe import run
    env = KINDS[kind]
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        default = run(f"{kind}-cpu", "--config cpu", corpus, tmp)
        speed = run(f"{kind}-speedrun", "--config speedrun-cpu", corpus, tmp)
        planned = run(f"{kind}-budget", f"--budget {budget}", corpus, tmp)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    reached = [s for s, v in speed["curve"] if v <= 1.886]
    return {"python train.py (cpu preset), wall s": default["wall"],
            "python train.py (cpu preset), val": default["val"],
            "speedrun-cpu to 1.886, wall s": speed["wall"] if reached else float("nan"),
            "speedrun-cpu, val": speed["val"],
            "--budget, s": budget,
            "--budget, val (whole split)": planned["val"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS),
                        help="native (this CPU as it is), avx2 (torch, oneDNN and MKL held to AVX2)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per micro-figure (best counts)")
    parser.add_argument("--busy", action="store_true", help="also time a step with the other cores busy")
    parser.add_argument("--runs", action="store_true", help="also the train.py runs of docs/benchmarks.md")
    parser.add_argument("--nanogpt", type=Path, help="with --runs: a nanoGPT checkout, its CPU recipe too")
    parser.add_argument("--corpus", type=Path,
                        default=ROOT / "data" / "tinyshakespeare" / "input.txt.gz",
                        help="with --runs: the text they and nanoGPT train on (default: tiny "
                             "Shakespeare, data/tinyshakespeare/input.txt.gz)")
    parser.add_argument("--figure", help=argparse.SUPPRESS)       # the worker's entry
    args = parser.parse_args()
    if args.figure:
        print(json.dumps(figure(args.figure, args.repeats)))
        return
    from common.cpu import wait_passively_if_busy
    wait_passively_if_busy()            # on a busy machine nanoGPT's runs and ours wait alike
    import platform
    import torch
    from common.cpu import vector_flags
    from engine.device import cpu_name
    print(f"cpu: {cpu_name()}, {os.cpu_count()} logical cores; flags: {vector_flags()}")
    print(f"torch {torch.__version__}, python {platform.python_version()}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}, load average {os.getloadavg()[0]:.2f} at start")
    table: dict[str, dict[str, object]] = {}

    def add(kind, values):
        for key, value in values.items():
            table.setdefault(key, {})[kind] = value

    names = MICRO + ([f"busy:{n}" for n in (1, os.cpu_count() or 2)] if args.busy else [])
    for name in names:                                # interleaved: each figure, kind by kind
        for kind in args.kinds:
            add(kind, worker(kind, name, args.repeats))
            print(f"  {name} under {kind}: done", file=sys.stderr, flush=True)
    if args.busy:                                     # OpenMP's own default: spinning
        for kind in args.kinds:
            add(kind, worker(kind, f"busy:{os.cpu_count() or 2}", args.repeats,
                             {"OMP_WAIT_POLICY": "ACTIVE"}))
    if args.runs:
        sys.path.insert(0, str(ROOT / "bench"))
        with tempfile.TemporaryDirectory() as tmp:
            for kind in args.kinds:
                # nanoGPT first, so that --budget gets its wall time under the same kind in
                # the same sitting: the comparison the targets are stated for.
                budget = BUDGET
                if args.nanogpt:
                    from cpu_speedrun import nanogpt_curve, run_nanogpt
                    saved = dict(os.environ)
                    os.environ.update(KINDS[kind])
                    try:
                        log = Path(tmp) / f"nanogpt-{kind}.log"
                        run_nanogpt(args.nanogpt, args.corpus, log)
                    finally:
                        os.environ.clear()
                        os.environ.update(saved)
                    t, _, v = nanogpt_curve(log)[-1]
                    budget = f"{t:.0f}s"
                    add(kind, {"nanoGPT CPU recipe, wall s": t, "nanoGPT CPU recipe, val": v})
                runs = train_runs(kind, args.corpus, Path(tmp), budget)
                add(kind, runs)
                if args.nanogpt:
                    add(kind, {"speedrun-cpu to 1.886 / nanoGPT's time":
                               runs["speedrun-cpu to 1.886, wall s"] / t})
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end\n")
    print("| figure | " + " | ".join(args.kinds) + " |")
    print("|---|" + "---|" * len(args.kinds))
    for key, by_kind in table.items():
        cells = [by_kind.get(k, "-") for k in args.kinds]
        cells = [f"{c:,.4g}" if isinstance(c, float) else str(c) for c in cells]
        print(f"| {key} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
