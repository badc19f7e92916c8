"""One lever at a time, at equal wall time: which of the speedrun tricks pay on a CPU.

    python bench/cpu_levers.py                    # every lever, 45 s of training each
    python bench/cpu_levers.py --seconds 20 --only qk_norm relu2
    python bench/cpu_levers.py --steps 700 --seed 1      # equal steps: quality per step

The base is what `--budget 100s` planned on tiny Shakespeare from the cpu preset when
these levers were measured (3 x 96, context 128, batch 16, Muon at 0.013, AdamW at 3e-3,
warmup-stable-decay, bf16 autocast where the CPU has native bf16; since the planner aims
at 10 tokens per parameter it picks 4 x 128 there, the "4x128" row), trained
for a fixed number of seconds with the schedule following the clock; each row changes
one thing. Equal time, not equal steps: a lever that makes steps slower has to earn
that back in loss. Rows land in docs/benchmarks.md; a lever that pays is a
config field the presets use.
"""
from __future__ import annotations

import capability  # noqa: F401  (first: refuses an ATEN_CPU_CAPABILITY this CPU cannot run)

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_recipe import DEFAULT_CORPUS, run  # noqa: E402

BASE = ("--config cpu --model.n_layer=3 --model.n_embd=96 --model.n_head=3 "
        "--train.max_iters=100000 --train.eval_interval=100000 --train.eval_iters=20")

# (name, what it changes, train.py arguments added to the base)
LEVERS = [
    ("base", "3 x 96, ctx 128, batch 16, Muon 0.013, wsd", ""),
    ("cosine", "cosine decay to 0 instead of wsd", "--train.schedule=cosine"),
    ("wsd_0.3", "decay over the last 30% instead of 60%", "--train.decay_frac=0.3"),
    ("muon_0.02", "Muon's rate 0.02 instead of 0.013", "--train.muon_lr=0.02"),
    ("adamw", "AdamW for every weight", "--train.optimizer=adamw"),
    ("qk_norm", "QK-norm", "--model.qk_norm=true"),
    ("softcap", "logits soft-capped at 15", "--model.logit_softcap=15"),
    ("value_embeds", "value embeddings in every layer", "--model.value_embeds=true"),
    ("skips", "U-net skip connections", "--model.skip_connections=true"),
    ("ve_skips", "value embeddings and U-net skips", "--model.value_embeds=true --model.skip_connections=true"),
    ("token_mix", "each token mixed with the 3 before it ahead of attention", "--model.token_mix=4"),
    ("batch_ramp", "batch grows from 4 to 16 over the first 30%", "--train.batch_ramp=0.3"),
    ("untied", "untied output layer", "--model.tie_embeddings=false"),
    ("zero_head", "untied output layer starting at zero",
     "--model.tie_embeddings=false --model.zero_head=true"),
    ("relu2", "ReLU² MLP instead of GELU", "--model.mlp=relu2"),
    ("ctx_64", "context 64, batch 32 (same tokens per step)",
     "--model.block_size=64 --train.batch_size=32"),
    ("fp32", "fp32 instead of bf16 autocast (attention stays fp32 in both)", "--train.dtype=float32"),
    ("compile", "torch.compile", "--train.compile=true"),
    ("4x128", "4 x 128 (the preset's own size)", "--model.n_layer=4 --model.n_embd=128 --model.n_head=4"),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=45.0, help="training time per lever")
    parser.add_argument("--steps", type=int, default=0,
                        help="equal steps instead of equal time: quality per step alone, with "
                             "no say for speed (for a machine whose speed drifts between runs)")
    parser.add_argument("--seed", type=int, default=1337, help="train.seed of every run")
    parser.add_argument("--only", nargs="+", help="lever names (the base always runs)")
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS,
                        help="the text every run trains on (default: tiny Shakespeare, "
                             "data/tinyshakespeare/input.txt.gz)")
    args = parser.parse_args()
    levers = [lv for lv in LEVERS if lv[0] == "base" or not args.only or lv[0] in args.only]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, what, extra in levers:
            length = (f"--train.max_iters={args.steps} --train.eval_interval={args.steps}" if args.steps
                      else f"--train.time_limit={args.seconds}")
            r = run(name, f"{BASE} {length} --train.seed={args.seed} {extra}", args.corpus, Path(tmp))
            rows.append((name, what, extra, r))
            print(f"{name}: {r['steps']} steps, val {r['val']:.4f}, {r['wall']:.1f} s", flush=True)
    base = rows[0][3]["val"]
    length = f"{args.steps} steps" if args.steps else f"{args.seconds:.0f} s"
    print(f"\nEach row: {length} of training on tiny Shakespeare (seed {args.seed}), one change "
          "to the base.")
    print("| lever | change | steps | wall time | val loss | vs base |")
    print("|---|---|---|---|---|---|")
    for name, what, extra, r in rows:
        print(f"| {name} | {what} (`{extra or '-'}`) | {r['steps']} | {r['wall']:.1f} s | "
              f"{r['val']:.4f} | {r['val'] - base:+.4f} |")


if __name__ == "__main__":
    main()
