"""Optimizers (engine/optim.py): AdamW alone or Muon beside it, saved and resumed."""
import json

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from common.errors import ConfigError
from engine import cli
from engine.optim import configure_optimizer
from engine.loop import train
from engine.run import setup_run
from model import GPT, ModelConfig


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    model = GPT(ModelConfig(vocab_size=30, n_layer=2, n_head=2, n_embd=16, bias=True))
    t = cli.build(None, ["--train.optimizer=muon"]).train
    opt = configure_optimizer(model, t, torch.device("cpu"))
    muon = {id(p) for g in opt.named["muon"].param_groups for p in g["params"]}
    adamw = {id(p) for g in opt.named["adamw"].param_groups for p in g["params"]}
    assert not muon & adamw and muon | adamw == {id(p) for p in model.parameters()}
    assert id(model.blocks[0].attn.w_qkv.weight) in muon and id(model.wte.weight) in adamw
    assert all(p.dim() == 2 for g in opt.named["muon"].param_groups for p in g["params"])
    opt.set_lr(0.5)
    assert opt.named["muon"].param_groups[0]["lr"] == pytest.approx(t.muon_lr / 2)
    assert opt.named["adamw"].param_groups[0]["lr"] == pytest.approx(t.lr / 2)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
def test_grouped_muon_steps_as_torchs_muon_does_and_shares_its_checkpoints(nesterov, adjust, native,
                                                                           monkeypatch):
    """GroupedMuon batches the Newton-Schulz iterations of same-shape matrices; torch's
    own Muon, one matrix at a time, is the reference: the same parameters after every
    step (tall, wide and square matrices, two of a shape), and a state saved by one
    continues in the other. On a CPU with native bf16 both iterate in bf16; without it
    ours iterates in fp32, and so does the reference: torch's Muon with its one cast to
    bf16 (`grad.bfloat16()`) made an fp32 copy instead."""
    from engine.optim import GroupedMuon
    from engine import machine as precision
    monkeypatch.setattr(precision, "native_bf16", lambda: native)
    shapes = [(12, 8), (8, 12), (8, 8), (12, 8), (8, 12), (16, 8)]
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(6)]

    def run(cls, steps, params=None, state=None):
        params = params or [torch.nn.Parameter(p.clone()) for p in start]
        opt = cls(params, lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov,
                  adjust_lr_fn=adjust)
        if state is not None:
            opt.load_state_dict(state)
        for step_grads in steps:
            for p, grad in zip(params, step_grads):
                p.grad = grad.clone()
            opt.step()
        return params, opt.state_dict()

    # In bf16, its rounding at most (1% of the distance moved over six steps); in fp32,
    # fp32's (measured 6e-6), where bf16 iterations would be 2% off.
    tolerance = 1e-2 if native else 1e-4
    with pytest.MonkeyPatch.context() as reference:
        if not native:
            reference.setattr(torch.Tensor, "bfloat16", lambda t, *a, **k: t.clone())
        theirs, _ = run(torch.optim.Muon, grads)
        half, state = run(torch.optim.Muon, grads[:3])
    ours, _ = run(GroupedMuon, grads)
    for p, q, p0 in zip(ours, theirs, start):
        moved = (q - p0).abs().max()
        assert moved > 1e-3
        assert (p - q).abs().max() <= tolerance * moved
    resumed, _ = run(GroupedMuon, grads[3:], [torch.nn.Parameter(p.detach().clone()) for p in half], state)
    for p, q, h in zip(resumed, theirs, half):
        moved = (q - h).abs().max()
        assert moved > 1e-3 and (p - q).abs().max() <= tolerance * moved


