"""A run's checkpoint edited with its hashes recomputed (the hashes catch damage, not
tampering): each file is checked before it costs memory or leads outside its folder."""
import hashlib
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch

from conftest import run_script, train_tiny
from common.errors import AttnlabError


@pytest.fixture(scope="module")
def tiny_run(corpus, tmp_path_factory) -> Path:
    return train_tiny(corpus, tmp_path_factory.mktemp("hostile"), "r", "--train.max_iters=10")


def edited(run: Path, tmp_path: Path, **replaced) -> Path:
    """A copy of `run` whose checkpoints' files are replaced by `replaced` (name: text
    or, for config.json, a function of its dict), with state.json's hashes recomputed."""
    copy = tmp_path / "runs" / "edited"
    shutil.copytree(run, copy)
    for ckpt in (copy / "checkpoints").iterdir():
        state = json.loads((ckpt / "state.json").read_text())
        for name, new in replaced.items():
            if name == "state":
                state = new(state)
                continue
            text = json.dumps(new(json.loads((ckpt / name).read_text()))) if callable(new) else new
            (ckpt / name).write_text(text)
            state["files"][name] = hashlib.sha256((ckpt / name).read_bytes()).hexdigest()
        (ckpt / "state.json").write_text(json.dumps(state))
    return copy


def widened(n_embd, n_layer):
    return lambda c: {**c, "model": {**c["model"], "n_embd": n_embd, "n_layer": n_layer}}


@pytest.mark.parametrize("entry", [["sample.py", "--max_new_tokens=2", "--run"],
                                   ["-m", "attnlab.heads", "grid", "--run"],
                                   ["train.py", "--config", "tiny", "--train.init_from"]])
def test_a_config_edited_to_a_huge_model_is_one_error_line_on_every_path(tiny_run, tmp_path, entry):
    """13 TB: a traceback from the allocation; one of ~10^13 weights within the caps on
    each size: the memory check names the file."""
    for n_embd, n_layer in [(1048576, 1000), (65536, 1000)]:
        copy = edited(tiny_run, tmp_path / str(n_embd), **{"config.json": widened(n_embd, n_layer)})
        proc = run_script(*entry, copy, f"--train.out_dir={tmp_path / 'out'}", check=False,
                          timeout=120) if entry[0] == "train.py" else \
            run_script(*entry, copy, check=False, timeout=120)
        assert proc.returncode == 2, proc.stderr[-2000:]
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert "config.json" in errors[0] and str(copy) in errors[0]


def test_a_config_edited_to_another_shape_is_refused_before_that_model_is_built(
        tiny_run, tmp_path, monkeypatch):
    """Within the memory there is, the shapes are compared with the model's skeleton
    (meta tensors) first: the model the edit describes is never allocated."""
    from engine import inference
    built = []

    class Watched(inference.GPT):
        def __init__(self, config):
            if torch.empty(0).device.type != "meta":
                built.append(config.n_embd)
            super().__init__(config)
    monkeypatch.setattr(inference, "GPT", Watched)
    copy = edited(tiny_run, tmp_path, **{"config.json": widened(1024, 4)})
    with pytest.raises(AttnlabError, match="does not fit this model config"):
        inference.load_run(copy)
    assert built == []


@pytest.mark.parametrize("config, said", [
    (lambda c: {**c, "model": "wide"}, "model is 'wide'"),
    (lambda c: {**c, "model": {**c["model"], "n_layer": 1 << 40}}, "model.n_layer=1099511627776")])
def test_a_config_of_the_wrong_shape_is_refused_by_its_schema(tiny_run, tmp_path, config, said):
    from engine.inference import load_run
    copy = edited(tiny_run, tmp_path, **{"config.json": config})
    with pytest.raises(AttnlabError) as err:
        load_run(copy)
    assert said in str(err.value) and "config.json" in str(err.value)


