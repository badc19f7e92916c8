"""Faults inside a run: a diverging loss, and experiment tracking with no network."""
import json
import math
import os
import shutil
import time

import pytest
import torch

from engine import checkpoint, cli
from engine.tracking import Metrics
from engine.loop import TrainingDiverged, train
from engine.run import setup_run


def make_trainer(corpus, tmp_path, *extra):
    cfg = cli.build("tiny", [f"--data.path={corpus}", f"--data.cache_dir={tmp_path / 'c'}",
                                f"--train.out_dir={tmp_path / 'runs'}", "--train.run_name=r", *extra])
    return setup_run(cfg, log=lambda *a: None)


@pytest.mark.parametrize("log_interval", [1, 10, 7])
def test_a_nan_loss_stops_the_run_naming_the_step_and_keeping_the_last_checkpoint(
        corpus, tmp_path, log_interval):
    """The step named is the one that diverged, whichever step logs next."""
    trainer = make_trainer(corpus, tmp_path, "--train.max_iters=40",
                           f"--train.log_interval={log_interval}")
    class Poisoned(torch.nn.Module):
        """The real model, whose training loss turns to NaN from the 16th step on."""

        def __init__(self, model):
            super().__init__()
            self.model, self.calls = model, 0

        def forward(self, x, y):
            out = self.model(x, y)
            self.calls += self.training
            return out._replace(loss=out.loss * math.nan) if self.calls > 15 else out

    trainer.train_forward = Poisoned(trainer.model)
    with pytest.raises(TrainingDiverged) as err:
        train(trainer)
    message = str(err.value)
    assert "nan at step 16" in message and "train.lr" in message and "float32" in message
    assert "step_0000010" in message
    last = checkpoint.resolve(trainer.run_dir)
    weights, _, _ = checkpoint.load(last)                       # still intact and loadable
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_gradient_norms_are_logged(corpus, tmp_path):
    trainer = make_trainer(corpus, tmp_path, "--train.max_iters=5")
    train(trainer)
    records = [json.loads(l) for l in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    norms = [r["grad_norm"] for r in records if "grad_norm" in r]
    assert len(norms) == 5 and all(n > 0 and math.isfinite(n) for n in norms)
    # Model FLOPs utilisation against this CPU's measured fp32 matmul peak.
    assert all(0 < r["mfu"] < 1 for r in records if "loss" in r)


def test_peak_flops_from_the_table_and_the_probe():
    from engine.device import mfu, peak_flops
    assert peak_flops("cuda", "bfloat16", "NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("cuda", "bfloat16", "Some Future GPU") is None
    cpu = peak_flops("cpu", "float32")
    assert 1e8 < cpu < 1e14
    assert mfu(1e6, 1e4, 1e11) == pytest.approx(0.1) and mfu(1e6, 1e4, None) is None


def test_the_cpu_probe_runs_once_per_machine_and_a_bad_cache_is_measured_again(tmp_path, monkeypatch):
    from engine import device
    tmp_path = tmp_path / "attnlab"                     # not there yet, as on a fresh machine
    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path))
    probes = []
    monkeypatch.setattr(device, "probe_cpu_flops", lambda name: probes.append(name) or (2.5e11, 0.0))
    device.peak_flops.cache_clear()
    assert device.peak_flops("cpu", "bfloat16") == 2.5e11 and probes == ["bfloat16"]
    device.peak_flops.cache_clear()                    # a new process: read from the file
    assert device.peak_flops("cpu", "bfloat16") == 2.5e11 and probes == ["bfloat16"]
    (tmp_path / "cpu_peak_flops.json").write_text("{not json")
    device.peak_flops.cache_clear()
    assert device.peak_flops("cpu", "bfloat16") == 2.5e11 and probes == ["bfloat16"] * 2
    device.peak_flops.cache_clear()


def test_a_peak_kept_at_one_instruction_set_is_not_used_at_another(tmp_path, monkeypatch):
    """A run held to AVX2 on an AVX-512 machine (bench/cpu_kinds.py's avx2 kind) measures
    its own peak instead of reusing the native one, and the native peak stays kept."""
    from engine import device

    def process(capability, **env):                           # a new process under env
        for name in device.ISA_SETTINGS:
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
        device.peak_flops.cache_clear()
        return device.peak_flops("cpu", "float32")

    taken = fake_probes(monkeypatch, tmp_path, (2e11, 0.0), (5e10, 0.0), (4e10, 0.0))
    assert process("AVX512") == 2e11
    assert process("AVX512", ONEDNN_MAX_CPU_ISA="AVX2", MKL_ENABLE_INSTRUCTIONS="AVX2") == 5e10
    assert process("AVX2", ATEN_CPU_CAPABILITY="avx2") == 4e10 and len(taken) == 3
    assert process("AVX512") == 2e11 and len(taken) == 3      # the native peak, from the file
    device.peak_flops.cache_clear()


