"""train.py and sample.py end to end, as a user runs them (subprocesses), plus the
promises about runs: exact resume, Ctrl-C, atomic checkpoints, clear refusals."""
import json
import os
import pickle
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine import checkpoint
from common.errors import CheckpointError
from conftest import ROOT, run_script


def tiny_args(corpus, out, name, *extra):
    return ["train.py", "--config", "tiny", f"--data.path={corpus}",
            f"--data.cache_dir={out / 'cache'}", f"--train.out_dir={out / 'runs'}",
            f"--train.run_name={name}", *extra]


def losses(run_dir: Path) -> dict:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            out[rec["step"]] = (rec["loss"], rec["grad_norm"], rec["lr"])
    return out


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("trained")
    proc = run_script(*tiny_args(corpus, out, "run"))
    return out, out / "runs" / "run", proc


def test_train_runs_end_to_end_and_writes_a_run_directory(trained):
    out, run_dir, proc = trained
    assert "parameters" in proc.stdout and "MFLOPs per token" in proc.stdout
    assert "config:" in proc.stdout and " n_layer=2 " in proc.stdout                 # the resolved config is printed
    ckpts = checkpoint.list_checkpoints(run_dir)
    assert [p.name for p in ckpts] == ["step_0000000", "step_0000010", "step_0000020"]
    files = {p.name for p in ckpts[-1].iterdir()}
    assert files == {"model.safetensors", "train_state.safetensors", "state.json",
                     "config.json", "tokenizer.json"}
    assert json.loads((run_dir / "config.json").read_text())["model"]["vocab_size"] > 10
    records = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {r["step"] for r in records if "val_loss" in r} == {0, 10, 20}
    assert all("val_bpb" in r for r in records if "val_loss" in r)
    assert len(losses(run_dir)) == 20
    assert checkpoint.latest_run(out / "runs", log=lambda line: None) == run_dir


def test_the_model_line_says_what_auto_attention_became_as_the_device_line_does(trained):
    """The model line said `auto attention` while the device line said `attention eager`:
    it names the kernel the device line names (whatever this machine chose)."""
    import re
    _, _, proc = trained
    device = next(l for l in proc.stdout.splitlines() if l.startswith("device: "))
    model = next(l for l in proc.stdout.splitlines() if l.startswith("model: "))
    kernel = re.search(r", attention ([a-z]+)[;,]", device).group(1)
    assert f", auto attention ({kernel} on this machine: see device): " in model


def test_sample_streams_text_from_the_run(trained):
    _, run_dir, _ = trained
    # 4 + 28 tokens fill the context (32) exactly: within it, cached and uncached decoding
    # see the same tokens, so greedy text is the same by design (past it they differ:
    # the cache re-reads the newest half, the uncached path slides one token at a time).
    proc = run_script("sample.py", "--run", run_dir, "--prompt", "KING", "--max_new_tokens", "28",
                      "--temperature", "0")
    assert proc.stdout.startswith("KING") and len(proc.stdout.rstrip("\n")) == 32
    again = run_script("sample.py", "--run", run_dir, "--prompt", "KING", "--max_new_tokens", "28",
                       "--temperature", "0", "--use_cache", "false")
    assert again.stdout == proc.stdout
    explained = run_script("sample.py", "--run", run_dir, "--explain", "--max_new_tokens", "3")
    assert explained.stdout.count("<- chosen") == 3 and "step 3:" in explained.stdout
    two = run_script("sample.py", "--run", run_dir, "--num_samples", "2", "--max_new_tokens", "20",
                     "--top_p", "0.9", "--top_k", "5")
    assert two.stdout.count("--- sample") == 2
    # The preallocated cache (the step CUDA graphs replay) samples the same text.
    static = run_script("sample.py", "--run", run_dir, "--num_samples", "2", "--max_new_tokens",
                        "20", "--top_p", "0.9", "--top_k", "5", "--decode", "static")
    assert static.stdout == two.stdout and "decode static" in static.stderr


