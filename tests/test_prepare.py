"""data.prepare: sources through `datasets`, tokenizers at scale, shards, resume, offline."""
import gzip
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import data.build as prep
import data.prepare as prepare_cli
from common.errors import DataError, Terminated
from data.shards import HEADER, HEADER_BYTES, Shards, open_shard
from data.sources import SourceSpec, cut_pieces
from data.tokenizer import BPETokenizer
from conftest import ROOT, run_script  # noqa: E402
from data.tokens import Batches, load_tokens, open_prepared

WORDS = ("the cat sat on a mat while it rained and the dog looked at it for a long time "
         "because nothing else moved in the house that day").split()


def documents(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(n):
        words = rng.choice(WORDS, size=rng.integers(5, 40))
        docs.append(f"Story {i}: " + " ".join(words) + ".\nThe end.")
    return docs


def quiet(*args, **kwargs):
    return prep.prepare(*args, log=lambda *a: None, progress=False, **kwargs)


def split_docs(data, split: str) -> list[str]:
    """Decode a split's tokens and cut at the end-of-text token."""
    ids = np.asarray(getattr(data, split)).tolist()
    eot, docs, current = data.tokenizer.eot_id, [], []
    for i in ids:
        if i == eot:
            docs.append(data.tokenizer.decode(current))
            current = []
        else:
            current.append(i)
    assert current == []                     # every document ends with the token
    return docs


@pytest.fixture
def records(tmp_path):
    docs = documents(60)
    jsonl = tmp_path / "stories.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs)))
    import pyarrow as pa
    import pyarrow.parquet as pq
    parquet = tmp_path / "stories.parquet"
    pq.write_table(pa.table({"text": docs, "n": list(range(len(docs)))}), parquet)
    csv = tmp_path / "stories.csv"
    import csv as csv_module
    with open(csv, "w", newline="") as f:
        writer = csv_module.writer(f)
        writer.writerow(["body", "n"])
        writer.writerows([d, i] for i, d in enumerate(docs))
    return docs, {"jsonl": jsonl, "parquet": parquet, "csv": csv}


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "csv"])
def test_record_files_go_through_datasets_and_split_by_document(records, kind, tmp_path):
    docs, files = records
    column = "body" if kind == "csv" else "text"
    spec = SourceSpec(str(files[kind]), text_column=column, val_fraction=0.1)
    meta = quiet(spec, tmp_path / "out", "bpe", 300, shard_tokens=500, num_proc=1)
    data = open_prepared(tmp_path / "out")
    # Every 10th document is validation, in order; the rest train, each ended by <|endoftext|>.
    assert split_docs(data, "val") == docs[9::10]
    assert split_docs(data, "train") == [d for i, d in enumerate(docs) if i % 10 != 9]
    assert meta["splits"]["val"]["documents"] == 6 and meta["splits"]["train"]["documents"] == 54
    assert meta["splits"]["train"]["bytes"] == sum(len(d) for i, d in enumerate(docs) if i % 10 != 9)
    # Fixed-size shards: all full but the last.
    names = meta["splits"]["train"]["shards"]
    assert len(names) > 2
    assert all(len(open_shard(tmp_path / "out" / n)) == 500 for n in names[:-1])


def test_a_missing_text_column_lists_the_columns(records, tmp_path):
    _, files = records
    with pytest.raises(DataError, match="no column 'text'.*body, n.*--text-column"):
        quiet(SourceSpec(str(files["csv"])), tmp_path / "out", "bpe", 300)


