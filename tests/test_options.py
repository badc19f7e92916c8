"""The options every tool that reads a model shares (attnlab/options.py): the same
--run, --checkpoint and --device in each --help, the same refusals, and the checkpoint
each --checkpoint picks."""
import importlib
import json
from pathlib import Path

import pytest

from common.errors import AttnlabError, ConfigError

# Each tool, and how to call it so that the model it names is the next thing it needs.
TOOLS = {
    "heads": ["grid", "--text", "abc"],
    "lens": ["logit", "--text", "abc"],
    "induction": [],
    "article": ["bank"],
    "fill": ["--text", "a [MASK]"],
    "evaluate": ["--data", "README.md"],
    "export": ["--out", "unused"],
    "recall": ["--factors", "1"],
}
WITHOUT_RUN = {"extrapolate": []}                   # names its runs with --runs and --from


def main_of(tool):
    return importlib.import_module(f"attnlab.{tool}").main


@pytest.mark.parametrize("tool", [*TOOLS, *WITHOUT_RUN, "serve", "sample"])
def test_every_tools_help_shows_the_shared_options_with_their_defaults(tool, capsys):
    if tool == "sample":
        import sample
        parse = sample.parser().parse_args
    elif tool == "serve":
        from attnlab.serve import parser
        parse = parser().parse_args
    else:
        parse = main_of(tool)
    with pytest.raises(SystemExit) as done:
        parse(["--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--checkpoint WHICH best (lowest validation loss" in text and "(default: best)" in text
    assert "--device D auto, cpu, cuda, cuda:N or mps (default: auto" in text
    assert ("--run DIR" in text) is (tool not in WITHOUT_RUN)


@pytest.mark.parametrize("tool", TOOLS)
def test_a_bad_run_gets_the_same_one_line_in_every_tool(tool, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path.parent)         # relative paths as a user types them
    (tmp_path / "README.md").write_text("some text to score\n")
    missing = f"{tmp_path.name}/nosuch"
    argv = [a.replace("README.md", f"{tmp_path.name}/README.md") for a in TOOLS[tool]]
    with pytest.raises(AttnlabError) as err:
        main_of(tool)([*argv, "--run", missing, "--device", "cpu"])
    assert str(err.value) == (f"--run {missing}: no run, checkpoint or transformers folder "
                              "there, nor a run of that name in runs/; give one of those, or "
                              "leave --run out for the latest run")


@pytest.mark.parametrize("given,message", [
    (["--checkpoint", "bst"], "argument --checkpoint: 'bst' is not best, latest or a step number"),
    (["--checkpoint"], "--checkpoint needs a value"),
    (["--device", "gpu"], "argument --device: unknown device 'gpu'; valid: auto, cpu, cuda"),
])
def test_a_bad_checkpoint_or_device_is_refused_while_parsing(given, message):
    with pytest.raises(ConfigError, match=message):
        main_of("lens")(["logit", *given])


OUT_TOOLS = {"heads": ["grid", "--text", "abc"], "lens": ["logit", "--text", "abc"],
             "induction": [], "article": ["leak"], "export": [], "recall": [],
             "figures": ["masks"], "compare": [], "extrapolate": [], "seq2seq": []}


@pytest.mark.parametrize("given", ["", "  "])
@pytest.mark.parametrize("tool", OUT_TOOLS)
def test_an_empty_out_is_refused_while_parsing_not_read_as_the_default(tool, given, tmp_path,
                                                                        monkeypatch):
    """`--out ""` (an unset shell variable) used to write to the default place."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="argument --out: an empty path names no file or folder"):
        main_of(tool)([*OUT_TOOLS[tool], "--out", given])
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def run_with_steps(corpus, tmp_path_factory):
    """A tiny run with checkpoints at steps 0, 2, 4 and 6, its best by validation loss
    rewritten to step 2 (so best and latest differ)."""
    from engine import cli
    from engine.loop import train
    from engine.run import setup_run
    out = tmp_path_factory.mktemp("options")
    cfg = cli.build("tiny", [f"--data.path={corpus}", f"--data.cache_dir={out / 'cache'}",
                             f"--train.out_dir={out / 'runs'}", "--train.run_name=r",
                             "--train.max_iters=6", "--train.eval_interval=2",
                             "--train.keep_last=4"])
    train(setup_run(cfg, log=lambda *a, **k: None))
    run = out / "runs" / "r"
    (run / "best.json").write_text(json.dumps({"step": 2, "val_loss": 1.5}))
    return run


def loaded(argv, log=None):
    from attnlab.options import add_run_options, load
    from engine.cli import Parser
    parser = Parser("tool")
    add_run_options(parser)
    return load(parser.parse_args(argv), log=log)[3]


def test_checkpoint_best_latest_and_a_step(run_with_steps, monkeypatch):
    run = run_with_steps
    step = lambda n: run / "checkpoints" / f"step_{n:07d}"
    assert loaded(["--run", str(run)]) == step(2)                    # best, the default
    assert loaded(["--run", str(run), "--checkpoint", "latest"]) == step(6)
    lines = []
    assert loaded(["--run", str(run), "--checkpoint", "4"], log=lines.append) == step(4)
    assert lines == [f"checkpoint: {step(4)} (the checkpoint at step 4)"]
    assert loaded(["--run", str(run), "--checkpoint", "step_0000004"]) == step(4)
    with pytest.raises(AttnlabError, match=r"has no checkpoint at step 5; it keeps steps "
                                           r"0, 2, 4, 6: give one of those, or --checkpoint best"):
        loaded(["--run", str(run), "--checkpoint", "5"])
    monkeypatch.chdir(run.parent.parent)                               # a run by its name,
    assert loaded(["--run", "r", "--checkpoint", "latest"]).resolve() == step(6)   # in runs/
    assert loaded(["--checkpoint", "latest"]).resolve() == step(6)    # and the latest run


def test_checkpoint_beside_a_folder_of_one_set_of_weights_is_refused_not_ignored(run_with_steps,
                                                                                   tmp_path):
    """--run CHECKPOINT_FOLDER --checkpoint 6 sampled the folder given, step 2, and said
    only in passing; beside a transformers folder it was ignored without a word."""
    from attnlab.export import main as export
    run = run_with_steps
    folder = run / "checkpoints" / "step_0000002"
    assert loaded(["--run", str(folder)]) == folder                 # without it: that folder
    with pytest.raises(AttnlabError) as err:
        loaded(["--run", str(folder), "--checkpoint", "6"])
    assert str(err.value) == (f"--checkpoint 6 picks one of a run's checkpoints, and {folder} is "
                              "one checkpoint folder, with one set of weights; leave --checkpoint "
                              f"out, or give its run: --run {run} --checkpoint 6")
    assert export(["--run", str(run), "--out", str(tmp_path / "hf")]) == 0
    with pytest.raises(AttnlabError, match=r"is a transformers folder, with one set of weights; "
                                           r"leave --checkpoint out$"):
        loaded(["--run", str(tmp_path / "hf"), "--checkpoint", "latest"])
    assert loaded(["--run", str(tmp_path / "hf")]) == tmp_path / "hf"


def test_best_falls_back_to_the_latest_and_says_so(run_with_steps, tmp_path, capsys):
    import shutil
    run = tmp_path / "r"
    shutil.copytree(run_with_steps, run)
    (run / "best.json").unlink()
    assert loaded(["--run", str(run)]) == run / "checkpoints" / "step_0000006"
    assert "the latest checkpoint: no best.json names an evaluated checkpoint" in capsys.readouterr().err


def test_sample_finds_a_run_by_its_name_and_refuses_a_missing_one_in_the_shared_line(
        run_with_steps, monkeypatch, capsys):
    """sample.py's --run help says "run directory or name": a name alone used to be refused
    as a missing directory."""
    import sample
    monkeypatch.chdir(run_with_steps.parent.parent)
    assert sample.main(["--run", "r", "--checkpoint", "latest", "--device", "cpu",
                        "--max_new_tokens", "3"]) == 0
    assert f"\n[{Path('runs', 'r', 'checkpoints', 'step_0000006')}:" in capsys.readouterr().err
    with pytest.raises(AttnlabError, match="^--run nosuch: no run, checkpoint or transformers "
                                           "folder there, nor a run of that name in runs/"):
        sample.main(["--run", "nosuch", "--device", "cpu"])


def test_a_damaged_checkpoint_names_the_others_its_run_keeps_and_how_to_read_them(
        run_with_steps, tmp_path):
    """"use an earlier checkpoint" said neither which ones there are nor how to pick one."""
    import shutil
    from engine.checkpoint import use_another
    run = tmp_path / "r"
    shutil.copytree(run_with_steps, run)
    latest = run / "checkpoints" / "step_0000006"
    with open(latest / "model.safetensors", "r+b") as f:        # one byte flipped
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(AttnlabError) as err:
        loaded(["--run", str(run), "--checkpoint", "latest"])
    assert str(err.value) == (
        f"checkpoint file {latest / 'model.safetensors'} is missing or corrupt (its hash does "
        f"not match state.json); use another checkpoint: {run} also keeps steps 0, 2, 4 "
        "(--checkpoint STEP samples or looks inside one; --resume "
        f"{run / 'checkpoints' / 'step_0000004'} trains on from it in a new run)")
    assert loaded(["--run", str(run), "--checkpoint", "4"]) == run / "checkpoints" / "step_0000004"
    for other in ("step_0000000", "step_0000002", "step_0000004"):
        shutil.rmtree(run / "checkpoints" / other)
    assert use_another(latest) == f"{run} keeps no other whole checkpoint: train it again"
    assert use_another(tmp_path / "loose") == "use another checkpoint"


def test_a_state_json_whose_step_disagrees_with_its_folder_is_refused(run_with_steps, tmp_path):
    """state.json carries the hashes of the other files but none of its own: a step edited
    from 4 to 5 was read as step 5 by sampling and by a resume."""
    import shutil
    run = tmp_path / "r"
    shutil.copytree(run_with_steps, run)
    ckpt = run / "checkpoints" / "step_0000004"
    state = json.loads((ckpt / "state.json").read_text())
    state["step"] = 5
    (ckpt / "state.json").write_text(json.dumps(state))
    with pytest.raises(AttnlabError, match=r"step_0000004 is named for step 4 but its state.json "
                                           r"says step 5 \(.*step_0000004/state.json\); it is corrupt or edited: use another "
                                           r"checkpoint: .* also keeps steps 0, 2, 6"):
        loaded(["--run", str(run), "--checkpoint", "4"])


class Loaded(Exception):
    """Raised by the stand-in for load_run: the tool has chosen its run."""


def finished_then_killed(out: Path) -> tuple[Path, Path]:
    """runs/done, finished (evaluated at its last step), then runs/killed, written later
    and stopped at step 150 before its first evaluation past step 0."""
    import os
    made = []
    for name, steps, last_eval, written in (("done", [0, 250, 500], 500, 1_000_000),
                                            ("killed", [0, 150], 0, 2_000_000)):
        run = out / name
        (run / "config.json").parent.mkdir(parents=True)
        (run / "config.json").write_text("{}")
        for step in steps:
            state = run / "checkpoints" / f"step_{step:07d}" / "state.json"
            state.parent.mkdir(parents=True)
            state.write_text(json.dumps({"step": step, "last_eval": min(step, last_eval)}))
            os.utime(state, (written + step, written + step))
        made.append(run)
    return made[0], made[1]


# Every tool that reads the latest run when --run is left out.
LATEST = {"sample": [], "serve": [], "heads": ["grid", "--text", "abc"],
          "heads induction": [], "lens": ["logit", "--text", "abc"], "export": ["--out", "x"],
          "fill": ["--text", "a [MASK]"], "evaluate": ["--data", "README.md"],
          "article": ["bank"]}


@pytest.mark.parametrize("tool", LATEST)
def test_every_tool_reads_the_run_that_trained_not_a_newer_one_killed_before_learning(
        tool, tmp_path, monkeypatch, capsys):
    import engine.inference
    monkeypatch.chdir(tmp_path)                  # runs/, as a user's checkout has it
    (tmp_path / "README.md").write_text("some text to score\n")
    done, killed = finished_then_killed(Path("runs"))
    chosen = []

    def stand_in(run, *args, **kwargs):
        chosen.append(Path(run))
        raise Loaded
    monkeypatch.setattr(engine.inference, "load_run", stand_in)
    if tool == "sample":
        import sample
        main = sample.main
    elif tool == "serve":
        import attnlab.serve
        monkeypatch.setattr(attnlab.serve, "listen", lambda host, port: None)
        main = attnlab.serve.main
    else:
        main = main_of(tool.split()[0])
    with pytest.raises(Loaded):
        main([*tool.split()[1:], *LATEST[tool], "--device", "cpu"])
    assert chosen == [done]
    said = capsys.readouterr()
    assert (f"run: {done} (the latest run that trained, evaluated at step 500; not the newer "
            f"{killed}, stopped before its first evaluation; --run DIR for another)"
            in said.err + said.out)


def test_with_no_run_trained_yet_the_newest_is_read_and_the_line_says_none_has(tmp_path):
    from engine.checkpoint import latest_run
    done, killed = finished_then_killed(tmp_path)
    # --resume wants the newest, whether it learned or not.
    assert latest_run(tmp_path, log=lambda line: None) == killed
    import shutil
    shutil.rmtree(done)
    lines = []
    assert latest_run(tmp_path, log=lines.append, trained=True) == killed
    assert lines == [f"run: {killed} (the latest run; none in the folder has been evaluated "
                     "past step 0 yet; --run DIR for another)"]


def test_a_run_trained_with_your_attention_opens_in_every_tool_that_reads_one(corpus, tmp_path):
    """docs/exercises.md ends with the learner's model on the page: the tools read runs
    through load(), which knew no `yours` and refused the run's config."""
    import shutil
    from conftest import train_tiny
    from attnlab.exercises.learner import SOLUTIONS
    from attnlab.options import load
    from attnlab.serve import parser
    mine = tmp_path / "mine"
    shutil.copytree(SOLUTIONS, mine)
    run = train_tiny(corpus, tmp_path, "yours", "--model.attention=yours", f"--exercises={mine}",
                     "--train.max_iters=2", "--train.eval_interval=2")
    lines = []
    model, cfg, _, _ = load(parser().parse_args(["--run", str(run), "--device", "cpu",
                                                 "--exercises", str(mine)]),
                            log=lines.append)
    assert f"attention: yours (scaled_dot_product_attention in {mine / '01_attention.py'})" in lines
    assert model.config.attention == cfg.model.attention


@pytest.mark.parametrize("tool, argv, message", [
    ("induction", ["--span", "100000"], "argument --span: '100000' is not a whole number from 4 to 128"),
    ("induction", ["--span", "3"], "argument --span: '3' is not a whole number from 4 to 128"),
    ("extrapolate", ["--runs", "x", "--batches", "0"], "argument --batches: '0' is not a whole number from 1 to 1,000"),
    ("extrapolate", ["--runs", "x", "--batch_size", "100000000"], "argument --batch_size: '100000000' is not a whole number from 1 to 256"),
    ("extrapolate", ["--runs", "x", "--factors", "1", "100000"], "argument --factors: '100000' is not a whole number from 1 to 64"),
    ("fill", ["--text", "a [MASK]", "--top", "-1"], "argument --top: '-1' is not a whole number from 1 to 100"),
    ("fill", ["--text", "a [MASK]", "--top", "0"], "argument --top: '0' is not a whole number from 1 to 100"),
    ("fill", ["--text", "a [MASK]", "--top", "100000000"], "from 1 to 100"),
])
def test_an_option_out_of_its_range_is_refused_while_parsing(tool, argv, message, tmp_path,
                                                             monkeypatch):
    """Each of these was a traceback or an unbounded allocation: induction --span 100000
    took 5.3 GB with no output, extrapolate --batches 0 divided by zero, fill --top -1 was
    "selected index k out of range" and --top 0 printed nothing."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=message):
        main_of(tool)(argv)


def test_a_batch_past_the_tokens_extrapolate_reads_is_refused_before_any_work(run_with_steps,
                                                                              tmp_path):
    with pytest.raises(AttnlabError, match=r"is 524,288 tokens a batch; this tool reads at "
                       r"most 65,536: give a smaller --batch_size or smaller --factors"):
        main_of("extrapolate")(["--runs", str(run_with_steps), "--batch_size", "256",
                                "--factors", "1", "64", "--out", str(tmp_path)])


@pytest.mark.parametrize("argv, message", [
    (["--context", "16"], r"--context 16 cannot hold the task's fact, question and some filler"),
    ([], r"context of 32 tokens cannot hold the task's fact, question and some filler"),
])
def test_recall_refuses_a_context_too_short_for_its_task_in_one_line(tmp_path, argv, message):
    """`recall --model RUN --context 16` was a ValueError traceback from the task."""
    from conftest import ROOT, train_tiny
    run = train_tiny(ROOT / "data" / "shakespeare" / "plays.txt.gz", tmp_path, "r",
                     "--train.max_iters=1")          # the plays hold every character the task writes
    with pytest.raises(AttnlabError, match=message + r" in this tokenizer: give --context \d+ or more"):
        main_of("recall")(["--model", str(run), *argv, "--factors", "1", "--out", str(tmp_path / "out")])


def test_fill_shows_every_token_when_top_is_past_the_vocabulary():
    import torch
    from attnlab.fill import fill
    from data.tokenizer import CharTokenizer
    from model import GPT, ModelConfig
    tok = CharTokenizer("ab ").with_mask()
    model = GPT(ModelConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=1, n_embd=8, block_size=8,
                            causal=False)).eval()
    (_, guesses), = fill(model, tok, "a[MASK]", top=100)
    assert len(guesses) == tok.vocab_size


def test_evaluate_reads_a_gzipped_corpus_as_train_does(run_with_steps, corpus, tmp_path, capsys):
    """`evaluate --data data/shakespeare/plays.txt.gz` refused the corpus train.py reads
    ("not UTF-8 text"); its loss is the plain text's."""
    import gzip
    text = Path(corpus).read_text(encoding="utf-8")[-2000:]
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    (tmp_path / "t.txt.gz").write_bytes(gzip.compress(text.encode("utf-8")))
    scores = []
    for name in ("t.txt", "t.txt.gz"):
        main_of("evaluate")(["--run", str(run_with_steps), "--data", str(tmp_path / name)])
        scores.append([l for l in capsys.readouterr().out.splitlines() if l.startswith("attnlab ")])
    assert scores[0] == scores[1] and scores[0]
    (tmp_path / "bad.gz").write_bytes(b"not a gzip")
    with pytest.raises(Exception, match="bad.gz is not readable gzip"):
        main_of("evaluate")(["--run", str(run_with_steps), "--data", str(tmp_path / "bad.gz")])
