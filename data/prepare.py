"""Prepare any corpus for train.py: read it, train a tokenizer, write token shards.

    python -m data.prepare roneneldan/TinyStories --val-split validation --out data/tinystories
    python -m data.prepare "books/*.txt" --tokenizer char --out data/books
    python -m data.prepare notes.jsonl --text-column body --out data/notes
    python train.py --data.path=data/tinystories

Steps, each with a progress bar:
1. the tokenizer: byte-level BPE trained with HF `tokenizers` from an iterator over the
   first `--tokenizer-sample` bytes of the training documents (never the whole corpus in
   memory), with an end-of-text token between documents; or the character vocabulary
   (one pass over everything, so validation has no unknown characters);
2. the tokens: pieces of text encoded by `--num-proc` processes, appended in document
   order to fixed-size shards (data/shards.py) of each split;
3. meta.json, written last: source, tokenizer hash, document, byte and token counts.
A build that is stopped resumes where it left off when the same command runs again:
finished shards are kept, the rest is redone from the last recorded point.
"""
from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from tqdm import tqdm

if __package__ in (None, ""):                 # run as a file: python data/prepare.py ...
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attnlab.errors import AttnlabError, DataError, friendly_errors
from attnlab.files import write_json_atomic
from data.shards import CannotResume, ShardWriter, token_dtype
from data.sources import Source, SourceSpec, open_source
from data.tokenizer import BPETokenizer, CharTokenizer, Tokenizer

FORMAT = "attnlab-tokens"
VERSION = 1
BATCH_CHARS = 1 << 20                  # text per encoding task
SAVE_EVERY_S = 10.0                    # how often progress is recorded between shards
SPLITS = ("train", "val")


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def read_meta(folder: Path) -> dict | None:
    """meta.json of a finished build, or None."""
    meta = _read_json(Path(folder) / "meta.json")
    return meta if meta is not None and meta.get("format") == FORMAT else None


def prepare_key(source_key: dict, tokenizer: str, vocab_size: int, tokenizer_sample: int,
                shard_tokens: int) -> dict:
    """Everything a build's result depends on; a folder built with another key is stale."""
    bpe = tokenizer == "bpe"
    return {"format": VERSION, "source": source_key, "tokenizer": tokenizer,
            "vocab_size": vocab_size if bpe else None,
            "tokenizer_sample": tokenizer_sample if bpe else None, "shard_tokens": shard_tokens}


def prepare(spec: SourceSpec, out: str | Path, tokenizer: str = "bpe", vocab_size: int = 4096,
            tokenizer_sample: int = 100_000_000, shard_tokens: int = 100_000_000,
            num_proc: int = 0, overwrite: bool = False, key_extra: dict | None = None,
            log=print, progress: bool = True) -> dict:
    """Tokenize `spec`'s documents into `out`; returns the meta.json contents."""
    out = Path(out)
    if tokenizer not in ("char", "bpe"):
        raise DataError(f"unknown tokenizer {tokenizer!r}; choose char or bpe")
    source = open_source(spec)
    key = prepare_key(key_extra or vars(spec), tokenizer, vocab_size, tokenizer_sample, shard_tokens)
    meta = read_meta(out)
    if meta is not None and meta.get("key") == key:
        log(f"{out} is already prepared ({meta['splits']['train']['tokens']:,} train tokens)")
        return meta
    state = _read_json(out / "progress.json")
    if (meta is not None or state is not None) and (state or {}).get("key") != key:
        if not overwrite:
            raise DataError(f"{out} holds tokens prepared with other settings; choose another "
                            "--out or add --overwrite to replace them")
        _clear(out)
        state = None
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").unlink(missing_ok=True)
    tok = None
    if state is not None:
        try:
            tok = Tokenizer.load(out)
            if tok.fingerprint() != state["tokenizer_fingerprint"]:
                tok = None
        except AttnlabError:
            tok = None
        if tok is None:
            state = None
        else:
            log(f"resuming {out}: {state['items']:,} pieces of text already encoded")
    started = time.perf_counter()
    if tok is None:
        tok = _train_tokenizer(source, tokenizer, vocab_size, tokenizer_sample, progress)
        tok.save(out)
        state = _fresh_state(key, tok)
        write_json_atomic(out / "progress.json", state)
    tokenizer_s = time.perf_counter() - started
    try:
        meta = _encode(source, tok, out, state, shard_tokens, num_proc, log, progress)
    except CannotResume as err:
        log(f"{err}; starting the token pass over")
        meta = _encode(source, tok, out, _fresh_state(key, tok), shard_tokens, num_proc, log,
                       progress)
    meta.update(format=FORMAT, version=VERSION, key=key, source=source.describe(),
                val_rule=source.val_rule, tokenizer=tok.kind, vocab_size=tok.vocab_size,
                tokenizer_fingerprint=tok.fingerprint(), eot_id=tok.eot_id,
                dtype=token_dtype(tok.vocab_size).name, shard_tokens=shard_tokens,
                created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                seconds={"tokenizer": round(tokenizer_s, 3),
                         "tokens": round(time.perf_counter() - started - tokenizer_s, 3)})
    write_json_atomic(out / "meta.json", meta)          # last: the folder is now complete
    (out / "progress.json").unlink(missing_ok=True)
    return meta


