#!/usr/bin/env bash
# Every GPU figure of docs/benchmarks.md in one go, on one H100/H200-class GPU, inside a
# time limit: the sections run in order of what is least known, each under what is left
# of DEADLINE seconds (default 480), and a section that fails or runs out says so and
# the next one runs. Needs torch with CUDA, transformers, numpy, tokenizers,
# safetensors, tqdm (no wandb, no datasets, no network).
#   1. which SDPA kernel runs (flash expected) for the training shapes in bf16;
#   2. the gpu preset: wall time, val loss at every evaluation, whether the last is the
#      best, and its training time to val 1.45;
#   3. each model card's preset (gpt-oss, qwen3-next, deepseek-v3, deepseek-v3.2, gemma3,
#      kimi-linear) trained briefly on CUDA, then sampled with its cache (deepseek-v3 also
#      with its multi-token prediction drafting): val loss, tokens/s, whether it samples;
#   4. generation tokens/s at batch 1 (growing KV cache, static cache, the static step as a
#      CUDA graph, no cache) against transformers' generate, and whether their tokens agree;
#   5. attention cost in bf16: flash causal against flex causal, and the windows;
#   6. the tests that need a GPU (flex gradients against the float64 reference, CUDA
#      graph decoding, float16 loss scaling);
#   7. training tokens/s and MFU of the baby GPT, eager and compiled;
#   8. --budget 30s on the GPU;
#   9. nanoGPT's recipe (the baby preset) for what time is left, its evaluations so far.
# Usage: bash bench/gpu_check.sh [path/to/tinyshakespeare.txt]
#   RUNS=DIR    where the runs go (default bench/out/gpu_check); the summary is RUNS/summary.txt
#   LOG=FILE    the summary elsewhere;  DEADLINE=SECONDS  the whole check's limit
#   ONLY=WORD   only the sections whose title holds WORD (ONLY=cards: the model cards)
# Dry run on a CPU with tiny settings (checks the script, not the GPU): DRY=1 bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export CORPUS="${1:-data/tinyshakespeare/input.txt.gz}"
export RUNS="${RUNS:-bench/out/gpu_check}"
LOG="${LOG:-$RUNS/summary.txt}"
DEADLINE="${DEADLINE:-480}"
# Refused before any work: on a lent GPU a wrong setting would spend its time for nothing.
if ! [[ "$DEADLINE" =~ ^[0-9]+$ ]] || (( DEADLINE == 0 )); then
    echo "error: DEADLINE is the whole check's limit in seconds (like 480), not '$DEADLINE'" >&2
    exit 2
fi
if ! mkdir -p "$RUNS" 2>/dev/null || ! [[ -w "$RUNS" ]]; then
    echo "error: RUNS=$RUNS is not a folder this script can write; set RUNS to one" >&2
    exit 2
fi
if ! touch "$LOG" 2>/dev/null; then
    echo "error: LOG=$LOG cannot be written; set LOG to a file in a writable folder" >&2
    exit 2
fi
exec > >(tee "$LOG") 2>&1
export WANDB_MODE=disabled PYTHONUNBUFFERED=1
if [[ "${DRY:-}" == 1 ]]; then
    GPU="--config tiny --train.max_iters=40 --train.eval_interval=20"
    BABY="--config tiny --train.max_iters=400 --train.eval_interval=20"
    SIZE="--config tiny --train.max_iters=30"
    BUDGET=20s; LENGTHS="256 512"; DEVICE=cpu; TESTS="flex_gradients or bfloat16 or draws_the_same"
    CARD="--train.max_iters=4 --train.eval_interval=2 --train.eval_iters=2 --model.n_layer=4 --model.n_embd=32 --model.n_head=2 --model.block_size=32"
    CARDS="gpt-oss deepseek-v3"; CARD_TOKENS=20
    SCALE=4                                   # a section's seconds on a GPU, over a dry run's
