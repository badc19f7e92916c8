"""Generation speed at batch 1: this project's decoders (growing KV cache, static
cache, the static step as a CUDA graph on a GPU, no cache) against Hugging Face
transformers' GPT2LMHeadModel.generate (with its cache), same sizes, in the same
process. Also the KV-cache memory for multi-head, GQA and MQA.

    python bench/generate_speed.py                       # baby GPT: 6 layers, 6 heads, 384 wide
    python bench/generate_speed.py --new 256 --rounds 1
    python bench/generate_speed.py --device cuda --no-uncached
"""
from __future__ import annotations

import capability  # noqa: F401  (first: refuses an ATEN_CPU_CAPABILITY this CPU cannot run)

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from model import GPT, ModelConfig  # noqa: E402

VOCAB = 65


def hf_model(L, H, C, ctx):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=ctx, n_embd=C, n_layer=L, n_head=H,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=0, eos_token_id=None, pad_token_id=0)
    return GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa").eval()


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_ours(model, prompt, new, decode):
    sync(prompt.device)
    start = time.perf_counter()
    n = sum(1 for _ in model.generate(prompt, new, temperature=0, decode=decode))
    sync(prompt.device)
    return n / (time.perf_counter() - start)


@torch.no_grad()
def time_hf(model, prompt, new):
    sync(prompt.device)
    start = time.perf_counter()
    out = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                         use_cache=True, pad_token_id=0)
    sync(prompt.device)
    return (out.shape[1] - prompt.shape[1]) / (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new", type=int, nargs="+", default=[256, 1000],
                        help="tokens generated per timed run (a table block each)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="interleaved rounds per generator (the best counts)")
    parser.add_argument("--no-uncached", action="store_true", help="skip the slow no-cache runs")
    parser.add_argument("--device", default="cpu", help="where to generate: cpu, cuda or cuda:N")
    args = parser.parse_args()
    L, H, C = 6, 6, 384
    ctx = 1024
    device = args.device
    torch.manual_seed(0)
    ours = GPT(ModelConfig(vocab_size=VOCAB, n_layer=L, n_head=H, n_embd=C, block_size=ctx,
                           position="learned", bias=True)).eval()
    # sample.py's default where bf16 is native: the weights in bf16 (half the bytes to
    # stream per token; on this CPU they then fit in its 32 MB L3 cache).
    ours_bf16 = GPT(ours.config).eval()
    ours_bf16.load_state_dict(ours.state_dict())
    ours, ours_bf16 = ours.to(device), ours_bf16.to(device, torch.bfloat16)
    hf = hf_model(L, H, C, ctx).to(device)
    prompt = torch.zeros(1, 1, dtype=torch.long, device=device)
    decoders = ["cache", "static"] + (["graph"] if prompt.device.type == "cuda" else [])
    runs = [(f"attnlab, decode={d}", ours, d) for d in decoders]
    runs += [(f"attnlab, decode={d}, bf16 weights", ours_bf16, d) for d in decoders]
    if not args.no_uncached:
        runs.append(("attnlab, no cache", ours, "full"))
    print(f"torch {torch.__version__}, {device}, {torch.get_num_threads()} threads; {L} layers, "
          f"{H} heads, {C} wide, context {ctx}, batch 1, greedy, fp32 unless marked")
    rows = []
    hf_label = "HF GPT2LMHeadModel.generate (cache)"
    for new in args.new:
        time_hf(hf, prompt, 8)                                          # warm-up
        for _, model, decode in runs:
            time_ours(model, prompt, 8, decode)
        best = {hf_label: 0.0, **{label: 0.0 for label, _, _ in runs}}
        for _ in range(args.rounds):                    # interleaved, so drift hits all alike
            best[hf_label] = max(best[hf_label], time_hf(hf, prompt, new))
            for label, model, decode in runs:
                best[label] = max(best[label], time_ours(model, prompt, new, decode))
        base = best[hf_label]
        for label, rate in best.items():
            rows.append((new, label, rate, rate / base))
    print("\n| new tokens | generator | tokens/s | vs HF |")
    print("|---|---|---|---|")
    for new, label, rate, ratio in rows:
        print(f"| {new} | {label} | {rate:,.0f} | {ratio:.2f}x |")

    print("\nKV-cache memory for 1,000 tokens at this size (fp32):")
    print("| attention | n_kv_head | cache bytes | vs multi-head |")
    print("|---|---|---|---|")
    sizes = {}
    for name, n_kv in [("multi-head", 6), ("GQA", 2), ("MQA", 1)]:
        m = GPT(ModelConfig(vocab_size=VOCAB, n_layer=L, n_head=H, n_kv_head=n_kv, n_embd=C,
                            block_size=ctx)).eval()
        cache = m.new_cache(1000)
        with torch.no_grad():
            m(torch.zeros(1, 1000, dtype=torch.long), cache=cache)
        sizes[name] = cache.nbytes()
        print(f"| {name} | {n_kv} | {sizes[name]:,} | {sizes['multi-head'] / sizes[name]:.0f}x smaller |")


if __name__ == "__main__":
    main()