def test_text_folders_and_globs_keep_every_byte_and_separate_files(tmp_path):
    folder = tmp_path / "books"
    folder.mkdir()
    texts = [f"Book {i}.\n" + " ".join(documents(30, seed=i)) + "\n" for i in range(3)]
    for i, text in enumerate(texts):
        (folder / f"book{i}.txt").write_text(text)
    for source in (str(folder), str(folder / "*.txt")):
        out = tmp_path / ("glob" if "*" in source else "dir")
        meta = quiet(SourceSpec(source), out, "bpe", 400, num_proc=1)
        data = open_prepared(out)
        train, val = split_docs(data, "train"), split_docs(data, "val")
        # The last 10% of the bytes is validation; the file it falls in is cut there.
        assert "".join(train + val) == "".join(texts)
        assert len(train) == 3 and len(val) == 1
        assert meta["splits"]["val"]["bytes"] == pytest.approx(0.1 * len("".join(texts)), abs=2)


def test_char_tokenizer_keeps_records_apart_with_a_newline(records, tmp_path):
    docs, files = records
    quiet(SourceSpec(str(files["jsonl"]), val_fraction=0.5), tmp_path / "out", "char")
    data = open_prepared(tmp_path / "out")
    assert data.tokenizer.decode(np.asarray(data.val).tolist()) == "\n".join(docs[1::2]) + "\n"


def test_slices_take_the_first_documents_or_bytes(records, tmp_path):
    docs, files = records
    meta = quiet(SourceSpec(str(files["jsonl"]), max_docs=20), tmp_path / "a", "char")
    assert meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"] == 20
    meta = quiet(SourceSpec(str(files["jsonl"]), max_bytes=3000), tmp_path / "b", "char")
    taken = meta["splits"]["train"]["bytes"] + meta["splits"]["val"]["bytes"]
    assert 3000 <= taken < 3000 + max(len(d) for d in docs)


def test_parallel_encoding_writes_the_same_shards(records, tmp_path, monkeypatch):
    _, files = records
    monkeypatch.setattr(prep, "BATCH_CHARS", 2000)          # many tasks for two processes
    spec = SourceSpec(str(files["jsonl"]))
    quiet(spec, tmp_path / "one", "bpe", 300, shard_tokens=700, num_proc=1)
    quiet(spec, tmp_path / "two", "bpe", 300, shard_tokens=700, num_proc=2)
    names = sorted(p.name for p in (tmp_path / "one").glob("*.bin"))
    assert names == sorted(p.name for p in (tmp_path / "two").glob("*.bin")) and len(names) > 3
    for name in names:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()