def fake_probes(monkeypatch, tmp_path, *results):
    """Probes that return (FLOP/s, other programs' cores) from `results` in turn; the
    probes taken are counted in the returned list."""
    from engine import device
    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path))
    queue, taken = list(results), []
    monkeypatch.setattr(device, "probe_cpu_flops", lambda name: taken.append(name) or queue.pop(0))
    device.peak_flops.cache_clear()
    return taken


def test_a_probe_taken_while_other_programs_are_busy_is_not_kept(tmp_path, monkeypatch):
    """A busy probe serves its own process only; the kept peak is the highest quiet one."""
    from engine import device
    taken = fake_probes(monkeypatch, tmp_path, (8.5e9, 1.5), (8e10, 0.1), (7e10, 0.0), (1.2e11, 0.2))
    assert device.peak_flops("cpu", "float32") == 8.5e9         # busy: used now, not kept
    device.peak_flops.cache_clear()                            # the next process probes again
    assert device.peak_flops("cpu", "float32") == 8e10 and len(taken) == 2
    device.peak_flops.cache_clear()                            # quiet: kept
    assert device.peak_flops("cpu", "float32") == 8e10 and len(taken) == 2
    assert device.cpu_peak("float32", at_least=9e10) == 8e10    # a lower quiet probe: the peak stays
    assert device.cpu_peak("float32", at_least=9e10) == 1.2e11  # a higher one raises it
    device.peak_flops.cache_clear()
    assert device.peak_flops("cpu", "float32") == 1.2e11 and len(taken) == 4
    device.peak_flops.cache_clear()


def test_a_stale_peak_cannot_show_an_mfu_over_100_percent(tmp_path, monkeypatch):
    """A peak kept from a busier day is measured again once the model outruns it; if the
    new probe is no better (the machine is busy now), no MFU is shown rather than >100%."""
    from common.files import write_json_atomic
    from engine import device
    taken = fake_probes(monkeypatch, tmp_path, (8e10, 0.0), (8.5e9, 1.5))
    key = device.cpu_peak_key("float32")
    write_json_atomic(tmp_path / "cpu_peak_flops.json", {"format": 2, key: {"flops": 8.5e9, "other_cores": 0.0}})
    share = device.Utilisation("cpu", "float32")
    assert share(1e6, 4e4) == pytest.approx(4e10 / 8e10) and len(taken) == 1   # re-measured
    device.peak_flops.cache_clear()
    assert device.peak_flops("cpu", "float32") == 8e10                          # and kept
    write_json_atomic(tmp_path / "cpu_peak_flops.json", {"format": 2, key: {"flops": 8.5e9, "other_cores": 0.0}})
    device.peak_flops.cache_clear()
    share = device.Utilisation("cpu", "float32")
    assert share(1e6, 4e4) is None and len(taken) == 2       # busy again: nothing to show
    assert share(1e6, 4e4) is None and len(taken) == 2       # and not probed at every log line
    assert share(1e6, 4e3) == pytest.approx(4e9 / 8.5e9)
    device.peak_flops.cache_clear()


def test_a_run_shows_no_mfu_over_100_percent_from_a_peak_cached_under_load(corpus, tmp_path, monkeypatch):
    """The cache as a busy machine left it (a bare number of the first format, read low),
    then a real run: its MFU stays a share of what the CPU can do."""
    from engine import device
    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    keys = (device.cpu_peak_key(dtype) for dtype in ("float32", "bfloat16"))
    (tmp_path / "cache" / "cpu_peak_flops.json").write_text(json.dumps({key: 1e6 for key in keys}))
    device.peak_flops.cache_clear()
    trainer = make_trainer(corpus, tmp_path, "--train.max_iters=4", "--train.log_interval=1")
    train(trainer)
    device.peak_flops.cache_clear()
    records = [json.loads(l) for l in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    shown = [r["mfu"] for r in records if "mfu" in r]
    assert shown and all(0 < m <= 1 for m in shown)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mfu_is_against_the_peak_of_the_precision_the_run_computes_in(corpus, tmp_path, monkeypatch, dtype):
    from engine import device
    from engine.loop import Speedometer
    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path / "cache"))
    peaks = {"float32": 1e11, "bfloat16": 4e11}
    monkeypatch.setattr(device, "probe_cpu_flops", lambda name: (peaks[name], 0.0))
    device.peak_flops.cache_clear()
    trainer = make_trainer(corpus, tmp_path, f"--train.dtype={dtype}")
    speed = Speedometer(trainer)
    assert speed.utilisation.dtype_name == dtype and speed.utilisation.peak == peaks[dtype]
    device.peak_flops.cache_clear()


