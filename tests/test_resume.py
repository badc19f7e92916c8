"""Resuming and reading back a run: options a resume changes take effect (or are
refused), an older checkpoint branches into a new run instead of rewriting history,
and the tools pick a trained checkpoint and the run trained last, saying which."""
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from common.errors import CheckpointError, ConfigError
from conftest import ROOT, run_script
from engine import checkpoint, cli
from engine.inference import load_run
from engine.loop import train
from engine.resume import nothing_to_train, resume_changes, resume_config
from engine.run import setup_run


def quiet(*a, **k):
    pass


def tiny_run(corpus, out, name="r", *extra):
    cfg = cli.build("tiny", [f"--data.path={corpus}", f"--data.cache_dir={out / 'cache'}",
                             f"--train.out_dir={out / 'runs'}", f"--train.run_name={name}", *extra])
    run = setup_run(cfg, log=quiet)
    train(run)
    return run.run_dir


def stopped_run(corpus, out, name, step, *extra):
    """A tiny run stopped after `step` steps as Ctrl-C stops one: it saves a checkpoint there."""
    cfg = cli.build("tiny", [f"--data.path={corpus}", f"--data.cache_dir={out / 'cache'}",
                             f"--train.out_dir={out / 'runs'}", f"--train.run_name={name}", *extra])
    run = setup_run(cfg, log=quiet)
    forward, calls = run.train_forward, []

    def stop_there(x, y):
        calls.append(1)
        if len(calls) == step:
            run.stop_signal = signal.SIGINT
        return forward(x, y)
    run.train_forward = stop_there
    train(run)
    return run


def resume(path, overrides=None, log=quiet, spy=None):
    cfg, run_dir, ckpt = resume_config(str(path), str(path), overrides or {})
    run = setup_run(cfg, run_dir=run_dir, resume=ckpt, log=log)
    if spy is not None:
        spy(run)
    train(run)
    return run


