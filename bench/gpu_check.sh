#!/usr/bin/env bash
# Every GPU figure of docs/benchmarks.md in one go, under 8 minutes on one H100/H200-class GPU.
# Needs torch with CUDA, transformers, numpy, tokenizers, safetensors, tqdm (no wandb,
# no datasets, no network).
#   1. which SDPA kernel runs (flash expected) for the training shapes in bf16;
#   2. the gpu preset: wall time, val loss at every evaluation, whether the last is the
#      best, and its time to 1.45; nanoGPT's recipe (the baby preset) beside it;
#   3. training tokens/s and MFU of the baby GPT, eager and compiled;
#   4. --budget 30s on the GPU;
#   5. generation tokens/s at batch 1 (growing KV cache, static cache, the static step as a
#      CUDA graph, no cache) against transformers' generate, and whether their tokens agree;
#   6. attention cost in bf16 (where the window starts to beat flash causal);
#   7. the tests that need a GPU (flex gradients against the float64 reference).
# Usage: bash bench/gpu_check.sh [path/to/tinyshakespeare.txt]
# Dry run on a CPU with tiny settings (checks the script, not the GPU): DRY=1 bash bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
CORPUS="${1:-data/tinyshakespeare/input.txt.gz}"
OUT="${OUT:-bench/out}/gpu_check"
mkdir -p "$OUT"
export WANDB_MODE=disabled PYTHONUNBUFFERED=1
if [[ "${DRY:-}" == 1 ]]; then
    GPU=(--config tiny --train.max_iters=40 --train.eval_interval=20)
    BABY=(--config tiny --train.max_iters=40 --train.eval_interval=20)
    SIZE=(--config tiny --train.max_iters=30)
    BUDGET=20s; LENGTHS="256 512"; DEVICE=cpu; TESTS=(-k "flex_gradients or bfloat16 or draws_the_same")
else
    GPU=(--config gpu); BABY=(--config baby); SIZE=(--config gpu --train.max_iters=300)
    BUDGET=30s; LENGTHS="1024 4096 8192 16384 32768"; DEVICE=cuda; TESTS=(-k "flex_gradients or cuda_graph")
fi

python - "$DEVICE" <<'PY'
import sys, torch
if sys.argv[1] == "cuda":
    from torch.nn.attention import SDPBackend, sdpa_kernel
    assert torch.cuda.is_available(), "no CUDA GPU"
    print(f"gpu: {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16: {torch.cuda.is_bf16_supported()}")
    q = torch.randn(8, 6, 256, 64, device="cuda", dtype=torch.bfloat16)
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        print("sdpa: the FlashAttention kernel runs for the training shapes (bf16, causal)")
    except RuntimeError as err:
        print(f"sdpa: FlashAttention NOT available: {err}")
else:
    print(f"dry run on the CPU, torch {torch.__version__}")
PY

report() {   # run name -> evaluations, last vs best, wall time
python - "$OUT/$1" "$2" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(f"{sys.argv[1]}/metrics.jsonl")]
evals = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
best = min(evals, key=lambda e: e[1])
print("  val loss:", ", ".join(f"{s}: {v:.4f}" for s, v in evals))
print(f"  best {best[1]:.4f} at step {best[0]}; last {evals[-1][1]:.4f} at step {evals[-1][0]}"
      f" ({'the last is the best' if best == evals[-1] else 'the last is NOT the best'})")
hit = next((s for s, v in evals if v <= 1.45), None)
print(f"  val <= 1.45 first at step {hit}" if hit is not None else "  val <= 1.45 not reached")
print(f"  wall time {float(sys.argv[2]):.1f} s (start-up included); training time "
      f"{max(r.get('elapsed_s', 0) for r in rows):.1f} s")
PY
}

for preset in gpu baby; do
    echo "== the $preset preset on tiny Shakespeare"
    args=("${GPU[@]}"); [[ $preset == baby ]] && args=("${BABY[@]}")
    start=$(date +%s.%N)
    python train.py "${args[@]}" --data.path="$CORPUS" --train.device="$DEVICE" \
        --train.out_dir="$OUT" --train.run_name="$preset" > "$OUT/$preset.log" 2>&1
    report "$preset" "$(python -c "print($(date +%s.%N) - $start)")"