def newton_schulz_float64(g: np.ndarray, coefficients, steps: int, eps: float) -> np.ndarray:
    """Jordan et al.'s quintic Newton-Schulz iteration for one wide matrix, in float64
    NumPy: X <- a·X + (b·A + c·A²)·X, A = X·Xᵀ, from X = G / max(‖G‖, eps)."""
    a, b, c = coefficients
    x = g / max(np.linalg.norm(g), eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x


def test_without_native_bf16_newton_schulz_is_fp32_to_its_float64_reference(monkeypatch):
    """On a CPU that would emulate bf16, the iterations run in fp32: equal to float64 to
    fp32's rounding (measured 1.5e-6 of the largest entry; bf16's would be 3.4e-2). With
    native bf16 they run in bf16, as torch's Muon does, within bf16's rounding."""
    from engine.optim import newton_schulz, newton_schulz_dtype
    from engine import machine as precision
    g = torch.randn(3, 8, 24, generator=torch.Generator().manual_seed(0))
    coefficients, steps, eps = (3.4445, -4.7750, 2.0315), 5, 1e-7
    ref = np.stack([newton_schulz_float64(m, coefficients, steps, eps) for m in g.double().numpy()])
    cpu = torch.device("cpu")
    for native, tolerance in ((False, 1e-5), (True, 6e-2)):
        monkeypatch.setattr(precision, "native_bf16", lambda: native)
        out = newton_schulz(g, coefficients, steps, eps, newton_schulz_dtype(cpu))
        assert out.dtype == (torch.bfloat16 if native else torch.float32)
        assert np.abs(out.double().numpy() - ref).max() <= tolerance * np.abs(ref).max()


class DtypeRecorder(TorchDispatchMode):
    """Every aten op that runs, by name, with the dtypes of its tensors in and out."""

    def __init__(self):
        super().__init__()
        self.ops: dict[str, set] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        self.ops.setdefault(func.overloadpacket.__name__, set()).update(t.dtype for t in tensors)
        return out


MATMULS = {"mm", "bmm", "baddbmm", "addmm", "addbmm", "matmul", "linear"}


@pytest.mark.parametrize("native", [False, True])
def test_without_native_bf16_a_training_step_runs_no_bf16_matmul(native, corpus, tmp_path, monkeypatch):
    """A CPU that would emulate bf16 (forced here, whatever this one is): two training
    steps with Muon and the precision left to auto, 256 wide (where a CPU with native bf16
    autocasts to bf16), evaluation included, run no op in bf16 at all, matmuls above all:
    the layers, attention and Muon's Newton-Schulz iterations are fp32. With native bf16
    forced on, the same recorder sees bf16 matmuls in the layers and in Newton-Schulz."""
    import engine.device
    from engine import machine as precision
    monkeypatch.setattr(precision, "native_bf16", lambda: native)
    monkeypatch.setattr(engine.device, "peak_flops", lambda *a: None)   # no matmul probe
    cfg = cli.build("tiny", [f"--data.path={corpus}", f"--data.cache_dir={tmp_path / 'c'}",
                             f"--train.out_dir={tmp_path / 'r'}", "--train.run_name=bf16",
                             "--train.optimizer=muon", "--train.max_iters=2", "--train.eval_iters=1",
                             "--model.n_layer=1", "--model.n_embd=256", "--model.n_head=8",
                             "--model.block_size=16", "--train.batch_size=2"])
    run = setup_run(cfg, log=lambda *a, **k: None)
    with DtypeRecorder() as recorder:
        train(run)
    ran = {op for op in MATMULS if op in recorder.ops}
    assert {"mm", "baddbmm"} <= ran                # the layers' and Newton-Schulz's matmuls
    in_bf16 = {op for op, dtypes in recorder.ops.items() if torch.bfloat16 in dtypes}
    if native:
        assert {"mm", "baddbmm"} <= in_bf16
    else:
        assert not in_bf16, sorted(in_bf16)


def _losses(run_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_training_learns_and_resumes_exactly(optimizer, corpus, tmp_path):
    def cfg(name, steps):
        return cli.build("tiny", [f"--data.path={corpus}", f"--data.cache_dir={tmp_path / 'c'}",
                                     f"--train.out_dir={tmp_path / 'r'}", f"--train.run_name={name}",
                                     f"--train.optimizer={optimizer}", f"--train.max_iters={steps}"])
    quiet = dict(log=lambda *a, **k: None)
    train(setup_run(cfg("straight", 20), **quiet))
    first = setup_run(cfg("split", 20), **quiet)
    forward = first.train_forward

    def stop_after_ten(x, y):                 # as Ctrl-C would: save at step 10 and stop
        if first.progress.step == 9:
            first.stop_signal = "test"
        return forward(x, y)
    first.train_forward = stop_after_ten
    assert train(first)["interrupted"]
    train(setup_run(cfg("split", 20), run_dir=tmp_path / "r" / "split", resume=True, **quiet))
    straight, split = _losses(tmp_path / "r" / "straight"), _losses(tmp_path / "r" / "split")
    assert straight == split
    assert straight[20] < straight[1] - 0.3


def test_the_schedule_warms_up_linearly_then_decays_by_cosine_to_min_lr():
    """The first step already learns (lr/W, not 0), step W-1 reaches the peak, the
    cosine is half-way at the middle of the decay and ends at min_lr."""
    import math
    from engine.loop import lr_at
    t = cli.build("tiny", ["--train.lr=1e-3", "--train.min_lr=1e-4", "--train.warmup_iters=10",
                           "--train.max_iters=110"]).train
    assert lr_at(0, t) == pytest.approx(1e-4) and lr_at(4, t) == pytest.approx(5e-4)
    assert lr_at(9, t) == pytest.approx(1e-3) and lr_at(10, t) == pytest.approx(1e-3)
    assert lr_at(60, t) == pytest.approx((1e-3 + 1e-4) / 2)
    assert lr_at(35, t) == pytest.approx(1e-4 + 0.5 * (1 + math.cos(math.pi / 4)) * 9e-4)
    assert lr_at(110, t) == pytest.approx(1e-4) and lr_at(500, t) == pytest.approx(1e-4)


def test_warmup_stable_decay_holds_the_peak_then_falls_in_a_straight_line():
    """wsd with decay_frac 0.2 over 100 steps after a warm-up of 10: the peak until
    step 90, then linear to min_lr at 110 (half-way at 100), min_lr after."""
    from engine.loop import lr_at
    t = cli.build("tiny", ["--train.lr=1e-3", "--train.min_lr=1e-4", "--train.warmup_iters=10",
                           "--train.max_iters=110", "--train.schedule=wsd",
                           "--train.decay_frac=0.2"]).train
    assert lr_at(9, t) == pytest.approx(1e-3) and lr_at(10, t) == pytest.approx(1e-3)
    assert lr_at(89, t) == pytest.approx(1e-3) and lr_at(90, t) == pytest.approx(1e-3)
    assert lr_at(95, t) == pytest.approx(1e-4 + 0.75 * 9e-4)
    assert lr_at(100, t) == pytest.approx((1e-3 + 1e-4) / 2)
    assert lr_at(110, t) == pytest.approx(1e-4) and lr_at(500, t) == pytest.approx(1e-4)
    with pytest.raises(ConfigError, match="decay_frac"):
        cli.build("tiny", ["--train.decay_frac=0"])


def test_muons_momentum_warms_up_from_085_in_a_straight_line(corpus, tmp_path):
    """muon_momentum_warmup 4 to 0.95: 0.85 + 0.025 s at step s < 4 (by hand), then 0.95,
    in the group Muon steps with; AdamW's betas stay as they were."""
    cfg = cli.build("tiny", [f"--data.path={corpus}", f"--data.cache_dir={tmp_path / 'c'}",
                             f"--train.out_dir={tmp_path / 'r'}", "--train.run_name=m",
                             "--train.optimizer=muon", "--train.max_iters=6",
                             "--train.muon_momentum_warmup=4"])
    run = setup_run(cfg, log=lambda *a, **k: None)
    seen, forward = [], run.train_forward
    muon, adamw = run.optimizer.named["muon"], run.optimizer.named["adamw"]
    run.train_forward = lambda x, y: seen.append(muon.param_groups[0]["momentum"]) or forward(x, y)
    train(run)
    assert seen == pytest.approx([0.85, 0.875, 0.9, 0.925, 0.95, 0.95])
    assert adamw.param_groups[0]["betas"] == (cfg.train.beta1, cfg.train.beta2)
    with pytest.raises(ConfigError, match="muon_momentum_warmup"):
        cli.build("tiny", ["--train.muon_momentum_warmup=-1"])


def test_a_stop_at_an_evaluation_step_is_evaluated_on_resume(corpus, tmp_path):
    """Ctrl-C during the step that makes an evaluation due: the run saves and stops
    before evaluating, and the resumed run evaluates that step first."""
    def cfg():
        return cli.build("tiny", [f"--data.path={corpus}", f"--data.cache_dir={tmp_path / 'c'}",
                                  f"--train.out_dir={tmp_path / 'r'}", "--train.run_name=s",
                                  "--train.max_iters=20", "--train.eval_interval=10"])
    first = setup_run(cfg(), log=lambda *a, **k: None)
    forward = first.train_forward

    def stop_in_step_ten(x, y):
        if first.progress.step == 9:
            first.stop_signal = "test"
        return forward(x, y)
    first.train_forward = stop_in_step_ten
    assert train(first)["interrupted"]
    evaluated = lambda: [json.loads(l)["step"] for l in (tmp_path / "r" / "s" / "metrics.jsonl")
                         .read_text().splitlines() if "val_loss" in l]
    assert evaluated() == [0]                              # stopped before evaluating step 10
    train(setup_run(cfg(), run_dir=tmp_path / "r" / "s", resume=True, log=lambda *a, **k: None))
    assert evaluated() == [0, 10, 20]


def test_the_batch_ramp_grows_the_batch_from_a_quarter_to_all_of_it(corpus, tmp_path):
    """batch_ramp 0.5 over 20 steps at batch 8: round(8 * (1/4 + 3/4 * s/10)) sequences
    at step s < 10 (worked out by hand below), then 8; the model sees exactly those, the
    first of each drawn batch."""
    cfg = cli.build("tiny", [f"--data.path={corpus}", f"--data.cache_dir={tmp_path / 'c'}",
                             f"--train.out_dir={tmp_path / 'r'}", "--train.run_name=ramp",
                             "--train.batch_size=8", "--train.max_iters=20",
                             "--train.batch_ramp=0.5", "--train.log_interval=1"])
    run = setup_run(cfg, log=lambda *a, **k: None)
    seen, forward = [], run.train_forward
    run.train_forward = lambda x, y: seen.append(x.shape[0]) or forward(x, y)
    train(run)
    assert seen == [2, 3, 3, 4, 4, 5, 6, 6, 7, 7] + [8] * 10
    with pytest.raises(ConfigError, match="batch_ramp"):
        cli.build("tiny", ["--train.batch_ramp=1"])


def test_the_ramped_batch_is_the_head_of_the_batch_the_run_would_draw(corpus, tmp_path):
    """Slicing, not a new draw: step s trains on the first sequences of the batch a run
    without the ramp trains on at step s, so resuming and the data order stay as before."""
    def batches(*extra):
        cfg = cli.build("tiny", [f"--data.path={corpus}", f"--data.cache_dir={tmp_path / 'c'}",
                                 f"--train.out_dir={tmp_path / 'r'}", "--train.batch_size=8",
                                 "--train.max_iters=6", *extra])
        run = setup_run(cfg, log=lambda *a, **k: None)
        seen, forward = [], run.train_forward
        run.train_forward = lambda x, y: seen.append(x.clone()) or forward(x, y)
        train(run)
        return seen
    plain, ramped = batches("--train.run_name=a"), batches("--train.run_name=b", "--train.batch_ramp=0.5")
    assert [len(x) for x in ramped] == [2, 4, 6, 8, 8, 8]
    assert all(torch.equal(r, p[:len(r)]) for r, p in zip(ramped, plain))
