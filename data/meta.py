"""The two JSON files of a token folder, read as untrusted input: meta.json (written
last by data/build.py: what the folder holds) and progress.json (a build's record of
how far it got). A prepared folder may come from elsewhere, so each is read only when it
is a plain file of bounded size and checked against its schema (common/schema.py)
before any value is used; a damaged one is one error naming it, never a KeyError from
the code that trusted it. Each is read only where it stays inside the folder once links
are followed (common/files.py's `inside`), as the shard names meta.json gives are
where data/shards.py opens them."""
from __future__ import annotations

import os
from pathlib import Path

from common.errors import DataError
from common.files import JSON_LIMIT, inside, parse_json_object, read_bounded, read_json
from common.schema import Field, config_problems, count, first_problems

FORMAT = "attnlab-tokens"
VERSION = 1
META, PROGRESS = "meta.json", "progress.json"
MAX_TOKENS = 1 << 62                   # as data.prepare's sizes: far beyond any corpus
MAX_SHARDS = 30_000     # a split's: both splits' maps stay under Linux's default 65,530 a process
MAX_VOCAB = 1 << 32                    # token ids are stored as uint32 at most

_SPLIT = Field(dict, required=True, fields={
    "documents": count(MAX_TOKENS, low=0), "bytes": count(MAX_TOKENS),
    "chars": count(MAX_TOKENS, low=0), "tokens": count(MAX_TOKENS),
    "shards": Field(list, 1, MAX_SHARDS, required=True, items=Field(str))})
META_SCHEMA = {
    "format": Field(str, required=True), "version": count(VERSION),
    "splits": Field(dict, required=True, fields={"train": _SPLIT, "val": _SPLIT}),
    "key": Field(dict, required=True), "source": Field(dict, required=True),
    "tokenizer": Field(str, required=True), "vocab_size": count(MAX_VOCAB),
    "tokenizer_fingerprint": Field(str, required=True),
    # Written for the reader and checked against the folder by data/tokens.py.
    "dtype": Field(str, choices=("uint16", "uint32")),
    "eot_id": count(MAX_VOCAB - 1, low=0, required=False, null=True),
    "shard_tokens": count(MAX_TOKENS, required=False),
}
_WRITER = Field(dict, fields={"shards": count(MAX_SHARDS, low=0),
                              "partial_tokens": count(MAX_TOKENS, low=0)})
_COUNTS = Field(dict, required=True, fields={
    name: count(MAX_TOKENS, low=0) for name in ("documents", "bytes", "chars", "tokens")})
PROGRESS_SCHEMA = {
    "key": Field(dict, required=True), "tokenizer_fingerprint": Field(str, required=True),
    "items": count(MAX_TOKENS, low=0),
    "writers": Field(dict, required=True, fields={"train": _WRITER, "val": _WRITER}),
    "counts": Field(dict, required=True, fields={"train": _COUNTS, "val": _COUNTS}),
}


class DamagedRecord(DataError):
    """A meta.json or progress.json that is there but cannot be trusted. `problem` says
    what is wrong with it, for a caller that goes on to rebuild instead of refusing."""

    def __init__(self, problem: str):
        super().__init__(f"{problem}; prepare the data again (python -m data.prepare with "
                         "--overwrite, or delete the folder)")
        self.problem = problem


def read_checked(folder: Path, name: str, schema: dict[str, Field]) -> dict | None:
    """The JSON object in folder/name when it fits `schema`; None when there is no such
    file; DamagedRecord naming it when it leads outside the folder (a link to a file
    elsewhere is never read), is not a plain file, is too large, not JSON or breaks the
    schema."""
    path = Path(folder) / name
    if not os.path.lexists(path):
        return None
    found = inside(folder, name)
    if found is None:
        raise DamagedRecord(f"{path} leads outside {folder}; a token folder holds its own "
                            f"{name}")
    try:
        record = parse_json_object(read_bounded(found, JSON_LIMIT))
    except ValueError as err:
        raise DamagedRecord(f"{path} {err}") from None
    except OSError as err:
        raise DamagedRecord(f"{path} cannot be read ({err.strerror or err})") from None
    problems = config_problems(record, schema)
    if problems:
        raise DamagedRecord(f"{path} is not a {name} that data.prepare writes: "
                            + first_problems(problems))
    return record


def read_meta(folder: Path) -> dict | None:
    """meta.json of a finished build, checked; None when the folder has none."""
    path = Path(folder) / META
    meta = read_checked(folder, META, META_SCHEMA)
    if meta is not None and meta["format"] != FORMAT:
        raise DamagedRecord(f"{path} has format {meta['format'][:40]!r}, not {FORMAT!r}; it "
                            "is not a meta.json that data.prepare writes")
    if meta is not None:
        _no_shard_twice(Path(folder), path, meta)
    return meta


def _no_shard_twice(folder: Path, path: Path, meta: dict) -> None:
    """A shard is listed once in one split: a name listed twice would read its tokens
    twice (weighting that text double), and one in both splits would score the model
    on text it trained on. A shard is its file, not its spelling: ./a.bin, a link to
    a.bin and a hard link of it are a.bin again."""
    seen: dict[object, str] = {}
    for split in ("train", "val"):
        for name in meta["splits"][split]["shards"]:
            key = _file_identity(folder, name)
            if key in seen:
                where = f"twice in {split}" if seen[key] == split else f"in both {seen[key]} and {split}"
                raise DamagedRecord(f"{path} lists the shard {name[:200]!r} {where} (under this "
                                    "name or another for the same file); a shard holds tokens "
                                    "of one split, read once")
            seen[key] = split


def _file_identity(folder: Path, name):
    """What a shard name reads: its file's device and inode where it is a file inside the
    folder (stat opens nothing, so a FIFO does not block), else the name as given (a name
    leading outside is refused where the shard is opened)."""
    found = inside(folder, name)
    try:
        info = os.stat(found) if found is not None else None
    except OSError:
        info = None
    return (info.st_dev, info.st_ino) if info is not None else (found or name)


def read_progress(folder: Path) -> dict | None:
    """progress.json of a build that did not finish, checked; None when there is none."""
    return read_checked(folder, PROGRESS, PROGRESS_SCHEMA)


def looks_prepared(folder: Path) -> bool:
    """Whether `folder` is a token folder, damaged or not: a meta.json that says so, or
    one beside a tokenizer.json or a first training shard. A folder of corpus files that
    holds a meta.json of its own (and none of those) is read as a corpus instead."""
    folder = Path(folder)
    if not os.path.lexists(folder / META):
        return False
    found = inside(folder, META)          # a link elsewhere is not read, though it marks the folder
    return any(os.path.lexists(folder / name) for name in ("tokenizer.json", "train_000000.bin")) \
        or (found is not None and (read_json(found) or {}).get("format") == FORMAT)
