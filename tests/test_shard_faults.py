"""A token folder (meta.json, progress.json, tokenizer.json, shards) and a corpus folder
read as untrusted input: each damaged or crafted case is one error naming the file,
never a traceback, a hang, or a file opened outside the folder (docs/safety.md)."""
import contextlib
import json
import os
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest

import data.build as build
import data.prepare as prepare_cli
from common.errors import AttnlabError, DataError
from common.schema import Field, config_problems, count
from data.shards import CannotResume, ShardWriter, open_shard
from data.sources import SourceSpec
from data.tokens import load_tokens

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes (POSIX)")
TEXT = "the cat sat on the mat and looked at the rain for a long time.\n" * 60


@contextlib.contextmanager
def no_hang(seconds: int = 30):
    """Raise instead of waiting forever (a pipe opened for reading waits for a writer):
    on the code before the fix these cases hung, and a hung test would stop the suite."""
    def stop(*_):
        raise TimeoutError("waited on a file that never ends")
    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def quiet(spec, out, **kwargs):
    return build.prepare(spec, out, "char", log=lambda *a: None, progress=False, **kwargs)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("built")
    (root / "c.txt").write_text(TEXT)
    quiet(SourceSpec(str(root / "c.txt")), root / "p")
    return root / "p"


@pytest.fixture
def folder(built, tmp_path):
    """A fresh copy of a prepared folder, and beside it another one (`../other`)."""
    shutil.copytree(built, tmp_path / "other")
    return Path(shutil.copytree(built, tmp_path / "p"))


def edit_meta(folder: Path, change) -> None:
    meta = json.loads((folder / "meta.json").read_text())
    change(meta)
    (folder / "meta.json").write_text(json.dumps(meta))


def refusal(folder: Path, cls=DataError) -> str:
    with no_hang(), pytest.raises(cls) as err:       # (before: some were read as a corpus)
        load_tokens(str(folder), cache_dir=str(folder.parent / "cache"))
    return str(err.value)


# -- meta.json against its schema (defect 3) -------------------------------------------

DAMAGED = {
    "no fingerprint": (lambda m: m.pop("tokenizer_fingerprint"), "tokenizer_fingerprint is missing"),
    "shard a number": (lambda m: m["splits"]["train"].update(shards=[5]),
                       "splits.train.shards[0] is '5' (int), not a string"),
    "tokens a word": (lambda m: m["splits"]["val"].update(tokens="many"),
                      "splits.val.tokens is 'many' (str), not a whole number"),
    "tokens 10**30": (lambda m: m["splits"]["train"].update(tokens=10**30),
                      "splits.train.tokens=1000000000000000000000000000000 is outside"),
    "no val bytes": (lambda m: m["splits"]["val"].update(bytes=0), "splits.val.bytes=0 is outside"),
    "no shards": (lambda m: m["splits"]["val"].update(shards=[]), "splits.val.shards has 0 items"),
    "a million shards": (lambda m: m["splits"]["val"].update(shards=["val_000000.bin"] * 10**6),
                         "splits.val.shards has 1,000,000 items"),
    "no key": (lambda m: m.pop("key"), "key is missing"),
    "splits only": (lambda m: [m.clear(), m.update(splits=5)], "splits is '5' (int), not an object"),
    "other format": (lambda m: m.update(format="other"), "has format 'other'"),
    # Fields written for the reader are checked too, and against what the folder holds
    # (a second pass found these accepted, and the run trained).
    "dtype object": (lambda m: m.update(dtype="object"), "dtype is 'object', not one of uint16"),
    "dtype uint32": (lambda m: m.update(dtype="uint32"),
                     "says dtype='uint32', but the folder's tokenizer and shards hold 'uint16'"),
    "eot_id 10**9": (lambda m: m.update(eot_id=10**9), "says eot_id=1000000000, but"),
    "eot_id 10**12": (lambda m: m.update(eot_id=10**12), "eot_id=1000000000000 is outside"),
    "eot_id -1": (lambda m: m.update(eot_id=-1), "eot_id=-1 is outside"),
    "vocab one more": (lambda m: m.update(vocab_size=m["vocab_size"] + 1), "says vocab_size="),
}


