"""From a text file to cached token files, and from those to training batches.

The first run on a corpus tokenizes it into `train.bin` / `val.bin` (flat uint16
arrays, uint32 when the vocabulary passes 65,535) plus `tokenizer.json` and
`meta.json` in a cache folder. Later runs memory-map those files. The cache is keyed
by the hash of the source file and the tokenizer settings; when either changes it is
rebuilt. meta.json is written last, so a build that dies half way is never mistaken
for a finished one.
"""
from __future__ import annotations

import gzip
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from attnlab.errors import DataError
from attnlab.files import file_sha256, write_json_atomic
from data.tokenizer import BPETokenizer, Tokenizer, line_chunks, train_tokenizer

DATA_DIR = Path(__file__).resolve().parent
BUNDLED_CORPUS = DATA_DIR / "shakespeare" / "plays.txt.gz"
FORMAT_VERSION = 1


def read_text(path: Path) -> str:
    """A UTF-8 text file (gzip-compressed when it ends in .gz), checked for use."""
    if not path.is_file():
        raise DataError(f"corpus file {path} not found; set data.path to a UTF-8 text "
                        "file, or leave it empty to use the bundled Shakespeare corpus")
    try:
        raw = gzip.open(path).read() if path.suffix == ".gz" else path.read_bytes()
        text = raw.decode("utf-8")
    except (UnicodeDecodeError, OSError, EOFError) as err:
        raise DataError(f"corpus file {path} is not readable UTF-8 text ({err})") from None
    if not text.strip():
        raise DataError(f"corpus file {path} is empty; give data.path a file with text in it")
    return text


@dataclass
class TokenData:
    train: np.ndarray            # memory-mapped token ids
    val: np.ndarray
    tokenizer: Tokenizer
    meta: dict
    directory: Path

    @property
    def bits_unit(self) -> str:
        """Character models report bits per character, BPE models bits per byte."""
        return "bpc" if self.tokenizer.kind == "char" else "bpb"

    def bits(self, loss: float) -> float:
        """Convert a per-token loss in nats to bits per character (char) or byte (BPE)."""
        per = self.meta["val_chars"] if self.tokenizer.kind == "char" else self.meta["val_bytes"]
        return loss / math.log(2) * self.meta["val_tokens"] / per


def cache_key(source: Path, tokenizer: str, vocab_size: int, val_fraction: float) -> dict:
    return {"format": FORMAT_VERSION, "source_sha256": file_sha256(source),
            "tokenizer": tokenizer, "vocab_size": vocab_size if tokenizer == "bpe" else None,
            "val_fraction": val_fraction}


def load_tokens(path: str = "", tokenizer: str = "char", vocab_size: int = 2048,
                val_fraction: float = 0.1, cache_dir: str = "", log=print) -> TokenData:
    """Tokenized train/val splits of a corpus, built on first use and cached."""
    source = Path(path).expanduser() if path else BUNDLED_CORPUS
    if not source.is_file():
        read_text(source)                                   # raises the clear message
    key = cache_key(source, tokenizer, vocab_size, val_fraction)
    name = source.name.split(".")[0] + f"-{tokenizer}" + (f"{vocab_size}" if tokenizer == "bpe" else "")
    folder = Path(cache_dir or DATA_DIR / "cache") / name
    meta_path = folder / "meta.json"
    meta = _read_meta(meta_path)
    tok = None
    if meta is not None and meta.get("key") == key:
        try:
            tok = Tokenizer.load(folder)
        except Exception:
            tok = None
        if tok is None or tok.fingerprint() != meta.get("tokenizer_fingerprint"):
            log(f"tokenizer in {folder} changed; rebuilding the token cache")
            tok = None
    if tok is None:
        if meta is not None:
            log(f"{source.name} or the tokenizer settings changed; rebuilding {folder}")
        meta, tok = _build(source, folder, key, tokenizer, vocab_size, val_fraction, log)
    dtype = np.dtype(meta["dtype"])
    splits = {}
    for split in ("train", "val"):
        file = folder / f"{split}.bin"
        if not file.is_file() or file.stat().st_size != meta[f"{split}_tokens"] * dtype.itemsize:
            meta_path.unlink(missing_ok=True)
            raise DataError(f"token file {file} is missing or truncated; run again to rebuild it")
        splits[split] = np.memmap(file, dtype=dtype, mode="r")
    return TokenData(splits["train"], splits["val"], tok, meta, folder)


