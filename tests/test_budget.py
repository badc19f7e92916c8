"""train.py --budget: measure, choose a size by tokens per parameter, stop on time."""
import json
import math
import re
import time

import pytest
import torch

from engine import cli
from engine.budget import TOKENS_PER_PARAM, budget_seconds, candidates, choose, parse_duration
from common.errors import ConfigError
from conftest import run_script
from test_train import tiny_args


def test_durations_parse_and_nonsense_is_refused():
    assert parse_duration("5m") == 300 and parse_duration("90s") == 90
    assert parse_duration("1h30m") == 5400 and parse_duration("300") == 300
    for bad in ("5 minutes", "m5", "", "1x"):
        with pytest.raises(ConfigError, match="not a duration"):
            parse_duration(bad)


def test_the_choice_is_the_size_nearest_the_compute_optimal_ratio():
    cfg = cli.build("cpu", [])
    cfg.model.vocab_size = 65
    cands = candidates(cfg.model)
    assert [c.params for c in cands] == sorted(c.params for c in cands)
    chosen = []
    for seconds in (60, 600, 6000, 60000):
        pick = choose(cands, 1e11, seconds)
        distance = [abs(math.log(c.ratio / TOKENS_PER_PARAM)) for c in cands]
        assert abs(math.log(pick.ratio / TOKENS_PER_PARAM)) == min(distance)
        assert pick.tokens == pytest.approx(1e11 / pick.flops_per_token * seconds)
        chosen.append(pick.params)
    assert chosen == sorted(chosen) and chosen[0] < chosen[-1]   # more time, larger model


def test_a_probe_under_load_is_taken_again_and_the_faster_kept():
    """Other programs' load while the machine is measured would choose a smaller model
    for the whole run: the probe is taken again once, and load through both is said."""
    from engine.machine import Reading
    from engine.budget import probe_again_if_busy

    def machine(loads):
        """Readings 1 s apart on 2 cores, this process using one core, others `loads`."""
        busy, total, own, t = 0, 0, 0.0, 0.0
        yield Reading(t, busy, total, own)
        for load in loads:
            t, own, total, busy = t + 1, own + 1, total + 200, busy + int(100 * (1 + load))
            yield Reading(t, busy, total, own)
            yield Reading(t, busy, total, own)       # the next probe starts where this ended

    for loads, rates, kept, probes, said in [
            ([0.0], [5.0, 9.0], 5.0, 1, False),        # quiet: one probe
            ([1.0, 0.0], [2.0, 5.0], 5.0, 2, False),   # a burst: again, the faster kept
            ([1.0, 1.0], [2.0, 1.5], 2.0, 2, True)]:   # busy throughout: said
        read, said_lines, taken = machine(loads).__next__, [], []

        def probe():
            taken.append(rates[len(taken)])
            return taken[-1], 0.0
        assert probe_again_if_busy(probe, said_lines.append, read, cores=2)[0] == kept
        assert len(taken) == probes and bool(said_lines) == said
    assert said_lines[0].startswith("budget: other programs held 1.0 of 2 cores")


def test_a_budget_run_plans_explains_and_stops_on_time(corpus, tmp_path):
    # The clock starts in train.py's main; the interpreter's start-up comes on top, and on
    # a busy machine it alone can take many seconds, so it is measured, not assumed. The
    # budget grows with it: the tokenizing and the probe before training slow down alike,
    # and a budget they use up is refused ("leaves 0 s to train"), which is right, but not
    # what this test asks.
    started = time.perf_counter()
    run_script("train.py", "--help")
    startup = time.perf_counter() - started
    budget = max(25, round(12 * startup))
    started = time.perf_counter()
    proc = run_script(*tiny_args(corpus, tmp_path, "budget", "--budget", f"{budget}s"))
    wall = time.perf_counter() - started
    out = proc.stdout + proc.stderr
    assert "tokens/param" in out and "<- chosen" in out and "chosen:" in out
    assert wall < budget + startup + max(6, 2 * startup), out[-2000:]
    run_dir = tmp_path / "runs" / "budget"
    records = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last_step = max(r["step"] for r in records)
    evals = [r for r in records if "val_loss" in r]
    assert evals[-1]["step"] == last_step and len(evals) >= 3
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["train"]["time_limit"] > 0 and saved["train"]["max_iters"] >= last_step


