"""Mutation testing: plant each of a list of plausible one-line bugs and check that
some test fails on it.

    python bench/mutation_report.py                  # every mutation (about 10 minutes)
    python bench/mutation_report.py --only rope      # those whose name contains "rope"

Each mutation replaces one exact line fragment in one file of a fresh copy of the
repository (the tracked files, in a temporary folder: the working tree is never
touched) and runs the tests that cover that file. A mutation whose fragment is no
longer in the file is reported as stale, so the list cannot silently rot. The table
it prints goes in docs/testing.md.
"""
from __future__ import annotations

import capability  # noqa: F401  (first: refuses an ATEN_CPU_CAPABILITY this CPU cannot run)

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ATTN = "tests/test_attention.py"
MODEL = "tests/test_model.py"
POS = "tests/test_positions.py"
SAMP = "tests/test_sampling.py"
PREP = "tests/test_prepare.py"
INTEROP = "tests/test_interop.py -k 'export_loads or imports_with'"
DECODE = "tests/test_decode.py"

# (name, file, exact fragment, replacement, tests)
MUTATIONS = [
    ("GQA: repeat instead of repeat_interleave", "model/attention.py",
     "k = k.repeat_interleave(H // H_kv, dim=1)", "k = k.repeat(1, H // H_kv, 1, 1)", ATTN),
    ("sampler always returns the argmax", "model/sampling.py",
     "return torch.multinomial(probs, 1, generator=generator)", "return probs.argmax(-1, keepdim=True)", SAMP),
    ("RoPE on queries only", "model/attention.py",
     "        k = positions.rotate_in_pass(k, mask.q_start, mask.shared)\n", "", ATTN),
    ("KV-cache position offset + 1", "model/gpt.py",
     "start = cache.length", "start = cache.length + 1", MODEL),
    ("static cache ring one slot short", "model/cache.py",
     "return torch.where(pos < G, pos, G + (pos - G) % self.window)",
     "return torch.where(pos < G, pos, G + (pos - G) % (self.window - 1))", DECODE),
    ("static step does not hide empty slots", "model/attention.py",
     "        if self.on_device:                         # empty slots and the window: mask always\n            return False\n",
     "", DECODE),
    ("static step leaves its slot's position stale", "model/cache.py",
     "        self.slot_pos.index_copy_(0, self._slot, self.length)\n", "", DECODE),
    ("static load drops the oldest visible key", "model/cache.py",
     "keep = (pos > cache.length - self.window) | (pos < self.n_global)",
     "keep = (pos > cache.length - self.window + 1) | (pos < self.n_global)", DECODE),
    ("RoPE at a device position off by one", "model/positions.py",
     "pos = (start + torch.arange(T, device=x.device)).float()\n            angle",
     "pos = (start + 1 + torch.arange(T, device=x.device)).float()\n            angle", DECODE),
    ("wsd decays from the start", "engine/optim.py",
     "return 1.0 if progress <= held else max(0.0, (1.0 - progress) / t.decay_frac)",
     "return max(0.0, 1.0 - progress)", "tests/test_optim.py"),
    ("QK-norm over the heads, not d_k", "model/attention.py",
     "return F.rms_norm(x, (x.shape[-1],))",
     "return F.rms_norm(x.transpose(1, 3), (x.shape[1],)).transpose(1, 3)",
     f"{MODEL} -k qk_norm"),
    ("soft-cap without the inner division", "model/gpt.py",
     "logits = cap * torch.tanh(logits / cap)",
     "logits = cap * torch.tanh(logits)", f"{MODEL} -k softcap"),
    ("auto takes the band from 2W", "engine/machine.py",
     "if window and T >= BAND_PAYS_FROM * window:", "if window and T >= 2 * window:",
     "tests/test_machine.py -k band"),
    ("the CPU peak cache is never read", "engine/device.py",
     "    if kept and kept >= at_least:\n        return kept\n",
     "", "tests/test_faults.py -k probe"),
    ("the CPU peak cache folder never made", "engine/device.py",
     "            path.parent.mkdir(parents=True, exist_ok=True)\n", "", "tests/test_faults.py -k probe"),
    ("a CPU peak probed on a busy machine kept", "engine/device.py",
     "quiet = other is None or other < BUSY_CORES", "quiet = True", "tests/test_faults.py -k busy"),
    ("a stale CPU peak never probed again", "engine/device.py",
     'if self.peak and rate > self.peak and self.device_type == "cpu" and not self.reprobed:',
     "if False:", "tests/test_faults.py -k stale"),
    ("an MFU over 100% shown", "engine/device.py",
     "return None if share is None or share > 1 else share", "return share", "tests/test_faults.py -k stale"),
    ("value embedding of layer 0 everywhere", "model/gpt.py",
     "value_embed = self.value_embeds[i](idx)", "value_embed = self.value_embeds[0](idx)", f"{MODEL} -k unet"),
    ("U-net skip from the last, not the mirror, block", "model/extras.py",
     "return x + weights[mirror] * saved[mirror] if mirror < len(saved) else x",
     "return x + weights[mirror] * saved[-1] if mirror < len(saved) else x", f"{MODEL} -k unet"),
    ("CPU bf16 attention without 1/sqrt(d_k)", "model/attention.py",
     "scores = (q @ k.transpose(-2, -1)) / math.sqrt(d_k)", "scores = q @ k.transpose(-2, -1)",
     "tests/test_machine.py -k bf16_backends"),
    ("batch ramp takes the tail of the batch", "engine/loop.py",
     "x, y = x[:batch], y[:batch]", "x, y = x[-batch:], y[-batch:]", "tests/test_optim.py -k ramp"),
    ("window rule < becomes <=", "model/attention.py",
     "near = (q - k) < window", "near = (q - k) <= window", ATTN),
    ("no 1/sqrt(d_k) in eager", "model/attention.py",
     "scores = (q @ k.transpose(-2, -1)) / math.sqrt(d_k)", "scores = (q @ k.transpose(-2, -1))", ATTN),
    ("causal rule k < q (no self)", "model/attention.py", "ok = k <= q", "ok = k < q", ATTN),
    ("global tokens k <= n_global", "model/attention.py",
     "near = near | (k < n_global)", "near = near | (k <= n_global)", ATTN),
    ("top-p > instead of >=", "model/sampling.py",
     "drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= top_p",
     "drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) > top_p", SAMP),
    ("top-p drops the token that reaches p", "model/sampling.py",
     "drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= top_p",
     "drop_sorted = cum >= top_p", SAMP),
    ("temperature ignored", "model/sampling.py",
     "    logits = logits / temperature\n", "\n", SAMP),
    ("top-k drops the k-th", "model/sampling.py",
     "logits.masked_fill(logits < kth", "logits.masked_fill(logits <= kth", SAMP),
    ("ALiBi slope sign flipped", "model/positions.py",
     "return -slopes.view(-1, *([1] * distance.dim())) * distance",
     "return slopes.view(-1, *([1] * distance.dim())) * distance", f"{POS} {ATTN}"),
    ("ALiBi slopes of the next power of two", "model/positions.py",
     "low = 2 ** math.floor(math.log2(n_head))", "low = 2 ** math.ceil(math.log2(n_head))", POS),
    ("YaRN ramp bounds swapped", "model/positions.py",
     "keep = ((turns - 1.0) / (32.0 - 1.0)).clamp(0.0, 1.0)",
     "keep = ((turns - 32.0) / (1.0 - 32.0)).clamp(0.0, 1.0)", POS),
    ("NTK base exponent d/(d-1)", "model/positions.py",
     "base = config.rope_theta * config.rope_factor ** (d / (d - 2))",
     "base = config.rope_theta * config.rope_factor ** (d / (d - 1))", POS),
    ("linear scaling multiplies", "model/positions.py",
     "return inv_freq / config.rope_factor, 1.0", "return inv_freq * config.rope_factor, 1.0", POS),
    ("RoPE pair sign", "model/positions.py",
     "return (x * cos2).addcmul_(torch.cat((x2, x1), dim=-1), sin2)",
     "return (x * cos2).addcmul_(torch.cat((x2, x1), dim=-1), -sin2)", f"{POS} {ATTN}"),
    ("sinusoidal sin/cos swapped", "model/positions.py",
     "pe[:, 0::2] = torch.sin(angle)", "pe[:, 0::2] = torch.cos(angle)", POS),
    ("sinusoidal no sqrt(d) scale", "model/positions.py",
     "return x * math.sqrt(d) + pe.to(x.dtype)", "return x + pe.to(x.dtype)", POS),
    ("rolling cache keeps one too few", "model/cache.py",
     "recent = min(self.window - 1, self.stored - g)", "recent = min(self.window - 2, self.stored - g)", MODEL),
    ("cache forgets to advance", "model/cache.py",
     "        self.stored += T\n        self.length += T", "        self.stored += T", MODEL),
    ("banded block keys offset", "model/attention.py",
     "k_pos = torch.arange(-W, n * W, device=device).unfold(0, 2 * W, W)",
     "k_pos = torch.arange(-W + 1, n * W + 1, device=device).unfold(0, 2 * W, W)", ATTN),
    ("pre-norm dropped from the MLP", "model/layers.py",
     "x = x + self.mlp(self.norm_mlp(x))", "x = x + self.mlp(x)", MODEL),
    ("residual dropped around attention", "model/layers.py",
     "        x = x + a\n", "        x = a\n", MODEL),
    ("SwiGLU gate and up swapped", "model/layers.py",
     "return self.dropout(self.proj(F.silu(gate) * up))",
     "return self.dropout(self.proj(F.silu(up) * gate))", INTEROP),
    ("loss on unshifted targets", "data/tokens.py",
     "return window[:, :-1], window[:, 1:]", "return window[:, :-1], window[:, :-1]", "tests/test_data.py"),
    ("shard header count off by one", "data/shards.py",
     "HEADER.pack(MAGIC, VERSION, self.dtype.itemsize, self.filled)",
     "HEADER.pack(MAGIC, VERSION, self.dtype.itemsize, self.filled - 1)", PREP),
    ("validation cut inside a character", "data/sources.py",
     "    while at < len(block) and 0x80 <= block[at] < 0xC0:", "    while False:", PREP),
    ("record split every k+1-th", "data/sources.py",
     'lambda i: "val" if i % k == k - 1 else "train"', 'lambda i: "val" if i % k == 0 else "train"', PREP),
    ("interop: NeoX q/k/v not interleaved", "engine/interop.py",
     'out[theirs + hf + ".weight"] = _neox_qkv(w, cfg) if width == 3 else w',
     'out[theirs + hf + ".weight"] = w', INTEROP),
    ("interop: GPT-2 Conv1D not transposed back", "engine/interop.py",
     "out[ours + name + \".weight\"] = w.t().contiguous() if conv else w",
     "out[ours + name + \".weight\"] = w", INTEROP),
    ("exact GELU computed in its tanh form", "model/layers.py",
     '    approximate = "none"', '    approximate = "tanh"', MODEL),
    ("interop: exact GELU exported as GPT-2's tanh form", "engine/interop.py",
     'return "gelu" if MLPS[cfg.mlp] is MLPS["gelu"] else tanh_name', "return tanh_name", INTEROP),
    ("interop: every imported GELU read as the tanh form", "engine/interop.py",
     "return next(ours for ours, theirs in _HF_GELU.items() if act in theirs)", 'return "gelu_tanh"', INTEROP),
    ("adaptive readout: scores by frequency rank, not token id", "model/readout.py",
     "return logp[:, self.rank].reshape(*h.shape[:-1], -1)",
     "return logp.reshape(*h.shape[:-1], -1)", "tests/test_readout.py"),
    ("adaptive readout: -1 targets not left out", "model/readout.py",
     "        if not keep.all():\n", "        if False:\n", "tests/test_readout.py"),
    ("adaptive readout: a run never ranks the vocabulary", "engine/run.py",
     "        model.adaptive.set_frequencies(counts)\n", "        pass\n", "tests/test_readout.py"),
    ("Muon: momentum and gradient swapped in the buffer", "engine/optim.py",
     "torch._foreach_lerp_(bufs, grads, 1 - momentum)", "torch._foreach_lerp_(bufs, grads, momentum)",
     "tests/test_optim.py -k grouped"),
    ("Muon: Newton-Schulz coefficients b and c swapped", "engine/optim.py",
     "torch.baddbmm(gram, gram, gram, beta=b, alpha=c)", "torch.baddbmm(gram, gram, gram, beta=c, alpha=b)",
     "tests/test_optim.py -k grouped"),
    ("untied output layer counted twice", "model/gpt.py",
     "            # An untied output layer stays in the count",
     "            n += 0 if self.config.tie_embeddings else self.lm_head.weight.numel()\n"
     "            # An untied output layer stays in the count", MODEL),
    ("spaced evaluation windows run one start past the split", "data/tokens.py",
     "np.linspace(0, self.n_starts - 1, count)", "np.linspace(0, self.n_starts, count)",
     "tests/test_data.py"),
    ("evaluation back on a fixed random draw", "engine/loop.py",
     'for x, y in Batches(tokens, batch_size, block_size, device, split="val").spaced(iters):',
     'b = Batches(tokens, batch_size, block_size, device, seed=4242, split="val")\n'
     '    for x, y in (b.next() for _ in range(iters)):', "tests/test_data.py"),
    ("each shard's last window left out", "data/shards.py",
     "len(a) - window + 1, 0", "len(a) - window, 0", "tests/test_data.py"),
    ("--budget evaluations capped at the preset's batches", "engine/budget.py",
     "min(whole, EVAL_SHARE", "min(train_cfg.eval_iters, EVAL_SHARE", "tests/test_budget.py"),
    ("lr warm-up off by one", "engine/loop.py",
     "return train_cfg.lr * (step + 1) / train_cfg.warmup_iters",
     "return train_cfg.lr * step / train_cfg.warmup_iters", "tests/test_optim.py tests/test_budget.py"),
]