def test_an_interrupted_build_resumes_and_keeps_finished_shards(records, tmp_path, monkeypatch):
    _, files = records
    spec = SourceSpec(str(files["jsonl"]))
    monkeypatch.setattr(prep, "BATCH_CHARS", 300)
    monkeypatch.setattr(prep, "SAVE_EVERY_S", 0.0)
    quiet(spec, tmp_path / "fresh", "bpe", 300, shard_tokens=400, num_proc=1)

    calls = {"n": 0}
    real = prep._encode_items

    def dies_half_way(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 12:
            raise KeyboardInterrupt
        return real(*args, **kwargs)
    monkeypatch.setattr(prep, "_encode_items", dies_half_way)
    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        quiet(spec, out, "bpe", 300, shard_tokens=400, num_proc=1)
    assert not (out / "meta.json").exists() and (out / "progress.json").exists()
    finished = {p.name: p.stat().st_mtime_ns for p in out.glob("*.bin")}
    assert finished                                        # some shards were done
    with pytest.raises(DataError, match="did not finish.*again"):
        load_tokens(str(out))
    monkeypatch.setattr(prep, "_encode_items", real)
    logs = []
    prep.prepare(spec, out, "bpe", 300, shard_tokens=400, num_proc=1, log=logs.append, progress=False)
    assert any("resuming" in line for line in logs)
    for name, mtime in finished.items():                   # finished shards were not rewritten
        assert (out / name).stat().st_mtime_ns == mtime
    names = sorted(p.name for p in (tmp_path / "fresh").glob("*.bin"))
    assert names == sorted(p.name for p in out.glob("*.bin"))
    for name in names:
        assert (out / name).read_bytes() == (tmp_path / "fresh" / name).read_bytes()
    assert not list(out.glob("*.partial")) and not (out / "progress.json").exists()


def test_other_settings_in_the_same_folder_need_overwrite(records, tmp_path):
    _, files = records
    spec = SourceSpec(str(files["jsonl"]))
    quiet(spec, tmp_path / "out", "char")
    assert quiet(spec, tmp_path / "out", "char")["tokenizer"] == "char"     # same: kept
    with pytest.raises(DataError, match="other settings.*--overwrite"):
        quiet(spec, tmp_path / "out", "bpe", 300)
    assert quiet(spec, tmp_path / "out", "bpe", 300, overwrite=True)["tokenizer"] == "bpe"


def test_corrupt_shards_are_refused_with_their_path(records, tmp_path):
    _, files = records
    quiet(SourceSpec(str(files["jsonl"])), tmp_path / "out", "char")
    shard = tmp_path / "out" / "train_000000.bin"
    raw = shard.read_bytes()
    shard.write_bytes(raw[:-10])
    with pytest.raises(DataError, match="train_000000.bin.*truncated"):
        open_prepared(tmp_path / "out")
    shard.write_bytes(b"NOTTOKEN" + raw[8:])
    with pytest.raises(DataError, match="train_000000.bin is not an attnlab token shard"):
        open_prepared(tmp_path / "out")


def test_train_reads_a_prepared_folder_and_reports_bits_per_byte(records, tmp_path):
    _, files = records
    quiet(SourceSpec(str(files["jsonl"]), val_fraction=0.25), tmp_path / "stories", "bpe", 300,
          shard_tokens=300)
    result = run_script("train.py", "--config", "tiny", f"--data.path={tmp_path / 'stories'}",
                        "--model.block_size=16", "--train.max_iters=4", "--train.eval_interval=4",
                        "--train.eval_iters=2", f"--train.out_dir={tmp_path / 'runs'}",
                        "--train.run_name=r")
    assert result.returncode == 0, result.stderr
    assert "prepared with the bpe tokenizer" in result.stdout + result.stderr
    assert "bpb" in result.stdout + result.stderr
    records_ = [json.loads(l) for l in (tmp_path / "runs" / "r" / "metrics.jsonl").read_text().splitlines()]
    assert any("val_bpb" in r for r in records_)


def test_batches_span_every_shard_and_never_cross_one():
    shards = Shards([np.arange(0, 50, dtype=np.uint16), np.arange(1000, 1003, dtype=np.uint16),
                     np.arange(2000, 2040, dtype=np.uint16)])
    batches = Batches(shards, 64, 7)
    seen = set()
    for _ in range(20):
        x, y = batches.next()
        window = np.concatenate([x.numpy(), y.numpy()[:, -1:]], axis=1)
        assert (np.diff(window, axis=1) == 1).all()          # contiguous within one shard
        seen.update(window[:, 0] // 1000)
    assert seen == {0, 2}                                    # the 3-token shard is too short


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(list("ab c\n\t'1.é€ ") + ["'s", "  ", "\n\n", "<|endoftext|>", "cat"]),
                max_size=40).map("".join))
def test_fast_bpe_encoding_equals_the_tokenizer(text):
    tok = _bpe()
    assert tok.encode_array(text).tolist() == tok.encode(text)
    assert "".join(cut_pieces(text, 7)) == text


_TOK = []


def _bpe():
    if not _TOK:
        _TOK.append(BPETokenizer.train([" ".join(documents(50)) + " don't 12 €é\t\n"], 320))
    return _TOK[0]


def test_pieces_cut_at_newlines_encode_like_the_whole_text():
    tok = _bpe()
    text = "\n".join(documents(200))
    pieces = list(cut_pieces(text, 500))
    assert len(pieces) > 10 and all(len(p) <= 500 for p in pieces)
    assert sum((tok.encode(p) for p in pieces), []) == tok.encode(text)


