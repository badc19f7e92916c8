"""Where documents come from, as one stream of text pieces for data/prepare.py.

Three kinds of source, told apart by what the argument names:
* local text files (a file, a folder, or a glob of .txt/.md/.txt.gz): each file is one
  document; the last `val_fraction` of the bytes is the validation split (for a single
  file that is nanoGPT's Shakespeare split: first 90% train, last 10% validation);
* local JSONL, JSON, CSV or Parquet files, read by the `datasets` builders in streaming
  mode (no copy in the Arrow cache), one document per record's text column;
* a Hugging Face Hub dataset name ("roneneldan/TinyStories"), loaded with
  `datasets.load_dataset`, streamed with `streaming=True`.
For records, every k-th document (k = round(1 / val_fraction)) is a validation document,
a rule that needs no document count and so works on streams; or the dataset's own split
(`val_split="validation"`).

The stream is deterministic: the same source and settings give the same pieces in the
same order, which is what lets a build resume by counting the pieces it has done.
A piece is at most about a megabyte, cut where byte-level BPE would cut anyway, so a
huge file never has to sit in memory whole.
"""
from __future__ import annotations

import codecs
import contextlib
import glob
import gzip
import os
import socket
import stat
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator
from urllib.parse import urlparse

from common.errors import DataError
from common.files import file_kind, open_plain
from common.shell import word

TEXT_SUFFIXES = (".txt", ".md", ".text", ".txt.gz", ".md.gz")
RECORD_BUILDERS = {".jsonl": "json", ".json": "json", ".jsonl.gz": "json", ".json.gz": "json",
                   ".csv": "csv", ".parquet": "parquet"}
PIECE_CHARS = 1 << 20
SNIFFED_FILES, SNIFF_BYTES = 16, 1 << 16   # checked for text before the build starts
HUB_TIMEOUT_S = 3.0

Piece = tuple[str, str, bool]            # (split, text, last piece of its document)


@dataclass
class SourceSpec:
    source: str                          # path, folder, glob, or a Hub dataset name
    config_name: str = ""                # Hub dataset configuration ("sample-10BT")
    split: str = "train"                 # Hub split to read
    val_split: str = ""                  # Hub split to use for validation (else every k-th doc)
    text_column: str = "text"
    streaming: bool = False              # Hub only; local record files always stream
    max_docs: int = 0                    # 0 = all
    max_bytes: int = 0                   # 0 = all
    val_fraction: float = 0.1

    def validate(self) -> None:
        if not 0.0 < self.val_fraction < 1.0:
            raise DataError(f"the validation fraction must be between 0 and 1, got {self.val_fraction}")
        if self.max_docs < 0 or self.max_bytes < 0:
            raise DataError("max_docs and max_bytes must be 0 (everything) or positive")


def suffix_of(path: Path) -> str:
    name = path.name.lower()
    for suffix in sorted((*TEXT_SUFFIXES, *RECORD_BUILDERS), key=len, reverse=True):
        if name.endswith(suffix):
            return suffix
    return path.suffix.lower()


def local_files(source: str, passed: list[str] | None = None) -> list[Path] | None:
    """The files a local source names, or None when it names nothing on disk. A folder
    or glob may also hold entries named like text that are not plain files (a named
    pipe, a folder called notes.txt, a link to nothing or to /dev/zero): they are left
    out without being opened, and each is added to `passed` with what it is."""
    path = Path(source).expanduser()
    if path.is_file():
        return [path]
    if path.exists() and not path.is_dir():
        raise DataError(f"{path} is not a file or folder of text ({file_kind(path.stat().st_mode)}); "
                        "give a UTF-8 text file (.gz allowed), a folder or glob of them, "
                        "JSONL/CSV/Parquet files, or a prepared folder")
    if path.is_dir():
        named = sorted(p for p in path.rglob("*") if suffix_of(p) in (*TEXT_SUFFIXES, *RECORD_BUILDERS))
        files = _plain_files(named, passed)
        if not files:
            raise DataError(f"folder {path} holds no text (.txt, .md) or record (.jsonl, .csv, "
                            f".parquet) files{_passed_note(named, files)}")
        return files
    if glob.has_magic(source):
        named = sorted(Path(p) for p in glob.glob(os.path.expanduser(source), recursive=True))
        files = _plain_files(named, passed)
        if not files:
            raise DataError(f"no files match {source}{_passed_note(named, files)}")
        return files
    return None