def test_budget_cannot_resume_and_says_what_stops_a_resume_on_time():
    """It said only that the two cannot be combined, not what does the job instead."""
    proc = run_script("train.py", "--budget", "5m", "--resume", check=False)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "error: --budget plans a new run, and a resumed run keeps its model; to stop it on "
        "time give --train.time_limit=SECONDS instead (the seconds trained in all, counted "
        "over resumes)")
    proc = run_script("train.py", "--budget", "5m", check=False, env={"WORLD_SIZE": "2"})
    assert proc.returncode == 2 and "under torchrun give the model and train.max_iters" in proc.stderr


def test_under_a_time_limit_the_schedule_follows_the_clock():
    from engine.loop import lr_at, scheduled_lr
    t = cli.build("tiny", ["--train.max_iters=100", "--train.warmup_iters=10",
                           "--train.time_limit=60"]).train
    assert scheduled_lr(0, 0.5, t) == pytest.approx(lr_at(50, t))     # half the time gone
    assert scheduled_lr(80, 0.5, t) == pytest.approx(lr_at(80, t))    # steps ahead: steps rule
    t.time_limit = 0
    assert scheduled_lr(0, 0.5, t) == pytest.approx(lr_at(0, t))      # no limit: clock ignored
    assert lr_at(50, t) < lr_at(10, t)


def test_a_run_under_a_time_limit_passes_the_share_of_time_used(corpus, tmp_path, monkeypatch):
    """The loop hands train_step the share of train.time_limit spent so far."""
    import engine.loop as loop
    from engine.run import setup_run
    cfg = cli.build("tiny", [f"--data.path={corpus}", f"--data.cache_dir={tmp_path / 'c'}",
                             f"--train.out_dir={tmp_path / 'runs'}", "--train.max_iters=3",
                             "--train.time_limit=600", "--train.run_name=t"])
    seen, real = [], loop.train_step
    monkeypatch.setattr(loop, "train_step", lambda run, used: seen.append(used) or real(run, used))
    loop.train(setup_run(cfg, log=lambda *a: None))
    assert len(seen) == 3 and 0 < seen[0] <= seen[1] <= seen[2] < 0.5


@pytest.mark.parametrize("limit", [0.0, 1e-6])
def test_only_the_last_evaluation_reads_final_eval_iters(limit, corpus, tmp_path, monkeypatch):
    """At max_iters, or when the time limit stops the run, the evaluation reads
    train.final_eval_iters batches; the ones before, train.eval_iters."""
    import engine.loop as loop
    from engine.run import setup_run
    cfg = cli.build("tiny", [f"--data.path={corpus}", f"--data.cache_dir={tmp_path / 'c'}",
                             f"--train.out_dir={tmp_path / 'runs'}", "--train.max_iters=4",
                             "--train.eval_interval=2", "--train.eval_iters=2",
                             "--train.final_eval_iters=3", f"--train.time_limit={limit}",
                             "--train.run_name=t"])
    seen, real = [], loop.evaluate
    monkeypatch.setattr(loop, "evaluate", lambda *a, **k: seen.append(a[4]) or real(*a, **k))
    loop.train(setup_run(cfg, log=lambda *a: None))
    assert seen == ([2, 2, 3] if not limit else [3])