def test_wandb_offline_needs_no_network(corpus, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    trainer = make_trainer(corpus, tmp_path, "--train.max_iters=3", "--train.wandb=offline")
    train(trainer)
    assert list((trainer.run_dir / "wandb").glob("offline-run-*"))


def test_wandb_online_without_network_falls_back_to_offline(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    modes, lines = [], []

    class FakeRun:
        id = "abc"

        def log(self, *a, **k):
            pass

        def finish(self):
            pass

    def fake_init(mode, **kwargs):
        modes.append(mode)
        if mode == "online":
            raise wandb.errors.CommError("network is unreachable")
        return FakeRun()

    monkeypatch.setattr(wandb, "init", fake_init)
    metrics = Metrics(tmp_path, "online", "p", {}, "r", log=lines.append)
    assert modes == ["online", "offline"] and metrics.wandb_id == "abc"
    assert len(lines) == 1 and "offline" in lines[0]


def test_a_run_stops_when_it_reaches_the_target_val_loss(corpus, tmp_path):
    trainer = make_trainer(corpus, tmp_path, "--train.max_iters=200", "--train.eval_interval=10",
                           "--train.lr=3e-3", "--train.target_val_loss=3.3")
    result = train(trainer)
    reached = result["reached_target"]
    assert reached["val_loss"] <= 3.3 and reached["step"] < 200 and result["step"] == reached["step"]
    assert checkpoint.resolve(trainer.run_dir).name == f"step_{reached['step']:07d}"


def test_a_finished_run_is_not_overwritten_without_resume(corpus, tmp_path):
    from common.errors import CheckpointError
    train(make_trainer(corpus, tmp_path, "--train.max_iters=2"))
    with pytest.raises(CheckpointError, match="already holds checkpoints.*--resume"):
        make_trainer(corpus, tmp_path, "--train.max_iters=2")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="float16 autocast is for GPUs")
def test_float16_training_scales_its_loss_and_resumes_the_scaler(corpus, tmp_path):
    from engine.run import setup_run
    extra = ["--train.device=cuda", "--train.dtype=float16", "--train.max_iters=6",
             "--train.eval_interval=3"]
    run = make_trainer(corpus, tmp_path, *extra)
    assert run.scaler.is_enabled()
    train(run)
    scale = run.scaler.get_scale()
    cfg = cli.build("tiny", [f"--data.path={corpus}", f"--data.cache_dir={tmp_path / 'c'}",
                             f"--train.out_dir={tmp_path / 'runs'}", "--train.run_name=r", *extra])
    resumed = setup_run(cfg, resume=True, log=lambda *a: None)
    assert resumed.scaler.get_scale() == scale and resumed.progress.step == 6


@pytest.mark.parametrize("kind,width,expected", [
    ("avx512-bf16", 64, "bfloat16"), ("avx512-bf16", 48, "float32"), ("amx", 64, "bfloat16"),
    ("native-bf16", 128, "float32"), ("native-bf16", 256, "bfloat16"), ("no-bf16", 1024, "float32")])
def test_cpu_autocast_is_bf16_where_the_cpus_kind_says_it_pays(kind, width, expected, monkeypatch):
    """The measured rule, a fact of each kind: Zen 4 and AMX from 64 wide, another CPU
    with native bf16 from 256, never where bf16 would be emulated."""
    from engine import device, machine
    monkeypatch.setattr(machine, "cpu_kind_name", lambda flags=None: kind)
    assert device.pick_dtype("auto", torch.device("cpu"), width) == device.DTYPES[expected]


@pytest.mark.parametrize("preset", ["gpt-oss", "qwen3-next", "deepseek-v3", "deepseek-v3.2",
                                    "kimi-linear", "gemma3", "cpu"])
def test_a_mixture_of_experts_trains_in_fp32_on_a_cpu_where_a_dense_model_of_its_width_takes_bf16(
        preset, monkeypatch):
    """The cards with experts train faster in fp32 on a CPU (docs/after_the_article.md,
    "The cards' training time"): auto says so for them, in the engine, not in each preset,
    and the device line says why; a dense card of the same width keeps its kind's bf16, a
    GPU its bf16, and a precision named is kept."""
    from engine import device, machine
    from engine.cli import build
    monkeypatch.setattr(machine, "cpu_kind_name", lambda flags=None: "amx")
    cfg = build(preset, [])
    experts = machine.routes_experts(cfg.model)
    assert experts == (preset not in ("gemma3", "cpu"))
    assert cfg.train.dtype == "auto"
    cpu = torch.device("cpu")
    got = device.pick_dtype("auto", cpu, cfg.model.n_embd, experts=experts)
    assert got == (torch.float32 if experts else torch.bfloat16)
    assert device.pick_dtype("bfloat16", cpu, cfg.model.n_embd, experts=experts) == torch.bfloat16
    why = machine.why_dtype(cpu, got, "auto", cfg.model.n_embd, experts=experts)
    assert ("mixture of experts trains in fp32" in why) == experts
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert device.pick_dtype("auto", torch.device("cuda"), cfg.model.n_embd,
                             experts=experts) == torch.bfloat16


@pytest.mark.parametrize("kind,width,expected", [
    ("avx512-bf16", 384, "bfloat16"), ("avx512-bf16", 256, "float32"), ("amx", 384, "float32"),
    ("amx", 2048, "bfloat16"), ("no-bf16", 768, "float32")])
def test_cpu_sampling_holds_bf16_weights_only_where_decoding_gains(kind, width, expected, monkeypatch):
    """Decoding one token at a time gains from bf16 weights from 384 wide on Zen 4 only
    (4 x 128 decodes 1.7x faster in fp32), and on an AMX Xeon only at 2,048 (0.48x at
    384), whatever training autocasts to; an explicit precision is kept as asked."""
    from engine import device, machine
    monkeypatch.setattr(machine, "cpu_kind_name", lambda flags=None: kind)
    cpu = torch.device("cpu")
    assert device.pick_dtype("auto", cpu, width, decoding=True) == device.DTYPES[expected]
    assert device.pick_dtype("bfloat16", cpu, 64, decoding=True) == torch.bfloat16


def test_the_decode_probe_times_a_rows_product_at_the_models_width(monkeypatch):
    """What the decode precision was once timed for is now planned: the kind's width
    against the model's own, the same on a quiet machine and a busy one. Nothing is
    timed (the clock fails if read) and no product is computed (F.linear fails)."""
    from engine import machine
    monkeypatch.setattr(machine, "cpu_kind_name", lambda flags=None: "avx512-bf16")
    monkeypatch.setattr(time, "perf_counter", lambda: pytest.fail("the plan read the clock"))
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a: pytest.fail("a product ran"))
    start = machine.CPU_KINDS["avx512-bf16"].decode_bf16_from
    cpu = torch.device("cpu")
    planned = [machine.pick_dtype("auto", cpu, w, decoding=True) for w in (start - 1, start)]
    assert planned == [torch.float32, torch.bfloat16]