def files_of(folder):
    """Every file under `folder` with its bytes: what 'untouched' means."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def run20(corpus, tmp_path_factory):
    """A tiny run with checkpoints at steps 0, 10 and 20."""
    out = tmp_path_factory.mktemp("resume")
    return tiny_run(corpus, out)


def copy_of(run_dir, tmp_path):
    copy = tmp_path / "runs" / run_dir.name
    shutil.copytree(run_dir, copy)
    return copy


def test_a_resume_trains_with_the_rates_it_is_given_and_logs_the_rate_used(run20, tmp_path):
    """The loaded optimizer state brought back the old rate, and the schedule scaled it."""
    start = load_run(run20, "latest")[0].state_dict()
    plain = copy_of(run20, tmp_path / "plain")
    resume(plain, {"train": {"max_iters": "23"}})
    slow = copy_of(run20, tmp_path / "slow")
    used = []

    def record(run):
        step = run.optimizer.step
        run.optimizer.step = lambda scaler: (used.append(run.optimizer.param_groups[0]["lr"]),
                                             step(scaler))[1]
    resume(slow, {"train": {"max_iters": "23", "lr": "1e-9", "min_lr": "1e-10"}}, spy=record)
    moved = lambda folder: max((load_run(folder, "latest")[0].state_dict()[k] - v).abs().max().item()
                               for k, v in start.items())
    assert moved(plain) > 1e-4
    assert moved(slow) < 1e-7                         # 3 steps at about 1e-9
    logged = [r["lr"] for r in map(json.loads, (slow / "metrics.jsonl").read_text().splitlines())
              if "lr" in r and r["step"] > 20]
    assert len(used) == 3 and logged == used and all(1e-10 <= lr <= 1e-9 for lr in used)


def test_a_resume_names_each_option_it_changes(run20, tmp_path):
    copy = copy_of(run20, tmp_path)
    cfg, _, ckpt = resume_config(str(copy), str(copy), {"train": {"lr": "1e-9", "min_lr": "1e-10",
                                                                  "max_iters": "30"}})
    changes = resume_changes(cfg, ckpt)
    assert any(c.startswith("train.lr: ") and c.endswith("-> 1e-09") for c in changes)
    assert any(c.startswith("train.max_iters: 20 -> 30") for c in changes)
    cfg, _, ckpt = resume_config(str(copy), str(copy), {})
    assert resume_changes(cfg, ckpt) == []
    # An older checkpoint branches into a new run, which names itself: no change of the
    # user's to announce (it read "train.run_name: '' -> 'r-from-10'").
    older = copy / "checkpoints" / "step_0000010"
    cfg, run_dir, ckpt = resume_config(str(older), str(copy.parent), {})
    assert run_dir.name == "r-from-10" and resume_changes(cfg, ckpt) == []


def test_a_resume_says_what_it_changes_only_once_the_checkpoint_is_accepted(run20, tmp_path):
    """A corrupt checkpoint is refused and config.json stays as it was, so the line saying
    the changes are recorded there would be false; after a good load it is true."""
    copy = copy_of(run20, tmp_path)
    latest = checkpoint.list_checkpoints(copy)[-1]
    weights = latest / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[:-100])                             # truncated
    kept = lambda: {name: data for name, data in files_of(copy).items() if name != ".lock"}
    before = kept()                                              # the lock names its last holder
    change = ["--train.max_iters=22", f"--train.out_dir={tmp_path / 'runs'}"]
    proc = run_script("train.py", "--resume", copy, *change, check=False)
    assert proc.returncode == 2 and str(weights) in proc.stderr
    assert "resume changes" not in proc.stdout and kept() == before
    weights.write_bytes(good)
    proc = run_script("train.py", "--resume", copy, *change)
    assert "resume changes train.max_iters: 20 -> 22" in proc.stdout
    assert json.loads((copy / "config.json").read_text())["train"]["max_iters"] == 22


def test_a_damaged_optimizer_file_blocks_the_resume_but_not_sampling_or_looking_inside(run20, tmp_path):
    """Sampling and the study tools need the weights alone: a corrupt train_state file
    still stops a resume, naming it, while the weights load and are the same."""
    copy = copy_of(run20, tmp_path)
    latest = checkpoint.list_checkpoints(copy)[-1]
    good = load_run(copy, "latest")[0].state_dict()
    state = latest / checkpoint.TRAIN_STATE
    state.write_bytes(state.read_bytes()[:-50])
    model = load_run(copy, "latest")[0]
    assert all(torch.equal(model.state_dict()[k], v) for k, v in good.items())
    proc = run_script("sample.py", "--run", copy, "--max_new_tokens", "5", "--checkpoint", "latest",
                      check=False)
    assert proc.returncode == 0, proc.stderr
    with pytest.raises(CheckpointError, match=str(state)):
        checkpoint.load(latest)
    (latest / "model.safetensors").write_bytes(b"\0" * 64)       # the weights are still checked
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_run(copy, "latest")


def test_betas_weight_decay_and_momentum_given_to_a_resume_are_the_optimizers(run20, corpus, tmp_path):
    copy = copy_of(run20, tmp_path)
    cfg, run_dir, ckpt = resume_config(str(copy), str(copy), {"train": {
        "max_iters": "30", "beta1": "0.5", "beta2": "0.9", "weight_decay": "0.01", "lr": "2e-3"}})
    run = setup_run(cfg, run_dir=run_dir, resume=ckpt, log=quiet)
    run.release()
    decayed, plain = run.optimizer.named["adamw"].param_groups
    assert tuple(decayed["betas"]) == (0.5, 0.9) and tuple(plain["betas"]) == (0.5, 0.9)
    assert decayed["weight_decay"] == 0.01 and plain["weight_decay"] == 0.0
    assert decayed["base_lr"] == 2e-3
    assert run.optimizer.named["adamw"].state                # the moments were loaded
    muon = tiny_run(corpus, tmp_path / "m", "m", "--train.optimizer=muon", "--train.max_iters=2")
    cfg, run_dir, ckpt = resume_config(str(muon), str(muon), {"train": {
        "max_iters": "4", "muon_momentum": "0.8", "muon_lr": "0.01", "weight_decay": "0.05"}})
    run = setup_run(cfg, run_dir=run_dir, resume=ckpt, log=quiet)
    run.release()
    group = run.optimizer.named["muon"].param_groups[0]
    assert (group["momentum"], group["base_lr"], group["weight_decay"]) == (0.8, 0.01, 0.05)
    assert run.optimizer.named["muon"].state


def test_options_a_resume_cannot_honour_are_refused_in_one_line(run20, tmp_path):
    copy = copy_of(run20, tmp_path)
    before = files_of(copy)
    for key, value in [("optimizer", "muon"), ("seed", "7"), ("init_from", str(run20))]:
        with pytest.raises(CheckpointError, match=f"train.{key}: .* -> .*resume without them"):
            resume_config(str(copy), str(copy), {"train": {key: value}})
    with pytest.raises(ConfigError, match="train.max_iters=5 is before step 20"):
        resume_config(str(copy), str(copy), {"train": {"max_iters": "5"}})
    proc = run_script("train.py", "--resume", copy, "--train.optimizer=muon", check=False)
    assert proc.returncode == 2 and proc.stderr.startswith("error: a resume keeps")
    assert proc.stderr.count("\n") == 1 and "--train.init_from=" in proc.stderr
    assert files_of(copy) == before


def test_resuming_an_older_checkpoint_branches_into_a_new_run_and_leaves_the_old_one(run20, tmp_path):
    copy = copy_of(run20, tmp_path)
    before = files_of(copy)
    older = copy / "checkpoints" / "step_0000010"
    lines = []
    branch = resume(older, {"train": {"max_iters": "25", "keep_last": "1"}}, log=lines.append).run_dir
    assert files_of(copy) == before                    # not one byte of the old run changed
    assert branch == copy.parent / "r-from-10"
    assert any(f"{branch} is a new run from {older}" in line for line in lines)
    cfg = json.loads((branch / "config.json").read_text())
    assert cfg["parent"]["path"] == str(older) and cfg["parent"]["step"] == 10
    assert len(cfg["parent"]["weights_sha256"]) == 64 and cfg["train"]["run_name"] == "r-from-10"
    records = [json.loads(l) for l in (branch / "metrics.jsonl").read_text().splitlines()]
    inherited = [r for r in map(json.loads, (copy / "metrics.jsonl").read_text().splitlines())
                 if r["step"] <= 10]
    assert records[:len(inherited)] == inherited and all(r["step"] > 10 for r in records[len(inherited):])
    assert sorted({r["step"] for r in records}) == list(range(26))
    # Its own history from here on: the branch's checkpoints, best.json, and its latest.
    names = [p.name for p in checkpoint.list_checkpoints(branch)]
    assert names[-1] == "step_0000025"
    assert checkpoint.best_step(branch) in [int(n.split("_")[1]) for n in names]
    # The same checkpoint again: another new run; into a named run that has checkpoints: refused.
    again = resume(older, {"train": {"max_iters": "12"}}).run_dir
    assert again.name == "r-from-10-2" and files_of(copy) == before
    with pytest.raises(CheckpointError, match="r-from-10 already holds checkpoints; choose another"):
        resume_config(str(older), str(copy), {"train": {"run_name": "r-from-10"}})
    # The branch's own latest resumes in place.
    assert resume_config(str(branch), str(branch), {"train": {"max_iters": "30"}})[1] == branch


def test_a_new_run_name_on_resume_forks_the_latest_checkpoint(run20, tmp_path):
    copy = copy_of(run20, tmp_path)
    before = files_of(copy)
    fork = resume(copy, {"train": {"max_iters": "22", "run_name": "fork"}}).run_dir
    assert fork == copy.parent / "fork" and files_of(copy) == before
    assert checkpoint.list_checkpoints(fork)[-1].name == "step_0000022"
    assert checkpoint.best_step(fork) is not None


def test_another_out_dir_on_resume_goes_on_as_a_new_run_there(run20, tmp_path):
    """--resume RUN --train.out_dir=OTHER once kept writing into RUN, the option dropped."""
    copy = copy_of(run20, tmp_path)
    before = files_of(copy)
    other = tmp_path / "elsewhere"
    cfg, run_dir, _ = resume_config(str(copy), str(other), {"train": {"max_iters": "22",
                                                                      "out_dir": str(other)}})
    assert run_dir == other / f"{copy.name}-from-20" and cfg.parent["step"] == 20
    fork = resume(copy, {"train": {"max_iters": "22", "out_dir": str(other)}}).run_dir
    assert fork.parent == other and files_of(copy) == before
    assert checkpoint.list_checkpoints(fork)[-1].name == "step_0000022"
    # The run's own folder, said again, is no other place: it goes on in place.
    assert resume_config(str(copy), str(copy.parent), {"train": {"out_dir": str(copy.parent)}})[1] == copy


def test_an_out_dir_inside_the_run_is_refused_not_a_run_nested_in_the_run(run20, tmp_path):
    copy = copy_of(run20, tmp_path)
    before = files_of(copy)
    for inside in (copy, copy / "checkpoints"):
        with pytest.raises(ConfigError, match="is inside the run .*drop it to continue the run in place"):
            resume_config(str(copy), str(inside), {"train": {"out_dir": str(inside)}})
    assert files_of(copy) == before


def branch_stopped_in(name, run20, tmp_path, monkeypatch):
    """A branch of run20 into tmp_path/elsewhere, Ctrl-C'd inside engine.resume's `name`:
    (the command's overrides, the copied run, the branch folder, the checkpoint, the
    KeyboardInterrupt's message)."""
    import engine.resume as resume_module
    copy = copy_of(run20, tmp_path)
    other = tmp_path / "elsewhere"
    overrides = {"train": {"max_iters": "22", "out_dir": str(other)}}
    cfg, run_dir, ckpt = resume_config(str(copy), str(other), overrides)

    def stop(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(resume_module, name, stop)
    with pytest.raises(KeyboardInterrupt) as stopped:
        setup_run(cfg, run_dir=run_dir, resume=ckpt, log=quiet)
    monkeypatch.undo()
    return overrides, copy, run_dir, ckpt, stopped.value.args[0]


def test_a_branch_stopped_before_its_own_checkpoint_resumes_as_the_branch(run20, tmp_path, monkeypatch):
    """Ctrl-C after the parent's checkpoint was copied in: the folder once resumed as the
    parent's run (parent {}, its out_dir), the record of where it came from lost."""
    overrides, copy, run_dir, ckpt, said = branch_stopped_in("restore", run20, tmp_path, monkeypatch)
    other = run_dir.parent
    # The stop names the new run to go on with, not the command that makes another one.
    assert f"--resume {run_dir} continues from its last checkpoint, step_0000020" in said
    # The command it names: with the options the branch was started with (max_iters 22),
    # not the parent checkpoint's (20, "nothing to train").
    again, again_dir, again_ckpt = resume_config(str(run_dir), str(other), {})
    assert again_dir == run_dir and again.train.max_iters == 22
    assert nothing_to_train(again, again_ckpt, str(run_dir)) is None
    assert again.parent["path"] == str(ckpt) and again.parent["step"] == 20
    assert again.train.out_dir == str(other) and again.train.run_name == run_dir.name
    # Resumed, it records the weights it started from, as a branch not stopped does.
    resumed = setup_run(again, run_dir=again_dir, resume=again_ckpt, log=quiet)
    resumed.release()
    straight = resume_config(str(copy), str(tmp_path / "straight"),
                             {"train": {"max_iters": "22", "out_dir": str(tmp_path / "straight")}})
    branched = setup_run(*straight[:1], run_dir=straight[1], resume=straight[2], log=quiet)
    branched.release()
    assert resumed.cfg.parent["weights_sha256"] == branched.cfg.parent["weights_sha256"]
    assert json.loads((run_dir / "config.json").read_text())["parent"]["weights_sha256"] == \
        branched.cfg.parent["weights_sha256"]


def test_a_stop_once_the_branch_holds_its_checkpoint_names_the_branch(run20, tmp_path, monkeypatch):
    """Stopped after the copy and before set-up ended, it once said only "--resume RUN"."""
    _, _, run_dir, _, said = branch_stopped_in("record_parent_weights", run20, tmp_path, monkeypatch)
    assert f"stopped before training, nothing half-written was kept; python train.py --resume {run_dir} " in said


def test_a_branch_stopped_while_its_checkpoint_is_copied_is_taken_up_by_the_same_command(
        run20, tmp_path, monkeypatch):
    """Once, the same command made a second branch (-from-20-2) beside the empty first.
    The folder the stop leaves no checkpoint in is removed, so nothing of it stays."""
    overrides, copy, run_dir, _, said = branch_stopped_in("_branch_files", run20, tmp_path, monkeypatch)
    other = run_dir.parent
    assert f"its folder {run_dir} was removed" in said and "run the same command again" in said
    assert not run_dir.exists()
    assert resume_config(str(copy), str(other), overrides)[1] == run_dir
    resume(copy, overrides)
    assert sorted(p.name for p in other.iterdir()) == [run_dir.name]
    assert checkpoint.list_checkpoints(run_dir)[-1].name == "step_0000022"
    # A folder that is no stopped branch of this checkpoint is left alone.
    assert resume_config(str(copy), str(other), overrides)[1] == other / f"{run_dir.name}-2"


def test_a_branch_folder_left_without_a_checkpoint_is_taken_up_by_the_same_command(
        run20, tmp_path, monkeypatch):
    """A branch killed (not stopped) while its checkpoint was copied keeps its folder; the
    same command takes that folder up rather than make a second branch beside it."""
    import engine.resume as resume_module
    import engine.run as run_module
    made = []
    real = resume_module._branch_files

    def killed(source, ckpt, run_dir):
        made.append(run_dir)
        raise KeyboardInterrupt
    monkeypatch.setattr(resume_module, "_branch_files", killed)
    monkeypatch.setattr(run_module, "stopped_line", lambda run, how: how)   # as if killed: no clean-up
    copy = copy_of(run20, tmp_path)
    other = tmp_path / "elsewhere"
    overrides = {"train": {"max_iters": "22", "out_dir": str(other)}}
    cfg, run_dir, ckpt = resume_config(str(copy), str(other), overrides)
    with pytest.raises(KeyboardInterrupt):
        setup_run(cfg, run_dir=run_dir, resume=ckpt, log=quiet)
    monkeypatch.setattr(resume_module, "_branch_files", real)
    assert made == [run_dir] and run_dir.is_dir()
    assert resume_config(str(copy), str(other), overrides)[1] == run_dir


def test_a_new_run_stopped_before_its_first_checkpoint_leaves_no_folder(corpus, tmp_path, monkeypatch):
    """It once left config.json and tokenizer.json in a folder no command would take up:
    the same command made a new one beside it."""
    import engine.run as run_module
    from engine import cli
    written = run_module.write_run_files

    def write_then_stop(run):
        written(run)
        raise KeyboardInterrupt
    monkeypatch.setattr(run_module, "write_run_files", write_then_stop)
    cfg = cli.build("tiny", [f"--data.path={corpus}", f"--data.cache_dir={tmp_path / 'cache'}",
                             f"--train.out_dir={tmp_path / 'runs'}"])
    with pytest.raises(KeyboardInterrupt) as stopped:
        setup_run(cfg, log=quiet)
    assert "was removed, so nothing of it is left: run the same command again" in stopped.value.args[0]
    assert list((tmp_path / "runs").iterdir()) == []
    # A folder that was there before (a run_name given) is not this process's to remove.
    (tmp_path / "runs" / "mine").mkdir()
    cfg.train.run_name = "mine"
    with pytest.raises(KeyboardInterrupt) as stopped:
        setup_run(cfg, log=quiet)
    assert "nothing half-written was kept" in stopped.value.args[0]
    assert (tmp_path / "runs" / "mine" / "config.json").is_file()


def test_a_branch_records_its_parent_by_absolute_path(run20, tmp_path, monkeypatch):
    copy = copy_of(run20, tmp_path)
    monkeypatch.chdir(copy.parent)
    cfg, _, _ = resume_config(copy.name, ".", {"train": {"out_dir": "elsewhere"}})
    assert cfg.parent["path"] == str(copy / "checkpoints" / "step_0000020")


def test_a_file_given_as_out_dir_is_named_as_a_file(run20, corpus, tmp_path):
    copy = copy_of(run20, tmp_path)
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    # Refused before a finished run is told "nothing to train" with a command that names it.
    for out in (blocker, blocker / "sub"):
        with pytest.raises(ConfigError, match=f"{blocker} is a file, where --train.out_dir=.* needs a folder"):
            resume_config(str(copy), str(out), {"train": {"out_dir": str(out)}})
        with pytest.raises(CheckpointError, match=f"{blocker} is a file, not a folder of runs"):
            checkpoint.latest_run(out)
    cfg = cli.build("tiny", [f"--data.path={corpus}", f"--data.cache_dir={tmp_path / 'cache'}",
                             f"--train.out_dir={blocker / 'sub'}"])
    with pytest.raises(ConfigError, match=f"{blocker} is a file, where the run .* needs a folder"):
        setup_run(cfg, log=quiet)
    with pytest.raises(CheckpointError, match=r"train one with `python train\.py --train\.out_dir="):
        checkpoint.latest_run(tmp_path / "empty")


def test_sampling_after_a_ctrl_c_before_any_evaluation_uses_the_trained_weights(corpus, tmp_path):
    """Stopped at step 3, best.json still names step 0 (random weights)."""
    run = stopped_run(corpus, tmp_path, "stop", 3)
    assert checkpoint.best_step(run.run_dir) == 0
    lines = []
    _, _, _, ckpt = load_run(run.run_dir, "best", log=lines.append)
    assert ckpt.name == "step_0000003" and len(lines) == 1
    assert "step_0000003" in lines[0] and "best by validation loss is step 0" in lines[0]
    assert load_run(run.run_dir, "latest")[3].name == "step_0000003"
    # sample.py says so, and samples as many tokens as the run's preset says (50, not 500).
    proc = run_script("sample.py", "--run", run.run_dir)
    assert "step_0000003 (the latest checkpoint: the best" in proc.stderr
    assert len(proc.stdout) == 50 + 1                 # a character model: one per token


def make_run(out, name, steps, last_eval, best=None, written=None):
    """A run folder with checkpoint state.json files only: what choosing one reads."""
    run = out / name
    run.mkdir(parents=True)
    (run / "config.json").write_text("{}")
    for step in steps:
        ckpt = run / "checkpoints" / f"step_{step:07d}"
        ckpt.mkdir(parents=True)
        (ckpt / "state.json").write_text(json.dumps({"step": step, "last_eval": min(step, last_eval)}))
        if written is not None:
            os.utime(ckpt / "state.json", (written, written))
    if best is not None:
        (run / "best.json").write_text(json.dumps({"step": best, "val_loss": 1.5}))
    return run


def test_the_best_checkpoint_is_the_evaluated_one_unless_only_step_0_was(tmp_path):
    evaluated = make_run(tmp_path, "a", [0, 10, 13], last_eval=10, best=10)
    assert checkpoint.choose(evaluated, "best")[:3:2] == (evaluated / "checkpoints" / "step_0000010", False)
    assert "validation loss: 1.5000 at step 10" in checkpoint.choose(evaluated, "best")[1]
    worse_later = make_run(tmp_path, "b", [0, 10], last_eval=10, best=0)   # fine-tuning made it worse
    assert checkpoint.choose(worse_later, "best")[0].name == "step_0000000"
    unevaluated = make_run(tmp_path, "c", [0, 4], last_eval=0, best=0)
    assert checkpoint.choose(unevaluated, "best")[0].name == "step_0000004"
    # The way to step 0 it names takes it there (best, said once, led back to step 4).
    way = re.search(r"\((--checkpoint \S+) for step 0\)", checkpoint.choose(unevaluated, "best")[1])[1]
    assert checkpoint.choose(unevaluated, way.split()[1])[0].name == "step_0000000"
    no_best = make_run(tmp_path, "d", [0, 4], last_eval=0)
    path, why, departs = checkpoint.choose(no_best, "best")
    assert path.name == "step_0000004" and departs and "no best.json" in why


def test_the_latest_run_is_the_one_trained_last_not_the_one_created_last(tmp_path):
    out = tmp_path / "runs"
    make_run(out, "long", [0, 500], 500, written=2_000_000)          # still training, written last
    make_run(out, "trial", [0, 5], 5, written=1_000_000)             # created later, done early
    make_run(out, "failed", [], 0)                                   # no checkpoint at all
    (out / "LATEST").write_text("trial\n")                          # what train.py used to mark
    lines = []
    assert checkpoint.latest_run(out, log=lines.append) == out / "long"
    assert lines == [f"run: {out / 'long'} (the one whose checkpoint was written last; --run DIR for another)"]
    with pytest.raises(CheckpointError, match="no trained run found"):
        checkpoint.latest_run(tmp_path / "empty")


def test_an_export_cleans_what_a_killed_export_left_and_writes_shareable_files(run20, tmp_path):
    from attnlab.export import main
    pid_max = int(open("/proc/sys/kernel/pid_max").read())
    dead = tmp_path / f".hf.tmp-{pid_max + 1}"                       # no process has this pid
    alive = tmp_path / f".hf.tmp-{os.getppid()}"                     # an export still writing
    for folder in (dead, alive):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"partial")
    mask = os.umask(0o022)
    try:
        main(["--run", str(run20), "--out", str(tmp_path / "hf")])
    finally:
        os.umask(mask)
    assert not dead.exists() and alive.exists()
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "hf").iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes


def test_figures_go_to_the_run_or_an_ignored_folder(run20, tmp_path, monkeypatch):
    from attnlab.plotting import figures_folder
    monkeypatch.chdir(tmp_path)
    ckpt = checkpoint.resolve(run20)
    assert figures_folder(ckpt) == run20 / "figures"
    assert figures_folder() == Path("figures")
    ignored = subprocess_check_ignore("figures/attention_grid.png")
    assert ignored and not subprocess_check_ignore("docs/figures/x.png")


def subprocess_check_ignore(path):
    return subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0


def test_a_tool_that_refuses_its_input_leaves_no_figures_folder(run20, tmp_path, monkeypatch):
    """The run's figures/ is made by the first figure written into it, not before the
    tool has looked at what it was asked; the same calls with good input write there."""
    from attnlab import heads, induction, lens
    from common.errors import AttnlabError
    run = copy_of(run20, tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(AttnlabError, match="this model has layers 0-"):
        heads.main(["head", "--run", str(run), "--text", "ROMEO:", "--layer", "9"])
    with pytest.raises(AttnlabError, match="give some text with --text"):
        lens.main(["logit", "--run", str(run)])
    with pytest.raises(AttnlabError, match="patch needs --clean"):
        lens.main(["patch", "--run", str(run)])
    assert not (run / "figures").exists() and not (tmp_path / "figures").exists()
    heads.main(["head", "--run", str(run), "--text", "ROMEO:", "--layer", "0"])
    lens.main(["logit", "--run", str(run), "--text", "ROMEO: and"])
    induction.main(["--run", str(run)])
    assert sorted(p.name for p in (run / "figures").iterdir()) == [
        "attention_l0_h0.png", "induction_heads.png", "logit_lens.png"]
    assert not (tmp_path / "figures").exists()


@pytest.mark.parametrize("native", [True, False])
def test_a_resume_of_auto_keeps_the_precision_its_checkpoint_trained_in(run20, tmp_path, monkeypatch,
                                                                        native):
    """A checkpoint trained on a CPU of another kind (or before the kind decided) goes on
    in the precision it recorded where this CPU computes it natively, else picks anew;
    a precision named on the command line wins."""
    from engine import machine as precision
    copy = copy_of(run20, tmp_path)
    ckpt = checkpoint.list_checkpoints(copy)[-1]
    state = json.loads((ckpt / "state.json").read_text())
    assert state["autocast"] == "float32"                   # recorded at each save
    (ckpt / "state.json").write_text(json.dumps({**state, "autocast": "bfloat16"}))
    monkeypatch.setattr(precision, "native_bf16", lambda: native)
    for overrides, expected in [({}, torch.bfloat16 if native else torch.float32),
                                ({"dtype": "float32"}, torch.float32)]:
        cfg, run_dir, found = resume_config(str(copy), str(copy), {"train": overrides})
        run = setup_run(cfg, run_dir=run_dir, resume=found, log=quiet)
        run.release()
        assert run.dtype == expected, overrides
    cfg, run_dir, _ = resume_config(str(copy), str(copy), {})
    run = setup_run(cfg, run_dir=run_dir, resume=True, log=quiet)       # the run's latest
    run.release()
    assert run.dtype == (torch.bfloat16 if native else torch.float32)


def test_resuming_a_finished_run_says_nothing_was_trained_and_which_limit_to_raise(run20, tmp_path):
    """It used to print "done at step 20", as if it had trained, with no word of the limit."""
    copy = copy_of(run20, tmp_path)
    before = files_of(copy)
    out = run_script("train.py", "--resume", copy).stdout.splitlines()[-1]
    latest = copy / "checkpoints" / "step_0000020"
    assert out == (f"nothing to train: {latest} had already reached its last step "
                   f"(train.max_iters=20) at step 20; to train on, give more steps: python "
                   f"train.py --resume {copy} --train.max_iters=40")
    mtimes = lambda: {p: p.stat().st_mtime_ns for p in copy.rglob("*")}
    assert files_of(copy) == before                  # not a byte of the run rewritten,
    stamped = mtimes()
    run_script("train.py", "--resume", copy)
    assert mtimes() == stamped                       # nor a file touched
    assert "done at step 22" in run_script("train.py", "--resume", copy, "--train.max_iters=22").stdout


def test_a_finished_run_is_told_each_limit_it_reached_and_options_that_go_past_them(run20, tmp_path):
    """A resume given a time limit below the seconds already trained was told to give
    twice the limit given, which could still be below them, so the advice failed again;
    one given a target the run had already reached trained on to its next evaluation.
    Following the advice now leaves nothing reached."""
    copy = copy_of(run20, tmp_path)
    ckpt = checkpoint.list_checkpoints(copy)[-1]
    state = json.loads((ckpt / "state.json").read_text())
    used, best = state["limit_s"], state["best_val"]
    assert used > 0 and math.isfinite(best)

    def said(**train):
        cfg = resume_config(str(copy), str(copy), {"train": {k: str(v) for k, v in train.items()}})[0]
        return nothing_to_train(cfg, ckpt, "R")
    out = said(max_iters=40, time_limit=used / 2)
    assert out == (f"nothing to train: {ckpt} had already reached its time limit ({used:.1f} s "
                   f"trained, train.time_limit={used / 2:g} s) at step 20; to train on, give a "
                   f"limit past the {used:.1f} s trained (here {math.ceil(used / 2)} s more): "
                   f"python train.py --resume R --train.time_limit={math.ceil(used) + math.ceil(used / 2)}")
    assert said(max_iters=40, time_limit=out.rpartition("=")[2]) is None
    out = said(target_val_loss=best + 0.01)              # and max_iters=20, its last step
    assert out == (f"nothing to train: {ckpt} had already reached its target (val loss {best:.4f} "
                   f"<= train.target_val_loss={best + 0.01:g}) and its last step "
                   f"(train.max_iters=20) at step 20; to train on, give a lower target (0 for "
                   f"none) and more steps: python train.py --resume R --train.target_val_loss=0 "
                   f"--train.max_iters=40")
    assert said(target_val_loss=0, max_iters=40) is None
    # The options given stay in the command, or following it would drop them.
    cfg = resume_config(str(copy), str(copy), {"train": {"max_iters": "40", "target_val_loss": "9"}})[0]
    assert nothing_to_train(cfg, ckpt, "R", {"train": {"max_iters": "40", "target_val_loss": "9"}}
                            ).endswith("python train.py --resume R --train.max_iters=40 "
                                       "--train.target_val_loss=0")
    assert said(target_val_loss=best - 0.01, max_iters=40) is None


def test_a_finished_run_whose_newest_checkpoint_is_damaged_is_refused_as_damaged(run20, tmp_path):
    """It said "nothing to train", as if the run were whole, and the damage came out only
    at the next resume that trained. The refusal offers only the checkpoints that would
    load: it used to offer one it had just found corrupt."""
    copy = copy_of(run20, tmp_path)
    step0, step10, step20 = checkpoint.list_checkpoints(copy)
    with open(step20 / "model.safetensors", "r+b") as f:
        f.truncate(100)
    proc = run_script("train.py", "--resume", copy, check=False)
    assert proc.returncode == 2 and "nothing to train" not in proc.stdout
    assert proc.stderr.strip() == (
        f"error: checkpoint file {step20 / 'model.safetensors'} is missing or corrupt (its hash "
        f"does not match state.json); use another checkpoint: {copy} also keeps steps 0, 10 "
        f"(--checkpoint STEP samples or looks inside one; --resume {step10} trains on from it "
        "in a new run)")
    (step10 / "state.json").write_text("{")
    with pytest.raises(CheckpointError) as err:
        checkpoint.load(step20)
    assert str(err.value).endswith(
        f"use another checkpoint: {copy} also keeps step 0 (step 10 is damaged too) "
        f"(--checkpoint STEP samples or looks inside one; --resume {step0} trains on from it "
        "in a new run)")
    shutil.rmtree(step0)
    with pytest.raises(CheckpointError, match=re.escape(
            f"{copy} keeps no other whole checkpoint (step 10 is damaged too): train it again")):
        checkpoint.load(step20)


def test_a_runs_odd_checkpoint_folders_are_named_for_what_they_are(run20, tmp_path):
    """A stray checkpoints/step_abc/ sorted after every step and stood as the latest, so
    an intact run was refused as damaged; a run whose checkpoints are gone was said to
    have "weights but no config.json", both untrue. And train.py's line naming the
    latest run pointed to --run, an option train.py does not have."""
    copy = copy_of(run20, tmp_path)
    (copy / "checkpoints" / "step_abc").mkdir()
    proc = run_script("train.py", "--resume", f"--train.out_dir={copy.parent}")
    assert proc.stdout.splitlines()[-1].startswith(
        f"nothing to train: {copy / 'checkpoints' / 'step_0000020'} had already reached")
    assert f"run: {copy} (the one whose checkpoint was written last; --resume DIR for another)" \
        in proc.stderr
    for ckpt in checkpoint.list_checkpoints(copy):
        shutil.rmtree(ckpt)
    for cmd in (["train.py", "--resume", copy], ["sample.py", "--run", copy]):
        proc = run_script(*cmd, check=False)
        assert proc.returncode == 2 and proc.stderr.strip() == (
            f"error: run {copy} holds no checkpoint (its checkpoints/ has no step_NNNNNNN/ folder): "
            "it stopped before its first one, or they were removed; train into it again with "
            f"python train.py --config PRESET --train.out_dir={copy.parent} "
            f"--train.run_name={copy.name} (the preset and options it was started with), or "
            "point at another run"), proc.stderr


def test_a_run_reading_in_passes_resumes_with_exactly_the_losses_of_one_straight_through(corpus, tmp_path):
    """data.sampling=epochs: the checkpoint holds the pass's start and the windows read
    of it (data_position), so the resumed steps read the same windows. The stop falls
    mid-pass, and the run goes through a pass's end."""
    def losses(run_dir):
        rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows if "loss" in r}
    extra = ["--data.sampling=epochs", "--train.log_interval=1", "--train.eval_interval=1000",
             "--model.block_size=64", "--train.batch_size=32"]
    straight = tiny_run(corpus, tmp_path / "a", "s", "--train.max_iters=40", *extra)
    run = stopped_run(corpus, tmp_path / "b", "s", 13, "--train.max_iters=40", *extra)
    state = json.loads((run.run_dir / "checkpoints" / "step_0000013" / "state.json").read_text())
    assert state["data_position"] > 0
    resume(run.run_dir)
    # 60 kB: a pass is about 26 steps. Two runs in one process add up their threads'
    # partial sums in different orders (1e-7 apart); other windows differ by 1e-2.
    assert losses(run.run_dir) == pytest.approx(losses(straight), rel=1e-5, abs=0)