def _read_meta(meta_path: Path) -> dict | None:
    try:
        return json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _build(source, folder, key, kind, vocab_size, val_fraction, log):
    log(f"tokenizing {source} with the {kind} tokenizer into {folder} (once; cached after)")
    text = read_text(source)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "meta.json").unlink(missing_ok=True)          # invalid until rebuilt
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"data.val_fraction must be between 0 and 1, got {val_fraction}")
    # Split the text, not the tokens, so every tokenizer sees the same validation text
    # (as nanoGPT does for Shakespeare: first 90% train, last 10% val).
    cut = int(len(text) * (1.0 - val_fraction))
    texts = {"train": text[:cut], "val": text[cut:]}
    # The character vocabulary comes from the whole text, so validation has no unknowns;
    # BPE learns its merges from the training split only.
    tok = train_tokenizer(kind, text if kind == "char" else texts["train"], vocab_size)
    dtype = np.uint16 if tok.vocab_size <= 65535 else np.uint32
    meta = {"key": key, "source": str(source), "tokenizer": kind, "vocab_size": tok.vocab_size,
            "dtype": np.dtype(dtype).name, "tokenizer_fingerprint": tok.fingerprint()}
    for split, part in texts.items():
        if isinstance(tok, BPETokenizer):
            ids = [i for batch in line_chunks(part, 200) for i in tok.encode(batch)]
        else:
            ids = tok.encode(part)
        arr = np.asarray(ids, dtype=dtype)
        tmp = folder / f"{split}.bin.tmp"
        arr.tofile(tmp)
        os.replace(tmp, folder / f"{split}.bin")
        meta[f"{split}_tokens"] = int(arr.size)
        meta[f"{split}_chars"] = len(part)
        meta[f"{split}_bytes"] = len(part.encode("utf-8"))
    tok.save(folder)
    write_json_atomic(folder / "meta.json", meta)
    log(f"  {meta['train_tokens']:,} train and {meta['val_tokens']:,} val tokens, "
        f"vocabulary {tok.vocab_size}")
    return meta, tok


class Batches:
    """Random windows of block_size + 1 tokens: x is the window less its last token,
    y the window shifted by one, so position t learns to predict token t + 1.

    The draw comes from its own generator, whose state is saved with a checkpoint;
    a resumed run therefore sees exactly the batches it would have seen."""

    def __init__(self, tokens: np.ndarray, batch_size: int, block_size: int,
                 device: str | torch.device = "cpu", seed: int = 0, split: str = "train"):
        if len(tokens) < block_size + 2:
            raise DataError(
                f"the {split} split has {len(tokens):,} tokens, too few for one window of "
                f"model.block_size + 1 = {block_size + 1}; use a longer corpus or a "
                "smaller model.block_size")
        self.tokens, self.batch_size, self.block_size = tokens, batch_size, block_size
        self.device = torch.device(device)
        self.generator = torch.Generator().manual_seed(seed)
        self.offsets = np.arange(block_size + 1)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(len(self.tokens) - self.block_size - 1, (self.batch_size,),
                               generator=self.generator).numpy()
        window = torch.from_numpy(self.tokens[starts[:, None] + self.offsets].astype(np.int64))
        if self.device.type == "cuda":
            window = window.pin_memory().to(self.device, non_blocking=True)
        else:
            window = window.to(self.device)
        return window[:, :-1], window[:, 1:]

    def skip(self) -> None:
        """Draw a batch's starting points without reading it (another rank's share)."""
        torch.randint(len(self.tokens) - self.block_size - 1, (self.batch_size,),
                      generator=self.generator)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
