"""The configuration (engine/config.py, engine/cli.py, model/config.py): presets, overrides, and
refusing mistakes before any work with the valid choices listed."""
from dataclasses import fields

import pytest
from hypothesis import given, settings, strategies as st

from engine import cli, config
from common.errors import ConfigError

PRESETS = sorted(p.stem for p in config.CONFIG_DIR.glob("*.toml"))


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_loads_and_validates(preset):
    cfg = cli.build(preset, [])
    assert cfg.preset == preset


def test_overrides_beat_presets_and_are_typed():
    cfg = cli.build("cpu", ["--model.n_layer=3", "--train.lr", "3e-4", "--model.bias=true",
                               "--data.tokenizer=bpe"])
    assert cfg.model.n_layer == 3 and cfg.train.lr == 3e-4 and cfg.model.bias is True
    assert cfg.data.tokenizer == "bpe"
    assert cfg.model.n_embd == 128                   # from the preset


@pytest.mark.parametrize("args,message", [
    (["--model.n_layr=4"], "did you mean 'n_layer'"),
    (["--modle.n_layer=4"], "did you mean 'model'"),
    (["--model.attention=flash"], "valid choices: auto, banded, eager, flex, sdpa"),
    (["--model.position=alibi2"], "did you mean 'alibi'.*valid choices: alibi, learned, none"),
    (["--model.attention=banded"], "set model.sliding_window"),
    (["--model.n_global=4"], "set model.sliding_window too"),
    (["--model.attention=flex", "--train.device=cpu"], "no backward on CPU.*banded"),
    (["--model.position=learned", "--model.rope_scaling=yarn"], "needs model.position=rope"),
    (["--model.rope_scaling=ntk", "--model.rope_factor=0.5"], "at least 1"),
    (["--model.rope_scaling=longrope"], "valid choices: linear, none, ntk, yarn, yarn_by_pairs"),
    (["--data.tokenizer=word"], "valid choices: bpe, char"),
    (["--train.dtype=fp8"], "valid choices"),
    (["--train.lr=fast"], "train.lr must be a number"),
    (["--train.lr=nan"], "finite"),
    (["--train.lr=0"], "train.lr and train.muon_lr must be positive"),
    (["--model.n_layer=2.5"], "must be an integer"),
    (["--model.n_layer=0"], "positive integer"),
    (["--model.n_layer=100000"], "more than 512 layers"),
    (["--model.n_head=-2"], "positive integer"),
    (["--model.n_embd=100", "--model.n_head=3"], "not divisible"),
    (["--model.n_kv_head=4", "--model.n_head=6"], "must divide"),
    (["--model.bias=maybe"], "true or false"),
    (["--model.sliding_window=300", "--model.block_size=256"], "larger than the context"),
    (["--model.sliding_window=-1"], "must not be negative"),
    (["--model.mlp_hidden=-64"], "mlp_hidden must not be negative"),
    (["--model.mechanism=mla", "--model.mla_rope_dim=-2"], "mla_rope_dim must not be negative"),
    (["--model.mechanism=mla", "--model.mla_kv_rank=-8"], "mla_kv_rank must not be negative"),
    # A layer that keeps a value per query head beside a value table sized for shared heads.
    (["--model.mechanism=linear,mha", "--model.n_head=4", "--model.n_kv_head=2",
      "--model.value_embeds=true"], r"model.n_kv_head=2 shared heads: set model.n_kv_head=0 or "
     r"model.value_embeds=false"),
    (["--model.mechanism=mha,deltanet", "--model.n_head=4", "--model.n_kv_head=1",
      "--model.value_embeds=true"], r"model.mechanism=deltanet keeps a value for each"),
    # A value of the wrong kind or sign says what the option takes (its help).
    (["--model.token_mix=abc"], r"must be an integer, got 'abc' \(model.token_mix: before attention.*0 = off\)$"),
    (["--model.token_mix=-1"], r"must not be negative, got -1 \(model.token_mix: before attention.*0 = off\)$"),
    (["--model.token_mix=3", "--model.block_size=2"], r"give at most 2$"),
    (["--model.token_mix=300"], r"give at most 256 \(4 is usual\)$"),
    (["--model.mlp=none", "--model.mlp_hidden=64"], "model.mlp=none has none; leave it 0"),
    (["--train.batch_size=0"], "must be positive"),
    (["--sample.top_p=1.5"], "top_p"),
    (["--sample.temperature=-1"], "temperature"),
    (["--sample.top_k=-5"], r"^sample.top_k must not be negative, got -5$"),
    (["--sample.max_new_tokens=-3"], r"^sample.max_new_tokens must not be negative, got -3$"),
    (["--sample.num_samples=0"], r"^sample.num_samples must be at least 1, got 0$"),
    (["--sample.num_samples=100000000000000000000"], r"^sample.num_samples=100,000,000,000,000,000,000 "
     r"is more than 10,000 samples in one go"),
    (["--sample.num_samples=3000", "--sample.max_new_tokens=500"], r"^sample.num_samples=3,000 of "
     r"sample.max_new_tokens=500 is more than 1,000,000 tokens in one go"),
    (["--train.grad_clip=-1"], r"^train.grad_clip must not be negative, got -1.0$"),
    (["--model.n_layer"], "needs a value"),
    (["n_layer=4"], "unexpected argument"),
    (["--train.run_name=" + "a" * 300], "300 bytes long; give a name of at most 200"),
])
def test_bad_configuration_is_refused_with_a_reason(args, message):
    with pytest.raises(ConfigError, match=message):
        cli.build(None, args)