else
    GPU="--config gpu"; BABY="--config baby"; SIZE="--config gpu --train.max_iters=300"
    BUDGET=30s; LENGTHS="2048 8192 32768"; DEVICE=cuda; TESTS="flex_gradients or cuda_graph or float16"
    CARD="--train.max_iters=300 --train.eval_interval=100 --train.eval_iters=20"
    CARDS="gpt-oss qwen3-next deepseek-v3 deepseek-v3.2 gemma3 kimi-linear"; CARD_TOKENS=500
    SCALE=1
fi
export GPU BABY SIZE BUDGET LENGTHS DEVICE TESTS CARD CARDS CARD_TOKENS

# section NAME SECONDS_NEEDED FUNCTION: runs FUNCTION under what is left of the deadline
# (SIGINT first, so a training run stops with a final evaluation and checkpoint).
section() {
    local left=$((DEADLINE - SECONDS)) need=$(( ($2 + SCALE - 1) / SCALE ))
    if [[ -n "${ONLY:-}" && "$1" != *"$ONLY"* ]]; then
        echo "== $1: skipped (ONLY=$ONLY)"
        return
    fi
    if (( left < need )); then
        echo "== $1: skipped, it needs ${need} s and ${left} s are left of ${DEADLINE} s"
        return
    fi
    echo "== $1 (at ${SECONDS} s)"
    timeout --signal=INT --kill-after=20 "$left" bash -c "$3"
    local rc=$?
    (( rc == 0 )) || echo "  ($1 ended with status $rc$( (( rc == 124 )) && echo ': out of time'))"
}

header() {
[[ $DEVICE == cuda ]] && nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit \
    --format=csv,noheader | sed 's/^/nvidia-smi: /'
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
}

report() {   # run name, wall seconds -> evaluations, last vs best, time to 1.45
python - "$RUNS/$1" "$2" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(f"{sys.argv[1]}/metrics.jsonl")]
evals = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
train_s = {r["step"]: r["elapsed_s"] for r in rows if "elapsed_s" in r}
best = min(evals, key=lambda e: e[1])
print("  val loss:", ", ".join(f"{s}: {v:.4f}" for s, v in evals))
print(f"  best {best[1]:.4f} at step {best[0]}; last {evals[-1][1]:.4f} at step {evals[-1][0]}"
      f" ({'the last is the best' if best == evals[-1] else 'the last is NOT the best'})")
hit = next((s for s, v in evals if v <= 1.45), None)
print(f"  val <= 1.45 first at step {hit}, after {train_s.get(hit, 0):.1f} s of training"
      if hit is not None else "  val <= 1.45 not reached")
print(f"  wall time {float(sys.argv[2]):.1f} s (start-up and evaluations included); training "
      f"time {max(train_s.values(), default=0):.1f} s over {max(train_s, default=0)} steps")
PY
}

preset() {   # name, options
    local start=$SECONDS
    python train.py $2 --data.path="$CORPUS" --train.device="$DEVICE" \
        --train.out_dir="$RUNS" --train.run_name="$1" > "$RUNS/$1.log" 2>&1
    local rc=$?
    grep -E "^device:|time limit|interrupted" "$RUNS/$1.log" | sed 's/^/  /'
    [[ -f "$RUNS/$1/metrics.jsonl" ]] && report "$1" "$((SECONDS - start))"
    (( rc == 0 )) || { tail -3 "$RUNS/$1.log" | sed 's/^/  /'; return $rc; }
}

