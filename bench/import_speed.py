"""Import a GPT-2-sized (124M parameters) transformers folder: time and memory.

    python bench/import_speed.py

Builds a randomly initialised GPT2LMHeadModel of GPT-2 small's shape, saves it with
save_pretrained (safetensors) and a tokenizer, then loads it in fresh processes:
through attnlab (engine.interop.load_hf_folder, which maps the safetensors and makes
their tensors the model's own) and through transformers' own from_pretrained, the peer. Each
row gives the wall time of the load alone and the process's peak memory above what
it held after its imports, once every weight has been read (a loader that maps the
file reads it only when the weights are used), against the size of the weights on disk.
"""
from __future__ import annotations

import capability  # noqa: F401  (first: refuses an ATEN_CPU_CAPABILITY this CPU cannot run)

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])


def peak_mib():
    # This process's own peak resident memory. Not getrusage's ru_maxrss: Linux carries
    # the parent's peak into it across fork and exec, so a child started by a parent
    # that held more than the child ever uses reports the parent's figure.
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024


import torch
import transformers
from engine.interop import load_hf_folder
transformers.logging.set_verbosity_error()
torch.set_num_threads(2)
base = peak_mib()
start = time.perf_counter()
if sys.argv[3] == "attnlab":
    model, cfg, tok = load_hf_folder(sys.argv[2])
    n = model.num_params()
else:
    model = getattr(transformers, sys.argv[4]).from_pretrained(sys.argv[2])
    n = model.num_parameters()
took = time.perf_counter() - start
# A loader may map the file and leave its pages unread until a forward pass needs them
# (transformers does): read every weight once, so the peak counts the weights in memory.
with torch.no_grad():
    for t in model.state_dict().values():
        t.float().sum()
print(json.dumps({"seconds": took, "extra_mb": peak_mib() - base, "params": n}))
"""


def timed_import(folder, loader: str, hf_class: str) -> dict:
    """Load the folder in a fresh process, with attnlab's reader or `transformers.<hf_class>`:
    seconds, memory above the imports (MiB) and parameters."""
    proc = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), str(folder), loader, hf_class],
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    import torch
    import transformers
    from data.tokenizer import BPETokenizer
    transformers.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "gpt2-sized"
        torch.manual_seed(0)
        transformers.GPT2LMHeadModel(transformers.GPT2Config()).save_pretrained(folder)
        bpe = BPETokenizer.train(["a small sample of text for a tokenizer " * 20], 300)
        transformers.PreTrainedTokenizerFast(tokenizer_object=bpe.hf).save_pretrained(folder)
        weights_mb = (folder / "model.safetensors").stat().st_size / 2**20
        print(f"weights on disk: {weights_mb:,.0f} MiB (float32)\n")
        print("| loader | load time | peak memory above imports | / weights |")
        print("|---|---|---|---|")
        for loader in ("attnlab", "transformers"):
            r = timed_import(folder, loader, "AutoModelForCausalLM")
            print(f"| {loader} ({r['params'] / 1e6:.1f}M) | {r['seconds']:.2f} s | "
                  f"{r['extra_mb']:,.0f} MiB | {r['extra_mb'] / weights_mb:.2f}x |")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
