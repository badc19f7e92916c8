"""Build a token folder from any corpus: read it, train a tokenizer, write token
shards. The library behind `python -m data.prepare` (data/prepare.py, the command
line) and behind train.py's `data.path`, which prepares plain files on first use
(data/tokens.py).

Steps, each with a progress bar:
1. the tokenizer: byte-level BPE trained with HF `tokenizers` from an iterator over the
   first `tokenizer_sample` bytes of the training documents (never the whole corpus in
   memory), with an end-of-text token between documents; or the character vocabulary
   (one pass over everything, so validation has no unknown characters);
2. the tokens: pieces of text encoded by `num_proc` processes, appended in document
   order to fixed-size shards (data/shards.py) of each split;
3. meta.json, written last: source, tokenizer hash, document, byte and token counts.
A build that is stopped resumes where it left off when it is asked for again:
finished shards are kept, the rest is redone from the last recorded point.
"""
from __future__ import annotations

import collections
import functools
import multiprocessing
import os
import signal
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from tqdm import tqdm

from common.errors import AttnlabError, DataError
from common.files import inside, write_json_atomic
from data.meta import FORMAT, PROGRESS, VERSION, DamagedRecord, read_meta, read_progress
from data.shards import CannotResume, ShardWriter, open_shard, shard_name, token_dtype
from data.sources import Source, SourceSpec, open_source, passed_over_line
from data.tokenizer import TOKENIZERS, Tokenizer, tokenizer_limit

BATCH_CHARS = 1 << 20                  # text per encoding task
SAVE_EVERY_S = 10.0                    # how often progress is recorded between shards
SPLITS = ("train", "val")


def prepare_key(source_key: dict, tokenizer: str, vocab_size: int, tokenizer_sample: int,
                shard_tokens: int) -> dict:
    """Everything a build's result depends on; a folder built with another key is stale."""
    cls = TOKENIZERS[tokenizer]
    sized, sampled = cls.sized_by_setting, not cls.needs_every_symbol
    return {"format": VERSION, "source": source_key, "tokenizer": tokenizer,
            "vocab_size": vocab_size if sized else None,
            "tokenizer_sample": tokenizer_sample if sampled else None, "shard_tokens": shard_tokens}


def prepare(spec: SourceSpec, out: str | Path, tokenizer: str = "bpe", vocab_size: int = 4096,
            tokenizer_sample: int = 100_000_000, shard_tokens: int = 100_000_000,
            num_proc: int = 0, overwrite: bool = False, key_extra: dict | None = None,
            log=print, progress: bool = True, given: Tokenizer | None = None) -> dict:
    """Tokenize `spec`'s documents into `out`; returns the meta.json contents. With
    `given`, encode with that tokenizer (a fine-tuning run keeps its parent's) instead
    of learning one."""
    out = Path(out)
    if tokenizer not in TOKENIZERS:
        raise DataError(f"unknown tokenizer {tokenizer!r}; choose one of {', '.join(TOKENIZERS)}")
    source = open_source(spec)
    key = prepare_key(key_extra or vars(spec), tokenizer, vocab_size, tokenizer_sample, shard_tokens)
    if source.passed_over:
        log(passed_over_line(source.passed_over))
    meta, state = _earlier_build(out, key, overwrite)
    if meta is not None:
        log(f"{out} is already prepared ({meta['splits']['train']['tokens']:,} train tokens)")
        return meta
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").unlink(missing_ok=True)
    tok = _resumed_tokenizer(out, state, log)
    started = time.perf_counter()
    if tok is None:
        tok = given or _train_tokenizer(source, tokenizer, vocab_size, tokenizer_sample, progress)
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
    skipped = getattr(source, "skipped", {})
    if skipped:
        log("skipped records without text: "
            + ", ".join(f"{n:,} {kind}" for kind, n in sorted(skipped.items())))
    meta.update(format=FORMAT, version=VERSION, key=key, source=source.describe(),
                skipped_records=skipped,
                val_rule=source.val_rule, tokenizer=tok.kind, vocab_size=tok.vocab_size,
                tokenizer_fingerprint=tok.fingerprint(), eot_id=tok.eot_id,
                dtype=token_dtype(tok.vocab_size).name, shard_tokens=shard_tokens,
                created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                seconds={"tokenizer": round(tokenizer_s, 3),
                         "tokens": round(time.perf_counter() - started - tokenizer_s, 3)})
    write_json_atomic(out / "meta.json", meta)          # last: the folder is now complete
    (out / "progress.json").unlink(missing_ok=True)
    return meta


