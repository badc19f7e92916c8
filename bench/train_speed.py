"""Training throughput against Hugging Face transformers' GPT-2, same sizes, same
batches, in the same process (so the machine's mood affects both alike).

    python bench/train_speed.py                 # both sizes
    python bench/train_speed.py --sizes small --steps 20

Each step is forward + backward + AdamW update. The models alternate in rounds and
the best round of each counts, which filters out noise from other processes.
"""
from __future__ import annotations

import capability  # noqa: F401  (first: refuses an ATEN_CPU_CAPABILITY this CPU cannot run)

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.device import autocast, peak_flops  # noqa: E402
from model import GPT, ModelConfig  # noqa: E402
from engine.machine import native_bf16 as cpu_has_native_bf16  # noqa: E402

SIZES = {  # name: (n_layer, n_head, n_embd, block_size, batch_size)
    "small": (4, 4, 128, 64, 12),
    "baby": (6, 6, 384, 256, 64),
}
VOCAB = 65


def hf_gpt2(n_layer, n_head, n_embd, block):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=block, n_embd=n_embd, n_layer=n_layer,
                     n_head=n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa")


def ours(n_layer, n_head, n_embd, block, **variant):
    cfg = ModelConfig(vocab_size=VOCAB, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                      block_size=block, **variant)
    return GPT(cfg)


def make_step(model, kind, dtype):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ctx = autocast(torch.device("cpu"), dtype)

    def step(x, y):
        with ctx:
            if kind == "hf":
                loss = model(input_ids=x, labels=x).loss
            else:
                loss = model(x, y).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def measure(step, batches, steps):
    start = time.perf_counter()
    for x, y in batches[:steps]:
        step(x, y)
    return time.perf_counter() - start


def run_size(name, steps, rounds, compiled):
    L, H, C, T, B = SIZES[name]
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, VOCAB, (B, T), generator=g),) * 2 for _ in range(steps)]
    bf16 = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    contenders = {
        "HF GPT2LMHeadModel (sdpa, fp32)": make_step(hf_gpt2(L, H, C, T), "hf", torch.float32),
        "attnlab, GPT-2 layout (fp32)": make_step(      # GPT-2's tanh GELU, as HF's
            ours(L, H, C, T, position="learned", bias=True, mlp="gelu_tanh"), "ours", torch.float32),
        "attnlab, defaults (rope, fp32)": make_step(ours(L, H, C, T), "ours", torch.float32),
        f"attnlab, defaults ({str(bf16)[6:]} autocast)": make_step(ours(L, H, C, T), "ours", bf16),
        f"attnlab, relu² MLP ({str(bf16)[6:]} autocast)": make_step(
            ours(L, H, C, T, mlp="relu2"), "ours", bf16),
    }
    if compiled:
        contenders[f"attnlab, relu² MLP, compiled ({str(bf16)[6:]})"] = make_step(
            torch.compile(ours(L, H, C, T, mlp="relu2")), "ours", bf16)
    precision = {label: "bfloat16" if bf16 == torch.bfloat16 and "bfloat16" in label else "float32"
                 for label in contenders}
    flops = ours(L, H, C, T, position="learned", bias=True).flops_per_token()
    for step in contenders.values():                  # warm up: allocator, kernels
        measure(step, batches, 2)
    best = {k: float("inf") for k in contenders}
    for _ in range(rounds):
        for label, step in contenders.items():
            best[label] = min(best[label], measure(step, batches, steps))
    tokens = steps * B * T
    base = tokens / best["HF GPT2LMHeadModel (sdpa, fp32)"]
    print(f"\n{name}: {L} layers, {H} heads, {C} wide, context {T}, batch {B} "
          f"({steps} steps x {rounds} rounds, best round)")
    print(f"| {'model':<42} | {'tokens/s':>9} | {'vs HF':>6} | MFU (peak of its precision) |")
    print(f"|{'-' * 44}|{'-' * 11}|{'-' * 8}|---|")
    for label in contenders:
        rate = tokens / best[label]
        peak = peak_flops("cpu", precision[label])
        print(f"| {label:<42} | {rate:>9,.0f} | {rate / base:>5.2f}x | "
              f"{rate * flops / peak:.0%} of {peak / 1e12:.2f} TFLOP/s {precision[label]} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES),
                        help="models to time: small (4 x 128, context 64), baby (6 x 384, context 256)")
    parser.add_argument("--steps", type=int, default=0, help="steps per round (default per size)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved rounds per contender (the best counts)")
    parser.add_argument("--no-compile", action="store_true",
                        help="skip the torch.compile row (compiling takes about half a minute)")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"native bf16: {cpu_has_native_bf16()}")
    for name in args.sizes:
        run_size(name, args.steps or {"small": 30, "baby": 3}[name], args.rounds,
                 compiled=not args.no_compile)


if __name__ == "__main__":
    main()
