"""Self-speculative decoding with a model's multi-token prediction module (sample.py
--decode mtp) against plain decoding from the growing cache, greedy, batch 1, in the
same process: tokens per second, their ratio, the share of drafts kept, and whether
the tokens are the same (greedy: they must be).

    python train.py --config cpu --model.mtp_depth=1 --train.out_dir=out/mtp
    python bench/mtp_decode.py --run out/mtp
    python bench/mtp_decode.py --run out/mtp --new 200 --repeats 5 --prompts "ROMEO:" "The "

The two decoders take turns, plain first, each repeat over every prompt, so a change in
the machine's load falls on both alike; the speed is the median of the repeats and the
ratio the median of the repeats' own ratios. The machine line gives the load average
before and after.
"""
from __future__ import annotations

import capability  # noqa: F401  (first: refuses an ATEN_CPU_CAPABILITY this CPU cannot run)

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.inference import encode_prompt, load_run  # noqa: E402
from engine.machine import describe_cpu  # noqa: E402
from capability import cpu_model  # noqa: E402


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def decode(model, prompt, new: int, how: str) -> tuple[torch.Tensor, float]:
    """The greedy tokens and the seconds they took."""
    start = time.perf_counter()
    tokens = torch.cat(list(model.generate(prompt, new, temperature=0, decode=how)), 1)
    return tokens, time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="a run trained with model.mtp_depth >= 1")
    p.add_argument("--prompts", nargs="+", default=["ROMEO:", "First Citizen:\n", "The king "],
                   help="prompts decoded from, each in turn")
    p.add_argument("--new", type=int, default=200, help="tokens decoded from each prompt")
    p.add_argument("--repeats", type=int, default=3, help="interleaved turns of each decoder")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    args = p.parse_args()
    if args.repeats < 1 or args.new < 2:
        raise SystemExit("error: give --repeats of at least 1 and --new of at least 2")
    torch.set_num_threads(args.threads)
    model, cfg, tokenizer, _ = load_run(args.run)
    if getattr(model, "mtp", None) is None:
        raise SystemExit(f"error: {args.run} has no multi-token prediction module; train it "
                         "with --model.mtp_depth=1")
    prompts = [torch.tensor([encode_prompt(tokenizer, text)]) for text in args.prompts]
    m = cfg.model
    print(f"machine: {cpu_model()} ({describe_cpu()}); torch {torch.__version__}, "
          f"{args.threads} thread(s), {args.repeats} repeat(s); load average {load()}")
    print(f"model: {m.n_layer} layers, {m.n_embd} wide, context {m.block_size}, "
          f"mtp_depth {m.mtp_depth}; {len(prompts)} prompts x {args.new} tokens, greedy")
    decode(model, prompts[0], 8, "cache")                  # warm-up, untimed
    decode(model, prompts[0], 8, "mtp")
    speed = {"cache": [], "mtp": []}
    kept = drafted = 0
    same = True
    for _ in range(args.repeats):
        seconds = {"cache": 0.0, "mtp": 0.0}
        for prompt in prompts:
            plain, took = decode(model, prompt, args.new, "cache")
            seconds["cache"] += took
            spec, took = decode(model, prompt, args.new, "mtp")
            seconds["mtp"] += took
            kept, drafted = kept + model.mtp.accepted, drafted + model.mtp.drafted
            same = same and torch.equal(plain, spec)
        for how in speed:
            speed[how].append(len(prompts) * args.new / seconds[how])
    ratio = statistics.median(b / a for a, b in zip(speed["cache"], speed["mtp"]))
    print(f"plain (cache): {statistics.median(speed['cache']):,.0f} tokens/s")
    print(f"mtp:           {statistics.median(speed['mtp']):,.0f} tokens/s ({ratio:.2f}x plain); "
          f"drafts kept {kept} of {drafted} ({kept / max(drafted, 1):.1%}); "
          f"same tokens: {'yes' if same else 'NO'}")
    print(f"load average after: {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