def _earlier_build(out: Path, key: dict, overwrite: bool) -> tuple[dict | None, dict | None]:
    """What `out` holds of a build with `key`: (its meta.json, None) when that build
    finished, (None, its progress) when it did not, else (None, None). A build with
    other settings, or a damaged meta.json or progress.json, is cleared away with
    `overwrite` and refused without it."""
    try:
        meta = read_meta(out)
        if meta is not None and meta["key"] == key:
            return meta, None
        state = read_progress(out)
    except DamagedRecord as err:
        if not overwrite:
            raise DataError(f"{err.problem}; replace that build (data.prepare's --overwrite) "
                            "or choose another folder") from None
        clear_build(out)
        return None, None
    if (meta is not None or state is not None) and (state or {}).get("key") != key:
        if not overwrite:
            raise DataError(f"{out} holds tokens prepared with other settings; choose another "
                            "folder, or replace them (data.prepare's --overwrite)")
        clear_build(out)
        return None, None
    return None, state


def _resumed_tokenizer(out: Path, state: dict | None, log) -> Tokenizer | None:
    """The tokenizer a build that did not finish was encoding with, when its progress
    and tokenizer.json still agree (else None: the build starts over)."""
    if state is None:
        return None
    try:
        tok = Tokenizer.load(out)
    except AttnlabError:
        return None
    if tok.fingerprint() != state["tokenizer_fingerprint"]:
        return None
    log(f"resuming {out}: {state['items']:,} pieces of text already encoded")
    return tok


def _fresh_state(key: dict, tok: Tokenizer) -> dict:
    """progress.json of a token pass that has not started."""
    return {"key": key, "tokenizer_fingerprint": tok.fingerprint(), "items": 0, "writers": {},
            "counts": {s: {"documents": 0, "bytes": 0, "chars": 0, "tokens": 0} for s in SPLITS}}


def clear_build(out: Path) -> None:
    """Remove a build's files (and nothing else) from `out`."""
    for pattern in ("train_*.bin*", "val_*.bin*", "meta.json", "progress.json", "tokenizer.json"):
        for path in out.glob(pattern):
            path.unlink()


def _train_tokenizer(source: Source, kind: str, vocab_size: int, sample_bytes: int,
                     progress: bool) -> Tokenizer:
    """Learn the tokenizer `kind` from the source. One that must know every symbol
    (characters) reads every split; one that encodes any text (BPE) reads a sample of
    the training split only."""
    cls = TOKENIZERS[kind]
    every_split = cls.needs_every_symbol
    limit = source.total_bytes if every_split else sample_bytes
    bar = tqdm(total=limit, unit="B", unit_scale=True, disable=not progress,
               desc=f"{kind} tokenizer")
    seen, blank = 0, True

    def texts():
        nonlocal seen, blank
        for split, text, _ in source.pieces():
            if split != "train" and not every_split:
                continue
            yield text
            bar.update(len(text))
            seen += len(text)
            blank = blank and not text.strip()
            if not every_split and seen >= sample_bytes:
                return
    try:
        tok = cls.learn(texts(), vocab_size, records=source.newline_docs)
    finally:
        bar.close()
    if blank:
        raise _empty(source)
    size, limit = len(tok.to_json().encode()), tokenizer_limit(tok.vocab_size)
    if size > limit:             # train.py would refuse the folder's tokenizer.json for it
        raise DataError(f"the {kind} tokenizer learned from {source.spec.source} takes "
                        f"{size:,} bytes, more than the {limit:,} a tokenizer of "
                        f"{tok.vocab_size:,} tokens may; its text repeats too little to learn "
                        "from: use a larger, more varied corpus, or --tokenizer char")
    return tok


def _empty(source: Source) -> DataError:
    return DataError(f"{source.spec.source} holds only white space (spaces, tabs, newlines), "
                     "no text to learn from; give a file with text in it")