def test_a_resume_takes_a_runs_name_as_sample_py_does(run20, tmp_path, monkeypatch):
    """--resume NAME was refused as "NAME does not exist" beside runs/NAME."""
    monkeypatch.chdir(tmp_path)
    assert resume_config("r", str(run20.parent), {})[1] == run20.parent / "r"
    with pytest.raises(CheckpointError, match=r"cannot resume: nosuch does not exist, nor a run "
                                              r"of that name in .*runs/; give a run directory or its name"):
        resume_config("nosuch", str(run20.parent), {})


def test_commands_printed_for_a_run_paste_as_they_read_under_any_path(run20, tmp_path):
    """A run's folder went into the commands printed for it bare: under a folder with a
    space, a quote or a $, pasting one ran something else. Each path is one shell word
    now (shlex.split splits as a POSIX shell does)."""
    copy = tmp_path / "it's a $HOME run" / "r"
    shutil.copytree(run20, copy)
    done = run_script("train.py", "--resume", copy, "--train.max_iters=21").stdout.splitlines()[-1]
    assert shlex.split(done.partition("sample with: ")[2]) == ["python", "sample.py", "--run", str(copy)]
    proc = run_script("train.py", "--resume", copy, "--config", "tiny", check=False)
    assert shlex.split(proc.stderr.rpartition("weights: ")[2]) == [
        "python", "train.py", "--config", "tiny", f"--train.init_from={copy}"]
    ckpts = checkpoint.list_checkpoints(copy)
    with pytest.raises(CheckpointError) as err:
        load_run(ckpts[-1], "latest")
    assert shlex.split(str(err.value).rpartition("give its run: ")[2]) == [
        "--run", str(copy), "--checkpoint", "latest"]
    with open(ckpts[-1] / "model.safetensors", "r+b") as f:
        f.truncate(100)
    with pytest.raises(CheckpointError) as err:
        checkpoint.load(ckpts[-1])
    assert shlex.split(re.search(r"; --resume (.*) trains on", str(err.value))[1]) == [str(ckpts[-2])]