def test_unknown_preset_lists_the_available_ones():
    with pytest.raises(ConfigError, match="cpu"):
        cli.build("cpuu", [])


def test_preset_files_are_checked_like_the_command_line(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nn_layers = 3\n")
    with pytest.raises(ConfigError, match=r"unknown key model.n_layers in .*bad.toml"):
        cli.build(str(bad), [])
    bad.write_text("[model\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        cli.build(str(bad), [])


def test_saved_config_round_trips():
    cfg = cli.build("tiny", ["--model.position=learned"])
    again = config.from_dict(cfg.to_dict(), "test")
    assert again == cfg


def test_help_lists_every_field_with_its_choices_and_default():
    from train import parser
    text = " ".join(parser().format_help().split())          # argparse wraps lines
    for section, cls in config.SECTIONS.items():
        for f in fields(cls):
            assert f"--{section}.{f.name} VALUE" in text or f"--{section}.{f.name} [VALUE]" in text
    assert ("position encoding {none, sinusoidal, learned, rope, alibi, rope_partial} "
            "(default: 'rope')") in text
    assert "{disabled, offline, online} (default: 'disabled')" in text


KEYS = st.sampled_from(["model.n_layer", "model.position", "train.lr", "train.dtype",
                        "model.bias", "sample.top_p", "data.path", "nope.x", "model.zzz", "x"])
VALUES = st.one_of(st.text(max_size=12), st.integers(-5, 10**6).map(str),
                   st.floats(allow_nan=True, allow_infinity=True).map(str),
                   st.sampled_from(["true", "rope", "eager", "1e-3", "", "-0", "bfloat16"]))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.tuples(KEYS, VALUES).map(lambda kv: f"--{kv[0]}={kv[1]}"),
                          st.text(max_size=15)), max_size=4))
def test_random_overrides_are_accepted_or_refused_with_our_error(args):
    try:
        cfg = cli.build(None, args)
    except ConfigError:
        return
    cfg.validate()


# A run written before GELU was renamed (tests/fixtures/run-v0-gelu-tanh: one block of 16
# wide, 4 steps, `--model.mlp=gelu`, then the tanh form): its config.json has no version.
# expected.json holds the logits and seeded samples the code of that day computed from it.
OLD_RUN = config.CONFIG_DIR.parent / "tests" / "fixtures" / "run-v0-gelu-tanh"


def _old_run(tmp_path):
    import shutil
    return shutil.copytree(OLD_RUN, tmp_path / OLD_RUN.name)