def test_a_slow_machine_halves_the_batch_and_evaluation_keeps_to_its_share(corpus, tmp_path, monkeypatch):
    """With the machine measured at 1 step/s, a 2-minute budget fits too few steps for
    warm-up and decay: the batch halves until at least MIN_STEPS fit, and all the
    evaluations together stay within EVAL_SHARE of the budget."""
    import time
    import engine.budget as budget
    monkeypatch.setattr(budget, "measure", lambda cfg, device, dtype, seconds, *data: 1.0)
    cfg = cli.build("cpu", [f"--data.path={corpus}", f"--data.cache_dir={tmp_path / 'c'}",
                            "--train.batch_size=64"])
    planned = budget.plan(cfg, 120.0, time.perf_counter(), log=lambda *a: None).train
    assert planned.batch_size < 64 and planned.max_iters >= budget.MIN_STEPS
    assert planned.batch_size >= budget.MIN_BATCH
    eval_step_s = 1.0 / planned.grad_accum / 3 * planned.batch_size / 64   # a smaller batch, a cheaper one
    batches = planned.final_eval_iters + (budget.EVALS - 1) * planned.eval_iters
    assert batches * eval_step_s <= budget.EVAL_SHARE * 120.0
    assert 2 <= planned.eval_iters <= planned.final_eval_iters
    assert planned.eval_interval * (budget.EVALS - 1) >= planned.max_iters
    # Halving the batch keeps the sequences the last evaluation reads: the whole split, or
    # what half the share afforded at the batch of 64.
    from data.tokens import load_tokens
    n_val = len(load_tokens(str(corpus), "char", cache_dir=str(tmp_path / "c"), log=lambda *a: None).val)
    at_64 = min(math.ceil(n_val / (64 * cfg.model.block_size)),
                int(budget.EVAL_SHARE * 120.0 / 2 * 3))
    assert planned.final_eval_iters * planned.batch_size == max(2, at_64) * 64


def test_where_it_is_affordable_each_evaluation_reads_the_whole_validation_split(corpus, tmp_path,
                                                                                   monkeypatch):
    import time
    import engine.budget as budget
    from data.tokens import load_tokens
    monkeypatch.setattr(budget, "measure", lambda cfg, device, dtype, seconds, *data: 50.0)
    cfg = cli.build("cpu", [f"--data.path={corpus}", f"--data.cache_dir={tmp_path / 'c'}",
                            "--train.eval_iters=2"])
    planned = budget.plan(cfg, 120.0, time.perf_counter(), log=lambda *a: None)
    n_val = len(load_tokens(str(corpus), "char", cache_dir=str(tmp_path / "c"), log=lambda *a: None).val)
    per_batch = planned.train.batch_size * planned.model.block_size
    assert n_val > 2 * per_batch                       # more than the preset's 2 batches read
    assert n_val <= planned.train.final_eval_iters * per_batch < n_val + per_batch
    # The evaluations before it read a sample: their time goes to training.
    assert planned.train.eval_iters == max(2, int(planned.train.final_eval_iters * budget.BETWEEN_SHARE))
    assert planned.train.eval_iters < planned.train.final_eval_iters


@pytest.mark.parametrize("kind", ["avx512-bf16", "no-bf16"])
def test_the_plan_records_the_kinds_precision_in_the_config(kind, corpus, tmp_path, monkeypatch):
    """The plan times sizes, not precisions: the precision is the CPU kind's for the
    chosen width, written into the config, so the run it plans is reproducible."""
    import time
    import engine.budget as budget
    from engine import machine
    monkeypatch.setattr(machine, "cpu_kind_name", lambda flags=None: kind)
    monkeypatch.setattr(machine, "native_bf16", lambda: machine.CPU_KINDS[kind].native_bf16)
    timed = []
    monkeypatch.setattr(budget, "measure", lambda cfg, dev, dtype, seconds, *data:
                        timed.append(dtype) or 20.0)
    cfg = cli.build("cpu", [f"--data.path={corpus}", f"--data.cache_dir={tmp_path / 'c'}",
                            "--train.device=cpu"])
    planned = budget.plan(cfg, 120.0, time.perf_counter(), log=lambda line: None)
    expected = machine.pick_dtype("auto", torch.device("cpu"), planned.model.n_embd)
    assert planned.train.dtype == str(expected).removeprefix("torch.")
    assert timed[-1] == expected                         # the chosen model, in its precision


