"""A run folder, a model folder or a data folder someone shares is read as untrusted
input (docs/safety.md): nothing in it chooses code to run, nothing a run writes or
removes lies outside its folder, a name never leaves configs/, weights are held to the
model their config builds, and a folder a crash left before its first checkpoint is
named for what it is. Each case is one `error:` line that says what to do."""
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import ROOT, run_script, train_tiny
from common.errors import AttnlabError, CheckpointError, ConfigError, DataError
from attnlab.exercises.learner import SOLUTIONS


def error_lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


def one_error(proc) -> str:
    lines = error_lines(proc)
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, \
        (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    return lines[0]


def rehash(ckpt: Path, name: str) -> None:
    """state.json's hash of `name` recomputed, as an edit that means to pass would."""
    state = json.loads((ckpt / "state.json").read_text())
    state["files"][name] = hashlib.sha256((ckpt / name).read_bytes()).hexdigest()
    (ckpt / "state.json").write_text(json.dumps(state))


@pytest.fixture(scope="module")
def base(corpus, tmp_path_factory) -> Path:
    """A plain run of the tiny preset."""
    return train_tiny(corpus, tmp_path_factory.mktemp("safety"), "base", "--train.max_iters=4",
                      "--train.eval_interval=4", "--train.eval_iters=1")


def copied(run: Path, tmp_path: Path, name: str = "copy") -> Path:
    return Path(shutil.copytree(run, tmp_path / "runs" / name, symlinks=True))


# --- a run never chooses the code it runs -------------------------------------------

@pytest.fixture(scope="module")
def yours_run(corpus, tmp_path_factory) -> Path:
    """A run trained, as a learner trains one, with the answer key as the learner's
    attention."""
    root = tmp_path_factory.mktemp("yours")
    mine = Path(shutil.copytree(SOLUTIONS, root / "mine"))
    return train_tiny(corpus, root, "yours", "--model.attention=yours", f"--exercises={mine}",
                      "--train.max_iters=4", "--train.eval_interval=4", "--train.eval_iters=1")


def shipped_code(run: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of `run` shared with code in it: a file that passes exercise 1's check and
    leaves a mark when it is imported, and exercises.json naming the run's own folder,
    as a run that remembered its learner's folder once wrote. (The copy, the mark)."""
    copy = copied(run, tmp_path, "shared")
    mark = tmp_path / "code-ran"
    (copy / "01_attention.py").write_text(
        f"open({str(mark)!r}, 'a').write('ran\\n')\n" + (SOLUTIONS / "01_attention.py").read_text())
    (copy / "exercises.json").write_text(json.dumps({"folder": str(copy)}))
    return copy, mark


ENTRIES = {
    "sample": lambda run, out: ["sample.py", "--run", run, "--max_new_tokens=2", "--device=cpu"],
    "heads": lambda run, out: ["-m", "attnlab.heads", "grid", "--run", run, "--device=cpu",
                               "--text=ROMEO:", f"--out={out / 'heads.png'}"],
    "lens": lambda run, out: ["-m", "attnlab.lens", "logit", "--run", run, "--device=cpu",
                              "--text=ROMEO:"],
    "extrapolate": lambda run, out: ["-m", "attnlab.extrapolate", "--runs", run, "--device=cpu",
                                     "--batches=1", "--factors", "1", f"--out={out / 'ext'}"],
    "resume": lambda run, out: ["train.py", "--resume", run, "--train.max_iters=8"],
    "init_from": lambda run, out: ["train.py", "--config", "tiny", f"--train.init_from={run}",
                                   f"--train.out_dir={out / 'runs'}", "--train.max_iters=2",
                                   f"--data.cache_dir={out / 'cache'}"],
}


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_run_that_ships_code_never_runs_it(yours_run, tmp_path, entry, corpus):
    """sample.py imported the file exercises.json named (in the checker's child and in
    its own process) and exited 0; so did heads, lens, a resume and a run started from
    it. Now the learner's folder comes from the command line alone."""
    copy, mark = shipped_code(yours_run, tmp_path)
    args = ENTRIES[entry](copy, tmp_path)
    if entry == "init_from":
        args.append(f"--data.path={corpus}")
    line = one_error(run_script(*args, check=False, timeout=200))
    assert "--exercises DIR" in line and "model.attention=yours" in line, line
    assert not mark.exists() and not (tmp_path / "ext").exists()


def test_extrapolate_reads_a_yours_run_with_the_learners_folder(yours_run, tmp_path):
    """extrapolate had no --exercises: a run trained with the learner's attention was
    refused as an unreadable config naming only the registry's own backends."""
    mine = Path(shutil.copytree(SOLUTIONS, tmp_path / "mine"))
    run_script("-m", "attnlab.extrapolate", "--runs", yours_run, "--exercises", mine,
               "--device=cpu", "--batches=1", "--factors", "1", f"--out={tmp_path / 'ext'}")
    assert "| yours |" in (tmp_path / "ext" / "extrapolation.md").read_text()


def test_the_page_never_runs_a_runs_code_either(yours_run, tmp_path):
    """attnlab.serve reads its model through options.load, as every tool does."""
    from attnlab.exercises.learner import ExerciseError
    from attnlab.options import load
    from attnlab.serve import parser
    from conftest import registries_kept
    copy, mark = shipped_code(yours_run, tmp_path)
    with registries_kept(), pytest.raises(ExerciseError, match="--exercises DIR"):
        load(parser().parse_args(["--run", str(copy), "--device", "cpu"]), log=lambda line: None)
    assert not mark.exists()


def test_the_learners_folder_given_on_the_command_line_still_runs(yours_run, tmp_path):
    """The learner's way: the folder named with --exercises is the one loaded, whatever
    the run's own folder holds."""
    copy, mark = shipped_code(yours_run, tmp_path)
    mine = Path(shutil.copytree(SOLUTIONS, tmp_path / "mine"))
    proc = run_script("sample.py", "--run", copy, "--exercises", mine, "--max_new_tokens=2",
                      "--device=cpu", "--prompt=ROMEO:")
    assert f"attention: yours (scaled_dot_product_attention in {mine / '01_attention.py'})" \
        in proc.stderr
    assert proc.stdout.startswith("ROMEO:") and not mark.exists()


def test_a_yours_typed_on_the_command_line_takes_my_attention_and_one_from_a_file_does_not():
    from attnlab.exercises import plug
    from conftest import registries_kept
    from model import ModelConfig
    with registries_kept():
        plug.install()
        config = ModelConfig(attention="yours")
        assert plug.folder_for(ModelConfig(), None, "runs/x") is None
        assert plug.folder_for(config, None, None) == Path("my_attention")
        assert plug.folder_for(config, "mine", "runs/x") == Path("mine")
        with pytest.raises(AttnlabError, match=r"runs/x asks for your own code \(model.attention"):
            plug.folder_for(config, None, "runs/x")
        assert plug.typed(config, {"attention": "yours"})
        assert not plug.typed(config, {"position": "rope"})
        mixed = ModelConfig(mechanism="yours,mha", n_layer=2)
        assert plug.typed(mixed, {"mechanism": "yours,mha"}) and not plug.typed(mixed, {})


# --- nothing a run writes or removes lies outside it --------------------------------

def test_a_lock_that_is_a_link_is_refused_and_its_target_left_as_it_was(base, tmp_path):
    """The lock was opened through the link: its target truncated and a pid written in."""
    copy = copied(base, tmp_path)
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    (copy / ".lock").unlink(missing_ok=True)
    (copy / ".lock").symlink_to(target)
    line = one_error(run_script("train.py", "--resume", copy, "--train.max_iters=8", check=False))
    assert f"{copy / '.lock'} is a symbolic link" in line, line
    assert target.read_text() == "keep me\n"


def test_a_checkpoints_folder_that_links_to_another_runs_is_refused(base, tmp_path):
    """A relative link to another run's checkpoints/: the resume wrote its checkpoints
    there and pruned that run's."""
    other = copied(base, tmp_path, "other")
    copy = copied(base, tmp_path)
    before = sorted(p.name for p in (other / "checkpoints").iterdir())
    shutil.rmtree(copy / "checkpoints")
    (copy / "checkpoints").symlink_to(Path("..") / "other" / "checkpoints")
    line = one_error(run_script("train.py", "--resume", copy, "--train.max_iters=8",
                                "--train.keep_last=1", check=False))
    assert f"{copy / 'checkpoints'} is a symbolic link" in line, line
    assert sorted(p.name for p in (other / "checkpoints").iterdir()) == before


@pytest.mark.parametrize("name", ["metrics.jsonl", "checkpoints/step_0000002"])
def test_any_link_a_run_would_write_or_prune_through_is_refused(base, tmp_path, name):
    """metrics.jsonl is appended to (through a link, to the file it names); a step
    folder that is a link would be read as the run's and pruned through."""
    copy = copied(base, tmp_path)
    outside = tmp_path / "outside"
    shutil.copytree(copy / "checkpoints" / "step_0000004", outside) if "step" in name \
        else outside.write_text("")
    (copy / name).unlink(missing_ok=True)
    (copy / name).symlink_to(outside)
    line = one_error(run_script("train.py", "--resume", copy, "--train.max_iters=8", check=False))
    assert f"{copy / name} is a symbolic link" in line, line
    if "step" not in name:
        assert outside.read_text() == ""


@pytest.mark.parametrize("tool", [["attnlab.heads", "grid"], ["attnlab.heads", "head"],
                                  ["attnlab.heads", "html"], ["attnlab.lens", "logit"],
                                  ["attnlab.lens", "ablate"], ["attnlab.induction"]])
def test_a_figures_folder_that_is_a_link_is_refused(base, tmp_path, tool):
    """A run's figures/ linked elsewhere: every tool that writes there by default wrote
    its figure or page through the link, outside the run."""
    copy = copied(base, tmp_path)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (copy / "figures").symlink_to(outside)
    text = ["--text", "To be or not"] if len(tool) > 1 else []
    line = one_error(run_script("-m", *tool, "--run", copy, *text, check=False))
    assert f"{copy / 'figures'} is a symbolic link" in line and "--out" in line, line
    assert not list(outside.iterdir())


def test_the_lock_and_an_atomic_write_never_open_through_a_link(tmp_path):
    """Below the run's own check: the lock's open and an atomic write's temporary file."""
    import os
    from common.files import lock_file, write_bytes_atomic
    target = tmp_path / "target"
    target.write_text("keep me\n")
    (tmp_path / ".lock").symlink_to(target)
    with pytest.raises(OSError):
        lock_file(tmp_path / ".lock", wait=False)
    (tmp_path / f".out.json.tmp-{os.getpid()}").symlink_to(target)
    write_bytes_atomic(tmp_path / "out.json", b"{}")
    assert target.read_text() == "keep me\n" and (tmp_path / "out.json").read_bytes() == b"{}"


def test_the_checkpoint_writer_refuses_a_linked_checkpoints_folder(tmp_path):
    from engine import checkpoint
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").symlink_to(tmp_path / "elsewhere")
    for call in (lambda: checkpoint.prune(tmp_path / "run", 1),
                 lambda: checkpoint.remove_partial(tmp_path / "run")):
        with pytest.raises(CheckpointError, match="is a symbolic link"):
            call()


# --- a preset's name stays in configs/ ----------------------------------------------

def test_a_preset_name_never_leaves_configs(tmp_path, monkeypatch):
    """--config ../../../etc/passwd read that file as TOML; a file named `cpu` in the
    working folder stood in for the cpu preset. An explicit .toml path is the user's
    own file, as --help says, and is read."""
    from engine.config import RunConfig, load_preset
    monkeypatch.chdir(tmp_path)
    (tmp_path / "evil").write_text("[train]\nmax_iters = 7\n")
    (tmp_path / "cpu").write_text("[train]\nmax_iters = 7\n")
    (tmp_path / "mine.toml").write_text("[train]\nmax_iters = 7\n")
    for name in ("../" * 8 + "etc/passwd", str(tmp_path / "evil"), "./evil", "..", "evil/"):
        with pytest.raises(ConfigError, match="neither a preset's name nor a .toml file"):
            load_preset(RunConfig(), name)
    cfg = RunConfig()
    load_preset(cfg, "cpu")
    assert cfg.train.max_iters != 7 and cfg.preset == "cpu"
    load_preset(cfg, "mine.toml")
    assert cfg.train.max_iters == 7


def test_train_refuses_a_preset_path_in_one_line(tmp_path):
    line = one_error(run_script(ROOT / "train.py", "--config", "../../../../../../etc/passwd",
                                check=False, cwd=tmp_path))
    assert "neither a preset's name nor a .toml file" in line


# --- a run a crash left before its first checkpoint -----------------------------------

def crashed(base: Path, tmp_path: Path) -> Path:
    """What a crash in set-up leaves: the lock, config and tokenizer, no checkpoint."""
    run = tmp_path / "runs" / "crashed"
    run.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(base / name, run / name)
    (run / ".lock").write_text("12345\n")
    return run


def test_a_run_without_a_checkpoint_says_how_to_train_it_and_the_way_works(base, tmp_path, corpus):
    run = crashed(base, tmp_path)
    line = one_error(run_script("sample.py", "--run", run, check=False))
    advice = f"--train.out_dir={run.parent} --train.run_name={run.name}"
    assert "holds no checkpoint" in line and advice in line, line
    # The latest-run default names it where it is all there is.
    from engine import checkpoint
    with pytest.raises(CheckpointError, match=f"{run} stopped before its first checkpoint.*"
                                              f"--train.run_name={run.name}"):
        checkpoint.latest_run(run.parent)
    # And the way on trains into that folder.
    run_script("train.py", "--config", "tiny", *advice.split(), f"--data.path={corpus}",
               f"--data.cache_dir={tmp_path / 'cache'}", "--train.max_iters=2",
               "--train.eval_interval=2", "--train.eval_iters=1")
    assert checkpoint.list_checkpoints(run)


# --- weights held to the model their config builds ---------------------------------

def test_int32_weights_are_refused_naming_the_file(base, tmp_path):
    from engine.inference import load_run
    copy = copied(base, tmp_path)
    ckpt = copy / "checkpoints" / "step_0000004"
    path = ckpt / "model.safetensors"
    with safe_open(path, "pt") as f:
        metadata = f.metadata()
    weights = load_file(path)
    name = next(n for n, t in weights.items() if t.is_floating_point() and t.dim() == 2)
    weights[name] = weights[name].to(torch.int32)
    save_file(weights, path, metadata=metadata)
    rehash(ckpt, "model.safetensors")
    with pytest.raises(CheckpointError) as err:
        load_run(copy, "latest")
    assert str(path) in str(err.value) and f"dtype differs for {name} int32 vs float32" in str(err.value)


def test_weights_under_a_config_edited_to_another_mechanism_of_the_same_shapes_are_refused(
        corpus, tmp_path):
    """Linear attention's weights have multi-head attention's names and shapes: a config
    edited from linear to mha (hash recomputed) loaded them into softmax attention
    without a word. The weights file records the model it was saved for."""
    from engine.inference import load_run
    run = train_tiny(corpus, tmp_path, "linear", "--model.mechanism=linear",
                     "--train.max_iters=2", "--train.eval_interval=2", "--train.eval_iters=1")
    load_run(run, "latest")                                   # as saved: it loads
    ckpt = run / "checkpoints" / "step_0000002"
    config = json.loads((ckpt / "config.json").read_text())
    config["model"]["mechanism"] = "mha"
    (ckpt / "config.json").write_text(json.dumps(config))
    rehash(ckpt, "config.json")
    with pytest.raises(CheckpointError) as err:
        load_run(run, "latest")
    said = str(err.value)
    assert str(ckpt / "model.safetensors") in said and "model.mechanism='linear' in the weights" in said


# --- a validation split that is the training split -----------------------------------

def test_a_val_split_that_is_a_copy_of_the_train_split_is_refused(tmp_path):
    import data.build as build
    from data.sources import SourceSpec
    from data.tokens import load_tokens
    (tmp_path / "c.txt").write_text("the cat sat on the mat and looked at the rain.\n" * 80)
    folder = tmp_path / "p"
    build.prepare(SourceSpec(str(tmp_path / "c.txt")), folder, "char", log=lambda *a: None,
                  progress=False)
    load_tokens(str(folder), cache_dir=str(tmp_path / "cache"))      # as prepared: it loads
    meta = json.loads((folder / "meta.json").read_text())
    train, val = meta["splits"]["train"], meta["splits"]["val"]
    shutil.copy(folder / train["shards"][0], folder / val["shards"][0])
    val["tokens"] = train["tokens"]
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match="hold the very tokens of its train shards"):
        load_tokens(str(folder), cache_dir=str(tmp_path / "cache"))