def test_a_run_saved_before_the_gelu_rename_loads_with_the_activation_it_trained_with(tmp_path):
    """Old `gelu` (tanh) reads as `gelu_tanh`: the same logits to 1e-6 as the day it was
    written (exact GELU would move them by about 1e-5) and the same seeded samples."""
    import json
    import torch
    from engine.inference import load_run
    run = _old_run(tmp_path)
    assert "version" not in json.loads((run / "config.json").read_text())
    expected = json.loads((run / "expected.json").read_text())
    model, cfg, tokenizer, _ = load_run(run)
    assert cfg.model.mlp == "gelu_tanh" and cfg.version == config.CONFIG_VERSION
    assert cfg.model.mlp_hidden == 0 and model.blocks[0].mlp.proj.in_features == 4 * cfg.model.n_embd
    idx = torch.tensor([tokenizer.encode(expected["prompt"])])
    with torch.no_grad():
        logits = model(idx).logits[0, -1]
    torch.testing.assert_close(logits, torch.tensor(expected["last_logits"]), atol=1e-6, rtol=0)
    for decode, extra in [("full", {}), ("cache", {}), ("static", {}), ("sinks2", {"sinks": 2})]:
        g = torch.Generator().manual_seed(7)
        mode = {"decode": decode} if not extra else extra
        tokens = torch.cat(list(model.generate(idx, 40, 1.0, 0, 1.0, g, **mode)), 1)[0]
        assert tokens.tolist() == expected[decode], decode


def test_a_run_saved_before_the_gelu_rename_resumes(tmp_path):
    """Resuming compares the checkpoint's config with the run's and the command line's;
    both old files are migrated first, so the rename is not taken for a change."""
    from engine.resume import resume_config
    cfg, run_dir, ckpt = resume_config(str(_old_run(tmp_path)), "", {"train": {"max_iters": "6"}})
    assert cfg.model.mlp == "gelu_tanh" and ckpt.name == "step_0000004"
    assert cfg.to_dict()["version"] == config.CONFIG_VERSION


@pytest.mark.parametrize("mlp,n_embd,width", [("swiglu", 64, 192), ("swiglu", 100, 288),
                                              ("gelu", 48, 192), ("relu2", 48, 192)])
def test_a_saved_config_without_an_mlp_width_keeps_the_width_it_trained_with(mlp, n_embd, width):
    """Runs saved before model.mlp_hidden existed build the MLP their checkpoints hold."""
    from model import GPT
    cfg = config.from_dict({"version": config.CONFIG_VERSION,
                            "model": {"mlp": mlp, "n_embd": n_embd, "n_head": 2, "n_layer": 1,
                                      "vocab_size": 10, "block_size": 8}}, "saved")
    assert cfg.model.mlp_hidden == 0
    mlp_module = GPT(cfg.model).blocks[0].mlp
    assert mlp_module.proj.in_features == width
    assert mlp_module.fc.out_features == (2 * width if mlp == "swiglu" else width)


@pytest.mark.parametrize("saved,mlp", [
    ({"model": {"mlp": "gelu"}}, "gelu_tanh"),                       # version 1: the tanh form
    ({"model": {"mlp": "gelu_erf"}}, "gelu"),                        # version 1: the exact form
    ({"version": 1, "model": {"mlp": "swiglu"}}, "swiglu"),
    ({"version": 2, "model": {"mlp": "gelu"}}, "gelu"),              # already today's names
])
def test_old_configs_are_migrated_to_todays_names(saved, mlp):
    import copy
    before = copy.deepcopy(saved)
    cfg = config.from_dict(saved, "config.json")
    assert cfg.model.mlp == mlp and cfg.version == config.CONFIG_VERSION
    assert saved == before                                 # the saved dict is left as it was


@pytest.mark.parametrize("version,message", [(99, "newer than this attnlab reads"),
                                             ("2", "a whole number from 1"), (0, "a whole number")])
def test_a_config_of_an_unknown_version_is_refused_saying_why(version, message):
    with pytest.raises(ConfigError, match=message):
        config.from_dict({"version": version, "model": {}}, "run/config.json")


NAMES = ["alibi", "learned", "none", "rope", "sinusoidal", "yours", "attention", "lr"]


@pytest.mark.parametrize("given,suggested", [("bogus", None), ("rpoe", "rope"), ("sinusoid", "sinusoidal"),
                                             ("attn", "attention"), ("l", None), ("xyz", None),
                                             ("ROPE", "rope"), ("Alibi", "alibi")])
def test_a_misspelt_name_is_matched_only_to_a_name_close_to_it(given, suggested):
    """'bogus' used to be answered with "did you mean 'yours'?" (three letters of five).
    The model's registries and the config's keys keep the same rule (model/ imports
    nothing of the project's), so both are asked."""
    from common.errors import choices_hint
    from model.registry import unknown_name
    for text in (str(unknown_name("model.position", given, NAMES)), choices_hint(given, NAMES)):
        assert ("did you mean" in text) is (suggested is not None)
        if suggested:
            assert f"(did you mean {suggested!r}?)" in text