@pytest.mark.parametrize("case", DAMAGED)
def test_a_damaged_meta_json_is_one_error_naming_it_and_the_value(folder, case):
    change, words = DAMAGED[case]
    edit_meta(folder, change)
    message = refusal(folder)
    assert message.startswith(f"{folder / 'meta.json'} ") and words in message
    assert "\n" not in message and "prepare the data again" in message


@pytest.mark.parametrize("kind", ["not json", "a list", "a pipe", "a folder"])
def test_a_meta_json_that_cannot_be_read_as_an_object_is_named(folder, kind):
    meta = folder / "meta.json"
    meta.unlink()
    {"not json": lambda: meta.write_text("{"), "a list": lambda: meta.write_text("[1]"),
     "a pipe": lambda: os.mkfifo(meta), "a folder": lambda: meta.mkdir()}[kind]()
    assert refusal(folder).startswith(f"{meta} ")


def test_a_damaged_meta_json_in_the_token_cache_is_rebuilt_not_a_traceback(tmp_path):
    """The cache is the project's own: a damaged record there is rebuilt, with a line."""
    (tmp_path / "c.txt").write_text(TEXT)
    first = load_tokens(str(tmp_path / "c.txt"), cache_dir=str(tmp_path / "cache"), log=lambda *a: None)
    edit_meta(first.directory, lambda m: m.pop("key"))
    logs = []
    again = load_tokens(str(tmp_path / "c.txt"), cache_dir=str(tmp_path / "cache"), log=logs.append)
    assert any("key is missing; rebuilding" in line for line in logs)
    assert np.array_equal(np.asarray(again.train), np.asarray(first.train))


def test_a_damaged_progress_json_is_named_and_replaced_only_with_overwrite(tmp_path):
    (tmp_path / "c.txt").write_text(TEXT)
    spec, out = SourceSpec(str(tmp_path / "c.txt")), tmp_path / "out"
    meta = quiet(spec, out)
    (out / "meta.json").unlink()                     # as if stopped before it was written
    progress = build._fresh_state(meta["key"], build.Tokenizer.load(out))
    progress["items"] = "many"
    (out / "progress.json").write_text(json.dumps(progress))
    with pytest.raises(DataError) as err:
        quiet(spec, out)
    assert str(err.value).startswith(f"{out / 'progress.json'} ") and "items is 'many'" in str(err.value)
    assert "--overwrite" in str(err.value)
    assert quiet(spec, out, overwrite=True)["splits"]["train"]["tokens"] == meta["splits"]["train"]["tokens"]


# -- shards that are not plain files (defect 4), a tokenizer.json that is not one -------

@pytest.mark.parametrize("name", ["train_000000.bin", "val_000000.bin", "tokenizer.json"])
@pytest.mark.parametrize("kind", ["a named pipe", "a folder"])
def test_a_file_of_the_folder_that_is_not_a_plain_file_is_refused_without_waiting(folder, name, kind):
    path = folder / name
    path.unlink()
    os.mkfifo(path) if kind == "a named pipe" else path.mkdir()
    message = refusal(folder, AttnlabError)
    assert f"{path} is {kind}, not a plain file" in message or f"{path} is not a plain file" in message


def test_a_missing_shard_is_one_error_naming_it(folder):
    (folder / "val_000000.bin").unlink()
    assert refusal(folder).startswith(f"token shard {folder / 'val_000000.bin'} cannot be read")


@pytest.mark.parametrize("kind", ["a named pipe", "a link outside"])
def test_a_build_writes_its_partial_shard_only_as_a_plain_file_of_its_own(tmp_path, kind):
    """Resuming wrote into train_000000.bin.partial wherever it led (a link to a file
    elsewhere was cut short), and a fresh start waited forever on a pipe of that name."""
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"x" * 100)
    folder = tmp_path / "build"
    folder.mkdir()
    partial = folder / "train_000000.bin.partial"
    os.mkfifo(partial) if kind == "a named pipe" else partial.symlink_to(outside)
    (folder / "train_abc.bin").write_bytes(b"")       # not a shard's name: left alone
    with no_hang(), pytest.raises(CannotResume, match="not a plain file"):
        ShardWriter(folder, "train", np.uint16, 10, {"shards": 0, "partial_tokens": 3})
    with no_hang():
        writer = ShardWriter(folder, "train", np.uint16, 10)
        writer.append(np.arange(4, dtype=np.uint16))
        assert writer.close() == ["train_000000.bin"]
    assert outside.read_bytes() == b"x" * 100 and not (folder / "train_000000.bin").is_symlink()
    assert open_shard(folder / "train_000000.bin").tolist() == [0, 1, 2, 3]


