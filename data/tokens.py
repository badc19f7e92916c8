"""From a corpus to token shards, and from those to training batches.

`data.path` may name a folder written by `python -m data.prepare` (any corpus: Hub
datasets, JSONL, Parquet, folders of text), which is read as it is. Anything else (a
text file, a folder or glob of them, JSONL/CSV/Parquet files, or nothing: the bundled
Shakespeare) goes through the same `data.prepare` on first use into a cache folder,
keyed by the source's hash and the tokenizer settings and rebuilt when either changes.
Either way, training memory-maps the shards and never holds the corpus in memory.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from common.errors import DataError, closest
from common.files import file_sha256, lock_file, lock_holder
from common.shell import word
from data.build import clear_build, prepare, prepare_key
from data.meta import DamagedRecord, looks_prepared, read_meta
from data.shards import Shards
from data.sources import SourceSpec, local_files, open_source, passed_over_line
from data.tokenizer import TOKENIZERS, Tokenizer, tokenizer_limit

DATA_DIR = Path(__file__).resolve().parent
BUNDLED_CORPUS = DATA_DIR / "shakespeare" / "plays.txt.gz"
CACHE_SHARD_TOKENS = 1 << 30           # one shard per split for a corpus train.py prepares
# The whole training split is the BPE sample: corpora given to train.py directly are
# small enough (larger ones go through python -m data.prepare).
CACHE_BPE_SAMPLE = 1 << 62
PARALLEL_FROM_BYTES = 32 << 20         # below this, worker processes cost more than they save


@dataclass
class TokenData:
    train: Shards                 # memory-mapped token ids
    val: Shards
    tokenizer: Tokenizer
    meta: dict
    directory: Path

    bits_unit = "bpb"

    def bits(self, loss: float) -> float:
        """A per-token loss in nats as bits per byte of validation text: comparable
        between a character model and a BPE model of the same corpus (a BPE token
        covers several bytes, so its loss per token is larger)."""
        val = self.meta["splits"]["val"]
        return loss / math.log(2) * val["tokens"] / val["bytes"]


def open_prepared(folder: Path, meta: dict | None = None) -> TokenData:
    """A folder written by data.prepare, checked: tokenizer hash and every shard's header."""
    folder = Path(folder)
    meta = meta or read_meta(folder)
    if meta is None:
        raise DataError(f"{folder} has no meta.json from python -m data.prepare")
    # Bounded by the vocabulary meta.json claims (checked against the tokenizer below).
    tok = Tokenizer.load(folder, tokenizer_limit(meta["vocab_size"]))
    if tok.fingerprint() != meta["tokenizer_fingerprint"]:
        raise DataError(f"{folder / 'tokenizer.json'} is not the tokenizer its shards were made "
                        "with (its hash differs from meta.json); prepare the data again")
    splits = {s: Shards.open(folder, meta["splits"][s]["shards"]) for s in ("train", "val")}
    _meta_agrees(folder, meta, tok, splits)
    for s, shards in splits.items():
        if len(shards) != meta["splits"][s]["tokens"]:
            raise DataError(f"the {s} shards in {folder} hold {len(shards):,} tokens but "
                            f"meta.json says {meta['splits'][s]['tokens']:,}; prepare the data again")
        if len(shards) and shards.max() >= tok.vocab_size:
            raise DataError(f"the {s} shards in {folder} hold token id {shards.max()}, outside "
                            f"the tokenizer's vocabulary of {tok.vocab_size}; they were not made "
                            "with this tokenizer: prepare the data again")
    _refuse_val_as_train(folder, splits["train"], splits["val"])
    return TokenData(splits["train"], splits["val"], tok, meta, folder)


def _refuse_val_as_train(folder: Path, train: Shards, val: Shards) -> None:
    """A validation split that holds the training split's very tokens (its shards copied
    over) would score the model on text it trained on: a val loss that falls with
    memorising, which a user reads as learning. A split of one corpus never gives two
    equal halves unless the text is itself repeated, so it is refused, not warned of.
    Compared only when the counts agree, so a real split costs nothing here."""
    if len(val) != len(train) or not len(val):
        return
    if val.dtype == train.dtype and _digest(val) == _digest(train):
        raise DataError(f"the val shards in {folder} ({', '.join(val.names)[:200]}) hold the very "
                        f"tokens of its train shards ({', '.join(train.names)[:200]}), so the "
                        "validation loss would be measured on training text; prepare the data "
                        "again (python -m data.prepare) from the corpus")