# -- a check that only training needs ------------------------------------------------

@pytest.mark.parametrize("device", ["auto", "cpu"])
def test_a_run_trained_with_flex_is_read_to_sample_on_a_cpu_and_refused_to_train(device):
    """flex has no backward on a CPU, so training there is refused; a run trained with it
    on a GPU was refused too when its config was read to sample, whose forward works."""
    saved = config.RunConfig().to_dict()
    saved["model"]["attention"], saved["train"]["device"] = "flex", device
    cfg = config.from_dict(saved, "config.json")
    assert cfg.model.attention == "flex"
    with pytest.raises(ConfigError, match="no backward on CPU"):
        cfg.validate()


def test_sample_py_samples_a_flex_run_on_a_cpu(corpus, tmp_path):
    """A tiny run written as one trained with flex on a GPU (its config and the model
    fields its weights carry say flex; the weights are the same for every backend)."""
    import hashlib
    import json
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    from conftest import run_script, train_tiny
    run = train_tiny(corpus, tmp_path, "flex", "--train.max_iters=2", "--train.eval_interval=2",
                     "--train.eval_iters=1")
    for path in [run / "config.json", *run.glob("checkpoints/*/config.json")]:
        saved = json.loads(path.read_text())
        saved["model"]["attention"], saved["train"]["device"] = "flex", "auto"
        path.write_text(json.dumps(saved))
    for ckpt in run.glob("checkpoints/*"):
        weights = ckpt / "model.safetensors"
        with safe_open(weights, "pt") as f:
            meta = f.metadata()
        meta["attnlab_model"] = json.dumps({**json.loads(meta["attnlab_model"]), "attention": "flex"})
        save_file(load_file(weights), weights, metadata=meta)
        state = json.loads((ckpt / "state.json").read_text())
        for name in ("config.json", "model.safetensors"):
            state["files"][name] = hashlib.sha256((ckpt / name).read_bytes()).hexdigest()
        (ckpt / "state.json").write_text(json.dumps(state))
    proc = run_script("sample.py", "--run", run, "--max_new_tokens=8", "--device=cpu", check=False)
    assert proc.returncode == 0 and "attention flex" in proc.stderr, proc.stderr[-2000:]
    again = run_script("train.py", "--resume", run, "--train.max_iters=4", check=False)
    assert again.returncode == 2 and "no backward on CPU" in again.stderr, again.stderr[-2000:]


@pytest.mark.parametrize("kind", ["a named pipe", "a folder"])
def test_a_config_path_that_is_not_a_regular_file_is_named_for_what_it_is(kind, tmp_path):
    """A named pipe given as --config was reported as a missing preset, with the list of
    presets, though the path was there."""
    import os
    path = tmp_path / "mine.toml"
    os.mkfifo(path) if kind == "a named pipe" else path.mkdir()
    with pytest.raises(ConfigError, match=f"^--config {path} is {kind}, not a regular file; "):
        config.load_preset(config.RunConfig(), str(path))


@pytest.mark.parametrize("written", ['"yes"', '"true"', '"false"'])
def test_a_switch_written_as_a_string_in_a_file_is_refused_saying_it_takes_true_or_false(written, tmp_path):
    """qk_norm = "yes" in a preset (or a run's config.json) was read as true, and a run's
    config.json saying "yes" beside weights trained without QK-norm sampled with it; the
    command line's words stay."""
    path = tmp_path / "mine.toml"
    path.write_text(f"[model]\nqk_norm = {written}\n")
    with pytest.raises(ConfigError, match=f"^{path}: model.qk_norm takes true or false, .*got the "
                                          f"string {written[1:-1]!r}"):
        config.load_preset(config.RunConfig(), str(path))
    saved = config.RunConfig().to_dict()
    saved["model"]["qk_norm"] = written[1:-1]
    with pytest.raises(ConfigError, match="model.qk_norm takes true or false"):
        config.from_dict(saved, "config.json")
    assert cli.build("tiny", ["--model.qk_norm=yes"]).model.qk_norm is True


def test_an_empty_config_file_is_refused_rather_than_training_the_built_in_defaults(tmp_path):
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    with pytest.raises(ConfigError, match="sets nothing.*give a preset's name"):
        cli.build(str(empty), [])


@pytest.mark.parametrize("argv, preset", [([], "cpu"), (["--config", "gemma3"], "gemma3"),
                                          (["--config=tiny"], "tiny")])
