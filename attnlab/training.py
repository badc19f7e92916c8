"""The training loop behind train.py: AdamW with warm-up and cosine decay, gradient
accumulation and clipping, autocast, periodic evaluation, atomic checkpoints, exact
resume, and a clean stop on Ctrl-C or a diverging loss."""
from __future__ import annotations

import contextlib
import json
import math
import signal
import time
from datetime import datetime
from pathlib import Path

import torch
from tqdm import tqdm

from attnlab import checkpoint
from attnlab.config import RunConfig, from_dict
from attnlab.device import (autocast, mfu, peak_flops, pick_device, pick_dtype, setup_backends,
                            synchronize)
from attnlab.distributed import Dist
from attnlab.errors import AttnlabError, CheckpointError, ConfigError
from attnlab.files import write_json_atomic
from attnlab.optim import configure_optimizer
from attnlab.tracking import Metrics
from data.tokens import Batches, TokenData, load_tokens
from model import GPT

EVAL_SEED = 4242        # evaluation draws the same validation batches every time


class TrainingDiverged(AttnlabError):
    """The loss became NaN or infinite."""


def lr_at(step: int, t) -> float:
    """Linear warm-up to lr, then cosine decay to min_lr at max_iters."""
    if step < t.warmup_iters:
        return t.lr * (step + 1) / t.warmup_iters
    progress = min(1.0, (step - t.warmup_iters) / max(1, t.max_iters - t.warmup_iters))
    return t.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (t.lr - t.min_lr)


@torch.no_grad()
def evaluate(model, tokens, batch_size: int, block_size: int, iters: int, device, ctx) -> float:
    """Mean loss over the same `iters` validation batches every time."""
    was_training = model.training
    model.eval()
    batches = Batches(tokens, batch_size, block_size, device, seed=EVAL_SEED, split="val")
    total = torch.zeros((), device=device)
    for _ in range(iters):
        x, y = batches.next()
        with ctx:
            total += model(x, y).loss.float()
    model.train(was_training)
    return (total / iters).item()


def rng_tensors(device: torch.device) -> dict:
    out = {"rng.cpu": torch.get_rng_state()}
    if device.type == "cuda":
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            out[f"rng.cuda.{i}"] = state
    return out


def restore_rng(tensors: dict, device: torch.device) -> None:
    torch.set_rng_state(tensors["rng.cpu"])
    if device.type == "cuda":
        states = [tensors[k] for k in sorted(tensors) if k.startswith("rng.cuda.")]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)


def describe(cfg: RunConfig) -> str:
    """The resolved config, one line per section."""
    lines = []
    for section, values in cfg.to_dict().items():
        if isinstance(values, dict):
            lines.append(f"  {section}: " + " ".join(f"{k}={v!r}" for k, v in values.items()))
    return "\n".join(lines)


def resolve_resume(cfg_overrides: list, resume: str, out_dir: str) -> tuple[RunConfig, Path]:
    """The run to resume (a folder, or the latest run) and its saved config with
    training overrides applied; model and data must stay as they were."""
    from attnlab.config import apply, parse_overrides
    run_dir = Path(resume) if resume else _latest_run(Path(out_dir))
    config_path = run_dir / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"cannot resume: {run_dir} is not a run directory (no config.json)")
    try:
        saved = json.loads(config_path.read_text())
    except ValueError as err:
        raise CheckpointError(f"cannot resume: {config_path} is not valid JSON ({err})") from None
    cfg = from_dict(saved, str(config_path))
    for section, key, value in parse_overrides(cfg_overrides):
        apply(cfg, section, {key: value}, "the command line")
    cfg.validate()
    changed = [f"{s}.{k}: {saved[s].get(k)!r} -> {v!r}"
               for s in ("model", "data") for k, v in cfg.to_dict()[s].items()
               if saved.get(s, {}).get(k, v) != v]
    if changed:
        raise CheckpointError(f"the checkpoint in {run_dir} was trained with a different "
                              f"model or data config ({'; '.join(changed)}); resume without "
                              "those overrides, or start a new run")
    return cfg, run_dir


def _latest_run(out_dir: Path) -> Path:
    marker = out_dir / "LATEST"
    if not marker.is_file():
        raise CheckpointError(f"no run to resume in {out_dir}/ (no LATEST file); pass "
                              "--resume RUN_DIR or start a run with `python train.py`")
    return out_dir / marker.read_text().strip()