def test_the_probe_times_real_text_with_the_vocabulary_ranked(corpus, tmp_path, monkeypatch):
    """An adaptive readout's tail works for rare tokens only, so uniformly random tokens
    (mostly rare in a large vocabulary) would time it far too slow: the probe gets a batch
    of the training text and the training split's token counts."""
    import time
    from collections import Counter
    import engine.budget as budget
    seen = []
    monkeypatch.setattr(budget, "measure", lambda cfg, dev, dtype, seconds, batch=None, counts=None:
                        seen.append((batch, counts)) or 20.0)
    cfg = cli.build("cpu", [f"--data.path={corpus}", f"--data.cache_dir={tmp_path / 'c'}"])
    budget.plan(cfg, 120.0, time.perf_counter(), log=lambda *a: None)
    from data.tokenizer import Tokenizer
    text = corpus.read_text()
    train_text = text[:int(len(text) * (1 - cfg.data.val_fraction))]
    tok = Tokenizer.load(next((tmp_path / "c").rglob("tokenizer.json")).parent)
    expected = dict(Counter(train_text))
    assert len(seen) >= 2
    for batch, counts in seen:
        x, y = batch
        assert x.shape == (cfg.train.batch_size, cfg.model.block_size)
        assert torch.equal(x[:, 1:], y[:, :-1])                  # text, next token as target
        assert tok.decode(x[0].tolist()) in train_text
        assert {tok.decode([i]): int(n) for i, n in enumerate(counts) if n} == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_probe_times_the_attention_kernel_the_run_runs(dtype, monkeypatch):
    """The run sets its model's backend for the machine (engine.machine.fit_attention: the
    formula in bf16 on AMX); the probe once timed the model's default instead: on the Xeon it measured
    16 steps/s where the run made 29, and chose sizes for the slower machine."""
    import engine.budget as budget
    from engine import machine
    from model import GPT
    kernels = []
    real_step = GPT.forward

    def forward(self, *args, **kwargs):
        kernels.append(self.blocks[0].attn.kernel)
        return real_step(self, *args, **kwargs)
    monkeypatch.setattr(GPT, "forward", forward)
    cfg = cli.build("tiny", [])
    cfg.model.vocab_size = 65
    budget.measure(cfg, torch.device("cpu"), dtype, 0.0)
    model = GPT(cfg.model)
    machine.fit_attention(model, cfg.model, torch.device("cpu"), dtype)
    assert kernels and all(k is model.blocks[0].attn.kernel for k in kernels)


class Reached(Exception):
    """Raised where the work begins: what came before it refused nothing."""


def budget_main(monkeypatch, *argv) -> list:
    """train.py's main in this process, stopped where the plan would begin (by tokenizing
    the data); whether each call of it was given a readout."""
    import engine.budget as budget
    import train
    seen = []

    def plan(cfg, budget_s, started, given=None):
        seen.append(any(k in (given or {}).get("model", {}) for k in budget.READOUT_OPTIONS))
        raise Reached
    monkeypatch.setattr(budget, "plan", plan)
    with pytest.raises(Reached):
        train.main(["--config", "tiny", *argv])
    return seen


@pytest.mark.parametrize("value, says", [
    ("-5s", "'-5s' is not a duration"), ("999999h", "'999999h' is not a duration"),
    ("1e9s", "'1e9s' is not a duration"), ("8d", "'8d' is not a duration"),
    ("0s", "a budget of 0 s is too short"), ("5", "a budget of 5 s is too short to measure this machine and train; give at least 8 s "),
    ("0.5s", "a budget of 0.5 s is too short")])
def test_a_budget_no_plan_can_come_of_is_refused_before_any_work(value, says, monkeypatch):
    with pytest.raises(ConfigError, match=says):
        budget_main(monkeypatch, "--budget", value)
    budget_main(monkeypatch, "--budget", "1m")
    budget_main(monkeypatch, "--budget", "8s")             # the least it says it takes
    assert parse_duration("168h") == 7 * 24 * 3600          # a week is the longest


def test_a_budget_with_its_unit_apart_is_read_as_one_duration(monkeypatch):
    """`--budget 30 s`: argparse alone would refuse the unit as an unknown argument."""
    budget_main(monkeypatch, "--budget", "30", "s")
    with pytest.raises(ConfigError, match="a budget of 5 s is too short"):
        budget_main(monkeypatch, "--budget", "5", "s")