def test_help_gives_the_defaults_of_the_preset_the_command_trains(argv, preset):
    # The built-in 6 x 384 model is no preset's: --help shows what this command would train.
    from train import help_preset, parser
    shown = help_preset(argv + ["--help"])
    text = " ".join(parser(shown).format_help().split())
    cfg = config.RunConfig()
    config.load_preset(cfg, preset)
    assert shown[0] == preset
    assert f"model width d_model (default: {cfg.model.n_embd})" in text
    assert f"number of Transformer blocks (default: {cfg.model.n_layer})" in text
    assert f"the {preset} preset's" in text
    assert help_preset(argv) is None                         # no help asked for: nothing read


@pytest.mark.parametrize("section,key,folder", [
    ("train", "out_dir", "../../etc"), ("train", "out_dir", "/etc"), ("train", "out_dir", "~/runs"),
    ("train", "out_dir", "runs/../../x"), ("data", "cache_dir", "/tmp/elsewhere")])
def test_a_config_file_cannot_send_a_runs_files_outside_the_folder_it_runs_from(
        section, key, folder, tmp_path, monkeypatch):
    """A shared .toml once put a whole run under /etc: a folder a config file names for
    writing is refused in one line naming the file, the field and what to do, before
    anything is written; below the working folder it is taken, and the command line may
    still name any folder (the user's own choice)."""
    monkeypatch.chdir(tmp_path)
    hostile = tmp_path / "shared.toml"
    hostile.write_text(f'[model]\nn_layer = 1\n[{section}]\n{key} = "{folder}"\n')
    with pytest.raises(ConfigError) as err:
        cli.build(str(hostile), [])
    said = str(err.value)
    assert str(hostile) in said and f"{section}.{key}={folder!r}" in said
    assert f"--{section}.{key}={folder} on the command line" in said and "\n" not in said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shared.toml"]
    hostile.write_text(f'[model]\nn_layer = 1\n[{section}]\n{key} = "mine/runs"\n')
    assert getattr(getattr(cli.build(str(hostile), []), section), key) == "mine/runs"
    hostile.write_text('[model]\nn_layer = 1\n')
    given = cli.build(str(hostile), [f"--{section}.{key}={tmp_path.parent / 'x'}"])
    assert getattr(getattr(given, section), key) == str(tmp_path.parent / "x")


@pytest.mark.parametrize("preset,extra", [("cpu", []), ("tiny", []), ("tiny", ["--model.block_size=8"])])
def test_the_window_a_banded_refusal_suggests_is_one_the_config_takes(preset, extra):
    """model.attention=banded without a window suggested 256, which the cpu preset's context
    of 128 then refused as wider than the context: the example is sized to the config."""
    import re
    with pytest.raises(ConfigError, match=r"set model.sliding_window \(e.g. (\d+)") as err:
        cli.build(preset, ["--model.attention=banded", *extra])
    window = re.search(r"e\.g\. (\d+)", str(err.value)).group(1)
    cfg = cli.build(preset, ["--model.attention=banded", *extra, f"--model.sliding_window={window}"])
    assert 0 < cfg.model.sliding_window <= cfg.model.block_size


@pytest.mark.parametrize("args,meant", [(["--model.mechanism=mah"], "mha"),
                                        (["--model.position=rpoe"], "rope"),
                                        (["--model.norm=rmsnrom"], "rmsnorm"),
                                        (["--data.tokenizer=bep"], "bpe"),
                                        (["--data.tokenizer=cahr"], "char"),
                                        (["--train.dtype=flaot32"], "float32")])
def test_two_swapped_letters_get_a_did_you_mean(args, meant):
    """mah for mha got the list of choices alone: difflib rates a three-letter swap at 0.67,
    under the 0.7 it asks, and the swap's letters are not in the right order for an
    abbreviation. The model's fields (model/registry.py) and the others (common/errors.py)
    say it alike."""
    with pytest.raises(ConfigError, match=f"did you mean {meant!r}"):
        cli.build("tiny", args)