class Trainer:
    def __init__(self, cfg: RunConfig, run_dir: Path | None = None, resume: bool = False,
                 log=print, dist: Dist | None = None):
        self.dist = dist = dist or Dist()
        self.cfg, self.log = cfg, (log if dist.is_main else (lambda *a, **k: None))
        log = self.log
        t = cfg.train
        if t.grad_accum % dist.world:
            raise ConfigError(f"train.grad_accum={t.grad_accum} must be a multiple of the "
                              f"{dist.world} processes: each takes an equal share of the "
                              "micro-batches of one step")
        if t.time_limit and dist.world > 1:
            raise ConfigError("train.time_limit is for one process: under torchrun each "
                              "process's clock would move its own learning rate and stop "
                              "it at its own step; limit the run with train.max_iters")
        self.device = pick_device(t.device)
        if dist.world > 1 and self.device.type == "cuda":
            self.device = torch.device("cuda", dist.local_rank)
        self.dtype = pick_dtype(t.dtype, self.device, cfg.model.n_embd)
        setup_backends(self.device)
        torch.manual_seed(t.seed)
        if not dist.is_main:
            dist.barrier()                    # the main process builds the token cache first
        self.data: TokenData = load_tokens(cfg.data.path, cfg.data.tokenizer, cfg.data.vocab_size,
                                           cfg.data.val_fraction, cfg.data.cache_dir, log=log)
        if dist.is_main:
            dist.barrier()
        if cfg.model.vocab_size not in (0, self.data.tokenizer.vocab_size):
            log(f"model.vocab_size={cfg.model.vocab_size} replaced by the tokenizer's "
                f"{self.data.tokenizer.vocab_size}")
        cfg.model.vocab_size = self.data.tokenizer.vocab_size
        T = cfg.model.block_size
        self.batches = Batches(self.data.train, t.batch_size, T, self.device, seed=t.seed)
        Batches(self.data.val, 1, T, split="val")            # refuse a too-short val split now
        self.model = GPT(cfg.model).to(self.device)
        self.sharded = dist.world > 1 and t.parallel == "fsdp"
        if self.sharded:                      # before the optimizer sees the parameters
            from attnlab.sharding import shard
            shard(self.model)
        self.optimizer = configure_optimizer(self.model, t, self.device)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.dtype == torch.float16)
        self.ctx = autocast(self.device, self.dtype)
        self.step, self.best_val, self.elapsed, self.wandb_id = 0, math.inf, 0.0, None
        if run_dir is None:
            name = t.run_name or f"{cfg.preset or 'run'}-{datetime.now():%Y%m%d-%H%M%S}"
            run_dir = Path(t.out_dir) / name
        self.run_dir = Path(run_dir)
        if resume:
            self._resume()
        elif checkpoint.list_checkpoints(self.run_dir):
            raise CheckpointError(f"{self.run_dir} already holds checkpoints; continue it with "
                                  f"--resume {self.run_dir}, or choose another train.run_name")
        if dist.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.json").write_text(cfg.to_json())
            self.data.tokenizer.save(self.run_dir)
            (Path(t.out_dir) / "LATEST").write_text(self.run_dir.name + "\n")
        self.trained = self.model
        if dist.world > 1 and not self.sharded:   # gradients averaged across processes
            from torch.nn.parallel import DistributedDataParallel
            self.trained = DistributedDataParallel(
                self.model, device_ids=[dist.local_rank] if self.device.type == "cuda" else None)
        self.compiled = torch.compile(self.trained) if t.compile else self.trained
        self.evaluated = torch.compile(self.model) if t.compile else self.model
        self.stop_signal = None
        self.time_used = 0.0                  # share of train.time_limit spent (run() updates it)
        self.current_lr = 0.0                 # set by each train_step, logged with it

    def _resume(self) -> None:
        checkpoint.remove_partial(self.run_dir)
        ckpt = checkpoint.resolve(self.run_dir, "latest")
        weights, tensors, state = checkpoint.load(ckpt)
        opt_state = checkpoint.optimizer_join(tensors, state["optimizer"])
        if self.sharded:                      # each process keeps its own shard of each
            from attnlab.sharding import shard_optimizer_state, shard_weights
            weights = shard_weights(self.model, weights)
            opt_state = shard_optimizer_state(self.optimizer, opt_state)
        checkpoint.load_weights(self.model, weights, ckpt)
        try:
            self.optimizer.load_state_dict(opt_state)
        except (ValueError, KeyError, RuntimeError) as err:
            raise CheckpointError(f"optimizer state in {ckpt} does not fit this model ({err})") from None
        self.batches.load_state_dict({"generator": tensors["data.generator"]})
        restore_rng(tensors, self.device)
        if "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        self.step = state["step"]
        self.best_val = state.get("best_val", math.inf)
        self.elapsed = state.get("elapsed_s", 0.0)
        self.wandb_id = state.get("wandb_id")
        self.log(f"resuming {self.run_dir} from {ckpt.name} (step {self.step})")

    def save(self) -> Path | None:
        """Write a checkpoint (the main process only; the others wait for it). Sharded
        weights are gathered first, by every process, into the usual full format."""
        model, optimizer = self.model, self.optimizer
        if self.sharded:
            from attnlab.sharding import Snapshot, full_model_state, full_optimizer_state
            model = Snapshot(full_model_state(self.model))
            optimizer = Snapshot(full_optimizer_state(self.optimizer))
        if not self.dist.is_main:
            self.dist.barrier()
            return None
        path = self._write_checkpoint(model, optimizer)
        self.dist.barrier()
        return path

    def _write_checkpoint(self, model, optimizer) -> Path:
        tensors = {"data.generator": self.batches.generator.get_state(), **rng_tensors(self.device)}
        state = {"best_val": self.best_val, "elapsed_s": self.elapsed, "wandb_id": self.wandb_id,
                 "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None}
        state = {k: v for k, v in state.items() if v is not None}
        files = {"config.json": self.cfg.to_json(), "tokenizer.json": self.data.tokenizer.to_json()}
        return checkpoint.save(self.run_dir, self.step, model, optimizer, tensors,
                               state, files, self.cfg.train.keep_last)

    def summary(self) -> str:
        c, m = self.cfg.model, self.model
        return (f"model: {c.n_layer} layers x {c.n_head} heads, {c.n_embd} wide, context "
                f"{c.block_size}, {c.position} positions, {c.attention} attention: "
                f"{m.num_params() / 1e6:.2f}M parameters ({m.num_params(True) / 1e6:.2f}M "
                f"non-embedding), {m.flops_per_token() / 1e6:.1f} MFLOPs per token (train)")

    def _on_signal(self, signum, frame):
        if self.stop_signal is not None:      # second Ctrl-C: stop at once
            raise KeyboardInterrupt
        self.stop_signal = signum

    def evaluate(self) -> float:
        t = self.cfg.train
        return evaluate(self.evaluated, self.data.val, t.batch_size, self.cfg.model.block_size,
                        t.eval_iters, self.device, self.ctx)

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step. With a time limit, `self.time_used` (the share of it spent,
        kept by run()) moves the schedule on as well: the learning rate follows steps or
        time, whichever is further along, so the decay ends on time even if steps run
        slower than planned."""
        t = self.cfg.train
        schedule_step = max(self.step, int(self.time_used * t.max_iters)) if t.time_limit else self.step
        self.current_lr = lr_at(schedule_step, t)
        self.optimizer.set_lr(self.current_lr / t.lr)
        total = torch.zeros((), device=self.device)
        d = self.dist
        mine = [m for m in range(t.grad_accum) if m % d.world == d.rank]
        for m in range(t.grad_accum):
            if m not in mine:                 # another process's micro-batch
                self.batches.skip()
                continue
            x, y = self.batches.next()
            # DDP averages over processes, so each scales by world / grad_accum; gradients
            # are exchanged once, after this process's last micro-batch.
            sync = m == mine[-1] or d.world == 1
            if self.sharded:
                self.model.set_requires_gradient_sync(sync)
            with contextlib.nullcontext() if sync or self.sharded else self.trained.no_sync():
                with self.ctx:
                    loss = self.compiled(x, y).loss
                self.scaler.scale(loss * d.world / t.grad_accum).backward()
            total += loss.detach() / t.grad_accum
        self.optimizer.unscale_(self.scaler)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                              t.grad_clip if t.grad_clip > 0 else math.inf)
        if self.sharded:
            from attnlab.sharding import full
            norm = full(norm)
        self.optimizer.step(self.scaler)
        self.scaler.update()
        self.optimizer.zero_grad()
        return total, norm

    def _diverged(self, what: str, value: float) -> TrainingDiverged:
        last = checkpoint.list_checkpoints(self.run_dir)
        kept = f"the last good checkpoint is {last[-1]}" if last else "no checkpoint was written yet"
        t = self.cfg.train
        return TrainingDiverged(
            f"{what} became {value} at step {self.step}; stopped ({kept}). Try a lower "
            f"train.lr (now {t.lr:g}), train.dtype=float32 (now {str(self.dtype)[6:]}), or "
            f"a tighter train.grad_clip (now {t.grad_clip:g}), then resume or start again")

    def run(self) -> dict:
        t, log = self.cfg.train, self.log
        main = self.dist.is_main
        metrics = Metrics(self.run_dir, t.wandb if main else "disabled", t.wandb_project,
                          self.cfg.to_dict(), self.run_dir.name, self.wandb_id, log, write=main)
        self.wandb_id = metrics.wandb_id
        metrics.truncate_after(self.step + (1 if self.step else 0))
        # Under torchrun, Ctrl-C reaches every process at once and stops them all; the
        # save-and-stop handshake is for a single process.
        signals = (signal.SIGINT, signal.SIGTERM) if self.dist.world == 1 else ()
        handlers = {s: signal.signal(s, self._on_signal) for s in signals}
        tokens_per_step = t.batch_size * t.grad_accum * self.cfg.model.block_size
        device_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else ""
        peak = peak_flops(self.device.type, str(self.dtype)[6:], device_name)
        flops_per_token = self.model.flops_per_token()
        unit = self.data.bits_unit
        bar = tqdm(total=t.max_iters, initial=self.step, unit="step", dynamic_ncols=True,
                   mininterval=0.5, desc="train", disable=not main)
        result = {"run_dir": str(self.run_dir)}
        started = time.perf_counter()
        try:
            last_eval = self.step if self.step else None   # a resumed step was evaluated
            window_start, window_steps = time.perf_counter(), 0
            while True:
                out_of_time = bool(t.time_limit) and time.perf_counter() - started >= t.time_limit
                due = self.step % t.eval_interval == 0 or self.step >= t.max_iters or out_of_time
                if due and self.step != last_eval:
                    val = self._eval_and_save(metrics, bar, unit)
                    last_eval = self.step
                    window_start, window_steps = time.perf_counter(), 0
                    if t.target_val_loss and val <= t.target_val_loss:
                        log(f"reached val loss {val:.4f} <= {t.target_val_loss} at step "
                            f"{self.step}, {time.perf_counter() - started:.1f} s after the start")
                        result["reached_target"] = {"step": self.step, "val_loss": val}
                        break
                if self.step >= t.max_iters:
                    break
                if out_of_time:
                    log(f"time limit of {t.time_limit:.0f} s reached at step {self.step} of "
                        f"{t.max_iters}; stopped with a final evaluation and checkpoint")
                    result["out_of_time"] = True
                    break
                if t.time_limit:
                    self.time_used = (time.perf_counter() - started) / t.time_limit
                loss, norm = self.train_step()
                self.step += 1
                window_steps += 1
                bar.update(1)
                if self.step % t.log_interval == 0 or self.step == t.max_iters:
                    loss_value, norm_value = self.dist.sum(loss).item(), norm.item()
                    if not math.isfinite(loss_value):
                        raise self._diverged("the training loss", loss_value)
                    synchronize(self.device)
                    now = time.perf_counter()
                    # Per process: each trains 1/world of the step's tokens.
                    tok_s = window_steps * tokens_per_step / max(now - window_start, 1e-9)
                    utilisation = mfu(flops_per_token, tok_s / self.dist.world, peak)
                    self.elapsed += now - window_start
                    window_start, window_steps = now, 0
                    record = {"step": self.step, "loss": loss_value, "lr": self.current_lr,
                              "grad_norm": norm_value, "tokens_per_s": tok_s, "elapsed_s": self.elapsed}
                    shown = {"loss": f"{loss_value:.3f}", "tok_s": f"{tok_s:,.0f}"}
                    if utilisation is not None:
                        record["mfu"] = utilisation
                        shown["mfu"] = f"{utilisation:.1%}"
                    metrics.log(record)
                    bar.set_postfix(shown, refresh=False)
                if self.stop_signal is not None:
                    path = self.save()
                    bar.close()
                    log(f"stopped by signal {self.stop_signal} at step {self.step}; saved {path}; "
                        f"continue with: python train.py --resume {self.run_dir}")
                    result["interrupted"] = True
                    break
        finally:
            bar.close()
            metrics.close()
            for s, h in handlers.items():
                signal.signal(s, h)
        result.update(step=self.step, best_val=self.best_val)
        return result

    def _eval_and_save(self, metrics, bar, unit) -> float:
        val = self.evaluate()
        if not math.isfinite(val):
            raise self._diverged("the validation loss", val)
        best = val < self.best_val
        self.best_val = min(self.best_val, val)
        record = {"step": self.step, "val_loss": val, f"val_{unit}": self.data.bits(val)}
        metrics.log(record)
        if self.dist.is_main:                 # tqdm.write prints even for a disabled bar
            bar.write(f"step {self.step:>6}: val loss {val:.4f}, {self.data.bits(val):.3f} {unit}"
                      + (" (best)" if best else ""))
        path = self.save()
        if best and self.dist.is_main:
            write_json_atomic(self.run_dir / "best.json",
                              {"step": self.step, "val_loss": val, "path": str(path.name)})
        return val