# -- the token pass -------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _parsed(tokenizer_json: str) -> Tokenizer:
    """The tokenizer of a worker process, parsed once per process and reused, so its
    cache of encoded pieces carries from one task to the next."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")   # processes, not threads
    return Tokenizer.parse(tokenizer_json)


def _encode_items(items: list[tuple[str, str, bool]], newline_docs: bool,
                  tok: Tokenizer | str) -> list:
    """Encode pieces with `tok` (or, in a worker, its JSON). A document's last piece
    gets the end-of-text token after it; with no such token (characters), records are
    kept apart by a newline."""
    tok = _parsed(tok) if isinstance(tok, str) else tok
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


def _batches(pieces):
    """Groups of about BATCH_CHARS of text from an iterator of pieces."""
    batch, size = [], 0
    for item in pieces:
        batch.append(item)
        size += len(item[1])
        if size >= BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _check_shards_recorded(out: Path, state: dict, shard_tokens: int, dtype: np.dtype) -> None:
    """progress.json's shards against the folder: each split's token count is its
    finished shards plus its partial one, the partial one is shorter than a shard, and
    each finished shard is a full shard of this build on disk. CannotResume (the token
    pass starts over) when not: a forged or stale record is never built on."""
    path = out / PROGRESS
    for s in SPLITS:
        writer = state["writers"].get(s) or {"shards": 0, "partial_tokens": 0}
        done, partial = writer["shards"], writer["partial_tokens"]
        if partial >= shard_tokens or state["counts"][s]["tokens"] != done * shard_tokens + partial:
            raise CannotResume(f"{path} records {state['counts'][s]['tokens']:,} {s} tokens, "
                               f"which {done:,} full shards and a partial one of {partial:,} "
                               f"tokens (of {shard_tokens:,} a shard) cannot hold")
        for index in range(done):
            name = shard_name(s, index)
            try:
                if inside(out, name) is None:
                    raise DataError(f"{out / name} leads outside {out}")
                shard = open_shard(out / name)
            except DataError as err:
                why = str(err).split(";")[0]
                raise CannotResume(f"{path} records {done:,} finished {s} shards, but {why}") from None
            if len(shard) != shard_tokens or shard.dtype != dtype:
                raise CannotResume(f"{path} records {out / name} as a full shard of {shard_tokens:,} "
                                   f"{dtype} tokens, but it holds {len(shard):,} {shard.dtype}")


def _after_recorded(source: Source, state: dict, out: Path):
    """The source's pieces after those progress.json records as encoded, once the
    skipped ones are found to hold the documents, bytes and characters it counts for
    them: a record that claims more than the source holds, or other text, would make
    the build skip text it never encoded. CannotResume (start over) when they differ."""
    pieces, skip = source.pieces(), state["items"]
    seen = {s: {"documents": 0, "bytes": 0, "chars": 0} for s in SPLITS}
    for _, (split, text, doc_end) in zip(range(skip), pieces):
        c = seen[split]
        c["documents"] += doc_end
        c["bytes"] += len(text.encode("utf-8"))
        c["chars"] += len(text)
    recorded = {s: {k: state["counts"][s][k] for k in seen[s]} for s in SPLITS}
    if seen != recorded:
        raise CannotResume(f"{out / PROGRESS} records {skip:,} pieces of text as encoded, "
                           f"holding {_said(recorded)}, but the source's first {skip:,} hold "
                           f"{_said(seen)}")
    return pieces


def _said(counts: dict) -> str:
    return "; ".join(f"{s}: " + ", ".join(f"{n:,} {k}" for k, n in c.items())
                     for s, c in counts.items())


def _worker_start() -> None:
    """Ctrl-C reaches every process of the terminal's group: the workers leave it to the
    parent, which stops them and says what was kept, instead of each printing a traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _encode_in_order(batches, newline_docs: bool, tok: Tokenizer, num_proc: int, consume) -> None:
    """Encode each batch, in `num_proc` worker processes when more than one, and hand
    the results to `consume(results, n_items)` in document order."""
    if num_proc <= 1:
        for batch in batches:
            consume(_encode_items(batch, newline_docs, tok), len(batch))
        return
    pool = multiprocessing.get_context("spawn").Pool(num_proc, initializer=_worker_start)
    tok_json = tok.to_json()
    try:
        # At most two tasks per process in flight: memory stays flat however fast
        # the source reads, and results come back in document order.
        pending = collections.deque()
        for batch in batches:
            pending.append((pool.apply_async(_encode_items, (batch, newline_docs, tok_json)),
                            len(batch)))
            if len(pending) >= 2 * num_proc:
                result, n = pending.popleft()
                consume(result.get(), n)
        while pending:
            result, n = pending.popleft()
            consume(result.get(), n)
    finally:
        pool.terminate()


def _encode(source, tok, out, state, shard_tokens, num_proc, log, progress) -> dict:
    dtype = token_dtype(tok.vocab_size)
    _check_shards_recorded(out, state, shard_tokens, dtype)      # before any file is touched
    pieces = _after_recorded(source, state, out)
    writers = {s: ShardWriter(out, s, dtype, shard_tokens, state["writers"].get(s)) for s in SPLITS}
    counts = state["counts"]
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
        _encode_in_order(_batches(pieces), source.newline_docs, tok,
                         num_proc or os.cpu_count() or 1, consume)
    finally:
        bar.close()
    splits = {}
    for s in SPLITS:
        names = writers[s].close()
        splits[s] = dict(counts[s], shards=names)
    for s in SPLITS:
        if splits[s]["tokens"] == 0:
            raise DataError(f"{source.spec.source} gave no {s} text "
                            f"({counts['train']['documents']:,} training documents; the "
                            f"validation split is {source.val_rule}); use more documents or "
                            "another validation fraction")
    log(f"wrote {splits['train']['tokens']:,} train tokens in {len(splits['train']['shards'])} "
        f"shard(s) and {splits['val']['tokens']:,} val tokens to {out} (vocabulary "
        f"{tok.vocab_size:,}, validation: {source.val_rule})")
    return {"splits": splits}