def _fresh_state(key: dict, tok: Tokenizer) -> dict:
    """progress.json of a token pass that has not started."""
    return {"key": key, "tokenizer_fingerprint": tok.fingerprint(), "items": 0, "writers": {},
            "counts": {s: {"documents": 0, "bytes": 0, "chars": 0, "tokens": 0} for s in SPLITS}}


def _clear(out: Path) -> None:
    for pattern in ("train_*.bin*", "val_*.bin*", "meta.json", "progress.json", "tokenizer.json"):
        for path in out.glob(pattern):
            path.unlink()


def _train_tokenizer(source: Source, kind: str, vocab_size: int, sample_bytes: int,
                     progress: bool) -> Tokenizer:
    if kind == "char":
        # Every character of every split, so validation text never has an unknown one.
        chars: set[str] = set()
        with tqdm(total=source.total_bytes, unit="B", unit_scale=True, disable=not progress,
                  desc="character vocabulary") as bar:
            for _, text, _ in source.pieces():
                chars.update(text)
                bar.update(len(text))
        if not chars - set(" \t\r\n\f\v"):
            raise _empty(source)
        if source.newline_docs:
            chars.add("\n")                   # the separator between records
        return CharTokenizer(chars)
    bar = tqdm(total=sample_bytes, unit="B", unit_scale=True, disable=not progress,
               desc="BPE training sample")

    seen, blank = 0, True

    def sample():
        nonlocal seen, blank
        for split, text, _ in source.pieces():
            if split != "train":
                continue
            yield text
            bar.update(len(text))
            seen += len(text)
            blank = blank and not text.strip()
            if seen >= sample_bytes:
                return
    try:
        tok = BPETokenizer.train(sample(), vocab_size)
    finally:
        bar.close()
    if blank:
        raise _empty(source)
    return tok


def _empty(source: Source) -> DataError:
    return DataError(f"{source.spec.source} is empty (no text but white space); give "
                     "data.path a file with text in it")


# -- the token pass -------------------------------------------------------------------

_worker_tok: Tokenizer | None = None


def _init_worker(tokenizer_json: str) -> None:
    global _worker_tok
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")   # processes, not threads
    _worker_tok = Tokenizer.parse(tokenizer_json)


def _encode_items(items: list[tuple[str, str, bool]], newline_docs: bool,
                  tok: Tokenizer | None = None) -> list:
    """Encode pieces. A document's last piece gets the end-of-text token after it; with
    no such token (characters), records are kept apart by a newline."""
    tok = tok or _worker_tok
    dtype = token_dtype(tok.vocab_size)
    by_newline = tok.eot_id is None
    separator = tok.eot_id if not by_newline else tok.encode("\n")[0] if newline_docs else None
    out = []
    for split, text, doc_end in items:
        ids = tok.encode_array(text)
        if doc_end and separator is not None and not (by_newline and text.endswith("\n")):
            ids = np.append(ids, separator)
        out.append((split, ids.astype(dtype), len(text.encode("utf-8")), len(text), doc_end))
    return out


