"""The token cache and batches (data/tokens.py)."""
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from common.errors import DataError
from data.tokens import BUNDLED_CORPUS, Batches, load_tokens


def test_bundled_corpus_is_large_public_domain_text():
    import gzip
    text = gzip.open(BUNDLED_CORPUS, "rt", encoding="utf-8").read()
    assert len(text.encode()) > 1_000_000
    assert "ROMEO" in text and "HAMLET" in text
    assert "gutenberg" not in text.lower()


def test_shipped_tiny_shakespeare_is_nanogpts_benchmark_text():
    """The speedrun's ratio to nanoGPT holds only on nanoGPT's own input.txt, byte for byte
    (docs/corpora.md names its sha256)."""
    import gzip
    import hashlib
    path = Path(__file__).resolve().parent.parent / "data" / "tinyshakespeare" / "input.txt.gz"
    raw = gzip.open(path).read()
    assert len(raw) == 1_115_394
    assert hashlib.sha256(raw).hexdigest() == \
        "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
    assert raw.startswith(b"First Citizen:")


def test_cache_is_built_once_reused_and_rebuilt_on_change(corpus, tmp_path):
    logs = []
    first = load_tokens(str(corpus), "char", cache_dir=str(tmp_path), log=logs.append)
    assert any("tokenizing" in line for line in logs)
    assert first.train.dtype == np.uint16
    assert len(first.train) + len(first.val) == len(corpus.read_text())
    logs.clear()
    again = load_tokens(str(corpus), "char", cache_dir=str(tmp_path), log=logs.append)
    assert logs == [] and np.array_equal(again.train, first.train)
    # Changing a file's text rebuilds its cache ...
    own = tmp_path / "own" / "small.txt"
    own.parent.mkdir()
    own.write_text(corpus.read_text() + "\nAlas!\n")
    load_tokens(str(own), "char", cache_dir=str(tmp_path), log=logs.append)
    logs.clear()
    own.write_text(corpus.read_text() + "\nZounds!\n")
    load_tokens(str(own), "char", cache_dir=str(tmp_path), log=logs.append)
    assert any("changed" in line for line in logs)
    # ... and so does a different tokenizer, in a cache of its own.
    logs.clear()
    bpe = load_tokens(str(corpus), "bpe", vocab_size=300, cache_dir=str(tmp_path), log=logs.append)
    assert any("tokenizing" in line for line in logs)
    assert bpe.tokenizer.kind == "bpe" and bpe.meta["vocab_size"] == 300
    # Editing the cached tokenizer file counts as a tokenizer change.
    (first.directory / "tokenizer.json").write_text(json.dumps({"type": "char", "chars": ["a"]}))
    logs.clear()
    load_tokens(str(corpus), "char", cache_dir=str(tmp_path), log=logs.append)
    assert any("rebuilding" in line for line in logs)


def test_a_run_given_the_tokenizer_the_cache_holds_reads_that_cache_and_another_gets_its_own(
        corpus, tmp_path):
    """A run started from weights trained on the same text once built a second cache."""
    from data.tokenizer import CharTokenizer
    own = load_tokens(str(corpus), "char", cache_dir=str(tmp_path))
    logs = []
    again = load_tokens(str(corpus), "char", cache_dir=str(tmp_path), log=logs.append,
                        given=own.tokenizer)
    assert not any("tokenizing" in line for line in logs) and len(list(tmp_path.iterdir())) == 2
    assert np.array_equal(again.train.gather(np.array([0]), 1000), own.train.gather(np.array([0]), 1000))
    other = CharTokenizer.train("\t" + corpus.read_text())     # a character first: other ids
    assert other.fingerprint() != own.tokenizer.fingerprint()
    theirs = load_tokens(str(corpus), "char", cache_dir=str(tmp_path), log=logs.append, given=other)
    assert any("tokenizing" in line for line in logs)
    assert theirs.tokenizer.fingerprint() == other.fingerprint()
    assert not np.array_equal(theirs.train.gather(np.array([0]), 1000), own.train.gather(np.array([0]), 1000))