cards() {   # each card: a short run on the device, then samples from it with its cache
    local card failed=0
    for card in $CARDS; do
        echo "  $card:"
        python train.py --config "$card" $CARD --data.path="$CORPUS" --train.device="$DEVICE" \
            --train.out_dir="$RUNS" --train.run_name="card-$card" > "$RUNS/card-$card.log" 2>&1 \
            || { tail -3 "$RUNS/card-$card.log" | sed 's/^/    /'; failed=1; continue; }
        grep -E "^device:" "$RUNS/card-$card.log" | sed 's/^/    /'
        python - "$RUNS/card-$card/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
evals = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
rates = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
rates = rates[len(rates) // 3:] or rates                # after warm-up
print(f"    val loss at step {evals[-1][0]}: {evals[-1][1]:.4f}; "
      f"{sum(rates) / max(len(rates), 1):,.0f} training tokens/s")
PY
        local ways=cache
        [[ $card == deepseek-v3 ]] && ways="cache mtp"
        for decode in $ways; do
            local start=$SECONDS
            python sample.py --run "$RUNS/card-$card" --device "$DEVICE" --decode "$decode" \
                --prompt "ROMEO:" --max_new_tokens "$CARD_TOKENS" --temperature 0 \
                > "$RUNS/card-$card-$decode.txt" 2> "$RUNS/card-$card-$decode.log" \
                || { tail -3 "$RUNS/card-$card-$decode.log" | sed 's/^/    /'; failed=1; continue; }
            echo "    sampled $CARD_TOKENS tokens with decode=$decode in $((SECONDS - start)) s" \
                 "(start-up included): $(tr '\n' ' ' < "$RUNS/card-$card-$decode.txt" | cut -c1-60)"
            grep -E "^mtp:" "$RUNS/card-$card-$decode.txt" "$RUNS/card-$card-$decode.log" \
                | sed 's/^[^:]*:/    /'
        done
    done
    return $failed
}

generation() {
if [[ ! -f "$RUNS/gpu/metrics.jsonl" ]]; then
    echo "  skipped: no gpu preset run in $RUNS/gpu to decode with (its section did not run)"
    return 0
fi
python - "$RUNS/gpu" "$DEVICE" <<'PY'
import sys, time, torch, transformers
from engine.inference import load_run
transformers.logging.set_verbosity_error()
device = sys.argv[2]
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
model, cfg, tok, _ = load_run(sys.argv[1], "best", device)
prompt = torch.tensor([tok.encode("\n")], device=device)
c = cfg.model
N = c.block_size - 2                          # transformers' GPT-2 stops at its context
modes = ["cache", "static", "graph", "full"] if device == "cuda" else ["cache", "static", "full"]
rows, tokens = [], {}
from model.gpt import _KEPT_STEPS
for dtype in (torch.float32, torch.bfloat16):
    m = model.to(dtype)
    for decode in modes:
        list(m.generate(prompt, 8, temperature=0, decode=decode))     # kernels loaded
        if decode in ("static", "graph"):     # a first call makes its cache (and records)
            _KEPT_STEPS.pop(m, None)
            sync(); start = time.perf_counter()
            list(m.generate(prompt, N, temperature=0, decode=decode))
            sync(); rows.append((f"attnlab, decode={decode}, {str(dtype)[6:]}, first call",
                                 N / (time.perf_counter() - start)))
        best = float("inf")
        for _ in range(2):
            sync(); start = time.perf_counter()
            out = torch.cat(list(m.generate(prompt, N, temperature=0, decode=decode)), 1)
            sync(); best = min(best, time.perf_counter() - start)
        rows.append((f"attnlab, decode={decode}, {str(dtype)[6:]}", N / best))
        tokens[(dtype, decode)] = out
hf_rates = {}
for dtype in (torch.float32, torch.bfloat16):
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=c.vocab_size, n_positions=c.block_size, n_embd=c.n_embd, n_layer=c.n_layer,
        n_head=c.n_head)).to(device, dtype).eval()
    hf.generate(prompt, max_new_tokens=8, do_sample=False)
    best = float("inf")
    for _ in range(2):
        sync(); start = time.perf_counter()
        out = hf.generate(prompt, max_new_tokens=N, min_new_tokens=N, do_sample=False)
        sync(); best = min(best, time.perf_counter() - start)
    hf_rates[dtype] = (out.shape[1] - 1) / best
hf_rate = hf_rates[torch.float32]
print(f"  {N} new tokens, greedy, batch 1, a {c.n_layer} x {c.n_embd} model; the better of two "
      "calls after a first (which makes the static cache and records the graph, kept after)")