done

echo "== baby GPT training throughput and MFU (300 steps), eager and compiled"
for compile in false true; do
    python train.py "${SIZE[@]}" --data.path="$CORPUS" --train.device="$DEVICE" \
        --train.compile=$compile --train.eval_interval=10000 --train.eval_iters=2 \
        --train.log_interval=25 --train.out_dir="$OUT" --train.run_name=speed-$compile \
        > "$OUT/speed-$compile.log" 2>&1
    python - "$OUT/speed-$compile/metrics.jsonl" "$compile" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"tokens_per_s"' in l]
rows = rows[2:] or rows                                      # after warm-up and compile
print(f"  compile={sys.argv[2]}: {sum(r['tokens_per_s'] for r in rows) / len(rows):,.0f} tokens/s, "
      f"MFU {sum(r.get('mfu', 0) for r in rows) / len(rows):.1%}")
PY
done

echo "== --budget $BUDGET"
python train.py --budget "$BUDGET" --data.path="$CORPUS" --train.device="$DEVICE" \
    --train.out_dir="$OUT" --train.run_name=budget > "$OUT/budget.log" 2>&1 || true
grep -E "chosen:|done at step|time limit" "$OUT/budget.log" | sed 's/^/  /' || tail -3 "$OUT/budget.log"

echo "== generation at batch 1 (the gpu preset's model), against transformers' generate"
python - "$OUT/gpu" "$DEVICE" <<'PY'
import sys, time, torch, transformers
from engine.inference import load_run
transformers.logging.set_verbosity_error()
device = sys.argv[2]
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
model, cfg, tok, _ = load_run(sys.argv[1], "best", device)
prompt = torch.tensor([tok.encode("\n")], device=device)
c = cfg.model
hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
    vocab_size=c.vocab_size, n_positions=c.block_size, n_embd=c.n_embd, n_layer=c.n_layer,
    n_head=c.n_head)).to(device).eval()
N = c.block_size - 2                          # transformers' GPT-2 stops at its context
modes = ["cache", "static", "graph", "full"] if device == "cuda" else ["cache", "static", "full"]
rows, tokens = [], {}
for dtype in (torch.float32, torch.bfloat16):
    m = model.to(dtype)
    for decode in modes:
        list(m.generate(prompt, 8, temperature=0, decode=decode))
        sync(); start = time.perf_counter()
        out = torch.cat(list(m.generate(prompt, N, temperature=0, decode=decode)), 1)
        sync(); rows.append((f"attnlab, decode={decode}, {str(dtype)[6:]}",
                             N / (time.perf_counter() - start)))
        tokens[(dtype, decode)] = out
hf.generate(prompt, max_new_tokens=8, do_sample=False)
sync(); start = time.perf_counter()
out = hf.generate(prompt, max_new_tokens=N, min_new_tokens=N, do_sample=False)
sync(); hf_rate = (out.shape[1] - 1) / (time.perf_counter() - start)
print(f"  {N} new tokens, greedy, batch 1")
print(f"  transformers GPT2LMHeadModel.generate (fp32, cache): {hf_rate:,.0f} tokens/s")
for name, rate in rows:
    print(f"  {name}: {rate:,.0f} tokens/s ({rate / hf_rate:.2f}x)")
for dtype in (torch.float32, torch.bfloat16):
    same = [d for d in modes if torch.equal(tokens[(dtype, d)], tokens[(dtype, "cache")])]
    print(f"  {str(dtype)[6:]}: the same tokens as decode=cache: {', '.join(same)}")
PY

echo "== attention cost in bf16 (B=1, H=6, d_k=64, window 256)"
python bench/attention_cost.py --devices "$DEVICE" --lengths $LENGTHS --repeats 3 \
    --plot "$OUT/attention_cost.png" 2>&1 | grep -E "^\||beats|never" | sed 's/^/  /'

echo "== tests that need a GPU"
python -m pytest -q -p no:cacheprovider tests/test_attention.py tests/test_decode.py "${TESTS[@]}" 2>&1 | tail -2 | sed 's/^/  /'