def test_bits_per_byte_for_both_tokenizers(corpus, tmp_path):
    char = load_tokens(str(corpus), "char", cache_dir=str(tmp_path))
    # The corpus is ASCII: one character is one byte, so one bit per token is one per byte.
    assert char.bits_unit == "bpb" and char.bits(np.log(2)) == pytest.approx(1.0)
    bpe = load_tokens(str(corpus), "bpe", vocab_size=300, cache_dir=str(tmp_path))
    # A BPE token covers several bytes, so one bit per token is less than one per byte.
    assert bpe.bits_unit == "bpb" and bpe.bits(np.log(2)) < 0.8


def test_large_vocabularies_use_uint32(tmp_path):
    chars = [chr(c) for c in range(0x100, 0x100 + 70_000) if not 0xD800 <= c < 0xE000]
    path = tmp_path / "wide.txt"
    path.write_text("".join(chars) * 2, encoding="utf-8")
    data = load_tokens(str(path), "char", cache_dir=str(tmp_path))
    assert data.tokenizer.vocab_size > 65535 and data.train.dtype == np.uint32
    assert int(np.asarray(data.train).max()) > 65535


def test_missing_and_empty_corpora_are_explained(tmp_path):
    with pytest.raises(DataError, match="not found.*data.path"):
        load_tokens(str(tmp_path / "nope.txt"), cache_dir=str(tmp_path))
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(DataError, match="empty"):
        load_tokens(str(empty), cache_dir=str(tmp_path))
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00abc")
    with pytest.raises(DataError, match="UTF-8"):
        load_tokens(str(binary), cache_dir=str(tmp_path))
    # A bad byte far into a file: its value and what to do, not a position within a block.
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"plain text\n" * 300_000 + "caf\xe9\n".encode("latin-1"))
    with pytest.raises(DataError) as err:
        load_tokens(str(latin), cache_dir=str(tmp_path))
    assert str(err.value) == (f"corpus file {latin} is not readable UTF-8 text (byte 0xe9: "
                              "invalid continuation byte); give a UTF-8 text file (iconv -f "
                              "LATIN1 -t UTF-8 converts one saved as Latin-1)")


def test_text_with_nul_bytes_is_refused_as_not_text(tmp_path):
    """UTF-16 text and binary files with ASCII in them decode as UTF-8 without an error,
    and would be trained on as characters; NUL never occurs in text, so its path is named."""
    utf16 = tmp_path / "notes.txt"
    utf16.write_bytes("To be, or not to be\n".encode("utf-16-le") * 50)
    late = tmp_path / "late.txt"
    late.write_bytes(b"plain text\n" * 20_000 + b"\x00\x01\x02")
    for path, early in ((utf16, True), (late, False)):
        logs = []
        with pytest.raises(DataError, match=f"{path} holds NUL bytes.*UTF-8"):
            load_tokens(str(path), cache_dir=str(tmp_path / "cache"), log=logs.append)
        # Within its first 64 KiB, refused before the build starts; later, during it.
        assert any(line.startswith("tokenizing") for line in logs) != early
        assert not list((tmp_path / "cache").glob("*/meta.json"))
        assert not list((tmp_path / "cache").glob("*-char"))      # no empty folder left