def test_sample_says_bf16_weights_are_emulated_in_the_words_training_uses(trained, monkeypatch):
    """Held to AVX2 (as on a CPU without native bf16), bf16 asked for by name is kept,
    and sample.py's line says what it costs as train.py's set-up line does."""
    from engine import machine
    _, run_dir, _ = trained
    proc = run_script("sample.py", "--run", run_dir, "--dtype", "bfloat16", "--max_new_tokens", "2",
                      env={"ATEN_CPU_CAPABILITY": "avx2"})
    monkeypatch.setattr(machine, "native_bf16", lambda: False)
    cpu = torch.device("cpu")
    note = machine.why_dtype(cpu, torch.bfloat16, "bfloat16", 32, "sample.dtype")
    assert f"bfloat16 weights{note}, attention" in proc.stderr
    assert note.replace("sample.dtype", "train.dtype") == machine.why_dtype(
        cpu, torch.bfloat16, "bfloat16", 32)
    assert "emulated: this CPU has no native bf16" in note and "sample.dtype=auto" in note


def test_sample_explains_bad_prompts_and_options(trained):
    _, run_dir, _ = trained
    bad = run_script("sample.py", "--run", run_dir, "--prompt", "€uro", check=False)
    assert bad.returncode == 2 and "'€'" in bad.stderr and "Traceback" not in bad.stderr
    for args, text in [(["--top_p", "0"], "top_p"), (["--temperature", "-1"], "temperature"),
                       (["--run", run_dir / "nope"], "nope: no run, checkpoint or transformers folder there")] + \
            ([] if torch.cuda.is_available() else [(["--decode", "graph"], "CUDA device")]):
        proc = run_script("sample.py", "--run", run_dir, *map(str, args), check=False)
        assert proc.returncode == 2 and text in proc.stderr and "Traceback" not in proc.stderr


def test_resume_continues_from_the_saved_step(trained, corpus, tmp_path):
    out, run_dir, _ = trained
    proc = run_script("train.py", "--resume", run_dir, "--train.max_iters=30",
                      f"--train.out_dir={out / 'runs'}")
    assert "from step_0000020 (step 20)" in proc.stdout
    assert checkpoint.list_checkpoints(run_dir)[-1].name == "step_0000030"
    assert sorted(losses(run_dir)) == list(range(1, 31))


def test_resume_refuses_a_different_model(trained):
    _, run_dir, _ = trained
    proc = run_script("train.py", "--resume", run_dir, "--model.n_layer=3", check=False)
    assert proc.returncode == 2 and "model.n_layer: 2 -> 3" in proc.stderr
    # init_from keeps the source's shape, so for a size it is no way on; a new run is.
    assert "--train.init_from=" not in proc.stderr and "a model of another n_layer starts from scratch" in proc.stderr
    proc = run_script("train.py", "--resume", run_dir, "--model.attention=eager", check=False)
    assert proc.returncode == 2 and "model.attention: " in proc.stderr
    assert "--train.init_from=" in proc.stderr        # the way on from these weights, as safety.md says


