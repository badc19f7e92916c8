"""The training loop behind train.py: warm-up and cosine decay, gradient accumulation
and clipping, autocast, periodic evaluation, atomic checkpoints, and a clean stop on
Ctrl-C, a diverging loss, a target val loss or a time limit. The run it trains is
built by engine/run.py."""
from __future__ import annotations

import contextlib
import math
import signal
import sys
import time
from typing import Callable

import torch
from tqdm import tqdm

from common.errors import AttnlabError
from common.files import write_json_atomic
from common.shell import word
from engine import checkpoint
from engine.device import Utilisation, dtype_name, synchronize
from engine.objectives import auxiliary_loss, masked_accuracy, warm_indexers
from engine.optim import LR_SCHEDULES
from engine.rundir import stopped_line
from engine.state import EVAL_DRAWS, Run, save
from engine.tracking import Metrics
from data.tokens import Batches
from model.moe import load_line


class TrainingDiverged(AttnlabError):
    """The loss became NaN or infinite."""


def lr_at(step: int, train_cfg) -> float:
    """Linear warm-up to lr, then the schedule's decay to min_lr at max_iters."""
    if step < train_cfg.warmup_iters:
        return train_cfg.lr * (step + 1) / train_cfg.warmup_iters
    progress = min(1.0, (step - train_cfg.warmup_iters) / max(1, train_cfg.max_iters - train_cfg.warmup_iters))
    factor = LR_SCHEDULES[train_cfg.schedule](progress, train_cfg)
    return train_cfg.min_lr + factor * (train_cfg.lr - train_cfg.min_lr)


MUON_MOMENTUM_START = 0.85


def muon_momentum_at(step: int, train_cfg) -> float:
    """Muon's momentum, rising from 0.85 to muon_momentum over muon_momentum_warmup steps:
    early gradients change fast, and a long average of them points at stale directions."""
    if step >= train_cfg.muon_momentum_warmup:
        return train_cfg.muon_momentum
    frac = step / train_cfg.muon_momentum_warmup
    return MUON_MOMENTUM_START + frac * (train_cfg.muon_momentum - MUON_MOMENTUM_START)


def schedule_step(step: int, time_used: float, train_cfg) -> int:
    """Where the schedules stand. With a time limit they follow steps or time (the share
    of the limit spent), whichever is further along, so the decay ends on time even if
    steps run slower than planned; without one, steps alone."""
    return max(step, int(time_used * train_cfg.max_iters)) if train_cfg.time_limit else step


def scheduled_lr(step: int, time_used: float, train_cfg) -> float:
    return lr_at(schedule_step(step, time_used, train_cfg), train_cfg)


def batch_at(step: int, train_cfg) -> int:
    """Sequences per micro-batch at this step: with train.batch_ramp, from a quarter of
    batch_size growing linearly to all of it over that share of the steps (a batch-size
    schedule: early on the gradient is large next to its noise, so small batches buy
    more updates for the same tokens; later, larger ones average the noise away)."""
    full = train_cfg.batch_size
    ramp = train_cfg.batch_ramp * train_cfg.max_iters
    if not train_cfg.batch_ramp or step >= ramp:
        return full
    return max(1, min(full, round(full * (0.25 + 0.75 * step / ramp))))


class LimitClock:
    """Seconds on train.time_limit's clock, continuing from those a resumed checkpoint
    recorded (Progress.limit_s), so that the limit, the schedule that follows it and the
    evaluations timed by it go on where they were; each reading is kept in the progress
    that the next checkpoint saves."""

    def __init__(self, progress, now: Callable[[], float] = time.perf_counter):
        self.progress, self.now = progress, now
        self.origin = now() - progress.limit_s

    def read(self) -> float:
        self.progress.limit_s = self.now() - self.origin
        return self.progress.limit_s