def _batches(source: Source, skip: int):
    """Groups of about BATCH_CHARS of text, after skipping the pieces already done."""
    batch, size = [], 0
    for index, item in enumerate(source.pieces()):
        if index < skip:
            continue
        batch.append(item)
        size += len(item[1])
        if size >= BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _encode(source, tok, out, state, shard_tokens, num_proc, log, progress) -> dict:
    dtype = token_dtype(tok.vocab_size)
    writers = {s: ShardWriter(out, s, dtype, shard_tokens, state["writers"].get(s)) for s in SPLITS}
    counts = state["counts"]
    num_proc = num_proc or os.cpu_count() or 1
    pool = None
    if num_proc > 1:
        pool = multiprocessing.get_context("spawn").Pool(
            num_proc, initializer=_init_worker, initargs=(tok.to_json(),))
    done_bytes = counts["train"]["bytes"] + counts["val"]["bytes"]
    bar = tqdm(total=source.total_bytes, initial=done_bytes, unit="B", unit_scale=True,
               disable=not progress, desc="tokenizing")
    last_save = time.monotonic()

    def consume(results, n_items):
        nonlocal last_save
        finished = 0
        for split, ids, n_bytes, n_chars, doc_end in results:
            finished += writers[split].append(ids)
            c = counts[split]
            c["bytes"] += n_bytes
            c["chars"] += n_chars
            c["tokens"] += len(ids)
            c["documents"] += doc_end
            bar.update(n_bytes)
        state["items"] += n_items
        if finished or time.monotonic() - last_save > SAVE_EVERY_S:
            for w in writers.values():
                w.flush()
            state["writers"] = {s: w.state() for s, w in writers.items()}
            write_json_atomic(out / "progress.json", state)
            last_save = time.monotonic()

    try:
        batches = _batches(source, state["items"])
        if pool is None:
            for batch in batches:
                consume(_encode_items(batch, source.newline_docs, tok), len(batch))
        else:
            # At most two tasks per process in flight: memory stays flat however fast
            # the source reads, and results come back in document order.
            pending = collections.deque()
            for batch in batches:
                pending.append((pool.apply_async(_encode_items, (batch, source.newline_docs)), len(batch)))
                if len(pending) >= 2 * num_proc:
                    result, n = pending.popleft()
                    consume(result.get(), n)
            while pending:
                result, n = pending.popleft()
                consume(result.get(), n)
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
    splits = {}
    for s in SPLITS:
        names = writers[s].close()
        splits[s] = dict(counts[s], shards=names)
    for s in SPLITS:
        if splits[s]["tokens"] == 0:
            raise DataError(f"{source.spec.source} gave no {s} text "
                            f"({counts['train']['documents']:,} training documents; the "
                            f"validation split is {source.val_rule}); use more documents or "
                            "another --val-fraction")
    log(f"wrote {splits['train']['tokens']:,} train tokens in {len(splits['train']['shards'])} "
        f"shard(s) and {splits['val']['tokens']:,} val tokens to {out} (vocabulary "
        f"{tok.vocab_size:,}, validation: {source.val_rule})")
    return {"splits": splits}


def parse_size(text: str) -> int:
    """'50MB', '2G', '1e6' or '1000' as a number of bytes or tokens."""
    units = {"k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9}
    t = text.strip().lower()
    for suffix in sorted(units, key=len, reverse=True):
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * units[suffix])
    try:
        return int(float(t))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (examples: 50MB, 2G, 100000)") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
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
    p.add_argument("--tokenizer", choices=("bpe", "char"), default="bpe")
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size (default 4096)")
    p.add_argument("--tokenizer-sample", type=parse_size, default=100_000_000,
                   help="bytes of training text the BPE merges are learned from (default 100MB)")
    p.add_argument("--shard-tokens", type=parse_size, default=100_000_000,
                   help="tokens per shard file (default 100M)")
    p.add_argument("--num-proc", type=int, default=0, help="encoding processes (default: all cores)")
    p.add_argument("--overwrite", action="store_true", help="replace tokens prepared with other settings")
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    with friendly_errors():
        run(args)


def run(args) -> None:
    spec = SourceSpec(args.source, args.config_name, args.split, args.val_split, args.text_column,
                      args.streaming, args.max_docs, args.max_bytes, args.val_fraction)
    started = time.perf_counter()
    meta = prepare(spec, args.out, args.tokenizer, args.vocab_size, args.tokenizer_sample,
                   args.shard_tokens, args.num_proc, args.overwrite)
    took = time.perf_counter() - started
    s = meta["splits"]
    print(f"{s['train']['documents']:,} train / {s['val']['documents']:,} val documents, "
          f"{(s['train']['bytes'] + s['val']['bytes']) / 1e6:,.1f} MB in {took:.1f} s")
    print(f"train with: python train.py --data.path={args.out}")


if __name__ == "__main__":
    main()