def _start(args, env=None):
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def _wait_for_step(run_dir: Path, step: int, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        try:
            if max(losses(run_dir), default=0) >= step:
                return True
        except (OSError, ValueError):
            pass
        time.sleep(0.005)
    return False


# fp32 named: at 64 wide `auto` weighs a timed probe on a CPU with native bf16, and two
# fresh runs beside other tests' work could choose differently before any resume.
SLOW = ["--model.n_embd=64", "--train.batch_size=16", "--model.dropout=0.1",
        "--train.max_iters=120", "--train.eval_interval=15", "--train.dtype=float32"]


def test_killed_run_resumes_with_exactly_the_same_losses(corpus, tmp_path):
    run_script(*tiny_args(corpus, tmp_path, "straight", *SLOW))
    reference = losses(tmp_path / "runs" / "straight")
    rng = random.Random()
    for attempt in range(3):
        name = f"killed{attempt}"
        kill_at = rng.randint(20, 100)
        proc = _start(tiny_args(corpus, tmp_path, name, *SLOW))
        reached = _wait_for_step(tmp_path / "runs" / name, kill_at, proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if reached and proc.returncode == -signal.SIGKILL:
            break
    else:
        pytest.fail("could not kill the run in flight")
    run_dir = tmp_path / "runs" / name
    resumed = run_script("train.py", "--resume", run_dir)
    assert "resuming" in resumed.stdout
    assert losses(run_dir) == reference          # bitwise: loss, gradient norm, learning rate


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_saves_a_checkpoint_and_says_how_to_resume(corpus, tmp_path, signum):
    """Ctrl-C or a SIGTERM (a scheduler's stop) saves where it stopped, and the exit
    status is the shell's 128 + the signal: 130 and 143."""
    proc = _start(tiny_args(corpus, tmp_path, "int", *SLOW))
    run_dir = tmp_path / "runs" / "int"
    assert _wait_for_step(run_dir, 20, proc)
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum, stderr
    assert "--resume" in stdout
    step = int(checkpoint.list_checkpoints(run_dir)[-1].name.split("_")[1])
    assert step >= 20 and step % 15 != 0      # saved where it stopped, not at an eval


def test_a_second_ctrl_c_during_the_save_keeps_the_last_checkpoint_and_names_the_run(corpus, tmp_path):
    """The second Ctrl-C stops at once, in the middle of the save the first one began: the
    half-written checkpoint is dropped and the line says which run to resume from where
    (it used to be the generic "run the same command again")."""
    script = (
        "import os, signal, sys\n"
        "import engine.checkpoint as c, engine.loop as loop\n"
        "real_stop, real_write, saving = loop.stop_on_signal, c.save_file, []\n"
        "def stop(*a, **k):\n"
        "    saving.append(1)\n"
        "    return real_stop(*a, **k)\n"
        "def write(tensors, path, *a, **k):\n"
        "    real_write(tensors, path, *a, **k)\n"
        "    if saving: os.kill(os.getpid(), signal.SIGINT)\n"
        "loop.stop_on_signal, c.save_file = stop, write\n"
        "sys.argv = ['train.py'] + sys.argv[1:]\n"
        "import runpy; runpy.run_path('train.py', run_name='__main__')\n")
    run_dir = tmp_path / "runs" / "twice"
    proc = _start(["-c", script, *tiny_args(corpus, tmp_path, "twice", *SLOW)[1:]])
    assert _wait_for_step(run_dir, 20, proc)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    kept = checkpoint.list_checkpoints(run_dir)
    assert kept and int(kept[-1].name.split("_")[1]) % 15 == 0      # an evaluation's, not the cut one
    assert stderr.splitlines()[-1] == (
        f"error: interrupted; stopped at once, nothing half-written was kept; python train.py "
        f"--resume {run_dir} continues from its last checkpoint, {kept[-1].name}")
    checkpoint.load(kept[-1])
    assert "resuming" in run_script("train.py", "--resume", run_dir).stdout


def test_a_kill_during_a_checkpoint_write_keeps_the_previous_one(corpus, tmp_path):
    # Kill the process (SIGKILL, no clean-up) half way through writing its second checkpoint.
    script = (
        "import os, signal, sys\n"
        "import engine.checkpoint as c\n"
        "real, calls = c.save_file, []\n"
        "def dying(tensors, path, *a, **k):\n"
        "    calls.append(path)\n"
        "    real(tensors, path, *a, **k)\n"
        "    if len(calls) == 3: os.kill(os.getpid(), signal.SIGKILL)\n"
        "c.save_file = dying\n"
        "sys.argv = ['train.py'] + sys.argv[1:]\n"
        "import runpy; runpy.run_path('train.py', run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", script, *tiny_args(corpus, tmp_path, "k")[1:]],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    run_dir = tmp_path / "runs" / "k"
    assert [p.name for p in checkpoint.list_checkpoints(run_dir)] == ["step_0000000"]
    assert list((run_dir / "checkpoints").glob(".tmp-*"))          # the half-written one
    checkpoint.load(checkpoint.resolve(run_dir))                    # the previous one loads
    resumed = run_script("train.py", "--resume", run_dir)
    assert "step_0000000" in resumed.stdout
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))


def test_only_the_last_k_and_the_best_are_kept(corpus, tmp_path):
    run_script(*tiny_args(corpus, tmp_path, "keep", "--train.max_iters=50", "--train.keep_last=2",
                          "--train.lr=3e-3"))
    run_dir = tmp_path / "runs" / "keep"
    names = [p.name for p in checkpoint.list_checkpoints(run_dir)]
    best = json.loads((run_dir / "best.json").read_text())
    assert names[-2:] == ["step_0000040", "step_0000050"]
    assert f"step_{best['step']:07d}" in names and len(names) <= 3


def test_corrupt_checkpoints_are_refused_naming_the_file(trained, tmp_path):
    import shutil
    _, run_dir, _ = trained
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint.list_checkpoints(run_dir)[-1], ckpt)
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])             # truncated
    proc = run_script("sample.py", "--run", ckpt, check=False)
    assert proc.returncode == 2 and str(weights) in proc.stderr and "Traceback" not in proc.stderr
    (ckpt / "state.json").write_text("{")
    with pytest.raises(CheckpointError, match="state.json"):
        checkpoint.load(ckpt)