def test_a_name_in_state_json_that_leaves_the_checkpoint_is_never_read(tiny_run, tmp_path, monkeypatch):
    from engine import checkpoint
    from engine.inference import load_run
    outside = tmp_path / "secret.txt"
    outside.write_text("not the checkpoint's")
    digest = hashlib.sha256(outside.read_bytes()).hexdigest()
    read = []
    real = checkpoint.file_sha256
    monkeypatch.setattr(checkpoint, "file_sha256", lambda p: read.append(Path(p)) or real(p))
    for name in ("../../../../secret.txt", str(outside)):
        copy = edited(tiny_run, tmp_path / str(len(name)),
                      state=lambda s: {**s, "files": {**s["files"], name: digest}})
        with pytest.raises(AttnlabError) as err:
            load_run(copy)
        assert "state.json names" in str(err.value) and name in str(err.value)
        assert all(p.resolve().is_relative_to(copy.resolve()) for p in read), read


def bpe_json(tokens: int) -> str:
    vocab = {f"t{i}": i for i in range(tokens)}
    return json.dumps({"version": "1.0", "added_tokens": [], "normalizer": None,
                       "pre_tokenizer": None, "post_processor": None, "decoder": None,
                       "model": {"type": "BPE", "vocab": vocab, "merges": []}})


def test_a_tokenizer_past_the_vocabulary_is_refused_before_it_is_built(tiny_run, tmp_path, monkeypatch):
    """Building a tokenizer of a million tokens cost gigabytes before its ids were
    compared with the model's vocabulary; a file far larger than the vocabulary needs is
    refused by its size, unread."""
    from data.tokenizer import Tokenizer
    from engine.inference import load_run
    parsed = []
    real = Tokenizer.parse
    monkeypatch.setattr(Tokenizer, "parse", staticmethod(lambda *a: parsed.append(1) or real(*a)))
    copy = edited(tiny_run, tmp_path / "ids", **{"tokenizer.json": bpe_json(20_000)})
    with pytest.raises(AttnlabError) as err:
        load_run(copy)
    assert "token ids up to 19,999" in str(err.value) and "tokenizer.json" in str(err.value)
    assert parsed == []
    own = json.loads((tiny_run / "checkpoints" / "step_0000010" / "tokenizer.json").read_text())
    padded = json.dumps(own) + " " * (2 << 20)             # valid JSON, 2 MB of it blank
    copy = edited(tiny_run, tmp_path / "size", **{"tokenizer.json": padded})
    with pytest.raises(AttnlabError) as err:
        load_run(copy)
    assert "tokenizer.json" in str(err.value) and "more than the" in str(err.value)
    assert parsed == []


@pytest.mark.parametrize("entry", [["sample.py", "--max_new_tokens=20", "--run"],
                                   ["-m", "attnlab.heads", "grid", "--run"]])