def test_two_corpora_of_one_name_keep_their_own_caches(tmp_path):
    """a/notes.txt and b/notes.txt would share the folder notes-char: the second no longer
    rebuilds over the first, and each loads again without a build."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, second = tmp_path / "a" / "notes.txt", tmp_path / "b" / "notes.txt"
    first.write_text("the first corpus, about kings and crowns\n" * 400)
    second.write_text("another corpus, about ships at sea\n" * 400)
    cache = str(tmp_path / "cache")
    for path, builds in ((first, True), (second, True), (first, False), (second, False)):
        logs = []
        data = load_tokens(str(path), cache_dir=cache, log=logs.append)
        assert len(data.train) + len(data.val) == len(path.read_text())      # its own text
        assert any(line.startswith("tokenizing") for line in logs) == builds
        assert not any("rebuilding" in line for line in logs)
    assert len(list((tmp_path / "cache").glob("notes-char*"))) == 2


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no device files or named pipes here")
def test_a_path_that_is_neither_file_nor_folder_is_named_for_what_it_is(tmp_path):
    """/dev/null exists, so "not found" would send the user looking for a typo."""
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    for path, kind in [(Path(os.devnull), "a character device"), (pipe, "a named pipe")]:
        with pytest.raises(DataError) as err:
            load_tokens(str(path), cache_dir=str(tmp_path / "cache"))
        assert str(err.value).startswith(f"{path} is not a file or folder of text ({kind})")


def test_unreadable_kinds_and_empty_files_are_refused_before_any_work(tmp_path):
    """One error line and nothing written: no 'tokenizing' line, no cache folder. A lone
    file of an unknown kind is named as such, not said to mix file types."""
    odd, empty = tmp_path / "notes.dat", tmp_path / "empty.txt"
    odd.write_text("plain text, but a suffix nobody reads")
    empty.write_bytes(b"")
    for path, words in [(odd, ".dat is not a kind of file the project reads"), (empty, "is empty")]:
        logs = []
        with pytest.raises(DataError) as err:
            load_tokens(str(path), cache_dir=str(tmp_path / "cache"), log=logs.append)
        assert words in str(err.value) and "mixes" not in str(err.value)
        assert logs == []
        assert not any((tmp_path / "cache").glob("*-char"))


def test_too_short_for_one_window():
    with pytest.raises(DataError, match="too few.*block_size"):
        Batches(np.zeros(50, dtype=np.uint16), 4, 64, split="val")


def test_spaced_batches_run_evenly_from_the_first_window_to_the_last_across_shards():
    from data.shards import Shards
    # Two shards whose token values are their positions (the second offset by 1,000),
    # so each window's start, shard and contiguity can be read off its tokens.
    shards = Shards([np.arange(300, dtype=np.uint16), np.arange(1000, 1201, dtype=np.uint16)])
    b = Batches(shards, 5, 16, split="val")
    batches = list(b.spaced(4))
    assert len(batches) == 4 and all(x.shape == (5, 16) for x, _ in batches)
    x = torch.cat([x for x, _ in batches])
    y = torch.cat([y for _, y in batches])
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, -1], x[:, -1] + 1)
    assert torch.equal(x[:, 1:] - x[:, :-1], torch.ones(20, 15, dtype=x.dtype))  # none spans two shards
    # Starts in Shards.gather's numbering: 284 in the first shard, 185 in the second.
    starts = [int(v) if v < 1000 else 284 + int(v) - 1000 for v in x[:, 0]]
    assert starts[0] == 0 and int(y[-1, -1]) == 1200              # the first window, the last
    gaps = np.diff(starts)
    assert gaps.min() >= 24 and gaps.max() <= 25                  # 468 / 19 = 24.6 apart
    # A shard exactly one window long holds one window.
    assert Batches(np.arange(17, dtype=np.uint16), 1, 16).n_starts == 1
    assert all(torch.equal(p[0], q[0]) for p, q in zip(batches, b.spaced(4)))   # the same every time


def test_evaluation_is_the_whole_split_when_its_windows_tile_it():
    """engine.loop.evaluate against the mean over every target of the split, computed
    directly. The split changes halfway (an easy stretch, then a hard one), as real
    text does, and 16 windows of 16 tokens tile its 257 tokens exactly when spaced from
    the first window to the last; random windows would weight the halves unequally."""
    from contextlib import nullcontext
    from engine.loop import evaluate

    p_zero = 0.9                               # the stub's P(token 0) at every position

    class Stub(torch.nn.Module):
        def forward(self, x, y):
            logits = torch.log(torch.tensor([p_zero, 1 - p_zero])).expand(*x.shape, 2)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 2), y.reshape(-1))
            return type("Out", (), {"loss": loss})()

    tokens = np.array([0] * 100 + [1] * 157, dtype=np.uint16)
    targets = tokens[1:].astype(np.float64)
    expected = np.mean(-(targets * np.log(1 - p_zero) + (1 - targets) * np.log(p_zero)))
    got = evaluate(Stub(), tokens, 4, 16, 4, torch.device("cpu"), nullcontext())
    assert got == pytest.approx(expected, abs=1e-6)


def test_batches_are_shifted_by_one_and_resumable():
    tokens = np.arange(1000, dtype=np.uint16)
    b = Batches(tokens, 4, 16, seed=0)
    x, y = b.next()
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, -1], x[:, -1] + 1)
    state = b.state_dict()
    after = [b.next() for _ in range(3)]
    b2 = Batches(tokens, 4, 16, seed=99)
    b2.load_state_dict(state)
    assert all(torch.equal(p[0], q[0]) for p, q in zip(after, [b2.next() for _ in range(3)]))


def test_epochs_read_every_target_once_a_pass_in_a_new_order_and_offset_each_pass():
    """data.sampling=epochs against a count made here: token values are their positions,
    so a window's targets say which stretch it read. Planted bugs this catches: windows
    a block apart overlapping (stride block_size + 1 skips a token, block_size - 1 reads
    one twice), the same order or offset every pass, a pass cut short at a batch's end."""
    n, block = 1000, 16
    tokens = np.arange(n, dtype=np.uint16)
    one = Batches(tokens, 1, block, seed=0, sampling="epochs")    # a window at a time
    passes = []
    for _ in range(3):
        one.next()
        windows = [one.order[0]] + [int(one.next()[0][0, 0]) for _ in range(len(one.order) - 1)]
        passes.append(windows)
    for windows in passes:
        offset = min(windows)
        targets = sorted(t for s in windows for t in range(s + 1, s + block + 1))
        assert targets == list(range(offset + 1, offset + 1 + len(targets)))   # each once
        assert offset < block and n - 1 - targets[-1] < block     # from near one end to the other
    assert len({tuple(np.argsort(w)) for w in passes}) == 3      # a new order each pass,
    assert len({min(w) for w in passes}) > 1                      # and a new offset
    # Four windows a batch read the same windows in the same order, across passes' ends.
    four = Batches(tokens, 4, block, seed=0, sampling="epochs")
    stream = np.concatenate([four.next()[0][:, 0].numpy() for _ in range(sum(map(len, passes)) // 4)])
    assert stream.tolist() == [s for w in passes for s in w][:len(stream)]
    # Random draws over as many windows leave some of the text unread.
    rand = Batches(tokens, 4, block, seed=0)
    drawn = np.concatenate([rand.next()[1].flatten().numpy() for _ in range(len(stream) // 4)])
    assert (np.bincount(drawn, minlength=n)[block + 1:n - block] == 0).any()


@pytest.mark.parametrize("read", [0, 1, 30, 61, 62, 100])
def test_epochs_resume_mid_pass_and_at_its_end_with_the_same_batches(read):
    """state_dict keeps the generator at the pass's start and the windows read of it,
    so a resume draws the pass again and goes on where it was (62 batches: a pass of
    about 62 and a half)."""
    tokens = np.arange(4000, dtype=np.uint16)
    b = Batches(tokens, 4, 16, seed=7, sampling="epochs")
    for _ in range(read):
        b.next()
    state = b.state_dict()
    after = [b.next()[0] for _ in range(70)]
    again = Batches(tokens, 4, 16, seed=99, sampling="epochs")
    again.load_state_dict(state)
    assert all(torch.equal(p, again.next()[0]) for p in after)


def test_an_unknown_sampling_is_refused():
    with pytest.raises(DataError, match="unknown data.sampling 'shuffle'; valid choices: random, epochs"):
        Batches(np.arange(100, dtype=np.uint16), 2, 8, sampling="shuffle")


def test_a_data_path_that_names_nothing_says_to_check_it_before_preparing_one(tmp_path):
    """A path to no file was answered only with how to prepare a dataset there; a typo is the
    likelier cause, so the path is questioned first, with the file of its folder it most
    likely meant, or the folder on the way that is missing."""
    (tmp_path / "plays").mkdir()
    (tmp_path / "plays" / "shakespeare.txt").write_text("To be, or not to be. " * 50)
    for given, check in ((tmp_path / "plays" / "shakespear.txt",
                          f"check the path (did you mean {tmp_path / 'plays' / 'shakespeare.txt'}?)"),
                         (tmp_path / "plays" / "zzz.txt", "check the path. "),
                         (tmp_path / "play" / "x" / "shakespeare.txt",
                          f"check the path ({tmp_path / 'play'} does not exist)")):
        with pytest.raises(DataError) as refused:
            load_tokens(str(given), cache_dir=str(tmp_path / "cache"), log=lambda *a: None)
        said = str(refused.value)
        assert said.startswith(f"corpus {given} not found: {check}"), said
        assert said.index("check the path") < said.index("To prepare a dataset there")