class _Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ.get('EXPLOIT_MARKER', '/tmp/attnlab-pwned')}",))


def test_a_planted_pickle_is_never_executed(trained, tmp_path, monkeypatch):
    import hashlib
    import shutil
    _, run_dir, _ = trained
    marker = tmp_path / "pwned"
    monkeypatch.setenv("EXPLOIT_MARKER", str(marker))
    ckpt = tmp_path / "evil"
    shutil.copytree(checkpoint.list_checkpoints(run_dir)[-1], ckpt)
    payload = pickle.dumps(_Exploit())
    (ckpt / "model.safetensors").write_bytes(payload)
    state = json.loads((ckpt / "state.json").read_text())
    state["files"]["model.safetensors"] = hashlib.sha256(payload).hexdigest()   # hash passes
    (ckpt / "state.json").write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match="cannot be read as safetensors"):
        checkpoint.load(ckpt)
    assert not marker.exists()


def test_no_code_path_unpickles():
    for path in [*ROOT.glob("*.py"), *ROOT.glob("model/*.py"), *ROOT.glob("attnlab/*.py"),
                 *ROOT.glob("data/*.py")]:
        text = path.read_text()
        assert "pickle.load" not in text, path
        for line in text.splitlines():
            if "torch.load(" in line:
                assert "weights_only=True" in line, (path, line)


def test_missing_run_and_corpus_get_one_clear_line(tmp_path):
    proc = run_script("train.py", "--config", "tiny", f"--data.path={tmp_path / 'none.txt'}",
                      check=False)
    assert proc.returncode == 2 and "none.txt not found" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run_script("train.py", "--resume", tmp_path / "norun", check=False)
    assert proc.returncode == 2 and "norun does not exist, nor a run of that name in runs/; give a run directory or its name" in proc.stderr
    short = tmp_path / "short.txt"
    short.write_text("To be, or not to be.\n")
    proc = run_script("train.py", "--config", "tiny", f"--data.path={short}",
                      f"--data.cache_dir={tmp_path}", check=False)
    assert proc.returncode == 2 and "too few" in proc.stderr


def test_unknown_option_fails_before_any_work(tmp_path):
    proc = run_script("train.py", "--model.attn=eager", f"--train.out_dir={tmp_path}", check=False)
    assert proc.returncode == 2 and "did you mean 'attention'" in proc.stderr
    assert not (tmp_path / "LATEST").exists()


def test_a_run_given_as_sample_takes_it_is_answered_with_resume_and_init_from_in_one_short_line(tmp_path):
    """`--resume --run runs/X` was answered with a did-you-mean of --train.run_name and all
    of train.py's options, 2,700 characters; an unknown option of a parser this large
    gets its close match (if any) and --help, not the list."""
    for argv, said in ((["--resume", "--run", "runs/X"], "error: unknown option --run: train.py "
                        "takes a run to continue as --resume RUN_DIR, and a run, checkpoint or "
                        "transformers folder to start from as --init_from SRC"),
                       (["--resum", "runs/X"], "error: unknown option --resum (did you mean "
                        "'--resume'?); see python train.py --help for its "),
                       (["--bogus"], "error: unknown option --bogus; see python train.py --help")):
        proc = run_script("train.py", *argv, f"--train.out_dir={tmp_path}", check=False)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(said), lines
        assert len(lines[0]) < 200 and "valid choices" not in lines[0]


def test_help_lists_options():
    proc = run_script("train.py", "--help")
    assert "--model.position" in proc.stdout and "--resume" in proc.stdout
    proc = run_script("sample.py", "--help")
    assert "--sample.temperature" in proc.stdout and "--sample.explain" in proc.stdout


def test_ctrl_c_while_sampling_ends_the_text_line_and_says_so_with_status_130(trained):
    _, run_dir, _ = trained
    proc = _start(["sample.py", "--run", str(run_dir), "--max_new_tokens", "100000"])
    assert proc.stdout.read(1)                       # the text has begun to stream
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert stdout.endswith("\n") and stderr.splitlines()[-1] == (
        "error: interrupted; sampling stopped; run the same command again for the whole text")