def test_options_the_plan_sets_are_refused_next_to_budget_and_the_rest_are_kept(monkeypatch):
    with pytest.raises(ConfigError) as refused:
        budget_main(monkeypatch, "--budget", "1m", "--train.max_iters=5", "--model.n_layer=7",
                    "--train.batch_size=4")
    message = str(refused.value)
    assert "--model.n_layer and --train.max_iters cannot be given with it" in message
    assert "batch_size" not in message and "\n" not in message
    import engine.budget as budget
    for name in budget.PLANNED:
        section, _, key = name.partition(".")
        with pytest.raises(ConfigError, match=f"--{name} cannot be given"):
            budget_seconds("1m", {section: {key: "3"}})
    # What the plan honours reaches the plan: the batch and warm-up as upper bounds, the
    # precision, and a readout named on the command line, which the plan then keeps.
    assert budget_main(monkeypatch, "--budget", "1m", "--train.batch_size=4", "--train.warmup_iters=3",
                       "--train.dtype=float32", "--train.log_interval=5",
                       "--model.block_size=32") == [False]
    assert budget_main(monkeypatch, "--budget", "1m", "--model.readout=full") == [True]


def test_a_named_readout_is_kept_by_the_plan(corpus, tmp_path, monkeypatch):
    """The plan chooses the output layer only where the command line named none."""
    import engine.budget as budget
    monkeypatch.setattr(budget, "measure", lambda cfg, device, dtype, seconds, *data: 20.0)
    chose = []
    monkeypatch.setattr(budget, "choose_readout", lambda model_cfg, counts, log: chose.append(1))
    for given in (False, True):
        cfg = cli.build("cpu", [f"--data.path={corpus}", f"--data.cache_dir={tmp_path / 'c'}"])
        budget.plan(cfg, 120.0, time.perf_counter(), log=lambda *a: None,
                    given={"model": {"readout": "full"}} if given else None)
    assert chose == [1]


class FakeClock:
    """A clock that moves only when a training step runs: `step_s` per step."""

    def __init__(self, start=0.0, step_s=1.0):
        self.t, self.step_s = start, step_s

    def __call__(self):
        return self.t


def timed_steps(monkeypatch, clock, stop_after=None, fake=False):
    """engine.loop.train_step advancing `clock` by its step_s; the shares of the time
    limit it is given, in `used`; after `stop_after` steps, a Ctrl-C."""
    import engine.loop as loop
    real, used = loop.train_step, []

    def step(run, share):
        used.append(share)
        clock.t += clock.step_s
        if stop_after is not None and len(used) == stop_after:
            run.stop_signal = 2
        if fake:
            return torch.tensor(1.0), torch.tensor(1.0), run.cfg.train.batch_size
        return real(run, share)
    monkeypatch.setattr(loop, "train_step", step)
    return used