def train(run: Run, now: Callable[[], float] = time.perf_counter) -> dict:
    """Train until max_iters, a target, the time limit or a signal; return what ended it.
    `now` is the clock the time limit reads."""
    train_cfg, p = run.cfg.train, run.progress
    metrics = Metrics(run.run_dir, train_cfg.wandb if run.dist.is_main else "disabled", train_cfg.wandb_project,
                      run.cfg.to_dict(), run.run_dir.name, p.wandb_id, run.log, write=run.dist.is_main)
    p.wandb_id = metrics.wandb_id
    # A resumed run (last_eval set by restore) keeps the records up to its checkpoint's
    # step, the evaluation there included, even at step 0; a new run starts the file
    # afresh over what a run of its name stopped before its first checkpoint left.
    metrics.truncate_after(p.step + 1 if p.last_eval is not None else 0)
    speed, watch = Speedometer(run), DivergenceWatch()
    clock = LimitClock(p, now)
    # Into a file (train.py > log) the bar writes an update every half second; there one
    # every half minute says as much and keeps the log readable.
    bar = tqdm(total=bar_total(p, train_cfg), initial=p.step, unit="step", dynamic_ncols=True,
               mininterval=0.5 if sys.stderr.isatty() else 30, desc="train",
               disable=not run.dist.is_main)
    result = {"run_dir": str(run.run_dir)}
    with stop_signals(run):
        try:
            while True:
                elapsed = clock.read()
                out_of_time = bool(train_cfg.time_limit) and elapsed >= train_cfg.time_limit
                if evaluation_due(run, out_of_time) and p.step != p.last_eval:
                    watch.check(run)                  # a diverged step, before it is evaluated
                    last = out_of_time or p.step >= train_cfg.max_iters
                    val = evaluate_and_save(run, metrics, bar, last, clock)
                    speed.restart()
                    if train_cfg.target_val_loss and val <= train_cfg.target_val_loss:
                        run.log(f"reached val loss {val:.4f} <= {train_cfg.target_val_loss} at step "
                                f"{p.step}, {clock.read():.1f} s after the start")
                        result["reached_target"] = {"step": p.step, "val_loss": val}
                        break
                if p.step >= train_cfg.max_iters:
                    break
                if out_of_time:
                    run.log(f"time limit of {train_cfg.time_limit:.0f} s reached at step {p.step}; "
                            "stopped with a final evaluation and checkpoint")
                    result["out_of_time"] = True
                    break
                loss, norm, batch = train_step(run, elapsed / train_cfg.time_limit if train_cfg.time_limit else 0.0)
                p.step += 1
                watch.see(loss, p.step)
                bar.total = bar_total(p, train_cfg)
                bar.update(1)
                speed.count_step(batch)
                if p.step % train_cfg.log_interval == 0 or p.step == train_cfg.max_iters:
                    watch.check(run)
                    log_step(run, metrics, bar, speed, loss, norm)
                if run.stop_signal is not None:
                    stop_on_signal(run, bar, clock)
                    result["interrupted"] = True
                    break
        finally:
            bar.close()
            metrics.close()
            run.release()
    result.update(step=p.step, best_val=p.best_val)
    return result


def bar_total(p, train_cfg) -> int:
    """The steps the progress bar counts to: max_iters; under a time limit, where
    max_iters is a ceiling, the steps the run makes by the limit at its pace so far."""
    share = p.limit_s / train_cfg.time_limit if train_cfg.time_limit else 0.0
    if not p.step or share <= 0:
        return train_cfg.max_iters
    return max(p.step, min(train_cfg.max_iters, round(p.step / share)))


def evaluation_mark(step: int, limit_s: float, train_cfg) -> int:
    """How many eval_intervals of the schedule (schedule_step) lie behind a run at this step
    and this many seconds of its time limit."""
    return schedule_step(step, limit_s / train_cfg.time_limit, train_cfg) // train_cfg.eval_interval