def test_sample_py_decodes_a_small_model_with_fp32_weights(corpus, tmp_path):
    """sample.py asks for the decoding precision, not training's: a 256-wide model
    (bf16 autocast in training on any CPU with native bf16) samples in fp32."""
    from conftest import run_script, train_tiny
    run = train_tiny(corpus, tmp_path, "w256", "--model.n_embd=256", "--model.n_head=4",
                     "--train.max_iters=2", "--train.eval_iters=1")
    proc = run_script("sample.py", "--run", run, "--max_new_tokens", "5")
    assert "float32 weights" in proc.stderr


def test_a_full_disk_while_logging_metrics_names_the_file_and_the_resume(corpus, tmp_path, monkeypatch):
    """The write was an OSError without a file name, said as "run the same command
    again", which then refuses the folder for its checkpoints."""
    import errno
    import builtins
    from common.errors import AttnlabError
    trainer = make_trainer(corpus, tmp_path, "--train.max_iters=20", "--train.eval_interval=10")
    real_open = builtins.open

    def full_disk(path, mode="r", *a, **k):
        handle = real_open(path, mode, *a, **k)
        if str(path).endswith("metrics.jsonl") and "a" in mode and checkpoint.list_checkpoints(trainer.run_dir):
            def no_room(_):
                raise OSError(errno.ENOSPC, "No space left on device")
            handle.write = no_room
        return handle
    monkeypatch.setattr(builtins, "open", full_disk)
    with pytest.raises(AttnlabError) as err:
        train(trainer)
    message = str(err.value)
    assert str(trainer.run_dir / "metrics.jsonl") in message and "No space left" in message
    assert f"python train.py --resume {trainer.run_dir}" in message