def copy_tree(dst: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        target = dst / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="run the mutations whose name contains this")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if args.only.lower() in m[0].lower()]
    print(f"{len(MUTATIONS)} mutations listed, {len(chosen)} chosen\n")
    print("| mutation | file | caught by | time |")
    print("|---|---|---|---|")
    caught = 0
    for name, file, old, new, tests in chosen:
        with tempfile.TemporaryDirectory() as tmp:
            copy = Path(tmp)
            copy_tree(copy)
            path = copy / file
            text = path.read_text(encoding="utf-8")
            if old not in text:
                print(f"| {name} | {file} | STALE: fragment not found | - |")
                continue
            path.write_text(text.replace(old, new, 1), encoding="utf-8")
            start = time.perf_counter()
            command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                       *shlex.split(tests)]
            proc = subprocess.run(command, cwd=copy, capture_output=True, text=True,
                                  env={**os.environ, "PYTHONPATH": str(copy), "WANDB_MODE": "disabled"})
            took = time.perf_counter() - start
            failed = [line.split(" ")[1].split("::")[-1] for line in proc.stdout.splitlines()
                      if line.startswith("FAILED ")]
            ok = proc.returncode != 0
            caught += ok
            verdict = (failed[0][:60] if failed else "a test error") if ok else "NOT CAUGHT"
            print(f"| {name} | {file} | {verdict} | {took:.0f} s |", flush=True)
    print(f"\ncaught {caught} of {len(chosen)}")


if __name__ == "__main__":
    main()