def test_a_resume_given_a_preset_names_the_run_it_found_in_out_dir(run20, tmp_path):
    """--resume NAME looked for NAME in runs/ whatever --train.out_dir said, and --resume
    alone offered --train.init_from=RUN, a placeholder, for the run it had found; the
    command offered now is whole: the preset given, and the options given kept."""
    out = tmp_path / "elsewhere"
    shutil.copytree(run20, out / "r")
    for given in (["r"], []):
        proc = run_script("train.py", "--resume", *given, "--config", "tiny",
                          f"--train.out_dir={out}", check=False)
        assert proc.returncode == 2 and proc.stderr.strip().endswith(
            f"weights: python train.py --config tiny --train.init_from={out / 'r'} "
            f"--train.out_dir={out}"), proc.stderr


def test_a_file_or_a_runs_checkpoints_folder_given_for_a_run_names_the_folder_to_give(run20, tmp_path):
    """RUN/checkpoints was said to hold no checkpoint, RUN/config.json to have no
    config.json, and /dev/null not to exist."""
    copy = copy_of(run20, tmp_path)
    for cmd in (["sample.py", "--run"], ["train.py", "--resume"]):
        proc = run_script(*cmd, copy / "checkpoints", check=False)
        assert proc.returncode == 2 and proc.stderr.strip().endswith(
            f"{copy / 'checkpoints'} is the checkpoints/ folder of run {copy}: give the run "
            f"itself ({copy}), or one of the step_NNNNNNN folders in it"), proc.stderr
    for given, said in [(copy / "config.json", f"the folder it is in, {copy}"),
                        (copy / "checkpoints" / "step_0000010" / "state.json",
                         f"the folder it is in, {copy / 'checkpoints' / 'step_0000010'}"),
                        (Path(os.devnull), "a run directory, one of its checkpoint folders, or "
                                           "a transformers folder")]:
        with pytest.raises(CheckpointError, match=re.escape(f"{given} is a file, not a folder; give {said}")):
            resume_config(str(given), str(tmp_path), {})
        with pytest.raises(CheckpointError, match=re.escape(f"{given} is a file, not a folder; give {said}")):
            load_run(given)