def _digest(shards: Shards, size: int = 1 << 24) -> str:
    """A hash of a split's tokens, read shard after shard in slices (no whole copy)."""
    h = hashlib.sha256()
    for a in shards.arrays:
        for start in range(0, len(a), size):
            h.update(np.ascontiguousarray(a[start:start + size]).tobytes())
    return h.hexdigest()


def _meta_agrees(folder: Path, meta: dict, tok: Tokenizer, splits: dict) -> None:
    """What meta.json says of the folder against what the folder holds: a meta.json
    edited apart from its tokenizer and shards is refused, never half believed."""
    holds_what = [("vocab_size", tok.vocab_size), ("eot_id", tok.eot_id)] + \
        [("dtype", str(shards.dtype)) for shards in splits.values()]
    for field, holds in holds_what:
        if field in meta and meta[field] != holds:
            raise DataError(f"{folder / 'meta.json'} says {field}={meta[field]!r:.40}, but "
                            f"the folder's tokenizer and shards hold {holds!r}; prepare the "
                            "data again")


def _check_the_path(path: str) -> str:
    """': check the path ...' for a data.path that names nothing on disk (a typo is likelier
    than a dataset still to prepare): the file of its folder it most likely meant, or the
    first folder on the way that is missing; "" for a glob or a path that exists."""
    p = Path(path).expanduser()
    if not path or any(c in path for c in "*?[") or p.exists():
        return ""
    folder = p.parent
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    if folder != p.parent:
        return f": check the path ({word(str(folder / p.relative_to(folder).parts[0]))} does not exist)"
    try:
        near = closest(p.name, [e.name for e in folder.iterdir()][:10_000])
    except OSError:
        near = None
    return ": check the path" + (f" (did you mean {word(str(p.parent / near))}?)" if near else "")


def load_tokens(path: str = "", tokenizer: str = "char", vocab_size: int = 2048,
                val_fraction: float = 0.1, cache_dir: str = "", log=print,
                given: Tokenizer | None = None) -> TokenData:
    """Tokenized train/val splits of a corpus, prepared on first use and cached. With
    `given`, the corpus is encoded with that tokenizer instead of one learned from it."""
    if path and looks_prepared(Path(path).expanduser()):
        return _given_folder(Path(path).expanduser(), tokenizer, given, log)
    if path and (Path(path).expanduser() / "progress.json").is_file():
        raise DataError(f"{path} is a data.prepare build that did not finish; run the same "
                        "python -m data.prepare command again to complete it")
    source = str(Path(path).expanduser()) if path else str(BUNDLED_CORPUS)
    passed: list[str] = []
    files = local_files(source, passed)
    if files is None:
        raise DataError(f"corpus {path} not found{_check_the_path(path)}. To prepare a dataset there (a Hugging Face "
                        f"name or local files): python -m data.prepare SOURCE --out {word(path)}. "
                        "data.path takes a UTF-8 text file (.gz allowed), a folder or glob of "
                        "them, JSONL/CSV/Parquet files, or a prepared folder; leave it empty "
                        "for the bundled Shakespeare")
    if passed:
        log(passed_over_line(passed))
    spec = SourceSpec(source, val_fraction=val_fraction)
    open_source(spec)                 # a kind of file it cannot read: refused before any work
    size = sum(f.stat().st_size for f in files)
    if size == 0:
        raise DataError(f"{source} is empty; give data.path a file with text in it")
    # One file is hashed (a few ms per MB); a folder is keyed by names, sizes and times.
    fingerprint = ([file_sha256(f) for f in files] if len(files) == 1 else
                   [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files])
    key_extra = {"files": fingerprint, "val_fraction": val_fraction}
    tokenizer = given.kind if given is not None else tokenizer
    folder, key = _cache_folder(source, key_extra, tokenizer, vocab_size, cache_dir, given)
    folder.parent.mkdir(parents=True, exist_ok=True)
    # One build per cache folder at a time: a second training started meanwhile waits,
    # then finds the folder built.
    lock_path = folder.parent / f".{folder.name}.lock"
    lock = lock_file(lock_path, wait=False)
    if lock is None:
        log(f"another process (pid {lock_holder(lock_path)}) is building {folder}; waiting for it")
        lock = lock_file(lock_path, wait=True)
    with lock:
        return _cached(folder, key, spec, tokenizer, vocab_size, key_extra, size, given, log)


def _given_folder(folder: Path, tokenizer: str, given: Tokenizer | None, log) -> TokenData:
    """A folder data.prepare wrote, named by data.path, read as it is."""
    data = open_prepared(folder)
    if given is not None and data.tokenizer.fingerprint() != given.fingerprint():
        raise DataError(f"{folder} was prepared with another tokenizer than the model "
                        "starts from; give the corpus's text files instead, so they are "
                        "encoded with the model's own tokenizer")
    if data.tokenizer.kind != tokenizer:
        log(f"{folder} was prepared with the {data.tokenizer.kind} tokenizer "
            f"(vocabulary {data.tokenizer.vocab_size:,}); using it")
    return data