def evaluation_due(run: Run, out_of_time: bool) -> bool:
    """Every eval_interval steps, at max_iters and when the time is up. Under a time limit
    max_iters is a ceiling and the schedule follows the clock, so evaluations come each
    time the schedule passes another eval_interval, at even shares of the limit even when
    fewer steps come than max_iters allows."""
    train_cfg, p = run.cfg.train, run.progress
    if p.step >= train_cfg.max_iters or out_of_time:
        return True
    if not train_cfg.time_limit:
        return p.step % train_cfg.eval_interval == 0
    return p.last_eval is None or (evaluation_mark(p.step, p.limit_s, train_cfg)
                                   > evaluation_mark(p.last_eval, p.last_eval_s, train_cfg))


def train_step(run: Run, time_used: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One optimizer step over grad_accum micro-batches; this process trains its share
    (rank r: micro-batches r, r + N, ...). Returns the mean loss, the gradient norm and
    the sequences per micro-batch."""
    train_cfg, dist = run.cfg.train, run.dist
    at = schedule_step(run.progress.step, time_used, train_cfg)
    lr, batch = lr_at(at, train_cfg), batch_at(at, train_cfg)
    run.optimizer.set_lr(lr / train_cfg.lr)
    run.optimizer.set_muon_momentum(muon_momentum_at(at, train_cfg))
    run.progress.last_lr = run.optimizer.param_groups[0]["lr"]     # logged: the rate used
    # DeepSeek-V3.2's dense warm-up: the indexers learn from dense attention while the rest of
    # the model is frozen (its loss is not backpropagated, so its weights get no gradient).
    warming = run.progress.step < train_cfg.indexer_warmup
    if train_cfg.indexer_warmup:
        warm_indexers(run.model, warming)
    total = torch.zeros((), device=run.device)
    mine = [m for m in range(train_cfg.grad_accum) if m % dist.world == dist.rank]
    for m in range(train_cfg.grad_accum):
        if m not in mine:                     # another process's micro-batch
            run.batches.skip()
            continue
        x, y = run.batches.next()
        if batch < x.shape[0]:                # the batch-size schedule: the first sequences
            x, y = x[:batch], y[:batch]
        x, y = run.objective_batch(x, y, run.progress.step * train_cfg.grad_accum + m)
        # DDP averages over processes, so each scales by world / grad_accum; gradients
        # are exchanged once, after this process's last micro-batch.
        sync = m == mine[-1] or dist.world == 1
        if run.sharded:
            run.model.set_requires_gradient_sync(sync)
        no_sync = contextlib.nullcontext() if sync or run.sharded else run.distributed_model.no_sync()
        with no_sync:
            with run.autocast():
                loss = run.train_forward(x, y).loss
            # A layer's own loss (the sparse indexer's KL) trains only its parameters; the
            # logged loss stays the objective's, comparable between mechanisms.
            learned = auxiliary_loss(run.model) + (0.0 if warming else loss)
            run.scaler.scale(learned * dist.world / train_cfg.grad_accum).backward()
        total += loss.detach() / train_cfg.grad_accum
    run.optimizer.unscale_(run.scaler)
    norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(),
                                          train_cfg.grad_clip if train_cfg.grad_clip > 0 else math.inf)
    if run.sharded:
        from engine.sharding import full
        norm = full(norm)
    run.optimizer.step(run.scaler)
    run.scaler.update()
    run.optimizer.zero_grad()
    after_step(run.model, run.dist.sum)
    return total, norm, batch


def after_step(model: torch.nn.Module, reduce=lambda counts: counts) -> None:
    """Once per optimizer step, each module with an `after_step` updates what it keeps
    across steps from all the step's micro-batches, summed over processes by `reduce`
    (a mixture of experts' balancing bias, from the experts' load). Inside forward it would
    run once per micro-batch. Every loop that steps an optimizer calls it."""
    for module in model.modules():
        if hasattr(module, "after_step"):
            module.after_step(reduce)


@torch.no_grad()
def evaluate(model, tokens, batch_size: int, block_size: int, iters: int, device, ctx,
             prepare=None, counts: list | None = None) -> float:
    """Mean loss over `iters` validation batches spread evenly over the whole split,
    the same ones every time (Batches.spaced). `prepare(x, y, i)` turns batch i into
    the objective's (inputs, targets); `counts`, if given, gets [right, scored]: how
    many targets the top-scored token gets right (masked-token accuracy)."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=device)
    for i, (x, y) in enumerate(Batches(tokens, batch_size, block_size, device, split="val").spaced(iters)):
        if prepare is not None:
            x, y = prepare(x, y, i)
        with ctx:
            out = model(x, y)
        total += out.loss.float()
        if counts is not None and out.logits is not None:
            right, scored = masked_accuracy(out.logits, y)
            counts[0] += right
            counts[1] += scored
    model.train(was_training)
    return (total / iters).item()


def evaluate_and_save(run: Run, metrics: Metrics, bar, last: bool = False,
                      clock: LimitClock | None = None) -> float:
    """Val loss, a checkpoint, and best.json when it is the best so far. The `last`
    evaluation of a run reads train.final_eval_iters batches where that is set; the
    checkpoint records the time limit's `clock` read after the evaluation."""
    train_cfg, p, objective = run.cfg.train, run.progress, run.objective
    counts = [0, 0] if objective.reports_accuracy else None
    iters = train_cfg.final_eval_iters if last and train_cfg.final_eval_iters else train_cfg.eval_iters
    val = evaluate(run.eval_forward, run.data.val, train_cfg.batch_size, run.cfg.model.block_size,
                   iters, run.device, run.autocast(),
                   prepare=lambda x, y, i: run.objective_batch(x, y, EVAL_DRAWS + i), counts=counts)
    if not math.isfinite(val):
        raise diverged(run, "the validation loss", val)
    best = val < p.best_val
    p.best_val = min(p.best_val, val)
    p.last_eval, p.last_eval_s = p.step, p.limit_s    # recorded in the checkpoint written below
    unit, record, shown = run.data.bits_unit, {"step": p.step, "val_loss": val}, ""
    if objective.per_byte:
        record[f"val_{unit}"] = run.data.bits(val)
        shown += f", {run.data.bits(val):.3f} {unit}"
    if counts is not None:
        record["val_accuracy"] = counts[0] / max(counts[1], 1)
        shown += f", accuracy {record['val_accuracy']:.1%} of {counts[1]:,} masked tokens"
    metrics.log(record)
    if run.dist.is_main:                      # tqdm.write prints even for a disabled bar
        bar.write(f"step {p.step:>6}: {objective.loss_name} {val:.4f}{shown}"
                  + (" (best)" if best else ""))
        loads = load_line(run.model)                 # the experts' load in the last step
        if loads and p.step:
            bar.write(f"{'':13}{loads}")
    if clock is not None:
        clock.read()
    path = save(run)
    if best and run.dist.is_main:
        write_json_atomic(run.run_dir / "best.json",
                          {"step": p.step, "val_loss": val, "path": str(path.name)})
    return val


class Speedometer:
    """Tokens per second and MFU over the steps since the last log line, and the run's
    average (tokens so far / training time so far, evaluations left out) that the
    progress bar shows: the last few steps' rate swings with the load of the moment."""

    def __init__(self, run: Run):
        train_cfg = run.cfg.train
        self.run = run
        self.tokens_per_sequence = train_cfg.grad_accum * run.cfg.model.block_size
        name = torch.cuda.get_device_name(run.device) if run.device.type == "cuda" else ""
        self.utilisation = Utilisation(run.device.type, dtype_name(run.dtype), name)
        self.flops_per_token = run.model.flops_per_token()
        self.all_tokens, self.all_seconds = 0, 0.0
        self.restart()

    def restart(self) -> None:
        self.since, self.tokens = time.perf_counter(), 0

    def count_step(self, batch: int) -> None:
        self.tokens += batch * self.tokens_per_sequence

    def read(self) -> tuple[float, float | None, float]:
        """(tokens/s of the whole run since the last read, MFU of one process, seconds
        measured); restarts."""
        synchronize(self.run.device)
        now = time.perf_counter()
        seconds = now - self.since
        tok_s = self.tokens / max(seconds, 1e-9)
        utilisation = self.utilisation(self.flops_per_token, tok_s / self.run.dist.world)
        self.all_tokens += self.tokens
        self.all_seconds += seconds
        self.since, self.tokens = now, 0
        return tok_s, utilisation, seconds

    @property
    def average(self) -> float:
        """Tokens per second over this process's training so far."""
        return self.all_tokens / max(self.all_seconds, 1e-9)


def log_step(run: Run, metrics: Metrics, bar, speed: Speedometer, loss, norm) -> None:
    loss_value, norm_value = run.dist.sum(loss).item(), norm.item()
    if not math.isfinite(loss_value):
        raise diverged(run, "the training loss", loss_value)
    tok_s, utilisation, seconds = speed.read()
    p = run.progress
    p.elapsed_s += seconds
    record = {"step": p.step, "loss": loss_value, "lr": p.last_lr, "grad_norm": norm_value,
              "tokens_per_s": tok_s, "elapsed_s": p.elapsed_s}
    shown = {"loss": f"{loss_value:.3f}", "tok_s": f"{speed.average:,.0f}"}
    if utilisation is not None:
        record["mfu"] = utilisation
        shown["mfu"] = f"{utilisation:.1%}"
    metrics.log(record)
    bar.set_postfix(shown, refresh=False)


class DivergenceWatch:
    """Names the first step whose training loss was NaN or infinite, even when that
    step was not logged. It keeps the losses the steps computed anyway (no work and no
    wait for the GPU per step) and checks them at log and evaluation steps."""

    def __init__(self):
        self.pending: list[tuple[int, torch.Tensor]] = []

    def see(self, loss: torch.Tensor, step: int) -> None:
        self.pending.append((step, loss.detach()))

    def check(self, run: Run) -> None:
        if not self.pending:
            return
        losses = torch.stack([loss for _, loss in self.pending])
        bad = (~torch.isfinite(losses)).nonzero()
        if len(bad):
            step, loss = self.pending[int(bad[0, 0])]
            run.progress.step = step
            raise diverged(run, "the training loss", loss.item())
        self.pending.clear()


def diverged(run: Run, what: str, value: float) -> TrainingDiverged:
    last = checkpoint.list_checkpoints(run.run_dir)
    kept = f"the last good checkpoint is {last[-1]}" if last else "no checkpoint was written yet"
    train_cfg = run.cfg.train
    return TrainingDiverged(
        f"{what} became {value} at step {run.progress.step}; stopped ({kept}). Try a lower "
        f"train.lr (now {train_cfg.lr:g}), train.dtype=float32 (now {dtype_name(run.dtype)}), or "
        f"a tighter train.grad_clip (now {train_cfg.grad_clip:g}), then resume or start again")


@contextlib.contextmanager
def stop_signals(run: Run):
    """Ctrl-C or SIGTERM asks the loop to save and stop after the current step (a step
    cut short has drawn its batch and dropout masks and may have moved weights, so its
    state would not resume to the same losses); a second one stops at once. Under torchrun, Ctrl-C reaches every process at once and
    stops them all, so the handshake is for a single process."""
    def on_signal(signum, frame):
        if run.stop_signal is not None:
            raise KeyboardInterrupt(stopped_at_once(run))
        run.stop_signal = signum
    signals = (signal.SIGINT, signal.SIGTERM) if run.dist.world == 1 else ()
    handlers = {s: signal.signal(s, on_signal) for s in signals}
    try:
        yield
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


def stopped_at_once(run: Run) -> str:
    """What a second Ctrl-C leaves, said by errors_as_lines: the save it cut short was
    dropped whole (writes are atomic), so the run goes on from its last checkpoint."""
    return stopped_line(run, "stopped at once")


def stop_on_signal(run: Run, bar, clock: LimitClock | None = None) -> None:
    if clock is not None:                     # the checkpoint counts the time spent so far
        clock.read()
    path = save(run)
    bar.close()
    run.log(f"stopped by signal {run.stop_signal} at step {run.progress.step}; saved {path}; "
            f"continue with: python train.py --resume {word(run.run_dir)}")
