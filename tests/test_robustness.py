"""Faults a careless user or an attacker would cause, each reproducing a defect that
was found by trying it: runs that must not destroy or share what they write, inputs
that must end as one `error:` line, and state that must stay bounded."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from common.errors import CheckpointError
from conftest import ROOT, run_script
from engine import checkpoint, cli


def tiny(corpus, out, name, *extra):
    return ["train.py", "--config", "tiny", f"--data.path={corpus}",
            f"--data.cache_dir={out / 'cache'}", f"--train.out_dir={out / 'runs'}",
            f"--train.run_name={name}", *extra]


@pytest.fixture(scope="module")
def run20(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("robust")
    run_script(*tiny(corpus, out, "r"))
    return out, out / "runs" / "r"


def test_resuming_from_a_checkpoint_folder_writes_into_its_run_never_inside_it(run20, tmp_path):
    out, run = run20
    copy = tmp_path / "runs" / "r"
    shutil.copytree(run, copy)
    ckpt = copy / "checkpoints" / "step_0000020"             # the run's latest
    before = sorted(p.name for p in ckpt.iterdir())
    proc = run_script("train.py", "--resume", ckpt, "--train.max_iters=30",
                      f"--train.out_dir={tmp_path / 'runs'}")
    assert "from step_0000020 (step 20)" in proc.stdout
    assert sorted(p.name for p in ckpt.iterdir()) == before          # the checkpoint untouched
    assert checkpoint.list_checkpoints(copy)[-1].name == "step_0000030"
    run_script("sample.py", "--run", ckpt, "--max_new_tokens", "5")  # still a usable checkpoint


def test_the_checkpoints_own_config_wins_over_an_edited_run_config(run20, tmp_path):
    _, run = run20
    copy = tmp_path / "r"
    shutil.copytree(run, copy)
    saved = json.loads((copy / "config.json").read_text())
    saved["model"]["n_head"] = 4
    (copy / "config.json").write_text(json.dumps(saved))
    proc = run_script("train.py", "--resume", copy, "--train.max_iters=25", check=False)
    assert proc.returncode == 2 and "model.n_head: 2 -> 4" in proc.stderr
    assert "put config.json back" in proc.stderr


def test_a_second_process_on_the_same_run_is_refused(corpus, tmp_path):
    from engine.run import setup_run
    cfg = cli.build("tiny", [f"--data.path={corpus}", f"--data.cache_dir={tmp_path / 'c'}",
                             f"--train.out_dir={tmp_path / 'runs'}", "--train.run_name=same"])
    first = setup_run(cfg, log=lambda *a: None)
    with pytest.raises(CheckpointError, match=f"being written by another training process .pid {os.getpid()}"):
        setup_run(cfg, log=lambda *a: None)
    first.lock.close()                                    # released: the run can go on
    setup_run(cfg, log=lambda *a: None).lock.close()


def test_two_trainings_building_one_token_cache_at_once_both_succeed(corpus, tmp_path):
    procs = [subprocess.Popen([sys.executable, *tiny(corpus, tmp_path, f"p{i}", "--train.max_iters=2")],
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(3)]
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-800:]


@pytest.mark.parametrize("name", ["..", "a/b", "/tmp/x", "~x"])
def test_run_name_stays_inside_out_dir(name):
    from common.errors import ConfigError
    with pytest.raises(ConfigError, match="plain folder name"):
        cli.build("tiny", [f"--train.run_name={name}"])


def test_a_model_too_large_for_the_machine_is_refused_with_the_numbers(corpus, tmp_path):
    proc = run_script(*tiny(corpus, tmp_path, "huge", "--model.n_layer=99999999999999999999"),
                      check=False, timeout=60)
    assert proc.returncode == 2 and "GiB free" in proc.stderr and "parameters" in proc.stderr
    assert not (tmp_path / "runs" / "huge").exists()


def test_a_corrupt_cached_shard_is_rebuilt_and_foreign_ids_are_refused(corpus, tmp_path):
    from common.errors import DataError
    from data.shards import HEADER_BYTES
    from data.tokens import load_tokens
    quiet = dict(cache_dir=str(tmp_path), log=lambda *a: None)
    data = load_tokens(str(corpus), **quiet)
    reference = data.train.to_numpy().copy()
    shard = next(tmp_path.glob("*/train_000000.bin"))
    shard.write_bytes(shard.read_bytes()[:HEADER_BYTES + 100])            # truncated
    assert (load_tokens(str(corpus), **quiet).train.to_numpy() == reference).all()
    raw = bytearray(shard.read_bytes())
    raw[HEADER_BYTES:HEADER_BYTES + 2] = (60000).to_bytes(2, "little")   # an id past the vocabulary
    shard.write_bytes(bytes(raw))
    from data.tokens import open_prepared
    with pytest.raises(DataError, match="token id 60000, outside the tokenizer's vocabulary"):
        open_prepared(shard.parent)


def test_streamed_text_equals_the_whole_decode_and_costs_the_same_per_token():
    """Byte-level BPE pieces that split multi-byte characters come out whole, and the
    joined stream equals decoding every id at once."""
    from data.tokenizer import BPETokenizer
    from engine.inference import IncrementalDecoder
    tok = BPETokenizer.train(["naïve café — 日本語 text, with spaces and\nnewlines 😀"] * 30, 280)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        ids = torch.randint(0, tok.vocab_size, (60,), generator=g).tolist()
        decoder = IncrementalDecoder(tok)
        pieces = [decoder.add(i) for i in ids] + [decoder.flush()]
        assert "".join(pieces) == tok.decode(ids)
        assert all("\ufffd" not in p for p in pieces[:-1] if p) or "\ufffd" in tok.decode(ids)


def test_rope_past_its_table_keeps_the_table_and_the_angles():
    from model import ModelConfig
    from model.positions import RoPE
    rope = RoPE(ModelConfig(block_size=16, n_embd=32, n_head=2))
    x = torch.randn(1, 2, 1, 16, dtype=torch.float64)
    for start in (100, 50_000):
        out = rope.rotate(x.float(), start)
        angle = start * rope.inv_freq.double()                          # the formula, float64
        x1, x2 = x[..., :8], x[..., 8:]
        expected = torch.cat((x1 * angle.cos() - x2 * angle.sin(),
                              x2 * angle.cos() + x1 * angle.sin()), -1)
        torch.testing.assert_close(out.double(), expected, atol=2e-3 if start > 1000 else 1e-5, rtol=0)
    assert rope.cos.shape[0] == 16                                      # bounded: no growth


def test_a_torn_last_metrics_line_does_not_block_resume(run20, tmp_path):
    _, run = run20
    copy = tmp_path / "r"
    shutil.copytree(run, copy)
    with open(copy / "metrics.jsonl", "a") as f:
        f.write('{"step": 21, "loss": 3.')                               # a kill mid-write
    proc = run_script("train.py", "--resume", copy, "--train.max_iters=22", f"--train.out_dir={tmp_path}")
    steps = [json.loads(l)["step"] for l in (copy / "metrics.jsonl").read_text().splitlines()]
    assert "done at step 22" in proc.stdout and steps[-1] == 22


def test_nan_weights_are_never_saved_and_never_loaded(tmp_path):
    from model import GPT, ModelConfig
    model = GPT(ModelConfig(vocab_size=10, block_size=8, n_layer=1, n_head=2, n_embd=16))
    opt = torch.optim.AdamW(model.parameters())
    from engine.optim import Optimizers
    with torch.no_grad():
        model.wte.weight[0, 0] = float("nan")
    with pytest.raises(CheckpointError, match="NaN or infinite.*last one stays the last good one"):
        checkpoint.save(tmp_path, 5, model, Optimizers(adamw=opt), {}, {}, {}, 3)
    assert not list((tmp_path / "checkpoints").iterdir())             # no folder, no temp left
    with pytest.raises(CheckpointError, match="holds NaN or infinite weights"):
        checkpoint.load_weights(GPT(model.config), model.state_dict(), tmp_path)


def test_the_best_checkpoint_survives_pruning_when_it_is_not_among_the_last(tmp_path):
    for step in range(6):
        (tmp_path / "checkpoints" / f"step_{step:07d}").mkdir(parents=True)
    (tmp_path / "best.json").write_text(json.dumps({"step": 1, "val_loss": 1.0}))
    checkpoint.prune(tmp_path, keep_last=2)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == \
        ["step_0000001", "step_0000004", "step_0000005"]
    (tmp_path / "best.json").write_text(json.dumps({"step": "1"}))      # hand-edited: ignored
    checkpoint.prune(tmp_path, keep_last=2)
    assert len(checkpoint.list_checkpoints(tmp_path)) == 2


# Every command with a bad argument: one line starting with `error:`, no traceback.
BAD = [
    ["train.py", "--config", "tiny", "--model.n_layr=3"],
    ["train.py", "--config="],
    ["train.py", "--config", "tiny", "--train.seed=99999999999999999999"],
    ["train.py", "--resume", "/nonexistent/run"],
    ["sample.py", "--run", "README.md"],
    ["sample.py", "--run", "/nonexistent", "--explain_top=-3"],
    ["sample.py", "--max_new_tokens=1000000000"],
    ["sample.py", "--device=cuda:7", "--run", "/nonexistent"],
    ["-m", "data.prepare", "x.txt", "--out", "/tmp/x", "--max-bytes", "1e400"],
    ["-m", "data.prepare", "README.md", "--out", "README.md"],
    ["-m", "attnlab.heads", "grid", "--text", "x", "--run", "/nonexistent"],
    ["-m", "attnlab.export", "--run", "/nonexistent", "--out", "/tmp/x"],
    ["-m", "attnlab.evaluate", "--run", "/nonexistent", "--data", "README.md"],
    ["-m", "attnlab.figures", "nope"],
    ["-m", "attnlab.compare", "--variants", "nope"],
    ["-m", "attnlab.extrapolate"],
]


@pytest.mark.parametrize("args", BAD, ids=[" ".join(a[:3]) for a in BAD])
def test_every_command_answers_bad_input_with_one_error_line(args, tmp_path):
    proc = run_script(*args, check=False, timeout=60, cwd=ROOT)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr


@pytest.mark.parametrize("args", [BAD[0], BAD[4], BAD[9]], ids=["config", "run", "prepare"])
def test_the_traceback_is_there_when_asked_for(args):
    debug = run_script(*args, check=False, timeout=60, env={"ATTNLAB_DEBUG": "1"})
    assert "Traceback" in debug.stderr


def test_hand_edited_run_files_get_one_error_line(run20, tmp_path):
    _, run = run20
    copy = tmp_path / "runs" / "r"
    shutil.copytree(run, copy)
    (tmp_path / "runs" / "stray").write_bytes(b"\xff\xfe not a run")
    (tmp_path / "runs" / "half").mkdir()                   # a run stopped before its first checkpoint
    (tmp_path / "runs" / "half" / "config.json").write_text("{}")
    proc = run_script(ROOT / "sample.py", "--max_new_tokens", "3", cwd=tmp_path)
    assert "run: runs/r (the one whose checkpoint was written last" in proc.stderr
    state = copy / "checkpoints" / "step_0000020" / "state.json"
    state.write_text(json.dumps({"files": ["not", "a", "dict"], "step": "x"}))
    proc = run_script("sample.py", "--run", state.parent, check=False)
    assert proc.returncode == 2 and "no readable state.json" in proc.stderr


def test_a_full_disk_mid_checkpoint_leaves_no_temporary_folder(tmp_path, monkeypatch):
    import errno
    from engine.optim import Optimizers
    from model import GPT, ModelConfig
    model = GPT(ModelConfig(vocab_size=10, block_size=8, n_layer=1, n_head=2, n_embd=16))
    opt = Optimizers(adamw=torch.optim.AdamW(model.parameters()))

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(checkpoint, "save_file", full_disk)
    with pytest.raises(OSError):
        checkpoint.save(tmp_path, 3, model, opt, {}, {}, {}, 2)
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_muon_with_fsdp_is_refused_and_an_empty_bpe_prompt_starts_a_document():
    from common.errors import ConfigError
    from data.tokenizer import BPETokenizer
    from engine.inference import encode_prompt
    with pytest.raises(ConfigError, match="Muon orthogonalises whole matrices"):
        cli.build("tiny", ["--train.optimizer=muon", "--train.parallel=fsdp"])
    bpe = BPETokenizer.train(["some text to learn from, twice. " * 20], 280)
    assert encode_prompt(bpe, "") == [bpe.eot_id] and bpe.eot_id is not None


def test_evaluate_scores_the_validation_windows_as_training_does(run20):
    """With the stride equal to the context, the evaluate command's windows are the
    training-time evaluation's windows laid end to end: the same loss."""
    from attnlab.evaluate import sliding_loss
    from engine.inference import load_run
    _, run = run20
    model, cfg, tok, _ = load_run(run)
    T = cfg.model.block_size
    ids = torch.randint(0, tok.vocab_size, (4 * T + 1,), generator=torch.Generator().manual_seed(0))
    nats, count = sliding_loss(lambda x: model(x).logits, ids.tolist(), T, T, progress=False)
    windows = ids[: 4 * T + 1].unfold(0, T + 1, T)               # (4, T + 1), as Batches cuts them
    with torch.no_grad():
        training = model(windows[:, :-1], windows[:, 1:]).loss.item()
    assert count == 4 * T and nats / count == pytest.approx(training, rel=1e-5)
