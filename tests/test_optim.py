"""Optimizers (attnlab/optim.py): AdamW alone or Muon beside it, saved and resumed."""
import json

import pytest
import torch

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


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
def test_grouped_muon_steps_as_torchs_muon_does_and_shares_its_checkpoints(nesterov, adjust):
    """GroupedMuon batches the Newton-Schulz iterations of same-shape matrices; torch's
    own Muon, one matrix at a time, is the reference: the same parameters after every
    step (tall, wide and square matrices, two of a shape), and a state saved by one
    continues in the other."""
    from engine.optim import GroupedMuon
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

    theirs, _ = run(torch.optim.Muon, grads)
    ours, _ = run(GroupedMuon, grads)
    for p, q, p0 in zip(ours, theirs, start):
        moved = (q - p0).abs().max()
        assert moved > 1e-3
        assert (p - q).abs().max() <= 1e-2 * moved          # bf16 rounding at most
    half, state = run(torch.optim.Muon, grads[:3])
    resumed, _ = run(GroupedMuon, grads[3:], [torch.nn.Parameter(p.detach().clone()) for p in half], state)
    for p, q, h in zip(resumed, theirs, half):
        moved = (q - h).abs().max()
        assert moved > 1e-3 and (p - q).abs().max() <= 1e-2 * moved


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