def _cached_meta(folder: Path, log=None) -> dict | None:
    """The cache folder's meta.json, or None when it has none or a damaged one: the
    cache is this project's own, so a damaged record is rebuilt (said through `log`)."""
    try:
        return read_meta(folder)
    except DamagedRecord as err:
        if log is not None:
            log(f"{err.problem}; rebuilding {folder}")
        return None


def _cache_folder(source: str, key_extra: dict, tokenizer: str, vocab_size: int,
                  cache_dir: str, given: Tokenizer | None) -> tuple[Path, dict]:
    """The cache folder of this corpus and these settings, and the key of its build."""
    first = Path(source.rstrip("/*")).name.split(".")[0] or "corpus"
    sized = TOKENIZERS[tokenizer].sized_by_setting
    name = first + f"-{tokenizer}" + (f"{vocab_size}" if sized else "")
    key = prepare_key(key_extra, tokenizer, vocab_size, CACHE_BPE_SAMPLE, CACHE_SHARD_TOKENS)
    folder = Path(cache_dir or DATA_DIR / "cache") / name
    held = _cached_meta(folder)
    # A run started from another's weights keeps its tokenizer. Where that is the one this
    # corpus's own cache was built with (a fine-tune on the same text), it reads that
    # cache; another tokenizer gets a cache of its own.
    if given is not None and not (held is not None and held["key"] == key
                                  and held["tokenizer_fingerprint"] == given.fingerprint()):
        key_extra["tokenizer"] = given.fingerprint()
        name = f"{first}-{given.kind}-{given.fingerprint()[:10]}"
        key = prepare_key(key_extra, tokenizer, vocab_size, CACHE_BPE_SAMPLE, CACHE_SHARD_TOKENS)
        folder = folder.with_name(name)
        held = _cached_meta(folder)
    if held is not None and held["key"] != key and held["source"].get("source") != source:
        # Another corpus of the same name (a/notes.txt, b/notes.txt) built this folder: a
        # folder of this path's own, rather than a rebuild over the other one's.
        folder = folder.with_name(f"{name}-{hashlib.sha256(str(Path(source).resolve()).encode()).hexdigest()[:8]}")
    return folder, key


def _cached(folder: Path, key: dict, spec: SourceSpec, tokenizer: str, vocab_size: int,
            key_extra: dict, size: int, given: Tokenizer | None, log) -> TokenData:
    """The cache folder's tokens, built (or rebuilt) first unless it holds this key's."""
    meta = _cached_meta(folder, log)
    if meta is not None and meta["key"] == key:
        try:
            return open_prepared(folder, meta)
        except DataError as err:
            log(f"{err}; rebuilding {folder}")
            clear_build(folder)                  # start over rather than trust its record
    elif meta is not None:
        log(f"{Path(spec.source).name} or the tokenizer settings changed; rebuilding {folder}")
    log(f"tokenizing {spec.source} with the {tokenizer} tokenizer into {folder} (once; cached after)")
    try:
        meta = prepare(spec, folder, tokenizer, vocab_size, tokenizer_sample=CACHE_BPE_SAMPLE,
                       shard_tokens=CACHE_SHARD_TOKENS,
                       num_proc=0 if size > PARALLEL_FROM_BYTES else 1, overwrite=True,
                       key_extra=key_extra, log=lambda *a: None,
                       progress=size > PARALLEL_FROM_BYTES, given=given)
    except DataError:                  # text it cannot read: nothing worth resuming
        clear_build(folder)
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
        raise
    s = meta["splits"]
    log(f"  {s['train']['tokens']:,} train and {s['val']['tokens']:,} val tokens, "
        f"vocabulary {meta['vocab_size']}")
    return open_prepared(folder, meta)


SAMPLINGS = {    # how training windows are drawn (data.sampling)
    "random": "every window at a random start, with replacement, as nanoGPT draws them",
    "epochs": "passes over the text, each in a new random order of back-to-back windows "
              "from a random offset: every token a target once a pass",
}


