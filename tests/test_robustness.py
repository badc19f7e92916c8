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
from conftest import ROOT, run_script, train_tiny
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


def test_a_resume_refuses_a_garbled_run_config_a_broken_state_and_a_preset_naming_each(run20, tmp_path):
    """Each was taken in silence or named the wrong file: a run-level config.json that is not
    JSON was written over, a broken state.json was reported as config.json's bad hash, and
    --config (even a preset that does not exist) was dropped for the checkpoint's config."""
    _, run = run20
    copy = tmp_path / "r"
    shutil.copytree(run, copy)
    before = {p: p.read_bytes() for p in copy.rglob("*") if p.is_file() and p.name != ".lock"}
    ckpt = copy / "checkpoints" / "step_0000020"
    for preset in ("tiny", "nonexistent"):
        proc = run_script("train.py", "--resume", copy, "--config", preset, "--train.max_iters=25",
                          check=False)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith(f"error: --config {preset} chooses a new run's preset")
    # A run that is not there is the first thing to fix, before the --config refusal.
    proc = run_script("train.py", "--resume", tmp_path / "nope", "--config", "tiny", check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"error: cannot resume: {tmp_path / 'nope'} does not exist")
    restore_it = f"cp {ckpt / 'config.json'} {copy / 'config.json'}"
    for garbled in ("garbage{{{", '{"model": 5}'):       # the second was a traceback
        (copy / "config.json").write_text(garbled)
        proc = run_script("train.py", "--resume", copy, "--train.max_iters=25", check=False)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert f"{copy / 'config.json'} is not a readable run config" in proc.stderr
        assert restore_it in proc.stderr
        assert (copy / "config.json").read_text() == garbled           # not written over
    (copy / "config.json").unlink()                        # was "not a run directory", no way back
    proc = run_script("train.py", "--resume", copy, "--train.max_iters=25", check=False)
    assert proc.returncode == 2 and f"{copy / 'config.json'} is missing" in proc.stderr
    assert restore_it in proc.stderr
    (copy / "config.json").write_bytes(before[copy / "config.json"])
    (ckpt / "state.json").write_text("[1,2")
    proc = run_script("train.py", "--resume", copy, "--train.max_iters=25", check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"checkpoint {ckpt} has no readable state.json" in proc.stderr
    # A step of -5 divided by zero in the momentum warm-up; true retrained from step 1.
    for step in (-5, True):
        (ckpt / "state.json").write_text(json.dumps({**json.loads(before[ckpt / "state.json"]),
                                                     "step": step}))
        proc = run_script("train.py", "--resume", copy, "--train.max_iters=25", check=False)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert f"checkpoint {ckpt} has no readable state.json" in proc.stderr
    # Valid JSON of the wrong kind: each was a traceback after the run had begun writing.
    state = json.loads(before[ckpt / "state.json"])
    for field, value in [("best_val", "x"), ("elapsed_s", None), ("optimizer", 5),
                         ("autocast", "bogus")]:
        (ckpt / "state.json").write_text(json.dumps({**state, field: value}))
        proc = run_script("train.py", "--resume", copy, "--train.max_iters=25", check=False)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert f"{ckpt / 'state.json'} holds {field}={json.dumps(value)} of the wrong kind" in proc.stderr
    # Numbers out of their range: a NaN or negative best loss trained on with best.json
    # no longer following the best; 1e300 seconds printed 300 digits; a last evaluation
    # after the checkpoint's step, or before 0, moved when the next one fell due.
    for field, value, said in [("best_val", float("nan"), "holds best_val=NaN, not a number;"),
                               ("best_val", -1e9, "holds best_val=-1000000000.0, a loss below 0;"),
                               ("limit_s", 1e300, "records limit_s=1e+300"),
                               ("limit_s", None, "records limit_s=null in"),
                               ("elapsed_s", -100, "records elapsed_s=-100"),
                               ("last_eval", -3, f"holds last_eval=-3, not a step from 0 to its own ({state['step']});"),
                               ("last_eval", state["step"] + 1, "holds last_eval=")]:
        (ckpt / "state.json").write_text(json.dumps({**state, field: value}))
        proc = run_script("train.py", "--resume", copy, "--train.max_iters=25", check=False)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert said in proc.stderr, proc.stderr
    (ckpt / "state.json").write_bytes(before[ckpt / "state.json"])
    assert {p: p.read_bytes() for p in copy.rglob("*") if p.is_file() and p.name != ".lock"} == before


def test_a_second_process_on_the_same_run_is_refused(corpus, tmp_path):
    from engine.run import setup_run
    cfg = cli.build("tiny", [f"--data.path={corpus}", f"--data.cache_dir={tmp_path / 'c'}",
                             f"--train.out_dir={tmp_path / 'runs'}", "--train.run_name=same"])
    first = setup_run(cfg, log=lambda *a: None)
    with pytest.raises(CheckpointError, match=f"being written by another training process .pid {os.getpid()}"):
        setup_run(cfg, log=lambda *a: None)
    first.lock.close()                                    # released: the run can go on
    setup_run(cfg, log=lambda *a: None).lock.close()


def test_two_runs_started_in_the_same_second_take_two_folders(corpus, tmp_path, monkeypatch):
    """A run's own name is its preset and the second it started: two trainings started
    together on one laptop go on side by side, the second in NAME-2, where it was
    refused for the first one's folder; a finished run's folder is passed over too."""
    from engine import run as engine_run
    monkeypatch.setattr(engine_run, "fresh_name", lambda cfg: "tiny-20261204-190550")
    cfg = lambda: cli.build("tiny", [f"--data.path={corpus}", f"--data.cache_dir={tmp_path / 'c'}",
                                     f"--train.out_dir={tmp_path / 'runs'}"])
    first = engine_run.setup_run(cfg(), log=lambda *a: None)
    second = engine_run.setup_run(cfg(), log=lambda *a: None)
    assert (first.run_dir.name, second.run_dir.name) == ("tiny-20261204-190550",
                                                         "tiny-20261204-190550-2")
    first.lock.close()
    second.lock.close()
    (first.run_dir / "checkpoints" / "step_0000004").mkdir(parents=True)   # as if finished
    third = engine_run.setup_run(cfg(), log=lambda *a: None)
    assert third.run_dir.name == "tiny-20261204-190550-2"
    third.lock.close()


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
    proc = run_script(*tiny(corpus, tmp_path, "huge", "--model.n_embd=1048576"),
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


def test_rope_far_past_its_training_context_keeps_the_angles():
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
    assert [b for b in rope.buffers()] == [rope.inv_freq]              # bounded: nothing grows


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
    ["-m", "attnlab.lens", "logit", "--text", "x", "--run", "nosuch"],
    ["-m", "attnlab.induction", "--run", "/nonexistent", "--checkpoint", "latest"],
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
    assert "run: runs/r (the latest run that trained" in proc.stderr
    state = copy / "checkpoints" / "step_0000020" / "state.json"
    state.write_text(json.dumps({"files": ["not", "a", "dict"], "step": "x"}))
    proc = run_script("sample.py", "--run", state.parent, check=False)
    assert proc.returncode == 2 and "no readable state.json" in proc.stderr


@pytest.mark.parametrize("options, says", [
    (["--sample.sinks=4", "--sample.use_cache=false"],
     "error: sample.sinks keeps the first tokens in a rolling KV cache"),
    (["--sinks=4", "--decode=static"], "error: sample.sinks decodes from a rolling cache"),
    (["--sinks=-1"], "error: sample.sinks must be 0 (off) or positive"),
    (["--sinks=100000"], "error: sample.sinks=100000 keeps more tokens than the model's context"),
])
def test_attention_sinks_that_cannot_work_get_one_error_line(run20, options, says):
    # The last needs the run's context, so every case runs on a real run.
    _, run = run20
    proc = run_script("sample.py", "--run", run, "--max_new_tokens=3", *options, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(says), proc.stderr


def test_a_decode_mode_with_the_cache_turned_off_gets_one_error_line(run20):
    """--decode names how the cache is kept; --use_cache false turns it off: asked for
    both, the run is refused instead of quietly decoding without a cache."""
    _, run = run20
    proc = run_script("sample.py", "--run", run, "--max_new_tokens=3", "--decode=static",
                      "--use_cache=false", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "error: sample.decode=static says how to keep the KV cache"), proc.stderr


@pytest.mark.parametrize("failure", ["oserror", "safetensors"])
def test_a_full_disk_mid_checkpoint_leaves_no_temporary_folder(failure, tmp_path, monkeypatch):
    import errno
    from safetensors import SafetensorError
    from engine.optim import Optimizers
    from model import GPT, ModelConfig
    model = GPT(ModelConfig(vocab_size=10, block_size=8, n_layer=1, n_head=2, n_embd=16))
    opt = Optimizers(adamw=torch.optim.AdamW(model.parameters()))

    def full_disk(*args, **kwargs):          # what each raises on ENOSPC
        if failure == "oserror":
            raise OSError(errno.ENOSPC, "No space left on device")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    monkeypatch.setattr(checkpoint, "save_file", full_disk)
    with pytest.raises(CheckpointError, match=r"step_0000003 could not be written .*No space left on "
                                              r"device.*train.py --resume"):
        checkpoint.save(tmp_path, 3, model, opt, {}, {}, {}, 2)
    assert list((tmp_path / "checkpoints").iterdir()) == []


# Runs a script with safetensors' save_file failing as a full disk makes it fail,
# for the checkpoint of one step (argv: STEP SCRIPT ARGS...).
FULL_DISK_AT = """
import runpy, sys
import safetensors.torch
from safetensors import SafetensorError
real, step = safetensors.torch.save_file, sys.argv.pop(1)
def save_file(tensors, filename, *args, **kwargs):
    if f"step_{int(step):07d}" in str(filename):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    return real(tensors, filename, *args, **kwargs)
safetensors.torch.save_file = save_file
sys.argv.pop(0)
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_training_on_a_full_disk_stops_with_one_line_and_resumes_to_the_same_weights(run20, tmp_path):
    _, run = run20
    full, straight = tmp_path / "full" / "r", tmp_path / "straight" / "r"
    shutil.copytree(run, full)
    shutil.copytree(run, straight)
    wrapper = tmp_path / "full_disk.py"
    wrapper.write_text(FULL_DISK_AT)
    proc = run_script(wrapper, "30", ROOT / "train.py", "--resume", full, "--train.max_iters=40",
                      check=False)
    errors = [l for l in proc.stderr.splitlines() if l.startswith(("error", "Traceback"))]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert "No space left on device" in errors[0] and f"python train.py --resume {full}" in errors[0]
    assert sorted(p.name for p in (full / "checkpoints").iterdir()) == \
        sorted(p.name for p in (run / "checkpoints").iterdir())          # as they were, no temp
    run_script("train.py", "--resume", full, "--train.max_iters=40")
    run_script("train.py", "--resume", straight, "--train.max_iters=40")
    last = "checkpoints/step_0000040/model.safetensors"
    assert (full / last).read_bytes() == (straight / last).read_bytes()
    assert (full / "metrics.jsonl").read_text().count('"val_loss"') == \
        (straight / "metrics.jsonl").read_text().count('"val_loss"')


# Runs train.py with Ctrl-C arriving after set-up and before the training loop's own
# handler (argv: SCRIPT ARGS...).
CTRL_C_BEFORE_THE_LOOP = """
import runpy, sys
import engine.loop
def train(run, *args, **kwargs):
    raise KeyboardInterrupt
engine.loop.train = train
sys.argv.pop(0)
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_ctrl_c_before_the_loop_names_the_run_to_resume_a_branch_included(run20, tmp_path):
    """It once said only "--resume RUN continues a run ... otherwise run the same command
    again", and the same command made a second branch beside the one just made."""
    _, run = run20
    wrapper = tmp_path / "ctrl_c.py"
    wrapper.write_text(CTRL_C_BEFORE_THE_LOOP)
    other = tmp_path / "other"
    proc = run_script(wrapper, ROOT / "train.py", "--resume", run, f"--train.out_dir={other}",
                      "--train.max_iters=25", check=False)
    branch = other / f"{run.name}-from-20"
    errors = [l for l in proc.stderr.splitlines() if l.startswith(("error", "Traceback"))]
    assert proc.returncode == 130 and errors == [
        f"error: interrupted; stopped, nothing half-written was kept; python train.py --resume "
        f"{branch} continues from its last checkpoint, step_0000020"], proc.stderr[-2000:]


CTRL_C_WHILE_THE_TEXT_IS_READ = """
import runpy, sys
import engine.run
def _load_data(*args, **kwargs):
    raise KeyboardInterrupt
engine.run._load_data = _load_data
sys.argv.pop(0)
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("branch", [False, True])
def test_ctrl_c_before_the_run_folder_says_nothing_was_written(corpus, run20, tmp_path, branch):
    """It once said "python train.py --resume RUN continues a run from its last checkpoint
    where one was written; otherwise ...", leaving the user to guess which, when nothing
    had been written: the same command again is the way on, a new run or a branch."""
    _, run = run20
    wrapper = tmp_path / "ctrl_c.py"
    wrapper.write_text(CTRL_C_WHILE_THE_TEXT_IS_READ)
    other = tmp_path / "other"
    start = ["--resume", str(run)] if branch else ["--config", "tiny", f"--data.path={corpus}",
                                                     "--train.run_name=new"]
    proc = run_script(wrapper, ROOT / "train.py", *start, f"--train.out_dir={other}",
                      "--train.max_iters=25", check=False)
    errors = [l for l in proc.stderr.splitlines() if l.startswith(("error", "Traceback"))]
    assert proc.returncode == 130 and errors == [
        "error: interrupted; stopped before the run's folder was made, so nothing of it was "
        "written; run the same command again"], proc.stderr[-2000:]
    assert not other.exists() or not any(other.iterdir())


def _prepare(corpus, out, capsys=None):
    import data.prepare
    argv = [str(corpus), "--tokenizer", "char", "--out", str(out), "--num-proc", "1",
            "--shard-tokens", "5000"]
    if capsys is None:
        data.prepare.main(argv)
        return None
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        data.prepare.main(argv)
    stderr = capsys.readouterr().err            # progress bars aside, one line: error: ...
    err = [line for line in stderr.splitlines() if line.startswith("error")]
    assert exit_.value.code == 2 and len(err) == 1 and "Traceback" not in stderr, stderr
    return err[0]


def test_prepare_on_a_full_disk_or_read_only_out_says_so_in_one_line_and_resumes(
        corpus, tmp_path, monkeypatch, capsys):
    import errno
    from data.shards import ShardWriter
    real, calls = ShardWriter.append, []

    def fills_the_disk(self, ids):
        calls.append(1)
        if len(calls) == 4:                   # half the tokens reach the file, then ENOSPC
            self.file.write(ids[: len(ids) // 2].tobytes())
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, ids)
    text = corpus.read_text()
    books = tmp_path / "books"                # eight documents: eight pieces to append
    books.mkdir()
    for i in range(8):
        (books / f"{i}.txt").write_text(text[i * 7000:(i + 1) * 7000])
    monkeypatch.setattr(ShardWriter, "append", fills_the_disk)
    monkeypatch.setattr("data.build.BATCH_CHARS", 10_000)    # progress recorded between batches
    error = _prepare(books, tmp_path / "full", capsys)
    assert "No space left on device" in error and "run the same command again" in error
    monkeypatch.setattr(ShardWriter, "append", real)
    _prepare(books, tmp_path / "full")
    _prepare(books, tmp_path / "clean")
    names = sorted(p.name for p in (tmp_path / "clean").iterdir() if p.name != "meta.json")
    assert names == sorted(p.name for p in (tmp_path / "full").iterdir() if p.name != "meta.json")
    for name in names:
        assert (tmp_path / "full" / name).read_bytes() == (tmp_path / "clean" / name).read_bytes(), name

    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(self))
    monkeypatch.setattr("pathlib.Path.mkdir", read_only)
    error = _prepare(books, tmp_path / "ro" / "out", capsys)
    assert "Read-only file system" in error and "choose a folder you can write to" in error


def _tool_error(capsys, main, argv) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_, cli.errors_as_lines():
        main(argv)
    stderr = capsys.readouterr().err            # progress bars aside, one line: error: ...
    err = [line for line in stderr.splitlines() if line.startswith("error")]
    assert exit_.value.code == 2 and len(err) == 1 and "Traceback" not in stderr, stderr
    return err[0]


# Mistakes in a tool's arguments: (tool, argv with RUN and TMP, what the line must say,
# what it must not).
TOOL_MISTAKES = {
    "heads grid --out g.txt": ("heads", ["grid", "--run", "RUN", "--text", "hello", "--out", "TMP/g.txt"],
                               "cannot be saved as .txt; use .png", None),
    "heads lens on one token": ("heads", ["lens", "--run", "RUN", "--text", "h"], "at least 2", None),
    "heads search --top -3": ("heads", ["search", "--run", "RUN", "--text", "the cat saw the hat",
                                        "--from", "hat", "--to", "cat", "--top", "-3"],
                              "argument --top: '-3' is not a whole number of at least 1", None),
    "evaluate --compare RUN": ("evaluate", ["--run", "RUN", "--data", "TMP/text.txt", "--compare", "RUN"],
                               "is not a transformers folder but attnlab's own run", None),
    "evaluate --compare a missing folder": ("evaluate", ["--run", "RUN", "--data", "TMP/text.txt",
                                                         "--compare", "TMP/missing"],
                                            "TMP/missing does not exist", "repo"),
    "sample a folder with a broken config.json": ("sample", ["--run", "TMP/hf"],
                                                  "TMP/hf/config.json is not JSON", "train first"),
}


@pytest.mark.parametrize("case", TOOL_MISTAKES)
def test_tool_mistakes_get_one_error_line_that_says_what_is_wrong(case, run20, tmp_path, capsys):
    import sample
    from attnlab import evaluate, heads
    from engine.inference import load_run
    from engine.interop import export
    _, run = run20
    (tmp_path / "text.txt").write_text("the cat saw the hat\n" * 5)
    tool, argv, says, not_says = TOOL_MISTAKES[case]
    if "TMP/hf" in argv:
        model, cfg, tok, _ = load_run(run)
        export(model, cfg.model, tok, tmp_path / "hf")
        (tmp_path / "hf" / "config.json").write_text("{not json")
    main = {"heads": heads.main, "evaluate": evaluate.main, "sample": sample.main}[tool]
    error = _tool_error(capsys, main, [a.replace("RUN", str(run)).replace("TMP", str(tmp_path)) for a in argv])
    assert says.replace("TMP", str(tmp_path)) in error, error
    assert not_says is None or not_says not in error.lower(), error
    assert not (tmp_path / "g.txt").exists()


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


@pytest.mark.parametrize("stop", ["ends", "SIGTERM"])
def test_the_suite_removes_its_cache_folder_however_it_stops(tmp_path, stop):
    """tests/conftest.py gives a session a cache folder in the temporary directory; the
    session removes it whether it ends or is stopped by SIGTERM (a CI's time limit), so
    that runs do not pile them up there."""
    import signal
    import time
    flag = tmp_path / "running"
    (tmp_path / "test_wait.py").write_text(
        "import pathlib, time\n"
        f"def test_wait():\n    pathlib.Path({str(flag)!r}).touch()\n"
        f"    time.sleep({60 if stop == 'SIGTERM' else 0})\n")
    temp = tmp_path / "temp"
    temp.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("ATTNLAB_CACHE", "PYTEST_XDIST_WORKER",
                                                             "PYTEST_XDIST_WORKER_COUNT")}
    env.update(TMPDIR=str(temp), PYTHONPATH=f"{ROOT / 'tests'}{os.pathsep}{ROOT}")
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:xdist",
                             "-p", "no:cacheprovider", str(tmp_path / "test_wait.py")],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not flag.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert flag.exists()
    assert len([p for p in temp.iterdir() if p.name.startswith("attnlab-cache-")]) == 1
    if stop == "SIGTERM":
        proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=60)[0].decode()
    assert proc.returncode == (0 if stop == "ends" else 2), out
    assert not [p for p in temp.iterdir() if p.name.startswith("attnlab-cache-")], out


def test_ctrl_c_while_the_modules_load_is_one_line_and_status_130(capsys, monkeypatch):
    """A Ctrl-C during torch's import printed the import's whole traceback."""
    from common.errors import interrupt_at_start
    monkeypatch.delenv("ATTNLAB_DEBUG", raising=False)
    with pytest.raises(SystemExit) as stopped:
        with interrupt_at_start():
            raise KeyboardInterrupt
    err = capsys.readouterr().err
    assert stopped.value.code == 130 and err.startswith("error: interrupted while starting")
    assert err.count("\n") == 1
    for script in ("train.py", "sample.py"):       # both load torch inside it
        text = (ROOT / script).read_text()
        assert "with interrupt_at_start():" in text.split("def parser")[0]


def test_a_stack_of_more_layers_than_the_bound_is_refused_before_any_is_built(corpus, tmp_path):
    """Every layer is a module even on the meta device: past the bound the count alone is
    refused, at once, where sizing the model would build each one first."""
    proc = run_script(*tiny(corpus, tmp_path, "deep", "--model.n_layer=99999999999999999999"),
                      check=False, timeout=60)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1 and "layers" in errors[0], proc.stderr[-2000:]
    assert not (tmp_path / "runs" / "deep").exists()


def test_sinks_or_drafts_a_model_cannot_decode_with_are_refused_before_any_text(corpus, tmp_path):
    """Sinks on latent attention and drafts without a multi-token module were refused only
    once the prompt was printed ("Aerror: ..." on one line), and the sinks' line did not
    say what to do: both now fail before the header or the prompt, in one line."""
    run = train_tiny(corpus, tmp_path, "mla", "--model.mechanism=mla", "--train.max_iters=2",
                     "--train.eval_interval=2")
    for options, says in ((["--sinks=4"], "error: sinks renumber a rolling cache's keys"),
                          (["--decode=mtp"], "error: decode='mtp' drafts the token after next")):
        proc = run_script("sample.py", "--run", run, "--max_new_tokens=3", "--prompt=A",
                          *options, check=False)
        assert proc.returncode == 2 and proc.stdout == "", (proc.stdout, proc.stderr)
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith(says) and "Traceback" not in proc.stderr, proc.stderr
        assert "decode " not in proc.stderr.split("error:")[0]          # no header before it
        assert options != ["--sinks=4"] or last.endswith("sample without sinks (--sinks=0)")