TIMES = ("tokens_per_s", "elapsed_s", "mfu")      # what differs from one run to the next


def logged(run_dir) -> list[dict]:
    """A run's metrics lines without the fields that measure time."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in TIMES} for row in rows]


def test_a_run_resumed_from_its_step_0_checkpoint_logs_what_one_straight_through_does(
        corpus, tmp_path, one_thread):
    """The evaluation at step 0 is the checkpoint's own, so the resume does not repeat it;
    its metrics line was dropped with the lines past the checkpoint, leaving the resumed
    run's log one evaluation short of the run's."""
    from engine.resume import resume_config
    straight = make_trainer(corpus, tmp_path / "a", "--train.max_iters=4", "--train.eval_interval=2")
    train(straight)
    copy = tmp_path / "b" / "r"
    shutil.copytree(straight.run_dir, copy)
    for later in checkpoint.list_checkpoints(copy)[1:]:     # killed while writing step 2's
        shutil.rmtree(later)
    cfg, run_dir, ckpt = resume_config(str(copy), str(copy.parent), {})
    assert ckpt.name == "step_0000000" and run_dir == copy
    train(setup_run(cfg, run_dir=run_dir, resume=ckpt, log=lambda *a: None))
    mine, theirs = logged(copy), logged(straight.run_dir)
    assert [(r["step"], sorted(r)) for r in mine] == [(r["step"], sorted(r)) for r in theirs]
    for resumed, whole in zip(mine, theirs):                # threads may sum in another order
        assert resumed == pytest.approx(whole, rel=1e-5, abs=0)


def test_a_runs_metrics_are_read_bounded_on_resume_and_branch(tmp_path, monkeypatch):
    """A resume keeps the metrics up to its checkpoint and a branch copies its parent's:
    both read the whole file, of any size. One past the bound is refused by its size,
    before it is read, naming it."""
    from common.errors import AttnlabError
    from engine import resume, tracking
    monkeypatch.setattr(tracking, "METRICS_LIMIT", 1000, raising=False)
    run = tmp_path / "r"
    run.mkdir()
    path = run / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0}) for s in range(40)]
    path.write_text("\n".join(lines[:3]) + "\n")
    Metrics(run, "disabled", "p", {}, "r").truncate_after(2)
    assert path.read_text() == "\n".join(lines[:2]) + "\n"
    path.write_text("\n".join(lines) + "\n")
    for read in (lambda: Metrics(run, "disabled", "p", {}, "r").truncate_after(2),
                 lambda: resume._branch_files(run, run / "checkpoints" / "step_0000002", tmp_path / "b")):
        with pytest.raises(AttnlabError, match=f"{path} is 1,\\d+ bytes, more than the 1,000 it may be"):
            read()


@pytest.mark.parametrize("where", ["write_run_files", "log"])
def test_a_sigterm_while_a_new_run_is_set_up_removes_its_folder_and_says_so(corpus, tmp_path, where):
    """SIGTERM (a scheduler's stop, `kill`) ended the process at once: a run folder made
    and not yet checkpointed was left with its config and tokenizer and no word of it,
    and the same command made a new one beside it. Now it is stopped as Ctrl-C is: the
    folder is removed, one line says so, and the status is 143 (128 + SIGTERM). The
    signal comes as the run's files are written, or just after (the set-up lines)."""
    import subprocess
    import sys
    from conftest import ROOT
    script = f"""
import os, runpy, signal, sys
import engine.run, engine.state
def then_terminated(original):
    def call(*a, **k):
        out = original(*a, **k)
        os.kill(os.getpid(), signal.SIGTERM)
        return out
    return call
if {where!r} == "write_run_files":
    engine.run.write_run_files = then_terminated(engine.run.write_run_files)
else:
    engine.state.Run.summary = then_terminated(engine.state.Run.summary)
sys.argv = ["train.py", "--config", "tiny", "--data.path={corpus}", "--data.cache_dir={tmp_path / 'cache'}",
            "--train.out_dir={tmp_path / 'runs'}", "--train.max_iters=4"]
runpy.run_path("train.py", run_name="__main__")
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 143, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "before the run had a checkpoint; its folder" in errors[0] and "was removed" in errors[0]
    assert list((tmp_path / "runs").iterdir()) == []