def test_the_model_floors_did_you_mean_rule_answers_as_the_common_one():
    """model/ keeps its own copy of common/errors.py's closest() (it lifts out with torch
    alone): the two give the same suggestion, or none, for every kind of slip."""
    from common.errors import closest
    from model.registry import REGISTRIES, unknown_name
    slips = ["mah", "MHA", "attn", "rpoe", "alibi2", "bogus", "x", "", "mla_spares", "gated_delta",
             "layrenorm", "swigul", "eagre", "sdp", "learend", "yours_sinsk", "noen", "Rpoe"]
    for registry, valid in REGISTRIES.items():
        for slip in slips:
            said = str(unknown_name("model.x", slip, valid))
            close = closest(slip, sorted(valid))
            assert (f"did you mean {close!r}" in said) if close else "did you mean" not in said, \
                (registry, slip, said, close)


@pytest.mark.parametrize("args,field,works", [
    (["--model.n_head=5"], "n_head", [1, 2, 4, 8, 16, 32, 64]),        # cpu: 128 wide, RoPE
    (["--model.n_head=128"], "n_head", [1, 2, 4, 8, 16, 32, 64]),      # a head of 1: odd
    (["--model.n_embd=96", "--model.n_head=5"], "n_head", [1, 2, 3, 4, 6, 8, 12, 16, 24, 48]),
    (["--model.n_embd=96", "--model.n_head=5", "--model.position=learned"], "n_head",
     [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96]),
    (["--model.n_kv_head=3"], "n_kv_head", [1, 2, 4]),                 # cpu: 4 heads
    (["--model.n_head=12", "--model.n_embd=96", "--model.n_kv_head=5"], "n_kv_head",
     [1, 2, 3, 4, 6, 12])])
def test_a_head_count_that_does_not_fit_is_refused_with_every_value_that_does(args, field, works):
    """n_head=5 with n_embd 128 said only 'not divisible', n_kv_head=3 with 4 heads only
    'must divide': the line lists the values that work (with RoPE, those that leave each
    head an even size too), and each one listed is taken."""
    import re
    with pytest.raises(ConfigError) as err:
        cli.build("cpu", args)
    said = str(err.value)
    assert "\n" not in said
    listed = [int(n) for n in re.search(r"give (?:model\.\w+ )?one of ([\d, ]+)", said).group(1)
              .strip(", ").split(", ")]
    assert listed == works
    for value in listed:
        cli.build("cpu", [*args, f"--model.{field}={value}"])


def test_a_width_no_head_count_fits_says_to_change_the_width():
    with pytest.raises(ConfigError, match=r"so d_k must be even; make model.n_embd even$"):
        cli.build("cpu", ["--model.n_embd=97", "--model.n_head=7"])


def test_the_sampling_precision_help_says_what_the_code_decides_it_from():
    """sample.dtype's help said the one-token matmul was timed and bf16 kept where it ran
    1.1x faster; machine.pick_dtype reads a width fixed per CPU kind and times nothing. The
    help names each kind's width, as pick_dtype reads it."""
    from engine.machine import CPU_KINDS
    text = " ".join(config.SampleConfig.__dataclass_fields__["dtype"].metadata["help"].split())
    assert "timed here" not in text and "1.1x" not in text
    for name, kind in CPU_KINDS.items():
        start = kind.decode_bf16_from
        assert (f"{name} from {start:,} wide" if start is not None else name) in text
    assert "CPU_KINDS" in text and "no timing" in text


def test_a_switch_refused_on_the_command_line_lists_every_word_it_reads(tmp_path):
    """--model.qk_norm=yes was read while a refused word was told 'true or false' alone:
    the line lists every word the command line reads, and each one listed is read; a file
    still takes a boolean without quotes, and its line says where the words are read."""
    import re
    with pytest.raises(ConfigError) as err:
        cli.build("tiny", ["--model.qk_norm=maybe"])
    said = str(err.value)
    assert said.startswith("model.qk_norm must be true or false (or ") and "\n" not in said
    pairs = [("true", "false")] + [tuple(p.split("/")) for p in
                                   re.search(r"\(or ([\w/, ]+)\)", said).group(1).split(", ")]
    assert {w for p in pairs for w in p} == {"true", "false", "yes", "no", "on", "off", "1", "0"}
    for on, off in pairs:
        for word, value in ((on, True), (off, False), (on.upper(), True)):
            assert cli.build("tiny", [f"--model.qk_norm={word}"]).model.qk_norm is value
    path = tmp_path / "mine.toml"
    path.write_text("[model]\nqk_norm = 1\n")
    with pytest.raises(ConfigError, match=r"qk_norm takes true or false, written without quotes "
                                          r"in a file \(the command line also reads yes/no"):
        config.load_preset(config.RunConfig(), str(path))