class Batches:
    """Windows of block_size + 1 tokens: x is the window less its last token, y the
    window shifted by one, so position t learns to predict token t + 1.

    `sampling` "random" draws each start anew. Over a few passes of a small corpus that
    leaves text unread: at three passes' worth of draws about 5% of the tokens are never
    a target (e^-3) and 15% once, while others are read six times. "epochs" reads the
    text in passes instead, as random reshuffling does for SGD: back-to-back windows
    (each one's last token the next one's first, so every token is a target once) from
    an offset drawn per pass, in an order drawn per pass.

    The draws come from the batches' own generator. Its state at the start of the pass
    and the position in it are saved with a checkpoint (state_dict), so a resumed run
    sees exactly the batches it would have seen."""

    def __init__(self, tokens: Shards | np.ndarray, batch_size: int, block_size: int,
                 device: str | torch.device = "cpu", seed: int = 0, split: str = "train",
                 sampling: str = "random"):
        self.tokens = tokens if isinstance(tokens, Shards) else Shards([np.asarray(tokens)])
        self.window = block_size + 1
        self.n_starts = int(self.tokens.starts(self.window).sum())
        if self.n_starts < 1:
            raise DataError(
                f"the {split} split has {len(self.tokens):,} tokens, too few for one window of "
                f"model.block_size + 1 = {block_size + 1}; use a longer corpus or a "
                "smaller model.block_size")
        if sampling not in SAMPLINGS:
            raise DataError(f"unknown data.sampling {sampling!r}; valid choices: {', '.join(SAMPLINGS)}")
        self.batch_size, self.block_size, self.sampling = batch_size, block_size, sampling
        self.device = torch.device(device)
        self.generator = torch.Generator().manual_seed(seed)
        self.pass_state: torch.Tensor | None = None     # the generator before this pass's draws
        self.order: np.ndarray | None = None            # this pass's window starts, in order
        self.position = 0                               # windows of it read

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.load(self.draw())

    def draw(self) -> np.ndarray:
        """The next batch's window starts (Shards.gather's numbering)."""
        if self.sampling == "random":
            return torch.randint(self.n_starts, (self.batch_size,), generator=self.generator).numpy()
        starts = []
        while len(starts) < self.batch_size:     # a batch may end one pass and begin the next
            if self.order is None or self.position >= len(self.order):
                self._begin_pass()
            take = min(self.batch_size - len(starts), len(self.order) - self.position)
            starts.extend(self.order[self.position:self.position + take])
            self.position += take
        return np.asarray(starts, dtype=np.int64)

    def _begin_pass(self) -> None:
        self.pass_state = self.generator.get_state()
        stride = min(self.block_size, self.n_starts)
        offset = int(torch.randint(stride, (1,), generator=self.generator))
        order = torch.arange(offset, self.n_starts, stride)
        self.order = order[torch.randperm(len(order), generator=self.generator)].numpy()
        self.position = 0

    def spaced(self, n_batches: int):
        """`n_batches` batches whose windows start at evenly spaced points from the
        split's first window to its last: a systematic sample of the whole split, the
        same every time. Text changes along a corpus (the acts of a play, the modules of
        a library), and windows drawn at random can land on an easier or a harder stretch
        by chance: a fixed draw of 20 random batches of tiny Shakespeare's validation text
        scored two trained models 0.029 and 0.035 below their loss on the whole text.
        Spaced windows put each stretch in the sample in proportion; a sample still errs
        either way (20 spaced batches said 1.517 of a model whose whole-split
        loss is 1.497), so --budget reads the whole split where its time allows."""
        count = n_batches * self.batch_size
        starts = np.linspace(0, self.n_starts - 1, count).round().astype(np.int64)
        for i in range(n_batches):
            yield self.load(starts[i * self.batch_size:(i + 1) * self.batch_size])

    def load(self, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch of windows at these start indices (Shards.gather's numbering)."""
        window = torch.from_numpy(self.tokens.gather(starts, self.window))
        if self.device.type == "cuda":
            window = window.pin_memory().to(self.device, non_blocking=True)
        else:
            window = window.to(self.device)
        return window[:, :-1], window[:, 1:]

    def skip(self) -> None:
        """Draw a batch's starting points without reading it (another rank's share)."""
        self.draw()

    def state_dict(self) -> dict:
        """{"generator": a state to set it to, "position": windows read of the pass that
        state begins (-1: none begun: "random", or "epochs" before its first batch)}."""
        if self.pass_state is None:
            return {"generator": self.generator.get_state(), "position": -1}
        return {"generator": self.pass_state, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.pass_state, self.order, self.position = None, None, 0
        position = state.get("position", -1)
        if position < -1:
            raise ValueError(f"a position in a pass of {position} windows read")
        if self.sampling == "epochs" and position >= 0:
            self._begin_pass()                  # the same draws again, from the same state
            if position > len(self.order):
                raise ValueError(f"{position} windows read of a pass of {len(self.order)}")
            self.position = position
