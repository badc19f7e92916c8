"""Tokenization throughput and memory of python -m data.prepare on this machine.

Builds corpora of 50 MB and 200 MB by repeating local text (tiny Shakespeare and the
bundled plays), prepares each with the character and the BPE tokenizer in a fresh
process, and prints MB/s of the token pass (the tokenizer's own training is timed
apart) with the peak resident memory of the main process and of its workers. Flat
memory means the 200 MB rows need no more than the 50 MB rows. A last row prepares the
bundled corpus unrepeated, where few words repeat and the piece cache helps least.

    python bench/prepare_speed.py [--sizes 50 200] [--num-proc 2]
"""
from __future__ import annotations

import capability  # noqa: F401  (first: refuses an ATEN_CPU_CAPABILITY this CPU cannot run)

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from data.tokenizer import TOKENIZERS  # noqa: E402
SHAKESPEARE = ROOT / "data" / "tinyshakespeare" / "input.txt.gz"
BUNDLED = ROOT / "data" / "shakespeare" / "plays.txt.gz"

CHILD = r"""
import json, os, resource, sys, threading, time
sys.path.insert(0, sys.argv[1])
peak_workers = 0

def watch_workers():
    # Each worker's own high-water mark (VmHWM), read while it runs: getrusage's
    # RUSAGE_CHILDREN would report the parent's size at fork, which exec keeps.
    global peak_workers
    me = str(os.getpid())
    while True:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                status = open(f"/proc/{pid}/status").read()
            except OSError:
                continue
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            if fields.get("PPid", "").strip() == me and "VmHWM" in fields:
                peak_workers = max(peak_workers, int(fields["VmHWM"].split()[0]) / 1024)
        time.sleep(0.2)

threading.Thread(target=watch_workers, daemon=True).start()
from data.build import prepare
from data.sources import SourceSpec
source, out, kind, num_proc = sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
started = time.perf_counter()
meta = prepare(SourceSpec(source), out, kind, 4096, tokenizer_sample=5_000_000,
               num_proc=num_proc, log=lambda *a: None, progress=False)
wall = time.perf_counter() - started
mb = sum(meta["splits"][s]["bytes"] for s in ("train", "val")) / 1e6
tokens = sum(meta["splits"][s]["tokens"] for s in ("train", "val"))
print(json.dumps({"mb": mb, "n_tokens": tokens, "wall": wall, **meta["seconds"],
                  "rss_main": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "rss_workers": peak_workers}))
"""


def make_corpus(folder: Path, megabytes: int) -> Path:
    text = gzip.open(SHAKESPEARE, "rt", encoding="utf-8").read()
    text += gzip.open(BUNDLED, "rt", encoding="utf-8").read()
    path = folder / f"corpus{megabytes}.txt"
    target = megabytes * 1_000_000
    with open(path, "w") as f:
        written = 0
        while written < target:
            f.write(text)
            written += len(text)
    return path


def run(source: Path, out: Path, kind: str, num_proc: int) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), str(source), str(out), kind,
                           str(num_proc)], capture_output=True, text=True,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "true"})
    if proc.returncode:
        raise SystemExit(proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[50, 200], help="corpus sizes in MB")
    parser.add_argument("--num-proc", type=int, default=os.cpu_count(), help="encoding processes")
    args = parser.parse_args()
    print(f"data.prepare on {os.cpu_count()} cores, {args.num_proc} encoding processes; "
          "token pass only (tokenizer training timed apart)")
    print("| corpus | tokenizer | MB | tokens | token pass | MB/s | tokenizer training | "
          "peak RSS main | peak RSS per worker |")
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cases = [(f"repeated {mb} MB", make_corpus(tmp, mb)) for mb in args.sizes]
        cases.append(("bundled plays (5 MB, once)", BUNDLED))
        for label, source in cases:
            for kind in TOKENIZERS:           # every tokenizer the project has
                r = run(source, tmp / f"out-{source.stem}-{kind}", kind, args.num_proc)
                print(f"| {label} | {kind} | {r['mb']:,.1f} | {r['n_tokens']:,} | "
                      f"{r['tokens']:.1f} s | {r['mb'] / r['tokens']:,.1f} | "
                      f"{r['tokenizer']:.1f} s | {r['rss_main']:,.0f} MB | "
                      f"{r['rss_workers']:,.0f} MB |", flush=True)


if __name__ == "__main__":
    main()