def _plain_files(paths: list[Path], passed: list[str] | None) -> list[Path]:
    """The plain files among `paths` (symlinks followed); the rest noted in `passed`."""
    files = []
    for path in paths:
        why = not_plain(path)
        if why is None:
            files.append(path)
        elif passed is not None:
            passed.append(f"{path} ({why})")
    return files


def _passed_note(named: list[Path], files: list[Path]) -> str:
    others = [f"{p} ({not_plain(p)})" for p in named if p not in files]
    return f" ({passed_over_line(others)})" if others else ""


def not_plain(path: Path) -> str | None:
    """What `path` is when it is not a plain file (None when it is), found by stat alone."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return "a link to nothing" if path.is_symlink() else "gone"
    except OSError as err:
        return f"cannot be read: {err.strerror or err}"
    if stat.S_ISREG(mode):
        return None
    return ("a link to " if path.is_symlink() else "") + file_kind(mode)


def passed_over_line(passed: list[str], shown: int = 3) -> str:
    """One line for the entries a folder or glob held that are not plain files."""
    more = f" and {len(passed) - shown:,} more" if len(passed) > shown else ""
    return (f"passed over {len(passed):,} entr{'y' if len(passed) == 1 else 'ies'} that "
            f"{'is' if len(passed) == 1 else 'are'} not a plain file: "
            + ", ".join(passed[:shown]) + more)


def open_source(spec: SourceSpec) -> "Source":
    spec.validate()
    passed: list[str] = []
    files = local_files(spec.source, passed)
    source = _source_of(spec, files)
    source.passed_over = passed
    return source


def _source_of(spec: SourceSpec, files: list[Path] | None) -> "Source":
    if files is None:
        if spec.source.startswith((".", "/", "~")) or Path(spec.source).suffix:
            raise DataError(f"{spec.source} not found: give a text file, a folder, a glob, "
                            "or a Hugging Face dataset name such as roneneldan/TinyStories")
        return HubSource(spec)
    kinds = {suffix_of(f) in TEXT_SUFFIXES for f in files}
    if kinds == {True}:
        return TextSource(spec, files)
    builders = {RECORD_BUILDERS.get(suffix_of(f)) for f in files}
    if len(builders) == 1 and None not in builders:
        return RecordSource(spec, files, builders.pop())
    suffixes = sorted({suffix_of(f) or "(no suffix)" for f in files})
    known = (*TEXT_SUFFIXES, *RECORD_BUILDERS)
    unknown = [x for x in suffixes if x not in known]
    if unknown:
        raise DataError(f"{spec.source}: {', '.join(unknown)} is not a kind of file the project "
                        f"reads; give text ({', '.join(TEXT_SUFFIXES)}) or record files "
                        f"({', '.join(RECORD_BUILDERS)}), renaming a text file to .txt if it is one")
    raise DataError(f"{spec.source} mixes file types ({', '.join(suffixes)}); "
                    "give text files or one kind of record file (.jsonl, .csv or .parquet)")


def cut_pieces(text: str, limit: int = PIECE_CHARS) -> Iterator[str]:
    """Split text into pieces of at most about `limit` characters, preferably after a
    newline that a printable character follows (where byte-level BPE's pre-tokenizer
    starts a new word anyway), so the pieces tokenize as the whole text does."""
    while len(text) > limit:
        cut = _safe_cut(text, limit)
        yield text[:cut]
        text = text[cut:]
    if text:
        yield text


def _safe_cut(text: str, limit: int) -> int:
    at = limit
    while True:
        at = text.rfind("\n", limit // 2, at)
        if at < 0:
            break
        if "!" <= text[at + 1] <= "~":
            return at + 1
    at = text.rfind(" ", limit // 2, limit)
    while at > limit // 2:                         # " " between two printable characters
        if "!" <= text[at - 1] <= "~" and "!" <= text[at + 1] <= "~":
            return at
        at = text.rfind(" ", limit // 2, at)
    return limit


def _char_start(block: bytes, at: int) -> int:
    """The first index at or after `at` that does not continue a UTF-8 character."""
    while at < len(block) and 0x80 <= block[at] < 0xC0:
        at += 1
    return at


@contextlib.contextmanager
def reading(path: Path):
    """A corpus file opened for reading (through gzip for .gz), only when it is a plain
    file: a named pipe or device put in its place since the folder was listed is refused
    rather than waited on. A read that fails is one DataError naming this file, not the
    folder being written."""
    try:
        raw = open_plain(path)
    except ValueError as err:
        raise DataError(f"corpus file {path} {err}; give plain text files") from None
    except OSError as err:
        raise _unreadable(path, err) from None
    gz = path.name.endswith(".gz")
    try:
        with raw, (gzip.GzipFile(fileobj=raw, mode="rb") if gz else contextlib.nullcontext(raw)) as f:
            yield f
    except (OSError, EOFError, zlib.error) as err:
        raise _unreadable(path, err) from None


def _unreadable(path: Path, err: Exception) -> DataError:
    what = "readable gzip" if path.name.endswith(".gz") else "readable"
    reason = getattr(err, "strerror", None) or err
    return DataError(f"corpus file {path} is not {what} ({reason}); check it (or leave it out of "
                     "the corpus) and run the same command again")


class Source:
    spec: SourceSpec
    total_bytes: int | None = None               # for the progress bar, when known
    val_rule: str = ""
    newline_docs = False     # records: separate documents by a newline when there is no end-of-text token
    passed_over: list[str] = []  # entries of a folder or glob left out: not plain files

    def pieces(self) -> Iterator[Piece]:
        raise NotImplementedError

    def describe(self) -> dict:
        raise NotImplementedError


class TextSource(Source):
    BLOCK = 1 << 20                      # bytes read at a time

    def __init__(self, spec: SourceSpec, files: list[Path]):
        self.spec, self.files = spec, files
        if spec.max_docs:
            self.files = files[:spec.max_docs]
        sizes = [self._size(f) for f in self.files]
        total = sum(sizes)
        if spec.max_bytes:
            total = min(total, spec.max_bytes)
        if total == 0:
            raise DataError(f"{spec.source} is empty; give data.path a file with text in it")
        for path in self.files[:SNIFFED_FILES]:     # the usual faults, before any work
            with reading(path) as f:
                self._decode(path, codecs.getincrementaldecoder("utf-8")(), f.read(SNIFF_BYTES))
        self.total_bytes = total
        self.cut = int(total * (1.0 - spec.val_fraction))
        self.val_rule = f"the last {spec.val_fraction:.0%} of the bytes (from byte {self.cut:,})"

    @staticmethod
    def _size(path: Path) -> int:
        if not path.name.endswith(".gz"):
            return path.stat().st_size
        with reading(path) as f:
            return sum(len(block) for block in iter(lambda: f.read(1 << 22), b""))

    def describe(self) -> dict:
        return {"kind": "text files", "source": self.spec.source,
                "files": [str(f) for f in self.files][:100], "n_files": len(self.files)}

    def pieces(self) -> Iterator[Piece]:
        # Each file's run of one split is decoded on its own (a fresh UTF-8 decoder),
        # and handed on in pieces of at most PIECE_CHARS characters.
        current, path_of, decoder, carry = None, None, None, ""
        for index, path, split, data in self._parts():
            if (index, split) != current:
                if current is not None:
                    yield from self._flush(path_of, decoder, carry, current[1])
                current, path_of, carry = (index, split), path, ""
                decoder = codecs.getincrementaldecoder("utf-8")()
            carry += self._decode(path, decoder, data)
            if len(carry) > PIECE_CHARS:
                *done, carry = list(cut_pieces(carry))
                yield from ((split, piece, False) for piece in done)
        if current is not None:
            yield from self._flush(path_of, decoder, carry, current[1])

    def _parts(self) -> Iterator[tuple[int, Path, str, bytes]]:
        """(file index, file, split, bytes) in reading order, at most total_bytes in
        all. The split point moves forward off UTF-8 continuation bytes, so validation
        never starts inside a character (at a block's end: into the next block)."""
        offset, cut = 0, self.cut
        for index, path in enumerate(self.files):
            for block in self._blocks(path, self.total_bytes - offset):
                if offset <= cut < offset + len(block):
                    cut = offset + _char_start(block, cut - offset)
                at = min(max(cut - offset, 0), len(block))
                parts = (("train", block[:at]), ("val", block[at:]))
                yield from ((index, path, split, data) for split, data in parts if data)
                offset += len(block)

    def _blocks(self, path: Path, budget: int) -> Iterator[bytes]:
        with reading(path) as f:
            while budget > 0:
                block = f.read(self.BLOCK)[:budget]
                if not block:
                    return
                budget -= len(block)
                yield block

    def _decode(self, path, decoder, data: bytes, final: bool = False) -> str:
        try:
            text = decoder.decode(data, final)
        except UnicodeDecodeError as err:     # its position counts from the block read, not the file
            raise DataError(f"corpus file {path} is not readable UTF-8 text (byte "
                            f"0x{err.object[err.start]:02x}: {err.reason}); give a UTF-8 text "
                            "file (iconv -f LATIN1 -t UTF-8 converts one saved as Latin-1)") from None
        if "\0" in text:       # valid UTF-8, but text has no NUL: a binary file, or UTF-16
            raise DataError(f"corpus file {path} holds NUL bytes, so it is not text (a binary "
                            "file, or text saved as UTF-16); give a UTF-8 text file")
        return text

    def _flush(self, path, decoder, carry, split):
        # A --max-bytes slice may end inside a character: drop its first bytes then.
        carry += self._decode(path, decoder, b"", final=not self.spec.max_bytes)
        if carry:
            yield split, carry, True


class _DocumentSource(Source):
    """Records: one document per row; the split comes from a rule or the dataset."""
    newline_docs = True

    def _dataset(self, split: str):
        raise NotImplementedError

    def pieces(self) -> Iterator[Piece]:
        spec = self.spec
        self.skipped: dict[str, int] = {}             # records without text, by what they held
        if spec.val_split:
            yield from self._documents(self._dataset(spec.split), lambda i: "train")
            yield from self._documents(self._dataset(spec.val_split), lambda i: "val")
        else:
            k = max(2, round(1.0 / spec.val_fraction))
            yield from self._documents(self._dataset(spec.split),
                                       lambda i: "val" if i % k == k - 1 else "train")

    @property
    def val_rule(self) -> str:
        if self.spec.val_split:
            return f"the dataset's {self.spec.val_split!r} split"
        k = max(2, round(1.0 / self.spec.val_fraction))
        return f"every {k}th document"

    def _documents(self, dataset, split_of) -> Iterator[Piece]:
        spec, column = self.spec, self.spec.text_column
        n_docs = n_bytes = 0
        for batch in _checked(dataset.iter(batch_size=256), spec.source):
            if column not in batch:
                raise DataError(f"{spec.source} has no column {column!r}; its columns are "
                                f"{', '.join(batch)}; {_choose_column(spec.source)}")
            for text in batch[column]:
                if not isinstance(text, str) or not text:   # missing, empty or not text
                    kind = "empty" if text == "" else "null" if text is None else type(text).__name__
                    self.skipped[kind] = self.skipped.get(kind, 0) + 1
                    continue
                split = split_of(n_docs)
                *head, last = cut_pieces(text)
                for piece in head:
                    yield split, piece, False
                yield split, last, True
                n_docs += 1
                n_bytes += len(text.encode("utf-8"))
                if (spec.max_docs and n_docs >= spec.max_docs) or \
                        (spec.max_bytes and n_bytes >= spec.max_bytes):
                    return
        not_text = {k: n for k, n in self.skipped.items() if k not in ("empty", "null")}
        if not n_docs and not_text:
            raise DataError(f"column {column!r} of {spec.source} holds "
                            f"{', '.join(f'{n:,} {k}' for k, n in not_text.items())} values, "
                            f"not text; {_choose_column(spec.source)}")


def _choose_column(source: str) -> str:
    """How to name the column with the text: data.prepare's --text-column (train.py reads
    a file's `text` column, and has no option of its own for another)."""
    return (f"name the column with the text: python -m data.prepare {word(source)} --text-column "
            "NAME --out data/mine, then train with --data.path=data/mine")


def _checked(batches, source: str):
    """The dataset's batches, with a failure while reading turned into one clear line."""
    try:
        yield from batches
    except DataError:
        raise
    except Exception as err:  # noqa: BLE001 - the builders raise many types for bad files
        raise DataError(f"reading {source} failed ({type(err).__name__}: {err})") from None


class RecordSource(_DocumentSource):
    def __init__(self, spec: SourceSpec, files: list[Path], builder: str):
        if spec.val_split:
            raise DataError("--val-split names a split of a Hub dataset; local files are split "
                            "by --val-fraction")
        self.spec, self.files, self.builder = spec, files, builder
        self.total_bytes = spec.max_bytes or sum(f.stat().st_size for f in files)

    def describe(self) -> dict:
        return {"kind": f"{self.builder} files", "source": self.spec.source,
                "files": [str(f) for f in self.files][:100], "n_files": len(self.files),
                "text_column": self.spec.text_column}

    def _dataset(self, split: str):
        import datasets
        # Its builders log a file they cannot parse ("Failed to load JSON from file ...")
        # before raising; the DataError below says it in the one line a refusal gets.
        datasets.logging.set_verbosity(datasets.logging.CRITICAL)
        try:
            return datasets.load_dataset(self.builder, data_files=[str(f) for f in self.files],
                                         split="train", streaming=True)
        except Exception as err:  # the builders raise many types for unreadable files
            raise DataError(f"datasets could not read {self.spec.source} as {self.builder} "
                            f"({type(err).__name__}: {err})") from None


def hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def hub_reachable(timeout: float = HUB_TIMEOUT_S) -> bool:
    """Can this machine open a connection to the Hub? A few seconds at most, where
    `datasets` itself would retry for half a minute before giving up."""
    url = urlparse(hub_endpoint())
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=timeout):
            return True
    except OSError:
        return False