def evaluated_steps(run_dir):
    return [r["step"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "val_loss" in r]


def limited_cfg(corpus, tmp_path, *extra):
    return cli.build("tiny", [f"--data.path={corpus}", f"--data.cache_dir={tmp_path / 'c'}",
                              f"--train.out_dir={tmp_path / 'runs'}", "--train.run_name=t",
                              "--train.eval_iters=2", "--train.warmup_iters=2", *extra])


def test_a_resumed_run_continues_its_time_limit(corpus, tmp_path, monkeypatch):
    """Stopped after 4 of its 10 seconds, a resumed run trains the 6 left, with the
    schedule and the evaluations where they were; a checkpoint from before the clock was
    saved still resumes, with the whole limit again."""
    import shutil
    import engine.loop as loop
    from engine.resume import resume_config
    from engine.run import setup_run
    cfg = limited_cfg(corpus, tmp_path, "--train.time_limit=10", "--train.max_iters=1000",
                      "--train.eval_interval=500")
    clock = FakeClock()
    timed_steps(monkeypatch, clock, stop_after=4)
    run = setup_run(cfg, log=lambda *a: None)
    assert loop.train(run, now=clock)["interrupted"] and run.progress.step == 4
    old = tmp_path / "old"
    shutil.copytree(run.run_dir, old / "runs" / "t")
    clock = FakeClock(start=500.0)            # another process: its clock starts anywhere
    used = timed_steps(monkeypatch, clock)
    cfg, run_dir, ckpt = resume_config(str(run.run_dir), str(tmp_path / "runs"), {})
    result = loop.train(setup_run(cfg, run_dir=run_dir, resume=ckpt, log=lambda *a: None), now=clock)
    assert result["out_of_time"] and result["step"] == 10
    assert used == pytest.approx([0.4, 0.5, 0.6, 0.7, 0.8, 0.9])
    assert evaluated_steps(run.run_dir) == [0, 5, 10]         # half the limit, and the end
    # A checkpoint without the clock's seconds (older code wrote none) starts it again.
    state_file = sorted((old / "runs" / "t" / "checkpoints").glob("step_*"))[-1] / "state.json"
    state = json.loads(state_file.read_text())
    del state["limit_s"], state["last_eval_s"]
    state_file.write_text(json.dumps(state))
    clock = FakeClock()
    used = timed_steps(monkeypatch, clock)
    cfg, run_dir, ckpt = resume_config(str(old / "runs" / "t"), str(old / "runs"), {})
    result = loop.train(setup_run(cfg, run_dir=run_dir, resume=ckpt, log=lambda *a: None),
                        now=clock)
    assert result["out_of_time"] and result["step"] == 14 and used[0] == 0.0


def test_a_corrupt_clock_in_a_checkpoint_is_refused_with_its_path(corpus, tmp_path, monkeypatch):
    import engine.loop as loop
    from common.errors import CheckpointError
    from engine.resume import resume_config
    from engine.run import setup_run
    cfg = limited_cfg(corpus, tmp_path, "--train.max_iters=2", "--train.eval_interval=2")
    run = setup_run(cfg, log=lambda *a: None)
    loop.train(run)
    state_file = next((run.run_dir / "checkpoints").glob("step_*2")) / "state.json"
    state = json.loads(state_file.read_text())
    state["limit_s"] = "soon"
    state_file.write_text(json.dumps(state))
    cfg, run_dir, ckpt = resume_config(str(run.run_dir), str(tmp_path / "runs"), {"train": {"max_iters": "3"}})
    with pytest.raises(CheckpointError, match=re.escape(f"{state_file.parent} records limit_s=\"soon\"")):
        setup_run(cfg, run_dir=run_dir, resume=ckpt, log=lambda *a: None)


@pytest.mark.parametrize("limit", [0, 10])
def test_under_a_time_limit_evaluations_fall_at_even_shares_of_it(limit, corpus, tmp_path, monkeypatch):
    """With max_iters a ceiling far off, 10 one-second steps under a 10 s limit are
    evaluated at a third and two thirds of the time (eval_interval is a third of the
    schedule's steps) and at the end; without a limit, every eval_interval steps."""
    import engine.loop as loop
    from engine.run import setup_run
    steps = "1000" if limit else "6"
    interval = "334" if limit else "2"
    cfg = limited_cfg(corpus, tmp_path, f"--train.time_limit={limit}", f"--train.max_iters={steps}",
                      f"--train.eval_interval={interval}")
    clock = FakeClock()
    timed_steps(monkeypatch, clock)
    run = setup_run(cfg, log=lambda *a: None)
    loop.train(run, now=clock)
    assert evaluated_steps(run.run_dir) == ([0, 4, 7, 10] if limit else [0, 2, 4, 6])


def test_a_budget_run_uses_its_time_when_the_probe_is_several_times_too_slow(corpus, tmp_path,
                                                                             monkeypatch):
    """The probe says 4 steps/s and the steps come at 20/s: the run trains to the time
    limit, not to a max_iters the probe set, with the evaluations spread over the time
    and the schedule's warm-up the share of it that it was planned to be."""
    import engine.budget as budget
    import engine.loop as loop
    from engine.run import setup_run
    monkeypatch.setattr(budget, "measure", lambda cfg, device, dtype, seconds, *data: 4.0)
    cfg = cli.build("cpu", [f"--data.path={corpus}", f"--data.cache_dir={tmp_path / 'c'}",
                            f"--train.out_dir={tmp_path / 'runs'}", "--train.run_name=b"])
    lines = []
    cfg = budget.plan(cfg, 120.0, time.perf_counter(), log=lines.append)
    t = cfg.train
    planned = int(re.search(r"about (\d+) steps", lines[-1]).group(1))
    assert t.max_iters == planned * budget.CEILING and f"up to {t.max_iters}" in lines[-1]
    assert t.warmup_iters == max(1, min(50, planned // 10)) * budget.CEILING   # cpu's 50: a bound
    assert t.log_interval == max(1, min(10, planned // 20))
    monkeypatch.setattr(loop, "evaluate", lambda *a, **k: 1.0)
    clock = FakeClock(step_s=0.05)
    used = timed_steps(monkeypatch, clock, fake=True)
    run = setup_run(cfg, log=lambda *a: None)
    result = loop.train(run, now=clock)
    assert t.batch_size == 16                                # not halved: 4 steps/s is enough
    assert result["out_of_time"] and abs(result["step"] - t.time_limit / 0.05) <= 1
    assert result["step"] > 3 * planned                      # planned: 1.2 times what was measured
    evals = evaluated_steps(run.run_dir)
    assert len(evals) == budget.EVALS
    assert [round(s / result["step"], 2) for s in evals] == pytest.approx([0, 1 / 3, 2 / 3, 1], abs=0.02)
    warm = next(i for i, share in enumerate(used) if loop.schedule_step(i, share, t) >= t.warmup_iters)
    assert warm / len(used) == pytest.approx(t.warmup_iters / t.max_iters, abs=0.01)


def test_a_budget_reads_the_text_in_passes_and_decays_over_the_run_unless_told_otherwise(
        corpus, tmp_path, monkeypatch):
    import time
    import engine.budget as budget
    monkeypatch.setattr(budget, "measure", lambda cfg, device, dtype, seconds, *data: 50.0)
    for given, sampling, decay, mix in (
            ([], "epochs", 1.0, 4),
            (["--data.sampling=random", "--train.decay_frac=0.6", "--model.token_mix=0"], "random", 0.6, 0)):
        cfg = cli.build("cpu", [f"--data.path={corpus}", f"--data.cache_dir={tmp_path / 'c'}", *given])
        lines = []
        planned = budget.plan(cfg, 120.0, time.perf_counter(), log=lines.append,
                              given={"data": {"sampling": "random"}, "train": {"decay_frac": "0.6"},
                                     "model": {"token_mix": "0"}} if given else None)
        assert (planned.data.sampling, planned.train.decay_frac) == (sampling, decay)
        assert planned.model.token_mix == mix
        chosen = next(line for line in lines if line.startswith("chosen:"))
        assert ("in passes" if sampling == "epochs" else "at random") in chosen
        # What the plan set beyond the sizes is said, with what each does; what the
        # command line gave is not.
        said = [line for line in lines if line.startswith("set for a budget run")]
        if given:
            assert said == []
        else:
            assert len(said) == 1 and all(f in said[0] for f in (
                "data.sampling=epochs (the text read in passes", "train.decay_frac=1.0",
                "model.token_mix=4 (each token mixed with the 3 before it"))
    # A cosine schedule has no decay_frac to set: the config shows the preset's.
    cfg = cli.build("tiny", [f"--data.path={corpus}", f"--data.cache_dir={tmp_path / 'c'}"])
    assert cfg.train.schedule == "cosine"
    assert budget.plan(cfg, 120.0, time.perf_counter(), log=lambda *a: None).train.decay_frac == \
        cli.build("tiny", []).train.decay_frac
    # Without --budget: random windows as nanoGPT reads, the preset's decay over the last 60%.
    assert (cli.build("cpu", []).data.sampling, cli.build("cpu", []).train.decay_frac) == ("random", 0.6)
    assert cli.build("cpu", []).model.token_mix == 0


# -- the memory bound: every field that sizes a tensor, counted on the built shapes --

HUGE = 10 ** 11
SIZING_FIELDS = [                    # (the field, what else it needs)
    ("mla_kv_rank", ["--model.mechanism=mla"]),
    ("mla_rope_dim", ["--model.mechanism=mla"]),
    ("n_token_types", []),
    ("position_offset", ["--model.position=learned"]),
    ("mlp_hidden", []),
    ("indexer_heads", ["--model.mechanism=sparse"]),
    ("indexer_dim", ["--model.mechanism=sparse", "--model.position=none"]),   # RoPE: 16 at least
]


@pytest.mark.parametrize("field, needs", SIZING_FIELDS, ids=[f for f, _ in SIZING_FIELDS])
def test_the_memory_bound_counts_every_field_that_sizes_a_tensor(field, needs, monkeypatch):
    """A field the bound left out built a tensor of 10^11 rows and died of the allocation
    with a traceback: the bound is the built model's own count, so each is refused."""
    from engine import budget
    monkeypatch.setattr(budget, "available_bytes", lambda device: 8 << 30)
    cfg = cli.build("tiny", needs + [f"--model.{field}={HUGE}"])
    # The field's tensor is named, or the T x T maps it makes (a sparse layer's indexer heads).
    with pytest.raises(ConfigError, match=r"GiB free; (the weights and their optimizer state are .*; "
                                          r"the largest tensor is \S+, [0-9, x]*[0-9]{3},[0-9]{3},[0-9]{3},[0-9]{3}"
                                          r"|the attention maps \([0-9,]{15,} of them .*model.indexer_heads\))"):
        budget.refuse_what_cannot_fit(cfg, torch.device("cpu"))
    small = cli.build("tiny", needs + [f"--model.{field}=4"])
    budget.refuse_what_cannot_fit(small, torch.device("cpu"))        # a small one trains


@pytest.mark.parametrize("args,dominant,shrink", [
    (["--model.block_size=100000"], r"the attention maps \(4 of them across the layers, each "
     r"100,000 x 100,000 scores: model.block_size squared, at batch 8\) are 1.49e\+03 GiB of it",
     "make model.block_size (the maps grow as its square) or train.batch_size smaller, or keep "
     "fewer maps (model.n_head)"),
    (["--train.batch_size=1000000"], r"the activations backward keeps \(2 layers x 32 positions",
     "make model.block_size, train.batch_size, model.n_layer or model.n_embd smaller")])
def test_a_run_too_large_to_train_names_what_dominates_its_memory(args, dominant, shrink, monkeypatch):
    """block_size=100000 was refused naming the MLP's 512 x 128 weight as the largest
    tensor, while what grows is the activations and the T x T maps: the line names the part
    of the estimate that dominates it and the fields that shrink that part."""
    import re
    from engine import budget
    monkeypatch.setattr(budget, "available_bytes", lambda device: 8 << 30)
    cfg = cli.build("tiny", args)
    with pytest.raises(ConfigError) as err:
        budget.refuse_what_cannot_fit(cfg, torch.device("cpu"))
    said = str(err.value)
    assert "\n" not in said and "largest tensor" not in said
    assert re.search(dominant, said) and shrink in said, said


def test_the_activation_bound_counts_a_sparse_layers_indexer_maps():
    """Each indexer head keeps a T×T map of products (and their ReLU) in fp32 for backward,
    beside the heads' weights: 4 maps of 5 bytes a head, and 1 for the chosen keys."""
    from engine.budget import training_bytes
    args = ["--model.mechanism=sparse,mha", "--model.indexer_heads=3", "--model.n_layer=3"]
    sparse, plain = cli.build("tiny", args), cli.build("tiny", ["--model.n_layer=3"])
    t, b = sparse.model.block_size, sparse.train.batch_size
    extra = training_bytes(sparse)[1] - 12 * training_bytes(sparse)[0]
    base = training_bytes(plain)[1] - 12 * training_bytes(plain)[0]
    assert extra - base == 2 * b * 5 * (4 * 3 + 1) * t ** 2        # the two sparse layers


def test_the_counted_sizes_are_the_built_models_own():
    """Against a model built for real, with every sizing field set: its parameters and
    buffers, number for number (the vocabulary is the one a run sets from its data)."""
    from engine.budget import model_sizes
    from model import GPT
    for extra in (["--model.mechanism=mla", "--model.mla_kv_rank=24", "--model.mla_rope_dim=6",
                   "--model.mlp_hidden=40"],
                  ["--model.position=learned", "--model.position_offset=5",
                   "--model.n_token_types=3", "--model.value_embeds=true"]):
        cfg = cli.build("tiny", extra).model
        cfg.vocab_size = 65
        real = GPT(cfg)
        params, buffers, _ = model_sizes(cfg)
        assert params == sum(p.numel() for p in real.parameters())
        assert buffers == sum(b.numel() for b in real.buffers())


def test_a_huge_field_on_the_command_line_is_one_error_line(corpus, tmp_path):
    proc = run_script(*tiny_args(corpus, tmp_path, "huge", f"--model.mlp_hidden={HUGE}"),
                      check=False, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(errors) == 1 and "mlp" in errors[0] and "GiB free" in errors[0]