def test_a_tokenizer_shorter_than_the_vocabulary_is_refused_with_its_path(tiny_run, tmp_path, entry):
    """A character tokenizer cut to 20 of its run's characters: sampling drew ids it
    has no character for and ended in a TypeError from decode. The run learned its
    tokenizer, so its model's vocabulary is exactly the tokenizer's."""
    copy = edited(tiny_run, tmp_path, **{"tokenizer.json": lambda t: {**t, "chars": t["chars"][:20]}})
    proc = run_script(*entry, copy, check=False, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "tokenizer.json has 20 tokens" in errors[0]
    assert str(copy) in errors[0]


def test_a_character_tokenizer_names_an_id_it_has_no_character_for():
    from common.errors import TokenizerError
    from data.tokenizer import CharTokenizer
    tok = CharTokenizer(set("ab"))
    assert tok.decode([1, 0]) == "ba"
    for wrong in ([2], [-1]):             # -1 would read the last character silently
        with pytest.raises(TokenizerError, match=f"token id {wrong[0]} is past"):
            tok.decode(wrong)
    assert tok.with_mask().decode([2]) == tok.with_mask().mask


def forged_train_state(run: Path, tmp_path: Path, change) -> Path:
    """A copy of `run` whose latest checkpoint's train_state.safetensors is `change`d
    (a function of its tensors, edited in place; or of them and state.json's dict), with
    the hashes recomputed."""
    from safetensors.torch import load_file, save_file
    copy = edited(run, tmp_path)
    ckpt = sorted((copy / "checkpoints").iterdir())[-1]
    tensors = load_file(ckpt / "train_state.safetensors")
    state = json.loads((ckpt / "state.json").read_text())
    change(tensors, state)
    save_file(tensors, ckpt / "train_state.safetensors")
    state["files"]["train_state.safetensors"] = hashlib.sha256(
        (ckpt / "train_state.safetensors").read_bytes()).hexdigest()
    (ckpt / "state.json").write_text(json.dumps(state))
    return copy


def first(tensors):
    """A moment of a vector parameter (a norm's gain: 32 wide in the tiny preset)."""
    return next(k for k in sorted(tensors) if k.endswith(".exp_avg") and tensors[k].dim() == 1)


def without(key):
    return lambda t, s: t.pop(first(t) if key == "exp_avg" else key)


@pytest.mark.parametrize("change, said, file", [
    (lambda t, s: t.update({first(t): torch.zeros(1)}), r"exp_avg is \(1,\) float32, not \(32,\) float32",
     "train_state.safetensors"),
    (lambda t, s: t.update({first(t): t[first(t)].double()}), r"exp_avg is \(32,\) float64, not \(32,\) "
     "float32", "train_state.safetensors"),
    (lambda t, s: t.update({"optim.adamw.0.step": torch.zeros(3)}), r"step is \(3,\) float32, not \(\) float32",
     "train_state.safetensors"),
    (without("exp_avg"), r"optim\.adamw\.\d+ lacks exp_avg", "train_state.safetensors"),
    (lambda t, s: t.update({"optim.adamw.999.exp_avg": torch.zeros(1)}),
     "optim.adamw.999.exp_avg is no tensor this model's optimizer keeps", "train_state.safetensors"),
    (lambda t, s: t.update({first(t): torch.full((32,), math.nan)}), "exp_avg holds NaN",
     "train_state.safetensors"),
    (without("rng.cpu"), "rng.cpu is missing", "train_state.safetensors"),
    (lambda t, s: t.update({"data.generator": t["data.generator"][:8]}),
     r"data.generator is \(8,\) torch.uint8, not a generator's state", "train_state.safetensors"),
    (lambda t, s: t.update({"data.generator": torch.zeros_like(t["data.generator"])}),
     "data.generator is a state torch refuses", "train_state.safetensors"),
    (lambda t, s: t.update({"rng.cpu": torch.zeros_like(t["rng.cpu"])}),
     "rng.cpu is a state torch refuses", "train_state.safetensors"),
    (lambda t, s: s["optimizer"]["adamw"]["param_groups"].reverse(),
     "adamw.param_groups does not hold this model's parameters", "state.json"),
    (lambda t, s: s["optimizer"]["adamw"]["plain_state"].update({"0": {"exp_avg": 1}}),
     "adamw.plain_state holds state that is not a tensor", "state.json"),
])
def test_a_forged_optimizer_state_is_refused_before_the_optimizer_gets_any_of_it(
        tiny_run, tmp_path, monkeypatch, change, said, file):
    """The hashes catch damage, not tampering: a moment of another shape was loaded and
    broadcast into every step; a missing one stopped the first step with KeyError:
    'exp_avg', a missing random stream the resume with KeyError: 'rng.cpu'."""
    from engine.optim import Optimizers
    from engine.resume import resume_config
    from engine.run import setup_run
    loaded = []
    monkeypatch.setattr(Optimizers, "load_state_dict", lambda self, state: loaded.append(state))
    copy = forged_train_state(tiny_run, tmp_path, change)
    cfg, run_dir, ckpt = resume_config(str(copy), str(copy.parent), {})
    with pytest.raises(AttnlabError) as err:
        setup_run(cfg, run_dir=run_dir, resume=ckpt, log=lambda *a: None)
    assert re.search(said, str(err.value)), str(err.value)
    assert str(ckpt / file) in str(err.value) and "corrupt or edited" in str(err.value)
    assert loaded == []


def test_a_forged_optimizer_state_is_one_error_line_from_train_py(tiny_run, tmp_path):
    copy = forged_train_state(tiny_run, tmp_path, without("exp_avg"))
    proc = run_script("train.py", "--resume", copy, "--train.max_iters=12", check=False, timeout=600)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert str(copy / "checkpoints" / "step_0000010" / "train_state.safetensors") in errors[0]


@pytest.mark.parametrize("name, kind, entry", [
    ("config.json", "folder", "train.py"),
    ("config.json", "named pipe", "train.py"),
    ("checkpoints/step_0000010/config.json", "named pipe", "train.py"),
    ("checkpoints/step_0000010/state.json", "folder", "train.py"),
    ("checkpoints/step_0000010/model.safetensors", "named pipe", "sample.py"),
    ("checkpoints/step_0000010/tokenizer.json", "folder", "sample.py"),
    ("metrics.jsonl", "named pipe", "train.py"),
    (".lock", "named pipe", "train.py"),
    ("best.json", "folder", "train.py"),
])
def test_a_run_file_that_is_not_a_plain_file_is_named_for_what_it_is(tiny_run, tmp_path, name, kind, entry):
    """A run's config.json that was a folder or a pipe was said to be missing, with a cp
    that cannot help; a pipe is never opened (the open would wait for a writer, here
    until the timeout), and the error names the path and what stands there."""
    import os
    copy = edited(tiny_run, tmp_path)
    path = copy / name
    path.unlink()
    path.mkdir() if kind == "folder" else os.mkfifo(path)
    cmd = ["train.py", "--resume", copy, "--train.max_iters=12"] if entry == "train.py" else \
        ["sample.py", "--run", copy, "--max_new_tokens=2"]
    proc = run_script(*cmd, check=False, timeout=600)    # a hang, not a busy machine
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"{path} is a {kind}, not a plain file" in errors[0], errors[0]
    assert "missing" not in errors[0]


def test_tokens_prepared_again_with_another_tokenizer_are_refused_on_resume(corpus, tmp_path, one_thread):
    """A token folder prepared again after the run started, from other text, holds a BPE
    vocabulary of the same size whose ids stand for other text: the resume went on
    training on it. The run records the fingerprint of its tokens' tokenizer; a resume
    in place or a branch is refused naming both, and no branch folder is left behind."""
    import data.build as build
    from common.errors import CheckpointError
    from data.sources import SourceSpec
    from engine import cli
    from engine.loop import train
    from engine.resume import resume_config
    from engine.run import setup_run
    text, tokens, quiet = corpus.read_text(), tmp_path / "tokens", lambda *a: None
    fingerprints = []
    for i, part in enumerate((text[:30_000], text[30_000:])):
        (tmp_path / f"{i}.txt").write_text(part)
        meta = build.prepare(SourceSpec(str(tmp_path / f"{i}.txt")), tokens, "bpe", 300, num_proc=1,
                             overwrite=bool(i), log=quiet, progress=False)
        fingerprints.append(meta["tokenizer_fingerprint"])
        if i == 0:
            cfg = cli.build("tiny", [f"--data.path={tokens}", f"--train.out_dir={tmp_path / 'runs'}",
                                     "--train.run_name=r", "--train.max_iters=4", "--train.eval_interval=2"])
            train(setup_run(cfg, log=quiet))
    assert fingerprints[0] != fingerprints[1] and meta["vocab_size"] == 300
    run_dir = tmp_path / "runs" / "r"
    for given in (run_dir, run_dir / "checkpoints" / "step_0000002"):
        cfg, target, ckpt = resume_config(str(given), str(run_dir.parent), {})
        with pytest.raises(CheckpointError) as err:
            setup_run(cfg, run_dir=target, resume=ckpt, log=quiet)
        said = str(err.value)
        assert f"{tokens.resolve()} holds tokens prepared with another tokenizer (fingerprint " \
               f"{fingerprints[1][:16]}) than {ckpt} was trained on ({tokens.resolve()}, fingerprint " \
               f"{fingerprints[0][:16]})" in said, said
        assert f"--train.init_from={ckpt}" in said
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["r"]


@pytest.mark.parametrize("name, replaced", [
    ("model.safetensors", {"model.safetensors": "not safetensors"}),
    ("train_state.safetensors", {"train_state.safetensors": "not safetensors"}),
    ("state.json", {"state": lambda s: {**s, "limit_s": "soon"}}),
    ("state.json", {"state": lambda s: {k: v for k, v in s.items() if k != "step"}}),
])
def test_each_checkpoint_refusal_names_the_file_it_is_about(tiny_run, tmp_path, name, replaced):
    """Several said `checkpoint DIR ...` and left the reader to guess which of its files."""
    from engine.resume import resume_config
    from engine.run import setup_run
    copy = edited(tiny_run, tmp_path, **replaced)
    with pytest.raises(AttnlabError) as err:
        cfg, run_dir, ckpt = resume_config(str(copy), str(copy.parent), {})
        setup_run(cfg, run_dir=run_dir, resume=ckpt, log=lambda *a: None)
    assert str(copy / "checkpoints" / "step_0000010" / name) in str(err.value), str(err.value)


def test_a_config_edited_to_a_huge_field_outside_the_old_list_is_refused_naming_it(tiny_run, tmp_path):
    """mlp_hidden (like mla_kv_rank, n_token_types, position_offset) was left out of the
    size check, and loading built a 10^11-row matrix: a RuntimeError traceback."""
    from engine.inference import load_run
    copy = edited(tiny_run, tmp_path, **{"config.json": lambda c: {
        **c, "model": {**c["model"], "mlp_hidden": 10 ** 11}}})
    with pytest.raises(AttnlabError) as err:
        load_run(copy)
    assert "too large for this machine" in str(err.value) and "config.json" in str(err.value)
    assert "mlp" in str(err.value)


@pytest.mark.parametrize("entry", [["sample.py", "--max_new_tokens=5", "--run"],
                                   ["-m", "attnlab.heads", "grid", "--text", "KING", "--run"]])
def test_a_tokenizer_whose_normalizer_panics_the_library_is_one_error_line(tiny_run, tmp_path, entry):
    """The run's characters in export's tokenizer.json form, cut by the byte-level
    pre-tokenizer after a Replace normalizer of an empty pattern: the Rust library
    panicked as the tokenizer was first used (a PanicException traceback). The file is
    refused before the library builds it."""
    from data.tokenizer import CharTokenizer
    from engine.interop import hf_tokenizer
    own = json.loads((tiny_run / "checkpoints" / "step_0000010" / "tokenizer.json").read_text())
    form = json.loads(hf_tokenizer(CharTokenizer(own["chars"])).backend_tokenizer.to_str())
    form["normalizer"] = {"type": "Replace", "pattern": {"Regex": ""}, "content": "x"}
    form["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                             "use_regex": True}
    copy = edited(tiny_run, tmp_path, **{"tokenizer.json": json.dumps(form)})
    proc = run_script(*entry, copy, check=False, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(errors) == 1 and "tokenizer.json" in errors[0] and "Replace" in errors[0]
    assert "panicked" not in proc.stderr


@pytest.mark.parametrize("model", [{"mechanism": "bogus"}, {"sparse_top_k": -3}])
def test_a_resume_names_the_checkpoint_whose_config_it_cannot_read(tiny_run, tmp_path, model):
    """As sampling from it does: the file, and the way on, not the field's complaint alone."""
    copy = edited(tiny_run, tmp_path, **{"config.json": lambda c: {**c, "model": {**c["model"], **model}}})
    proc = run_script("train.py", "--resume", copy, check=False, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert "config.json is an unreadable config" in errors[0] and str(copy) in errors[0]


def test_a_checkpoint_removed_while_read_is_said_to_be_so_not_damaged(tmp_path, monkeypatch):
    """A tool reading a run that is still training can find the checkpoint it chose gone
    (the trainer keeps only its newest): it says so and to run again, not that the
    checkpoint is damaged."""
    from engine import interop
    from model import ModelConfig
    ckpt = tmp_path / "run" / "checkpoints" / "step_0000020"
    ckpt.mkdir(parents=True)
    (ckpt / "tokenizer.json").write_text("{}")
    real = interop.read_bounded

    def gone(path, limit):
        shutil.rmtree(ckpt)                       # the trainer removes it meanwhile
        return real(path, limit)
    monkeypatch.setattr(interop, "read_bounded", gone)
    with pytest.raises(AttnlabError, match=r"was removed while it was read .*: run the command again"):
        interop.read_run_tokenizer(ckpt, ModelConfig(vocab_size=65))
    ckpt.mkdir(parents=True)
    monkeypatch.setattr(interop, "read_bounded", lambda path, limit: (_ for _ in ()).throw(
        PermissionError(13, "Permission denied")))
    with pytest.raises(AttnlabError, match=r"tokenizer file .*: Permission denied; the checkpoint is"):
        interop.read_run_tokenizer(ckpt, ModelConfig(vocab_size=65))
