"""DeepSeek-V3.2's sparse attention on latent attention (model.mechanism=mla_sparse) decoding
after a long cache, its two paths in the same process: every cached latent up-projected and
all but the k chosen keys hidden (masked, the whole-sequence path), against the k chosen
latent rows gathered and attended in MLA's absorbed form (gathered, the decoding path).
Both score every cached indexer key; only the main attention's read differs.

    python bench/sparse_decode.py
    python bench/sparse_decode.py --contexts 1024 4096 16384 --steps 16 --repeats 3

The model is the deepseek-v3.2 preset's (4 layers, 128 wide, 4 heads, k = 32) with its
context raised to hold the cache, in fp32 on one thread, random weights (the time of a
step does not depend on them). The cache is filled by the model itself in chunks; then
each path decodes --steps tokens and forgets them (KVCache.truncate), the paths taking
turns, --repeats times; a cell is the median ms a token, and the two paths' logits are
compared on the same steps. The machine line gives the load average before and after.
"""
from __future__ import annotations

import capability  # noqa: F401  (first: refuses an ATEN_CPU_CAPABILITY this CPU cannot run)

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from capability import cpu_model  # noqa: E402
from engine import cli  # noqa: E402
from model import GPT  # noqa: E402
from model.latent_sparse_attention import LatentSparseAttention  # noqa: E402


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def use_path(model: GPT, masked: bool) -> None:
    """Every sparse layer's decoding step through the masked path, or back to the gathered."""
    for block in model.blocks:
        if isinstance(block.attn, LatentSparseAttention):
            if masked:
                block.attn.gathers = lambda q_len, k, k_len: False
            else:
                block.attn.__dict__.pop("gathers", None)


def steps(model: GPT, cache, tokens: torch.Tensor) -> tuple[float, torch.Tensor]:
    """(ms a token, logits): tokens (1, n) decoded one at a time, then forgotten."""
    started, out = time.perf_counter(), []
    for t in range(tokens.shape[1]):
        out.append(model(tokens[:, t:t + 1], cache=cache).logits)
    elapsed = (time.perf_counter() - started) * 1000 / tokens.shape[1]
    cache.truncate(tokens.shape[1])
    return elapsed, torch.cat(out, 1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384],
                   help="cache lengths (tokens) decoded after")
    p.add_argument("--steps", type=int, default=16, help="tokens each path decodes a turn")
    p.add_argument("--repeats", type=int, default=3,
                   help="turns each path takes, interleaved (the medians are shown)")
    p.add_argument("--chunk", type=int, default=512, help="tokens a pass when filling the cache")
    args = p.parse_args()
    if min(args.contexts) < 1 or args.steps < 1 or args.repeats < 1 or args.chunk < 1:
        raise SystemExit("error: give --contexts, --steps, --repeats and --chunk of at least 1")
    torch.set_num_threads(1)
    base = cli.build("deepseek-v3.2", []).model
    print(f"machine: {cpu_model()}; torch {torch.__version__}, 1 thread, fp32; "
          f"load average {load()}")
    print(f"model: the deepseek-v3.2 preset ({base.n_layer} layers, {base.n_embd} wide, "
          f"{base.n_head} heads, k = {base.sparse_top_k}), context raised to the cache")
    print("| cache tokens | masked ms/token | gathered ms/token (x masked) | largest logit gap |")
    print("|---|---|---|---|")
    generator = torch.Generator().manual_seed(0)
    for context in args.contexts:
        torch.manual_seed(0)
        model = GPT(replace(base, vocab_size=65, block_size=context + args.steps)).eval()
        text = torch.randint(0, 65, (1, context + args.steps), generator=generator)
        cache = model.new_cache(context + args.steps)
        times = {True: [], False: []}
        with torch.no_grad():
            for start in range(0, context, args.chunk):
                model(text[:, start:min(start + args.chunk, context)], cache=cache)
            logits = {}
            for _ in range(args.repeats):
                for masked in (True, False):
                    use_path(model, masked)
                    elapsed, logits[masked] = steps(model, cache, text[:, context:])
                    times[masked].append(elapsed)
        use_path(model, False)
        gap = (logits[True] - logits[False]).abs().max().item()
        slow, fast = statistics.median(times[True]), statistics.median(times[False])
        print(f"| {context:,} | {slow:.1f} | {fast:.1f} ({fast / slow:.2f}x) | {gap:.1e} |",
              flush=True)
    print(f"load average after: {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
