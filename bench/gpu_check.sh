#!/usr/bin/env bash
# One prepared check for a CUDA GPU machine, under 8 minutes on one H100/H200-class GPU:
#   1. which SDPA kernel runs (flash expected), bf16 and compile on;
#   2. training tokens/s and MFU of the baby GPT (6 layers, 6 heads, 384 wide, context 256);
#   3. time to val loss 1.47 on tiny Shakespeare (nanoGPT: about 3 minutes on an A100);
#   4. generation tokens/s with the KV cache.
# Usage: bash bench/gpu_check.sh [path/to/tinyshakespeare.txt]
set -euo pipefail
cd "$(dirname "$0")/.."
CORPUS="${1:-../shared/data/tinyshakespeare.txt}"
OUT="${OUT:-bench/out}/gpu_check"
mkdir -p "$OUT"
export WANDB_MODE=disabled

python - <<'PY'
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
import torch.nn.functional as F
assert torch.cuda.is_available(), "no CUDA GPU"
print(f"gpu: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
      f"bf16 supported: {torch.cuda.is_bf16_supported()}")
q = torch.randn(8, 6, 256, 64, device="cuda", dtype=torch.bfloat16)
try:
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    print("sdpa: the FlashAttention kernel runs for the training shapes (bf16, causal)")
except RuntimeError as err:
    print(f"sdpa: FlashAttention NOT available here: {err}")
PY

echo "== baby GPT, bf16 + compile: throughput and MFU (300 steps)"
python train.py --config gpu --data.path="$CORPUS" --train.compile=true --train.max_iters=300 \
    --train.eval_interval=300 --train.eval_iters=20 --train.log_interval=50 \
    --train.out_dir="$OUT" --train.run_name=throughput > "$OUT/throughput.log" 2>&1
python - "$OUT/throughput/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"tokens_per_s"' in l][1:]   # skip compile
print(f"training: {sum(r['tokens_per_s'] for r in rows) / len(rows):,.0f} tokens/s, "
      f"MFU {sum(r.get('mfu', 0) for r in rows) / len(rows):.1%} (bf16 peak from the table)")
PY

echo "== time to val loss 1.47 on tiny Shakespeare"
start=$(date +%s.%N)
python train.py --config gpu --data.path="$CORPUS" --train.compile=true --train.max_iters=5000 \
    --train.eval_interval=100 --train.eval_iters=50 --train.target_val_loss=1.47 \
    --train.out_dir="$OUT" --train.run_name=to-1.47 > "$OUT/to-1.47.log" 2>&1 || true
end=$(date +%s.%N)
grep -E "reached val loss|done at step" "$OUT/to-1.47.log" || tail -3 "$OUT/to-1.47.log"
python -c "print(f'wall time, start-up included: {float($end) - float($start):.1f} s')"

echo "== generation"
python - "$OUT/to-1.47" <<'PY'
import sys, time, torch
from engine.inference import load_run
model, cfg, tok, _ = load_run(sys.argv[1], "best", "cuda")
model = model.to(torch.bfloat16)
prompt = torch.tensor([tok.encode("\n")], device="cuda")
for use_cache in (True, False):
    list(model.generate(prompt, 16, temperature=0, use_cache=use_cache))
    torch.cuda.synchronize(); start = time.perf_counter()
    n = sum(1 for _ in model.generate(prompt, 500, temperature=0, use_cache=use_cache))
    torch.cuda.synchronize()
    print(f"generation ({'KV cache' if use_cache else 'no cache'}, bf16, batch 1): "
          f"{n / (time.perf_counter() - start):,.0f} tokens/s")
PY
