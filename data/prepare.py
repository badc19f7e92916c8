"""Prepare any corpus for train.py: read it, train a tokenizer, write token shards.

    python -m data.prepare roneneldan/TinyStories --val-split validation --out data/tinystories
    python -m data.prepare "books/*.txt" --tokenizer char --out data/books
    python -m data.prepare notes.jsonl --text-column body --out data/notes
    python train.py --data.path=data/tinystories

A build that is stopped resumes where it left off when the same command runs again:
finished shards are kept, the rest is redone from the last recorded point. The work
is done by data/build.py; this file is its command line.
"""
from __future__ import annotations

import argparse
import errno
import math
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):       # run as a file (python data/prepare.py): find the project
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.errors import DataError, friendly_errors, terminate_as_interrupt
from common.files import removed_if_left_empty
from common.shell import word
from data.build import prepare
from data.sources import SourceSpec
from data.tokenizer import TOKENIZERS


def parse_size(text: str) -> int:
    """'50MB', '2G', '1e6' or '1000' as a whole, positive number of bytes or tokens."""
    units = {"k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9}
    t = text.strip().lower()
    suffix = next((u for u in sorted(units, key=len, reverse=True) if t.endswith(u)), "")
    try:
        value = float(t[: len(t) - len(suffix)]) * units.get(suffix, 1)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 1 <= value < 2 ** 62):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size of at least 1 (examples: 50MB, 2G, 100000)")
    return int(value)


class Parser(argparse.ArgumentParser):
    """argparse whose mistakes end as the project's one `error:` line."""

    def error(self, message):
        raise DataError(f"{message}; see python -m data.prepare --help")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m data.prepare", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Local sources: a .txt/.md file (or .txt.gz), a folder of them, a glob, or "
               ".jsonl/.json/.csv/.parquet files. Anything else is a Hugging Face Hub dataset.")
    p.add_argument("source", help="file, folder, glob, or Hub dataset name (roneneldan/TinyStories)")
    p.add_argument("--out", required=True, help="folder for the shards, tokenizer.json and meta.json")
    p.add_argument("--config-name", default="", help="Hub dataset configuration (e.g. sample-10BT)")
    p.add_argument("--split", default="train", help="Hub split to read (default train)")
    p.add_argument("--val-split", default="",
                   help="Hub split for validation (e.g. validation); default: every k-th document")
    p.add_argument("--val-fraction", type=float, default=0.1,
                   help="share held out for validation: text files by bytes from the end, "
                        "records as every round(1/f)-th document (default 0.1)")
    p.add_argument("--text-column", default="text", help="column holding the text (default text)")
    p.add_argument("--streaming", action="store_true",
                   help="stream a Hub dataset instead of downloading it whole first")
    p.add_argument("--max-docs", type=int, default=0, help="take only the first N documents")
    p.add_argument("--max-bytes", type=parse_size, default=0, help="take only the first N bytes (e.g. 200MB)")
    p.add_argument("--tokenizer", choices=sorted(TOKENIZERS), default="bpe")
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size (default 4096)")
    p.add_argument("--tokenizer-sample", type=parse_size, default=100_000_000,
                   help="bytes of training text the BPE merges are learned from (default 100MB)")
    p.add_argument("--shard-tokens", type=parse_size, default=100_000_000,
                   help="tokens per shard file (default 100M)")
    p.add_argument("--num-proc", type=int, default=0, help="encoding processes (default: all cores)")
    p.add_argument("--overwrite", action="store_true", help="replace tokens prepared with other settings")
    return p


INTERRUPTED = ("error: interrupted; the tokens written so far are kept: run the same "
               "command again, which resumes")


def main(argv=None) -> None:
    with friendly_errors():
        args = build_parser().parse_args(argv)
        try:
            with terminate_as_interrupt():       # a scheduler's stop as a Ctrl-C
                run(args)
        except KeyboardInterrupt:
            if os.environ.get("ATTNLAB_DEBUG"):
                raise
            print(INTERRUPTED, file=sys.stderr)
            sys.exit(130)
        except OSError as err:
            if os.environ.get("ATTNLAB_DEBUG"):
                raise
            raise DataError(cannot_write(err, args.out)) from None


def cannot_write(err: OSError, out: str) -> str:
    """What a refused write means for the build, and what to do: a full disk keeps
    every finished shard and the recorded progress (the same command resumes); a
    folder that cannot be written needs another --out."""
    reason = f"{err.filename or out}: {err.strerror or err}"
    if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return (f"{reason}; the tokens written so far are kept: free some space (or choose "
                f"another --out) and run the same command again, which resumes")
    inside = bool(err.filename) and Path(os.path.abspath(err.filename)).is_relative_to(
        os.path.abspath(out))
    if err.errno in (errno.EROFS, errno.EACCES, errno.EPERM) and inside:
        return f"{reason}; --out {out} cannot be written: choose a folder you can write to"
    return f"{reason}; run the same command again once that is fixed (it resumes)"


def run(args) -> None:
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} is a file; give a folder for the shards")
    spec = SourceSpec(args.source, args.config_name, args.split, args.val_split, args.text_column,
                      args.streaming, args.max_docs, args.max_bytes, args.val_fraction)
    started = time.perf_counter()
    with removed_if_left_empty(out):          # a refused corpus leaves no empty --out
        meta = prepare(spec, out, args.tokenizer, args.vocab_size, args.tokenizer_sample,
                       args.shard_tokens, args.num_proc, args.overwrite)
    took = time.perf_counter() - started
    s = meta["splits"]
    print(f"{s['train']['documents']:,} train / {s['val']['documents']:,} val documents, "
          f"{(s['train']['bytes'] + s['val']['bytes']) / 1e6:,.1f} MB in {took:.1f} s")
    print(f"train with: python train.py {word(f'--data.path={args.out}')}")


if __name__ == "__main__":
    main()