def test_hub_datasets_load_with_a_val_split(monkeypatch, tmp_path):
    import datasets
    import data.sources as sources
    docs = documents(40)
    tables = {"train": datasets.Dataset.from_dict({"story": docs[:30]}),
              "validation": datasets.Dataset.from_dict({"story": docs[30:]})}
    asked = []

    def fake_load(name, config=None, split=None, streaming=False):
        asked.append((name, config, split, streaming))
        table = tables[split]
        return table.to_iterable_dataset() if streaming else table
    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    monkeypatch.setattr(sources, "hub_reachable", lambda timeout=0: True)
    spec = SourceSpec("someone/stories", config_name="small", val_split="validation",
                      text_column="story", streaming=True, max_docs=25)
    quiet(spec, tmp_path / "out", "bpe", 300)
    data = open_prepared(tmp_path / "out")
    assert split_docs(data, "train") == docs[:25] and split_docs(data, "val") == docs[30:]
    assert ("someone/stories", "small", "train", True) in asked


def test_an_unreachable_hub_falls_back_to_the_local_cache(monkeypatch, tmp_path):
    """No connection: data.prepare switches datasets to offline mode, and a dataset
    already in the local cache (here: the fake loader answers only when offline) is
    prepared as usual."""
    import datasets
    import huggingface_hub
    import data.sources as sources
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(var, "0")                       # restored after the test
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    docs = documents(30)

    def cached_only(name, config=None, split=None, streaming=False):
        if not datasets.config.HF_HUB_OFFLINE or os.environ["HF_HUB_OFFLINE"] != "1":
            raise ConnectionError("would have tried the network")
        return datasets.Dataset.from_dict({"text": docs})
    monkeypatch.setattr(datasets, "load_dataset", cached_only)
    monkeypatch.setattr(sources, "hub_reachable", lambda timeout=0: False)
    quiet(SourceSpec("someone/cached-stories"), tmp_path / "out", "bpe", 300)
    data = open_prepared(tmp_path / "out")
    assert split_docs(data, "train") + split_docs(data, "val") != [] and len(split_docs(data, "val")) == 3