# -- shard names confined to the folder (defect 7) -------------------------------------

@pytest.mark.parametrize("name", ["/etc/passwd", "../other/train_000000.bin",
                                  "sub/../../other/train_000000.bin", "link.bin"])
def test_a_shard_named_outside_the_folder_is_never_opened(folder, name):
    """Before: /etc/passwd was opened (its first 8 bytes shown as a bad magic) and
    ../other's shards trained. The refusal reads the same whether the file outside
    exists or not, and shows none of it."""
    (folder / "link.bin").symlink_to(folder.parent / "other" / "train_000000.bin")
    edit_meta(folder, lambda m: m["splits"]["train"].update(shards=[name]))
    message = refusal(folder)
    assert message == (f"{folder / 'meta.json'} names the shard {name!r}, which leads outside "
                       f"{folder}; a token folder holds its own shards: prepare the data again")
    shutil.rmtree(folder.parent / "other")           # the same words when nothing is there
    (folder / "link.bin").unlink()
    (folder / "link.bin").symlink_to(folder.parent / "other" / "train_000000.bin")
    assert refusal(folder) == message


@pytest.mark.parametrize("where", ["twice in train", "in both train and val"])
def test_a_shard_listed_twice_in_meta_json_is_refused_naming_meta_json(folder, where):
    """Before: a shard listed twice was read twice (its text weighted double), and one in
    both splits scored the model on text it trained on."""
    def twice(m):
        train = m["splits"]["train"]
        split = m["splits"]["train" if where == "twice in train" else "val"]
        split["shards"] = split["shards"] + train["shards"][:1]
        split["tokens"] += train["tokens"]             # the counts agree: only the name is wrong
    edit_meta(folder, twice)
    message = refusal(folder)
    assert message.startswith(f"{folder / 'meta.json'} lists the shard 'train_000000.bin' {where}")
    assert "\n" not in message and "prepare the data again" in message


@pytest.mark.parametrize("alias", ["./", ".//", "symlink", "hardlink"])
@pytest.mark.parametrize("where", ["twice in train", "in both train and val"])
def test_a_shard_listed_again_under_another_name_is_refused(folder, where, alias):
    """Before: ./train_000000.bin, or a link to it inside the folder, was a new name, so
    the check for a shard listed twice passed and val scored the model on training text."""
    first = "train_000000.bin"
    if alias in ("./", ".//"):
        again = alias + first
    else:
        again = "again.bin"
        if alias == "symlink":
            (folder / again).symlink_to(first)
        else:
            os.link(folder / first, folder / again)

    def twice(m):
        train = m["splits"]["train"]
        split = m["splits"]["train" if where == "twice in train" else "val"]
        split["shards"] = split["shards"] + [again]
        split["tokens"] += train["tokens"] // len(train["shards"])
    edit_meta(folder, twice)
    message = refusal(folder)
    assert message.startswith(f"{folder / 'meta.json'} lists the shard {again!r} {where}"), message
    assert "\n" not in message


# -- every file of the folder read inside it -------------------------------------------

@pytest.mark.parametrize("name", ["meta.json", "tokenizer.json"])
def test_a_file_of_the_folder_that_links_outside_it_is_never_read(folder, name):
    """Before: meta.json and tokenizer.json were read wherever a link led (here to the
    same file of a folder beside it, which loads as it would have)."""
    (folder / name).unlink()
    (folder / name).symlink_to(folder.parent / "other" / name)
    message = refusal(folder, AttnlabError)
    assert f"{folder / name} leads outside {folder}" in message and "\n" not in message


def test_a_progress_json_that_links_outside_the_folder_is_never_read(tmp_path):
    (tmp_path / "c.txt").write_text(TEXT)
    spec, out = SourceSpec(str(tmp_path / "c.txt")), tmp_path / "out"
    meta = quiet(spec, out)
    (out / "meta.json").unlink()                     # as if stopped before it was written
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps(build._fresh_state(meta["key"], build.Tokenizer.load(out))))
    (out / "progress.json").symlink_to(elsewhere)
    with pytest.raises(DataError) as err:
        quiet(spec, out)
    assert str(err.value).startswith(f"{out / 'progress.json'} leads outside {out}")
    assert "--overwrite" in str(err.value)