def test_a_folder_of_runs_given_for_a_run_names_the_runs_in_it(run20, tmp_path):
    """It was said to hold no checkpoint (sample.py) or to be no run directory (train.py)."""
    copy = copy_of(run20, tmp_path)
    folder = copy.parent
    for cmd in (["sample.py", "--run"], ["train.py", "--resume"]):
        proc = run_script(*cmd, folder, check=False)
        assert proc.returncode == 2 and proc.stderr.strip().endswith(
            f"{folder} is a folder of runs (r), not a run: give one of them, e.g. {copy}"), proc.stderr


def test_a_new_run_from_weights_refuses_another_tokenizer(run20, corpus, tmp_path):
    """--train.init_from with --data.tokenizer=bpe trained on with the source's char
    tokenizer, the option dropped without a word."""
    proc = run_script("train.py", "--config", "tiny", f"--train.init_from={run20}",
                      "--data.tokenizer=bpe", f"--data.path={corpus}",
                      f"--train.out_dir={tmp_path}", check=False)
    assert proc.returncode == 2 and proc.stderr.startswith(
        f"error: with train.init_from the tokenizer comes from its source ({run20}: char,"), proc.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("position", [-5, -1, 10 ** 15])
def test_a_data_position_out_of_its_pass_is_refused(corpus, tmp_path, position):
    """Within a pass's windows, or the resume would read some other order of the text
    without a word (the kinds, a string or true, are refused with the other fields')."""
    run = stopped_run(corpus, tmp_path, "s", 5, "--data.sampling=epochs", "--train.max_iters=20",
                      "--train.eval_interval=1000")
    ckpt = run.run_dir / "checkpoints" / "step_0000005"
    state = json.loads((ckpt / "state.json").read_text())
    assert state["data_position"] > 0
    state["data_position"] = position
    (ckpt / "state.json").write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match=rf"^checkpoint {ckpt / 'state.json'} records "
                                              rf"data_position={position}: .*; it is corrupt or "
                                              r"edited: use another checkpoint: .* also keeps step 0"):
        resume(run.run_dir)