def test_an_unreachable_hub_says_so_in_one_line(tmp_path):
    env = dict(os.environ, HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"))
    env.pop("HF_HUB_OFFLINE", None)
    result = subprocess.run([sys.executable, "-m", "data.prepare", "someone/not-cached",
                             "--out", str(tmp_path / "out")], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 2
    assert "cannot be reached" in result.stderr and "python -m data.prepare path/to" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_hub_is_probed_once_with_a_bound_of_seconds(monkeypatch):
    """Within seconds, counted as what it waits for rather than timed (a busy machine
    slows the imports around it, not the bound): one connection, HUB_TIMEOUT_S at most."""
    import socket
    import data.sources as sources
    tried = []

    def refused(address, timeout=None):
        tried.append(timeout)
        raise OSError("connection refused")
    monkeypatch.setattr(socket, "create_connection", refused)
    assert sources.hub_reachable() is False
    assert tried == [sources.HUB_TIMEOUT_S] and sources.HUB_TIMEOUT_S <= 5


def test_prepare_help_and_sizes():
    result = subprocess.run([sys.executable, "-m", "data.prepare", "--help"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0
    for flag in ("--streaming", "--max-docs", "--max-bytes", "--text-column", "--val-split",
                 "--num-proc", "--tokenizer-sample", "--shard-tokens"):
        assert flag in result.stdout
    assert prepare_cli.parse_size("50MB") == 50_000_000 and prepare_cli.parse_size("2k") == 2000
    assert HEADER_BYTES == 32


@pytest.mark.parametrize("block", [3, 7, 64, 1 << 20])
def test_text_is_read_in_blocks_and_cut_between_characters(tmp_path, monkeypatch, block):
    """However the reads fall, the pieces decode to the text, and the validation cut
    never splits a multi-byte character (here every character is 2 to 4 bytes)."""
    import data.sources as sources
    monkeypatch.setattr(sources.TextSource, "BLOCK", block, raising=False)
    monkeypatch.setattr(sources, "PIECE_CHARS", 16)
    text = "".join("é€😀\n"[i % 4] for i in range(401))
    path = tmp_path / "wide.txt"
    path.write_text(text, encoding="utf-8")
    src = sources.open_source(SourceSpec(str(path), val_fraction=0.3))
    pieces = list(src.pieces())
    assert "".join(p for _, p, _ in pieces) == text
    train = "".join(p for s, p, _ in pieces if s == "train")
    assert len(train.encode()) == pytest.approx(0.7 * len(text.encode()), abs=4)
    assert [s for s, _, _ in pieces] == sorted(s for s, _, _ in pieces)    # train, then val


def test_train_data_path_prepares_record_files_on_first_use(records, tmp_path):
    docs, files = records
    logs = []
    data = load_tokens(str(files["parquet"]), "bpe", vocab_size=300,
                       cache_dir=str(tmp_path / "cache"), log=logs.append)
    assert any("tokenizing" in line for line in logs)
    assert split_docs(data, "val") == docs[9::10]
    logs.clear()
    again = load_tokens(str(files["parquet"]), "bpe", vocab_size=300,
                        cache_dir=str(tmp_path / "cache"), log=logs.append)
    assert logs == [] and np.array_equal(np.asarray(again.train), np.asarray(data.train))


def fresh_and_stopped(records, tmp_path, monkeypatch):
    """A whole build into fresh/ and the same build into out/ stopped at its 12th batch of
    small pieces, with progress saved at each: (spec, fresh's meta, out)."""
    _, files = records
    spec = SourceSpec(str(files["jsonl"]))
    monkeypatch.setattr(prep, "BATCH_CHARS", 300)
    monkeypatch.setattr(prep, "SAVE_EVERY_S", 0.0)
    fresh = quiet(spec, tmp_path / "fresh", "bpe", 300, shard_tokens=400, num_proc=1)
    real, calls = prep._encode_items, {"n": 0}

    def dies(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 12:
            raise KeyboardInterrupt
        return real(*args, **kwargs)
    monkeypatch.setattr(prep, "_encode_items", dies)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        quiet(spec, out, "bpe", 300, shard_tokens=400, num_proc=1)
    monkeypatch.setattr(prep, "_encode_items", real)
    return spec, fresh, out


def test_a_partial_shard_shorter_than_its_record_restarts_the_token_pass(records, tmp_path, monkeypatch):
    spec, _, out = fresh_and_stopped(records, tmp_path, monkeypatch)
    partial = next(out.glob("train_*.bin.partial"))
    assert json.loads((out / "progress.json").read_text())["writers"]["train"]["partial_tokens"] > 0
    partial.write_bytes(partial.read_bytes()[:HEADER_BYTES])     # lost what progress recorded
    logs = []
    prep.prepare(spec, out, "bpe", 300, shard_tokens=400, num_proc=1, log=logs.append, progress=False)
    assert any("starting the token pass over" in line for line in logs)
    for path in (tmp_path / "fresh").glob("*.bin"):
        assert (out / path.name).read_bytes() == path.read_bytes()


def _shard_tokens(path, count: int) -> None:
    """Rewrite the shard at `path` to hold only its first `count` tokens, header and all."""
    raw = path.read_bytes()
    magic, version, itemsize, _ = HEADER.unpack(raw[:HEADER_BYTES])
    path.write_bytes(HEADER.pack(magic, version, itemsize, count)
                     + raw[HEADER_BYTES:HEADER_BYTES + count * itemsize])


FORGED = {   # a progress.json edited after a stop, and what it would have made the build do
    "items past the source": lambda p, out: p.update(items=p["items"] + 10**6),    # end at once
    "items skip text": lambda p, out: p.update(items=p["items"] + 3),             # skip 3 pieces
    "tokens miscounted": lambda p, out: p["counts"]["train"].update(tokens=p["counts"]["train"]["tokens"] + 5),
    "a finished shard cut short": lambda p, out: _shard_tokens(out / "train_000000.bin", 100),
}


@pytest.mark.parametrize("forged", FORGED)
def test_a_forged_progress_json_restarts_the_token_pass_instead_of_skipping_text(
        forged, records, tmp_path, monkeypatch):
    """progress.json is checked against what it claims before a build resumes from it:
    the pieces it skips must hold the documents, bytes and characters it counts, and its
    token counts must be the shards on disk. Before, each of these resumed: text was
    skipped, or meta.json counted tokens the shards do not hold."""
    spec, fresh, out = fresh_and_stopped(records, tmp_path, monkeypatch)
    progress = json.loads((out / "progress.json").read_text())
    assert progress["writers"]["train"]["shards"] > 0
    FORGED[forged](progress, out)
    (out / "progress.json").write_text(json.dumps(progress))
    logs = []
    meta = prep.prepare(spec, out, "bpe", 300, shard_tokens=400, num_proc=1, log=logs.append,
                        progress=False)
    said = [line for line in logs if line.endswith("; starting the token pass over")]
    assert len(said) == 1 and said[0].startswith(f"{out / 'progress.json'} records ")
    assert meta["splits"] == fresh["splits"]
    assert sorted(p.name for p in out.glob("*.bin")) == sorted(p.name for p in (tmp_path / "fresh").glob("*.bin"))
    for path in (tmp_path / "fresh").glob("*.bin"):
        assert (out / path.name).read_bytes() == path.read_bytes()


KILL_CHILD = """
import sys
sys.path.insert(0, sys.argv[1])
import data.build as build
from data.sources import SourceSpec
build.BATCH_CHARS, build.SAVE_EVERY_S = 4000, 0.0        # small tasks, progress after each
build.prepare(SourceSpec(sys.argv[2]), sys.argv[3], "bpe", 400, tokenizer_sample=200_000,
              shard_tokens=20_000, num_proc=int(sys.argv[4]), log=lambda *a: None, progress=False)
"""


@pytest.mark.parametrize("num_proc", [1, 2])
def test_a_build_killed_at_random_moments_resumes_to_identical_shards(num_proc, tmp_path):
    """SIGKILL (no chance to clean up) at random points, several times over, then the
    same command again: the shards equal an uninterrupted build's, byte for byte.
    ATTNLAB_KILLS sets how many kills (bench runs more than CI's three)."""
    import random
    import signal
    import time
    text = gzip.open(ROOT / "data" / "shakespeare" / "plays.txt.gz", "rt").read()[:600_000]
    source = tmp_path / "plays.txt"
    source.write_text(text)

    def start(out):
        return subprocess.Popen([sys.executable, "-c", KILL_CHILD, str(ROOT), str(source), str(out),
                                 str(num_proc)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    reference = tmp_path / "reference"
    began = time.perf_counter()
    assert start(reference).wait(timeout=300) == 0
    took = time.perf_counter() - began
    rng = random.Random(num_proc)
    out = tmp_path / "killed"
    wanted, kills = int(os.environ.get("ATTNLAB_KILLS", "3")), 0
    for _ in range(3 * wanted):                     # each resumed run has less left to do
        proc = start(out)
        time.sleep(rng.uniform(0.1, 0.4) * took)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait()
        if kills == wanted or proc.returncode == 0:
            break
    assert kills >= 2                                        # it was really interrupted
    assert start(out).wait(timeout=300) == 0
    names = sorted(p.name for p in reference.iterdir() if p.suffix in (".bin", ".json")
                   and p.name != "meta.json")
    assert names == sorted(p.name for p in out.iterdir() if p.suffix in (".bin", ".json")
                           and p.name != "meta.json")
    for name in names:
        assert (out / name).read_bytes() == (reference / name).read_bytes(), name
    assert not list(out.glob("*.partial")) and not (out / "progress.json").exists()


def test_a_column_of_numbers_read_by_train_py_says_how_to_name_the_text_column(tmp_path):
    """train.py has no --text-column: the refusal said to use one it does not take."""
    from data.tokens import load_tokens
    path = tmp_path / "j.jsonl"
    path.write_text('{"text": 5, "body": "words"}\n' * 20)
    with pytest.raises(DataError) as err:
        load_tokens(str(path), "char", cache_dir=str(tmp_path / "c"), log=lambda *a: None)
    assert str(err.value) == (f"column 'text' of {path} holds 20 int values, not text; name the "
                              f"column with the text: python -m data.prepare {path} --text-column "
                              "NAME --out data/mine, then train with --data.path=data/mine")


def test_a_malformed_jsonl_is_refused_in_one_line_with_no_log_line_before_it(tmp_path, capfd):
    from data.tokens import load_tokens
    path = tmp_path / "bad.jsonl"
    path.write_text("not json\n" * 5)
    with pytest.raises(DataError, match=f"reading {path} failed"):
        load_tokens(str(path), "char", cache_dir=str(tmp_path / "c"), log=lambda *a: None)
    captured = capfd.readouterr()
    assert "Failed to load JSON" not in captured.err + captured.out


def test_a_corpus_of_white_space_is_named_so_and_leaves_no_out_folder(tmp_path, capsys):
    """A file of spaces, tabs and newlines was called "empty", and the refusal left the
    --out folder it had made (and its parents) empty behind it."""
    corpus = tmp_path / "blank.txt"
    corpus.write_text("   \n\t\n  \n")
    with pytest.raises(SystemExit) as ended:
        prepare_cli.main([str(corpus), "--tokenizer", "char", "--out", str(tmp_path / "data" / "blank")])
    err = capsys.readouterr().err
    assert ended.value.code == 2 and "holds only white space" in err and "is empty" not in err, err
    assert not (tmp_path / "data").exists()
    kept = tmp_path / "kept"
    kept.mkdir()                                          # an empty folder the user made stays
    with pytest.raises(SystemExit):
        prepare_cli.main([str(corpus), "--tokenizer", "char", "--out", str(kept)])
    assert kept.is_dir()


@pytest.mark.parametrize("stop", [KeyboardInterrupt, Terminated])
def test_a_stopped_preparation_says_in_one_line_that_it_resumes(stop, tmp_path, monkeypatch, capsys):
    """Ctrl-C (or SIGTERM, raised as one) printed a traceback ending in KeyboardInterrupt,
    with no word that the same command resumes."""
    def stopped(args):
        raise stop()
    monkeypatch.setattr(prepare_cli, "run", stopped)
    with pytest.raises(SystemExit) as ended:
        prepare_cli.main([str(tmp_path / "a.txt"), "--out", str(tmp_path / "out")])
    assert ended.value.code == 130
    assert capsys.readouterr().err.splitlines() == [prepare_cli.INTERRUPTED]


def test_the_encoding_workers_leave_ctrl_c_to_the_parent():
    """Ctrl-C reaches every process of the terminal's group: each worker printed its own
    KeyboardInterrupt traceback."""
    import multiprocessing
    import signal
    with multiprocessing.get_context("spawn").Pool(1, initializer=prep._worker_start) as pool:
        assert pool.apply(signal.getsignal, (signal.SIGINT,)) == signal.SIG_IGN


# -- unbounded work: a line with no spaces, a Ctrl-C in the library, one character ----

LONGEST_RUN = 1000                 # the bound on a run BPE sees: data.tokenizer.LONGEST_RUN


def test_bpe_never_learns_from_a_run_longer_than_its_bound():
    """BPE learns within pre-tokens, at a cost that grows with the square of one's
    length: a line of 500K letters took 83 s (and of 2M, hours). Runs past LONGEST_RUN
    are cut before the trainer sees them, so no token is longer than that (and the space
    a word takes before it), the cost is linear in the text, and encoding cuts them the
    same way."""
    line = "ab" * 6000 + " " * 2500 + "x" * 1500           # runs of 12,000, 2,500 and 1,500
    tok = BPETokenizer.train([line], 400)
    longest = max(len(token) for token in tok.hf.get_vocab())
    assert longest <= LONGEST_RUN + 1, longest
    from data import tokenizer
    from data.tokenizer import LONG_RUN, bounded_runs
    assert tokenizer.LONGEST_RUN == LONGEST_RUN
    pieces = bounded_runs(line)
    assert "".join(pieces) == line and not any(LONG_RUN.search(p) for p in pieces)
    text = "the cat sat " + line + " on a mat"
    assert tok.encode_array(text).tolist() == tok.encode(text)
    spans = tok.spans(text)
    assert "".join(text[a:b] for a, b in spans) == text and len(spans) == len(tok.encode(text))
    prose = "\n".join(documents(50))
    assert bounded_runs(prose) == [prose]                   # prose is handed over untouched


def test_a_one_character_corpus_prepares_a_tokenizer_train_py_reads(tmp_path):
    """A file of one letter repeated made BPE learn tokens as long as the line (at 2M
    letters, a tokenizer.json past the size its vocabulary allows, which train.py then
    refused). Its runs are now cut, and the folder loads as train.py loads it."""
    (tmp_path / "a.txt").write_text("a" * 20_000 + "\n")
    quiet(SourceSpec(str(tmp_path / "a.txt")), tmp_path / "out", "bpe", 300)
    data = open_prepared(tmp_path / "out")
    longest = max(len(token) for token in data.tokenizer.hf.get_vocab())
    assert longest <= LONGEST_RUN + 1, longest


def test_a_tokenizer_too_large_for_its_vocabulary_is_refused_at_prepare_time(tmp_path, monkeypatch):
    """The safety net behind the cut: whatever makes a learned tokenizer.json larger
    than the limit train.py reads it under is said by prepare, in one line, before a
    shard is written."""
    (tmp_path / "a.txt").write_text("\n".join(documents(50)))
    monkeypatch.setattr(prep, "tokenizer_limit", lambda vocab_size: 1000)
    with pytest.raises(DataError, match=r"the bpe tokenizer learned from .*a.txt takes [0-9,]+ "
                                        r"bytes, more than the 1,000 a tokenizer of"):
        quiet(SourceSpec(str(tmp_path / "a.txt")), tmp_path / "out", "bpe", 300)
    assert not (tmp_path / "out" / "tokenizer.json").exists()


def test_ctrl_c_while_bpe_learns_is_honoured_at_once(tmp_path):
    """The Rust trainer does not return to Python until it is done, so a Ctrl-C waited
    for the end (78 s on a 500K-letter line). Training runs in a thread of its own and
    the main thread takes the signal. The corpus here would take the old code hours, so
    a wait to the end fails the test rather than passing slowly."""
    import random
    import signal
    rng = random.Random(0)
    (tmp_path / "long.txt").write_text("".join(rng.choice("abcdefgh") for _ in range(3_000_000)))
    proc = subprocess.Popen([sys.executable, "-m", "data.prepare", str(tmp_path / "long.txt"),
                             "--out", str(tmp_path / "out"), "--num-proc", "1"],
                            cwd=ROOT, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    seen = ""
    while "bpe tokenizer" not in seen:                       # the trainer is starting
        seen += proc.stderr.read(1)
        assert seen or proc.poll() is None
    time.sleep(2)                  # into the Rust library (not a timing the test relies on)
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("Ctrl-C waited for the tokenizer to finish learning")
    assert proc.returncode == 130 and err.strip().splitlines()[-1] == prepare_cli.INTERRUPTED