for dtype, rate in hf_rates.items():
    print(f"  transformers GPT2LMHeadModel.generate ({str(dtype)[6:]}, cache): {rate:,.0f} tokens/s")
for name, rate in rows:
    print(f"  {name}: {rate:,.0f} tokens/s ({rate / hf_rate:.2f}x generate in fp32, "
          f"{rate / hf_rates[torch.bfloat16]:.2f}x in bf16)")
for dtype in (torch.float32, torch.bfloat16):
    same = [d for d in modes if torch.equal(tokens[(dtype, d)], tokens[(dtype, "cache")])]
    print(f"  {str(dtype)[6:]}: the same tokens as decode=cache: {', '.join(same)}")
PY
}

attention_cost() {
    python bench/attention_cost.py --devices "$DEVICE" --lengths $LENGTHS --repeats 3 \
        --plot "$RUNS/attention_cost.png" > "$RUNS/attention_cost.log" 2>&1
    local rc=$?
    grep -E "^\||beats|never|x time" "$RUNS/attention_cost.log" | sed 's/^/  /'
    (( rc == 0 )) || tail -3 "$RUNS/attention_cost.log" | sed 's/^/  /'
    return $rc
}

gpu_tests() {
    python -m pytest -q -p no:cacheprovider tests/test_attention.py tests/test_decode.py \
        tests/test_faults.py -k "$TESTS" > "$RUNS/tests.log" 2>&1
    local rc=$?
    grep -E "FAILED|Error" "$RUNS/tests.log" | head -10 | sed 's/^/  /'
    tail -1 "$RUNS/tests.log" | sed 's/^/  /'
    return $rc
}

throughput() {
    for compile in false true; do
        python train.py $SIZE --data.path="$CORPUS" --train.device="$DEVICE" \
            --train.compile=$compile --train.eval_interval=10000 --train.eval_iters=2 \
            --train.log_interval=25 --train.out_dir="$RUNS" --train.run_name=speed-$compile \
            > "$RUNS/speed-$compile.log" 2>&1 || { tail -3 "$RUNS/speed-$compile.log"; return 1; }
        python - "$RUNS/speed-$compile/metrics.jsonl" "$compile" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"tokens_per_s"' in l]
rows = rows[len(rows) // 3:] or rows                    # after warm-up and compilation
print(f"  compile={sys.argv[2]}: {sum(r['tokens_per_s'] for r in rows) / len(rows):,.0f} tokens/s, "
      f"MFU {sum(r.get('mfu', 0) for r in rows) / len(rows):.1%}")
PY
    done
}

budget() {
    python train.py --budget "$BUDGET" --data.path="$CORPUS" --train.device="$DEVICE" \
        --train.out_dir="$RUNS" --train.run_name=budget > "$RUNS/budget.log" 2>&1
    local rc=$?
    grep -E "chosen:|done at step|time limit" "$RUNS/budget.log" | sed 's/^/  /'
    (( rc == 0 )) || tail -3 "$RUNS/budget.log" | sed 's/^/  /'
    return $rc
}

export -f header report preset cards generation attention_cost gpu_tests throughput budget
rm -rf "$RUNS"/{gpu,baby,budget,speed-false,speed-true} "$RUNS"/card-*   # each run starts afresh
section "GPU and SDPA kernel" 10 header
section "the gpu preset on tiny Shakespeare" 60 'preset gpu "$GPU"'
section "the model cards on the device, each trained briefly and sampled with its cache" 90 cards
section "generation at batch 1 (the gpu preset's model), against transformers' generate" 20 generation
section "attention cost in bf16 (B=1, H=6, d_k=64, window 256)" 30 attention_cost
section "tests that need a GPU" 30 gpu_tests
section "baby GPT training throughput and MFU (300 steps), eager and compiled" 60 throughput
section "--budget $BUDGET" 60 budget
section "nanoGPT's baby recipe (configs/baby.toml) for the time left" 40 'preset baby "$BABY"'
echo "== done at ${SECONDS} s of ${DEADLINE} s"