def go_offline() -> None:
    """Make datasets and huggingface_hub use their local cache only, even if imported."""
    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    import sys
    if "huggingface_hub" in sys.modules:
        sys.modules["huggingface_hub"].constants.HF_HUB_OFFLINE = True
    if "datasets" in sys.modules:
        sys.modules["datasets"].config.HF_HUB_OFFLINE = True


class HubSource(_DocumentSource):
    def __init__(self, spec: SourceSpec):
        self.spec = spec
        self.total_bytes = spec.max_bytes or None
        self.offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
        if not self.offline and not hub_reachable():
            self.offline = True
            go_offline()
        self._dataset(spec.split)                  # fail now, not after training a tokenizer

    def describe(self) -> dict:
        s = self.spec
        return {"kind": "Hugging Face dataset", "source": s.source, "config": s.config_name,
                "split": s.split, "val_split": s.val_split, "text_column": s.text_column,
                "streaming": s.streaming}

    def _dataset(self, split: str):
        import datasets
        s = self.spec
        try:
            ds = datasets.load_dataset(s.source, s.config_name or None, split=split,
                                       streaming=s.streaming)
        except Exception as err:  # noqa: BLE001 - datasets raises many types here
            if self.offline:
                raise DataError(
                    f"the Hugging Face Hub ({hub_endpoint()}) cannot be reached from this "
                    f"machine and {s.source!r} is not in the local datasets cache. Prepare it "
                    "where there is a network, or download its files and pass them instead: "
                    f"python -m data.prepare path/to/files/*.jsonl --text-column {s.text_column} "
                    "(text, JSONL, CSV and Parquet files work offline)") from None
            raise DataError(f"datasets could not load {s.source!r} (config "
                            f"{s.config_name or 'default'}, split {split!r}): "
                            f"{type(err).__name__}: {err}") from None
        if s.max_docs and not s.streaming:
            ds = ds.select(range(min(s.max_docs, len(ds))))
        return ds
