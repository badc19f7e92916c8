"""Token shard files: a 32-byte header, then the token ids as a flat array.

Header (little-endian): magic b"ATTNTOKS", format version (uint32), bytes per token
(uint32: 2 for uint16, 4 for uint32), token count (uint64), 8 reserved bytes. A reader
checks all four against the file size, so a truncated or foreign file is refused with
its path instead of training on garbage.

`ShardWriter` fills fixed-size shards in order. The shard being filled is written as
`<split>_NNNNNN.bin.partial`; when it is full its header gets the final count and it is
renamed to `<split>_NNNNNN.bin`, so a finished shard never changes again. `Shards` is
the reader: any number of memory-mapped shards of one split, sampled as one stream.
"""
from __future__ import annotations

import os
import stat
import struct
from pathlib import Path

import numpy as np

from common.errors import DataError
from common.files import inside, open_plain
from common.shell import word

MAGIC = b"ATTNTOKS"
VERSION = 1
HEADER = struct.Struct("<8sIIQ8x")            # magic, version, itemsize, count, reserved
HEADER_BYTES = HEADER.size                     # 32
DTYPES = {2: np.dtype(np.uint16), 4: np.dtype(np.uint32)}


class CannotResume(DataError):
    """The recorded progress of a build does not match its files: start it over."""


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (the common case: half the disk and memory traffic)."""
    return DTYPES[2] if vocab_size <= 65535 else DTYPES[4]


def shard_name(split: str, index: int) -> str:
    return f"{split}_{index:06d}.bin"


def prepare_again(path: Path) -> str:
    """What to do about a damaged shard at `path`: its folder prepared again, with the
    command that does it (the source is the one the folder was prepared from)."""
    return (f"prepare the folder again from its corpus: python -m data.prepare SOURCE --out "
            f"{word(str(Path(path).parent))} --overwrite")


def read_header(f, path: Path) -> tuple[np.dtype, int]:
    """The dtype and token count of the open shard `f` (at `path`), checked against its size."""
    raw = f.read(HEADER_BYTES)
    if len(raw) < HEADER_BYTES:
        raise DataError(f"token shard {path} is shorter than its header; {prepare_again(path)}")
    magic, version, itemsize, count = HEADER.unpack(raw)
    if magic != MAGIC:
        raise DataError(f"{path} is not an attnlab token shard (bad magic {magic!r}); "
                        f"{prepare_again(path)}")
    if version != VERSION or itemsize not in DTYPES:
        raise DataError(f"token shard {path} has format version {version}, token size "
                        f"{itemsize}; this attnlab reads version {VERSION} with 2 or 4 bytes: "
                        f"{prepare_again(path)}")
    expected = HEADER_BYTES + count * itemsize
    size = os.fstat(f.fileno()).st_size
    if size != expected:
        raise DataError(f"token shard {path} is {size:,} bytes but its header promises "
                        f"{expected:,} ({count:,} tokens); it is truncated or corrupt: "
                        f"{prepare_again(path)}")
    return DTYPES[itemsize], count


def open_shard(path: Path) -> np.ndarray:
    """The token ids of the shard at `path`, memory-mapped. Only a plain file is opened
    (a named pipe would wait for a writer forever, a device never end); anything else,
    or a file that cannot be read, is refused with its path."""
    try:
        f = open_plain(path)
    except ValueError as err:
        raise DataError(f"token shard {path} {err}; prepare the data again") from None
    except OSError as err:
        raise DataError(f"token shard {path} cannot be read ({err.strerror or err}); "
                        "prepare the data again") from None
    with f:
        dtype, count = read_header(f, path)
        if count == 0:
            return np.zeros(0, dtype=dtype)
        try:
            return np.memmap(f, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(count,))
        except OSError as err:             # out of address space or of maps a process may hold
            raise DataError(f"token shard {path} cannot be mapped into memory "
                            f"({err.strerror or err})") from None


class ShardWriter:
    """Appends token ids to `<split>_NNNNNN.bin` shards of `shard_tokens` tokens each.

    `state()` is what a resumable build records after flushing; `ShardWriter(...,
    state=...)` reopens the partial shard and cuts it back to that length, so tokens
    written after the last record are dropped and written again."""

    def __init__(self, folder: Path, split: str, dtype: np.dtype, shard_tokens: int,
                 state: dict | None = None):
        if shard_tokens < 1:
            raise DataError(f"shard size must be at least one token, got {shard_tokens}")
        self.folder, self.split, self.dtype = Path(folder), split, np.dtype(dtype)
        self.shard_tokens = shard_tokens
        self.done = 0                                  # finished shards
        self.filled = 0                                # tokens in the partial shard
        self.total = 0
        if state:
            self.done, self.filled = state["shards"], state["partial_tokens"]
            self.total = self.done * shard_tokens + self.filled
        self._clean_beyond_state()
        self.file = self._open_partial(truncate_to=self.filled)

    def _path(self, index: int, partial: bool) -> Path:
        return self.folder / (shard_name(self.split, index) + (".partial" if partial else ""))

    def _clean_beyond_state(self) -> None:
        # A shard finished after the last recorded state goes back to being the partial
        # one (it holds the recorded tokens plus some to redo); later ones are removed.
        finished_late = self._path(self.done, partial=False)
        if finished_late.exists():
            os.replace(finished_late, self._path(self.done, partial=True))
        for path in self.folder.glob(f"{self.split}_*.bin*"):
            number = path.name[len(self.split) + 1:].split(".")[0]
            if not number.isdigit():                     # not a shard's name: not ours
                continue
            index = int(number)
            if index > self.done or (index == self.done and not path.name.endswith(".partial")):
                path.unlink()

    def _open_partial(self, truncate_to: int = 0):
        path = self._path(self.done, partial=True)
        expected = HEADER_BYTES + truncate_to * self.dtype.itemsize
        if truncate_to:
            # Written into only when it is a plain file of this folder: never through a
            # link to a file elsewhere, nor a pipe that would wait for a reader.
            info = os.lstat(path) if os.path.lexists(path) else None
            if info is None or not stat.S_ISREG(info.st_mode) or info.st_size < expected:
                raise CannotResume(f"{path} is not a plain file as long as the recorded progress")
        else:
            path.unlink(missing_ok=True)          # a new file, not whatever stood at the name
        f = open(path, "r+b" if truncate_to else "wb")
        f.truncate(expected)
        f.seek(0)
        f.write(HEADER.pack(MAGIC, VERSION, self.dtype.itemsize, 0))
        f.seek(0, os.SEEK_END)
        return f

    def append(self, ids: np.ndarray) -> int:
        """Write ids; returns how many shards were finished by this call."""
        ids = np.asarray(ids, dtype=self.dtype)
        finished = 0
        while ids.size:
            take = min(ids.size, self.shard_tokens - self.filled)
            self.file.write(ids[:take].tobytes())
            self.filled += take
            self.total += take
            ids = ids[take:]
            if self.filled == self.shard_tokens:
                self._finish()
                finished += 1
                self.file = self._open_partial()
        return finished

    def _finish(self) -> None:
        self.file.seek(0)
        self.file.write(HEADER.pack(MAGIC, VERSION, self.dtype.itemsize, self.filled))
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self._path(self.done, partial=True), self._path(self.done, partial=False))
        self.done += 1
        self.filled = 0

    def flush(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())

    def state(self) -> dict:
        return {"shards": self.done, "partial_tokens": self.filled}

    def close(self) -> list[str]:
        """Finish the last (shorter) shard and return the names of all shards."""
        if self.filled or self.done == 0:
            self._finish()
        else:
            self.file.close()
            self._path(self.done, partial=True).unlink(missing_ok=True)
        return [shard_name(self.split, i) for i in range(self.done)]


class Shards:
    """The shards of one split, memory-mapped, read as one stream of windows.

    A window never crosses from one shard into the next: the shards are written in
    document order, but keeping each window inside one file keeps reads to one slice."""

    def __init__(self, arrays: list[np.ndarray], names: list[str] | None = None):
        if not arrays:
            raise DataError("a split needs at least one token shard")
        self.arrays = arrays
        self.names = names or [f"array {i}" for i in range(len(arrays))]
        self.dtype = arrays[0].dtype

    @classmethod
    def open(cls, folder: Path, names: list[str]) -> "Shards":
        """The shards meta.json names, each refused unless it stays inside `folder`
        (common/files.py's `inside`, the one rule for names read from a file): a name
        like /etc/passwd or ../other/train_000000.bin is never opened."""
        folder = Path(folder)
        for name in names:
            if inside(folder, name) is None:
                raise DataError(f"{folder / 'meta.json'} names the shard {str(name)[:200]!r}, "
                                f"which leads outside {folder}; a token folder holds "
                                "its own shards: prepare the data again")
        return cls([open_shard(folder / n) for n in names], list(names))

    def __len__(self) -> int:
        return sum(len(a) for a in self.arrays)

    def max(self) -> int:
        """The largest token id (one pass over the shards)."""
        return max(int(a.max()) for a in self.arrays if len(a))

    def counts(self, vocab_size: int) -> np.ndarray:
        """How often each token id occurs (one pass over the shards), int64 (vocab_size,)."""
        out = np.zeros(vocab_size, dtype=np.int64)
        for a in self.arrays:
            out += np.bincount(a, minlength=vocab_size)[:vocab_size]
        return out

    def starts(self, window: int) -> np.ndarray:
        """Windows of `window` tokens that start in each shard: a shard of n tokens has
        n - window + 1 (its last window ends on its last token), 0 when it is shorter."""
        return np.array([max(len(a) - window + 1, 0) for a in self.arrays], dtype=np.int64)

    def gather(self, index: np.ndarray, window: int) -> np.ndarray:
        """Windows of `window` tokens at global start indices in [0, starts(window).sum()),
        numbered shard after shard. Returns int64 (rows, window)."""
        counts = self.starts(window)
        offsets = np.arange(window)
        if len(self.arrays) == 1:
            return self.arrays[0][index[:, None] + offsets].astype(np.int64)
        bounds = np.cumsum(counts)
        which = np.searchsorted(bounds, index, side="right")
        local = index - (bounds - counts)[which]
        out = np.empty((len(index), window), dtype=np.int64)
        for shard in np.unique(which):
            rows = np.nonzero(which == shard)[0]
            out[rows] = self.arrays[shard][local[rows, None] + offsets]
        return out

    def __array__(self, dtype=None, copy=None):
        return self.to_numpy() if dtype is None else self.to_numpy().astype(dtype)

    def to_numpy(self) -> np.ndarray:
        """All tokens of the split in one array (copies unless there is one shard)."""
        return self.arrays[0] if len(self.arrays) == 1 else np.concatenate(self.arrays)