def test_a_tokenizer_json_far_larger_than_its_vocabulary_is_refused_unread(folder):
    """Bounded by the vocabulary meta.json claims (1 KiB a token, 1 MiB besides), not only
    by the 256 MB any tokenizer may take: padding that parses to the same tokenizer."""
    path = folder / "tokenizer.json"
    vocab = json.loads((folder / "meta.json").read_text())["vocab_size"]
    limit = (1 << 20) + 1024 * vocab
    path.write_text(path.read_text() + " " * limit)
    message = refusal(folder, AttnlabError)
    assert f"tokenizer file {path} is {path.stat().st_size:,} bytes, more than the {limit:,}" in message


def test_a_shard_with_a_bad_magic_number_says_how_to_prepare_the_folder_again(folder):
    shard = folder / "train_000000.bin"
    shard.write_bytes(b"NOTTOKEN" + shard.read_bytes()[8:])
    assert refusal(folder) == (
        f"{shard} is not an attnlab token shard (bad magic b'NOTTOKEN'); prepare the folder "
        f"again from its corpus: python -m data.prepare SOURCE --out {folder} --overwrite")


# -- data.prepare on a corpus folder (defect 10) ---------------------------------------

def test_entries_named_like_text_that_are_not_plain_files_are_named_when_passed_over(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(TEXT)
    os.mkfifo(corpus / "pipe.txt")
    (corpus / "folder.txt").mkdir()
    (corpus / "gone.txt").symlink_to(tmp_path / "nothing")
    (corpus / "zero.txt").symlink_to("/dev/zero")
    expected = [f"{corpus / 'folder.txt'} (a folder)", f"{corpus / 'gone.txt'} (a link to nothing)",
                f"{corpus / 'pipe.txt'} (a named pipe)", f"{corpus / 'zero.txt'} (a link to a character device)"]
    for source in (str(corpus), str(corpus / "*.txt")):
        logs = []
        with no_hang():
            build.prepare(SourceSpec(source), tmp_path / "out", "char", log=logs.append,
                          progress=False, overwrite=True)
        passed = [line for line in logs if line.startswith("passed over")]
        assert passed == [f"passed over 4 entries that are not a plain file: {', '.join(expected[:3])} "
                          "and 1 more"]
    logs = []
    with no_hang():
        load_tokens(str(corpus), cache_dir=str(tmp_path / "cache"), log=logs.append)
    assert any(line.startswith("passed over 4 entries") for line in logs)
    for entry in ("a.txt", "folder.txt", "gone.txt", "zero.txt"):
        (corpus / entry).unlink() if entry != "folder.txt" else (corpus / entry).rmdir()
    with no_hang(), pytest.raises(DataError, match=r"holds no text .* \(passed over 1 entry that is "
                                                   r"not a plain file: .*pipe.txt \(a named pipe\)\)"):
        load_tokens(str(corpus), cache_dir=str(tmp_path / "cache"))


@pytest.mark.skipif(not os.access("/proc/self/mem", os.R_OK), reason="needs /proc/self/mem")
def test_a_corpus_file_that_fails_to_read_is_the_path_named_not_the_output_folder(tmp_path, capsys):
    """/proc/self/mem is a plain file whose read fails (EIO) with no file name attached:
    the error used to name --out, which was never the problem."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(TEXT)
    (corpus / "mem.txt").symlink_to("/proc/self/mem")
    out = tmp_path / "out"
    with pytest.raises(SystemExit):
        prepare_cli.main([str(corpus), "--out", str(out), "--tokenizer", "char"])
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"error: corpus file {corpus / 'mem.txt'} is not readable (")
    assert str(out) not in line and "\n" not in line


# -- the schema's lists (common/schema.py) ---------------------------------------------

def test_a_list_field_checks_its_length_and_each_item():
    schema = {"names": Field(list, 1, 3, required=True, items=Field(str)),
              "sizes": Field(list, items=count(10, low=0))}
    assert config_problems({"names": ["a"], "sizes": [0, 10]}, schema) == []
    assert config_problems({"names": [], "sizes": [None, 11, True]}, schema) == [
        "names has 0 items, a number outside 1..3", "sizes[0] is null",
        "sizes[1]=11 is outside 0..10", "sizes[2] is 'True' (bool), not a whole number"]
    assert config_problems({"names": "a"}, schema) == ["names is 'a' (str), not a list"]
