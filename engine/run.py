"""A training run: what it holds (`Run`), how it is built (`setup_run`), and how its
state goes to a checkpoint and comes back (`save`, `restore`). The loop that trains
it is engine/loop.py."""
from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Callable

import torch

from common.errors import CheckpointError, ConfigError
from common.files import (file_in_the_way, lock_file, lock_holder, read_json, write_json_atomic,
                          write_text_atomic)
from common.shell import options, word
from engine import checkpoint
from engine.budget import refuse_what_cannot_fit
from engine.config import RunConfig, apply, apply_to, from_dict, migrate
from engine.device import DTYPES, autocast, dtype_name, pick_device, pick_dtype, setup_backends
from engine import machine
from engine.distributed import Dist
from engine.objectives import OBJECTIVES, draw_generator
from engine.optim import Optimizers, configure_optimizer
from data.tokenizer import TOKENIZERS, Tokenizer
from data.tokens import Batches, TokenData, load_tokens
from model import GPT
from model.readout import READOUTS, SHORTLIST_COVERAGE, shortlist_for

# Model fields a fine-tuning run may change: the same weights fit (causal only changes
# which positions a query sees).
SWAPPABLE_MODEL_FIELDS = ("attention", "dropout", "causal")

# Training options a resume cannot change, and why: a new value would be recorded and
# never used. Every other one (rates, betas, weight decay, the schedule, max_iters, ...)
# takes effect from the first step after the checkpoint.
FIXED_ON_RESUME = {
    "optimizer": "the optimizer's state in the checkpoint is for it",
    "seed": "the random streams come back from the checkpoint",
    "init_from": "the weights come from the checkpoint",
    "objective": "the tokenizer and the model's head were built for it",
}

# Where the masking draws of validation batches start, far from any training step's.
EVAL_DRAWS = 1 << 62


@dataclass
class Progress:
    """What changes as the run trains, and is saved with every checkpoint."""
    step: int = 0
    best_val: float = math.inf
    elapsed_s: float = 0.0              # training time, summed over resumes
    wandb_id: str | None = None
    last_eval: int | None = None        # the last step evaluated (a stop can save between)
    limit_s: float = 0.0                # seconds on train.time_limit's clock, summed over resumes
    last_eval_s: float = 0.0            # limit_s when the last evaluation was due
    last_lr: float = 0.0                # of the last step (logged; not saved)


@dataclass
class Run:
    cfg: RunConfig
    dist: Dist
    device: torch.device
    dtype: torch.dtype                  # the autocast precision
    data: TokenData
    batches: Batches                    # training batches, resumable
    model: GPT                          # the plain model: evaluation and checkpoints
    distributed_model: torch.nn.Module  # what backward runs through: DDP-wrapped, or the model
    train_forward: Callable             # distributed_model, compiled when train.compile
    eval_forward: Callable              # model, compiled when train.compile
    optimizer: Optimizers
    scaler: torch.amp.GradScaler        # loss scaling for float16; off otherwise
    run_dir: Path
    sharded: bool                       # FSDP: each process holds a shard of each weight
    log: Callable
    progress: Progress = field(default_factory=Progress)
    stop_signal: int | str | None = None
    lock: object = None                 # held while this process writes to run_dir
    made_dir: bool = False              # this process made run_dir (a new run or branch)
    kernel: str = ""                    # the attention kernel engine/machine.py handed the model

    def autocast(self):
        return autocast(self.device, self.dtype)

    @property
    def objective(self):
        return OBJECTIVES[self.cfg.train.objective]

    def objective_batch(self, x: torch.Tensor, y: torch.Tensor, index: int):
        """(inputs, targets) the objective makes of a window (x, y) that is batch `index`
        of its stream (training micro-batches count from 0, validation ones from
        EVAL_DRAWS): the draws depend on the index alone (objectives.draw_generator)."""
        obj, tok = self.objective, self.data.tokenizer
        generator = draw_generator(self.cfg.train.seed, index, x.device) if obj.draws else None
        return obj.batch(x, y, tok.mask_id, tok.vocab_size, generator)

    def release(self) -> None:
        """Let another process write to run_dir (engine.loop.train does this when it
        returns; a process that ends releases it anyway)."""
        if self.lock is not None:
            self.lock.close()
            self.lock = None

    def summary(self) -> str:
        c, m = self.cfg.model, self.model
        readout = (f", adaptive readout (shortlist of {c.readout_shortlist:,})"
                   if READOUTS[c.readout].shortlisted else "")
        mix = mixing(c)
        return (f"model: {c.n_layer} layers x {c.n_head} heads, {c.n_embd} wide, context "
                f"{c.block_size}, {c.position} positions{mix}, {c.mechanism} mechanism, "
                f"{c.attention} attention{readout}: "
                f"{m.num_params() / 1e6:.2f}M parameters ({m.num_params(True) / 1e6:.2f}M "
                f"non-embedding), {m.flops_per_token() / 1e6:.1f} MFLOPs per token (train)")

    def describe_setup(self) -> str:
        tok = self.data.tokenizer
        world = f", {self.dist.world} processes" if self.dist.world > 1 else ""
        why = machine.why_dtype(self.device, self.dtype, self.cfg.train.dtype, self.cfg.model.n_embd)
        return (f"device: {self.device}{cpu_facts(self.device)}, autocast {dtype_name(self.dtype)}"
                f"{why}, attention {self.kernel}{world}; data: "
                f"{self.cfg.data.path or 'the bundled Shakespeare'} ({tok.kind} tokenizer, "
                f"vocabulary {tok.vocab_size}, {len(self.data.train):,} train / "
                f"{len(self.data.val):,} val tokens)")


def cpu_facts(device: torch.device) -> str:
    """What decides a CPU's speed, for the set-up line: ' (AVX2, no-bf16 kind; 2 threads)'."""
    if device.type != "cpu":
        return ""
    n = torch.get_num_threads()
    return f" ({machine.describe_cpu()}; {n} thread{'s' if n > 1 else ''}, train.threads)"


@dataclass
class Pretrained:
    """The weights and tokenizer a run starts from (train.init_from), as against the
    corpus it trains on (data.sources)."""
    model: GPT
    tokenizer: Tokenizer


def adopt_source(cfg: RunConfig, model_overrides: dict[str, str],
                 train_overrides: dict[str, str] | None = None,
                 data_overrides: dict[str, str] | None = None) -> Pretrained:
    """Load train.init_from and make cfg's model its model: the architecture comes from
    the source, and a command-line override that would change it is refused. An encoder
    (model.causal=false) keeps its bidirectional objective unless the command line names
    one. The run records its parent (path and a hash of its weights)."""
    from engine.inference import load_run
    from engine.interop import describe_parent
    src = cfg.train.init_from
    model, source_cfg, tokenizer, _ = load_run(src, "best")
    if tokenizer.kind not in TOKENIZERS:
        # The data pipeline encodes a corpus with the tokenizers it can build (char, BPE);
        # a BERT-family folder's WordPiece is read for the tools, not for training.
        raise ConfigError(f"{src} is a BERT-family encoder with a {tokenizer.kind} tokenizer; "
                          "train.py fine-tunes GPT-2/Llama-family folders and runs trained "
                          "here, encoders included (see docs/interop.md)")
    wanted = replace(source_cfg.model)                 # a copy the overrides go into
    apply_to(wanted, "model", model_overrides, "the command line")
    conflicts = [f"model.{k}={getattr(wanted, k)!r} (the source has {getattr(source_cfg.model, k)!r})"
                 for k in model_overrides
                 if k not in SWAPPABLE_MODEL_FIELDS and getattr(wanted, k) != getattr(source_cfg.model, k)]
    if conflicts:
        raise ConfigError("with train.init_from the model comes from its source, and these "
                          f"overrides would change it: {'; '.join(conflicts)}; drop them (only "
                          f"{', '.join(SWAPPABLE_MODEL_FIELDS)} may change), or train a new model")
    cfg.model = wanted
    if "objective" not in (train_overrides or {}) and not wanted.causal:
        # The preset's next-token objective would let every position see the token it
        # is asked for; an encoder goes on with what it was trained on (a folder: the
        # bidirectional objective, the only one its head fits).
        own = source_cfg.train.objective
        cfg.train.objective = own if OBJECTIVES[own].bidirectional else next(
            name for name, o in OBJECTIVES.items() if o.bidirectional)
    if not OBJECTIVES[cfg.train.objective].bidirectional and not wanted.causal:
        raise ConfigError(f"{src} is an encoder (model.causal=false), and "
                          f"train.objective={cfg.train.objective} would let every position see "
                          "the token it is asked to predict; drop --train.objective (the "
                          "encoder's own is kept) or add --model.causal=true")
    named = (data_overrides or {}).get("tokenizer")
    if named is not None and named != tokenizer.kind:
        # The embedding's rows are the source's tokens: another tokenizer would read them
        # as other tokens, so it is refused rather than dropped.
        raise ConfigError(f"with train.init_from the tokenizer comes from its source ({src}: "
                          f"{tokenizer.kind}, {tokenizer.vocab_size:,} tokens), and "
                          f"--data.tokenizer={named} would give its embeddings other tokens; "
                          "drop it, or train a new model with that tokenizer")
    cfg.data.tokenizer = tokenizer.kind
    cfg.parent = describe_parent(cfg.train.init_from, model)
    cfg.validate()
    return Pretrained(model, tokenizer)


def setup_run(cfg: RunConfig, run_dir: Path | None = None, resume: bool | Path = False,
              log=print, dist: Dist | None = None, source: Pretrained | None = None) -> Run:
    """Device, data, model, its wrappers, optimizer and run directory, in that order;
    with `source`, the model starts from its weights and the data is encoded with its
    tokenizer; with `resume`, the state of a checkpoint (a path: that one; True: the
    run's latest)."""
    dist = dist or Dist()
    log = log if dist.is_main else (lambda *a, **k: None)
    train_cfg = cfg.train
    _check_parallel(cfg, dist)
    machine.fix_threads(train_cfg, log)       # before any work: recorded, reused on resume
    device = pick_device(train_cfg.device)
    if dist.world > 1 and device.type == "cuda":
        device = torch.device("cuda", dist.local_rank)
    setup_backends(device)
    refuse_what_cannot_fit(cfg, device)       # before the data or the model costs anything
    torch.manual_seed(train_cfg.seed)
    given = source.tokenizer if source else None
    if resume and cfg.train.init_from:        # a fine-tuning run keeps its parent's tokenizer
        given = Tokenizer.load(resume if isinstance(resume, Path)
                               else run_dir or Path(train_cfg.out_dir) / train_cfg.run_name)
    data = _load_data(cfg, dist, log, given)
    counts = None
    if READOUTS[cfg.model.readout].shortlisted and not resume and source is None:
        counts = torch.from_numpy(data.train.counts(cfg.model.vocab_size))
        fit_readout(cfg.model, counts, log)
        cfg.validate()                        # the shortlist against the vocabulary
    model = GPT(cfg.model)
    if counts is not None:
        model.adaptive.set_frequencies(counts)
    if source is not None:
        model.load_state_dict(source.model.state_dict())
    model = model.to(device)
    sharded = dist.world > 1 and train_cfg.parallel == "fsdp"
    if sharded:                               # before the optimizer sees the parameters
        from engine.sharding import shard
        shard(model)
    distributed_model = model
    if dist.world > 1 and not sharded:        # gradients averaged across processes
        from torch.nn.parallel import DistributedDataParallel
        distributed_model = DistributedDataParallel(
            model, device_ids=[dist.local_rank] if device.type == "cuda" else None)
    dtype = pick_dtype(train_cfg.dtype, device, cfg.model.n_embd)
    kernel = machine.fit_attention(model, cfg.model, device, dtype)
    run = Run(cfg, dist, device, dtype, data,
              batches=Batches(data.train, train_cfg.batch_size, cfg.model.block_size, device,
                              seed=train_cfg.seed, sampling=cfg.data.sampling),
              model=model, distributed_model=distributed_model,
              train_forward=machine.compiled(distributed_model, train_cfg.compile),
              eval_forward=machine.compiled(model, train_cfg.compile),
              optimizer=configure_optimizer(model, train_cfg, device),
              scaler=torch.amp.GradScaler(device.type, enabled=dtype == torch.float16),
              run_dir=Path(run_dir or Path(train_cfg.out_dir) / (train_cfg.run_name or _fresh_name(cfg))),
              sharded=sharded, log=log, kernel=kernel)
    run.made_dir = dist.is_main and not run.run_dir.exists()
    try:
        if dist.is_main and not (run_dir or train_cfg.run_name or resume) and dist.world == 1:
            _claim_fresh_dir(run)
        elif dist.is_main:
            run.lock = _lock_run_dir(run.run_dir)
        if isinstance(resume, Path) and resume.parent.parent.resolve() != run.run_dir.resolve():
            _branch(run, resume)
        elif resume:
            restore(run, resume if isinstance(resume, Path) else None)
            record_parent_weights(run)
        elif checkpoint.list_checkpoints(run.run_dir):
            raise CheckpointError(f"{run.run_dir} already holds checkpoints; continue it with "
                                  f"--resume {word(run.run_dir)}, or choose another train.run_name")
        if dist.is_main:
            _write_run_files(run)
    except KeyboardInterrupt as err:          # before training: say which folder to go on with
        run.release()                         # for a caller that goes on (a notebook)
        if err.args:
            raise
        raise KeyboardInterrupt(stopped_line(run, "stopped before training")) from None
    return run


def _branch(run: Run, ckpt: Path) -> None:
    """Continue from `ckpt` of another run in run.run_dir, a new run that records it as
    its parent: the checkpoint (and the best before it) are copied in, with the metrics
    up to its step, and nothing of the other run is touched."""
    source = ckpt.parent.parent
    if run.dist.is_main:                      # under the new run's lock
        if checkpoint.list_checkpoints(run.run_dir):
            raise CheckpointError(f"{run.run_dir} already holds checkpoints; choose another "
                                  f"--train.run_name to continue {ckpt} in a new run")
        # Its config.json first: a stop while the files are copied leaves a run that the
        # same command takes up again (_branch_dir), not a folder of another's files.
        _write_run_files(run)
        _branch_files(source, ckpt, run.run_dir)
    run.dist.barrier()
    run.log(f"branched: {run.run_dir} is a new run from {ckpt} (recorded as its parent); "
            f"{source} stays as it was")
    restore(run, run.run_dir / checkpoint.CKPT_DIR / ckpt.name)
    run.progress.wandb_id = None              # a run of its own in the tracker too
    record_parent_weights(run)


def record_parent_weights(run: Run) -> None:
    """The checksum of the weights a branch starts from, as fine-tuning records its
    source's; taken while the model still holds them (a branch stopped before its first
    step of training takes it when resumed)."""
    parent = run.cfg.parent
    if (not run.sharded and isinstance(parent, dict) and "path" in parent
            and "weights_sha256" not in parent and parent.get("step") == run.progress.step):
        from engine.interop import weights_sha256
        parent["weights_sha256"] = weights_sha256(run.model)


def mixing(c) -> str:
    """model.token_mix in the words of a summary line: ', each token mixed with the 3
    before it', or nothing for a model without it."""
    return (f", each token mixed with the {c.token_mix - 1} before it" if c.token_mix > 1 else
            ", each token's features rescaled (token_mix=1)" if c.token_mix else "")


def stopped_line(run: Run, how: str) -> str:
    """What a stop outside the training loop's own save leaves, for errors_as_lines to
    say: writes are atomic, so the run goes on from its last whole checkpoint. A folder
    this process made and stopped before its first checkpoint holds only what set-up
    wrote, and is removed, so that the same command again starts it afresh rather than
    leave it beside a new one."""
    run_dir = run.run_dir
    last = checkpoint.list_checkpoints(run_dir)
    if not last and run.made_dir:
        run.release()
        shutil.rmtree(run_dir, ignore_errors=True)
        return (f"{how}, before the run had a checkpoint; its folder {run_dir} was removed, so "
                "nothing of it is left: run the same command again")
    if not last:
        return (f"{how}, before {run_dir} had a checkpoint; nothing half-written was kept: "
                "run the same command again")
    return (f"{how}, nothing half-written was kept; python train.py --resume "
            f"{word(run_dir)} continues from its last checkpoint, {last[-1].name}")


def _branch_files(source: Path, ckpt: Path, run_dir: Path) -> None:
    """What a run branched from `ckpt` of run `source` starts with: the checkpoint, the
    metrics up to its step, and the best checkpoint up to it with its best.json."""
    step = (read_json(ckpt / "state.json") or {}).get("step", 0)
    records = []
    try:
        lines = (source / "metrics.jsonl").read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:                    # a torn last line
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
            records.append(record)
    write_text_atomic(run_dir / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in records))
    checkpoint.copy_checkpoint(ckpt, run_dir)
    evaluated = [r for r in records if isinstance(r.get("val_loss"), (int, float))]
    best = min(evaluated, key=lambda r: r["val_loss"], default=None)
    if best is not None:
        name = f"{checkpoint.PREFIX}{best['step']:07d}"
        if name != ckpt.name and (source / checkpoint.CKPT_DIR / name).is_dir():
            checkpoint.copy_checkpoint(source / checkpoint.CKPT_DIR / name, run_dir)
        if (run_dir / checkpoint.CKPT_DIR / name).is_dir():
            write_json_atomic(run_dir / "best.json",
                              {"step": best["step"], "val_loss": best["val_loss"], "path": name})


def fit_readout(model_cfg, counts: torch.Tensor, log) -> None:
    """An adaptive readout's shortlist from the training tokens' counts, where the
    config leaves it to the data (0)."""
    if not model_cfg.readout_shortlist:
        model_cfg.readout_shortlist = min(shortlist_for(counts), model_cfg.vocab_size - 1)
        log(f"adaptive readout: the {model_cfg.readout_shortlist:,} most frequent of "
            f"{model_cfg.vocab_size:,} tokens make up {SHORTLIST_COVERAGE:.0%} of the training "
            "tokens and get the full softmax; the rest go through its tail")


def _try_lock_run_dir(run_dir: Path):
    """The run directory made and locked for this process, or None where another
    training process holds it."""
    if blocking := file_in_the_way(run_dir):
        raise ConfigError(f"{blocking} is a file, where the run {run_dir} needs a folder; give "
                          "--train.out_dir a folder (it is made if missing)")
    run_dir.mkdir(parents=True, exist_ok=True)
    return lock_file(run_dir / ".lock", wait=False)


def _lock_run_dir(run_dir: Path):
    """One training process per run directory: a second one writing into the same run
    would interleave its metrics and checkpoints with the first's."""
    lock = _try_lock_run_dir(run_dir)
    if lock is None:
        raise CheckpointError(f"{run_dir} is being written by another training process (pid "
                              f"{lock_holder(run_dir / '.lock')}); wait for it to finish, or "
                              "choose another train.run_name")
    return lock


def _claim_fresh_dir(run: Run) -> None:
    """A run named for its preset and the second it started: a second run started in
    the same second (two trainings at once on one laptop) takes the name with -2, -3, ...
    instead of being refused for the first one's folder. (One process: under torchrun
    every rank must name the same folder.)"""
    base = run.run_dir
    for n in range(1, 100):
        run.run_dir = base if n == 1 else base.with_name(f"{base.name}-{n}")
        run.made_dir = not run.run_dir.exists()
        lock = _try_lock_run_dir(run.run_dir)
        if lock is not None and not checkpoint.list_checkpoints(run.run_dir):
            run.lock = lock
            return
        if lock is not None:
            lock.close()
    raise CheckpointError(f"{base} and 98 more names after it are taken; choose a "
                          "train.run_name")


def _check_parallel(cfg: RunConfig, dist: Dist) -> None:
    train_cfg = cfg.train
    if train_cfg.grad_accum % dist.world:
        raise ConfigError(f"train.grad_accum={train_cfg.grad_accum} must be a multiple of the "
                          f"{dist.world} processes: each takes an equal share of the "
                          "micro-batches of one step")
    if train_cfg.time_limit and dist.world > 1:
        raise ConfigError("train.time_limit is for one process: under torchrun each "
                          "process's clock would move its own learning rate and stop "
                          "it at its own step; limit the run with train.max_iters")


def _load_data(cfg: RunConfig, dist: Dist, log, given: Tokenizer | None = None) -> TokenData:
    """Tokens (the main process builds the cache, the others wait), the model's
    vocabulary taken from the tokenizer, and a validation split long enough."""
    data_cfg = cfg.data
    if not dist.is_main:
        dist.barrier()
    data = load_tokens(data_cfg.path, data_cfg.tokenizer, data_cfg.vocab_size,
                       data_cfg.val_fraction, data_cfg.cache_dir, log=log, given=given)
    if dist.is_main:
        dist.barrier()
    Batches(data.val, 1, cfg.model.block_size, split="val")     # refuse a too-short split now
    objective = OBJECTIVES[cfg.train.objective]
    if objective.needs_mask_token and data.tokenizer.mask_id is None:
        if given is not None:
            raise ConfigError(f"train.objective={cfg.train.objective} needs a mask token, and "
                              f"the tokenizer of {cfg.train.init_from} has none (its model's "
                              "vocabulary is fixed); start an encoder from scratch instead")
        data.tokenizer = data.tokenizer.with_mask()       # one id after the corpus's own
    if not cfg.model.causal and not objective.bidirectional:
        log("model.causal=false with a next-token objective: every position sees the token "
            "it is asked to predict, so the loss collapses and the model learns nothing it "
            "can generate with (the article's §04; python -m attnlab.article leak shows it)")
    if given is not None:                     # the model's vocabulary may be padded past it
        return data
    if cfg.model.vocab_size not in (0, data.tokenizer.vocab_size):
        log(f"model.vocab_size={cfg.model.vocab_size} replaced by the tokenizer's "
            f"{data.tokenizer.vocab_size}")
    cfg.model.vocab_size = data.tokenizer.vocab_size
    return data


def _fresh_name(cfg: RunConfig) -> str:
    return f"{cfg.preset or 'run'}-{datetime.now():%Y%m%d-%H%M%S}"


def _write_run_files(run: Run) -> None:
    run.run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(run.run_dir / "config.json", run.cfg.to_json())
    run.data.tokenizer.save(run.run_dir)


# -- checkpoints of a run --------------------------------------------------------------

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


def save(run: Run) -> Path | None:
    """Write a checkpoint (the main process only; the others wait for it). Sharded
    weights are gathered first, by every process, into the usual full format."""
    model, optimizer = run.model, run.optimizer
    if run.sharded:
        from engine.sharding import Snapshot, full_model_state, full_optimizer_state
        model = Snapshot(full_model_state(run.model))
        optimizer = Snapshot(full_optimizer_state(run.optimizer))
    if not run.dist.is_main:
        run.dist.barrier()
        return None
    p = run.progress
    batches = run.batches.state_dict()
    tensors = {"data.generator": batches["generator"], **rng_tensors(run.device)}
    state = {"best_val": p.best_val, "elapsed_s": p.elapsed_s, "wandb_id": p.wandb_id,
             "data_position": batches["position"],
             "last_eval": p.last_eval, "limit_s": p.limit_s, "last_eval_s": p.last_eval_s,
             "scaler": run.scaler.state_dict() if run.scaler.is_enabled() else None,
             "autocast": dtype_name(run.dtype)}        # what a resume of `auto` keeps
    state = {k: v for k, v in state.items() if v is not None}
    files = {"config.json": run.cfg.to_json(), "tokenizer.json": run.data.tokenizer.to_json()}
    path = checkpoint.save(run.run_dir, p.step, model, optimizer, tensors, state, files,
                           run.cfg.train.keep_last)
    run.dist.barrier()
    return path


def restore(run: Run, ckpt: Path | None = None) -> None:
    """Weights, optimizer, batches, random states and progress from a checkpoint of the
    run (default: its latest)."""
    checkpoint.remove_partial(run.run_dir)
    ckpt = ckpt or checkpoint.resolve(run.run_dir, "latest")
    weights, tensors, state = checkpoint.load(ckpt)
    _check_state(state, ckpt)
    if run.cfg.train.dtype == "auto":
        run.dtype = _kept_dtype(state, run.device, run.dtype)
        run.kernel = machine.fit_attention(run.model, run.cfg.model, run.device, run.dtype)
    try:
        opt_state = checkpoint.optimizer_join(tensors, state["optimizer"])
    except (AttributeError, KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"checkpoint {ckpt / 'state.json'} describes an optimizer state "
                              f"that cannot be read ({err}); it is corrupt or edited: "
                              f"{checkpoint.use_another(ckpt)}") from None
    if run.sharded:                           # each process keeps its own shard of each
        from engine.sharding import shard_optimizer_state, shard_weights
        weights = shard_weights(run.model, weights)
        opt_state = shard_optimizer_state(run.optimizer, opt_state)
    checkpoint.load_weights(run.model, weights, ckpt)
    # The saved param groups bring back the rates, betas and weight decay the checkpoint
    # was trained with; those of the config (the command line's, on a resume) are the
    # ones the optimizer was just built with, and they are what the next steps use.
    wanted = [{k: v for k, v in group.items() if k != "params"}
              for group in run.optimizer.param_groups]
    try:
        run.optimizer.load_state_dict(opt_state)
    except (ValueError, KeyError, RuntimeError) as err:
        raise CheckpointError(f"optimizer state in {ckpt} does not fit this model ({err})") from None
    for group, hyper in zip(run.optimizer.param_groups, wanted):
        group.update(hyper)
    position = state.get("data_position", -1)
    try:
        if position == -1 and "data_position" in state and state["step"] > 0 \
                and run.batches.sampling == "epochs":
            raise ValueError("no pass begun after training steps")     # every step reads one
        run.batches.load_state_dict({"generator": tensors["data.generator"], "position": position})
    except (ValueError, RuntimeError) as err:
        raise CheckpointError(f"checkpoint {ckpt / 'state.json'} records data_position={position}: "
                              f"{err}; it is corrupt or edited: {checkpoint.use_another(ckpt)}") from None
    restore_rng(tensors, run.device)
    if "scaler" in state:
        run.scaler.load_state_dict(state["scaler"])
    # A checkpoint from before last_eval was recorded was always written right after
    # an evaluation of its own step; one from before limit_s was recorded starts the time
    # limit's clock again.
    run.progress = Progress(state["step"], state.get("best_val", math.inf),
                            _seconds(state, "elapsed_s", ckpt), state.get("wandb_id"),
                            state.get("last_eval", state["step"]),
                            _seconds(state, "limit_s", ckpt), _seconds(state, "last_eval_s", ckpt))
    run.log(f"resuming {run.run_dir} from {ckpt.name} (step {run.progress.step})")


# The kinds state.json's own fields must be, checked before any is used: valid JSON of the
# wrong kind (a hand edit) would otherwise fail mid-run, after the run wrote to its folder.
STATE_KINDS = {"best_val": (int, float), "elapsed_s": (int, float), "last_eval": (int,),
               "data_position": (int,),
               "wandb_id": (str,), "scaler": (dict,), "optimizer": (dict,), "autocast": (str,)}


def _check_state(state: dict, ckpt: Path) -> None:
    wrong = [k for k, kinds in STATE_KINDS.items()
             if k in state and (isinstance(state[k], bool) or not isinstance(state[k], kinds))]
    if isinstance(state.get("autocast"), str) and state["autocast"] not in DTYPES:
        wrong.append("autocast")
    odd = []                              # the right kind, a value no run writes
    # A cross-entropy is never below 0 (inf: not evaluated yet); NaN would make every
    # later evaluation look no better, and best.json stop following the best.
    best = state.get("best_val")
    if "best_val" in state and "best_val" not in wrong and not best >= 0:
        odd.append(f"best_val={json.dumps(best)}, " + ("not a number" if best != best else "a loss below 0"))
    # The step last evaluated decides when the next evaluation is due.
    last = state.get("last_eval")
    if "last_eval" in state and "last_eval" not in wrong and not 0 <= last <= state["step"]:
        odd.append(f"last_eval={last}, not a step from 0 to its own ({state['step']})")
    said = ([f"{', '.join(f'{k}={json.dumps(state[k])}' for k in wrong)} of the wrong kind"]
            if wrong else []) + odd
    if said:
        raise CheckpointError(f"checkpoint {ckpt / 'state.json'} holds {' and '.join(said)}; "
                              f"it is corrupt or edited: {checkpoint.use_another(ckpt)}")


def _kept_dtype(state: dict, device: torch.device, picked: torch.dtype) -> torch.dtype:
    """The precision `auto` chose for the checkpoint resumed, where this CPU computes it
    natively; else `picked`: a checkpoint trained on a CPU of another kind goes on in the
    precision it was trained in, where this one computes it natively."""
    trained = DTYPES.get(state.get("autocast"))
    if device.type == "cpu" and trained in (torch.float32, torch.bfloat16) \
            and machine.compute_dtype(trained) == trained:
        return trained
    return picked


# More seconds than any run trains (about 30 years): a larger count is an edit, and
# would be printed, and added to, as a number hundreds of digits long.
MAX_SECONDS = 1e9


def _seconds(state: dict, key: str, ckpt: Path) -> float:
    value = state.get(key, 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < MAX_SECONDS:
        raise CheckpointError(f"checkpoint {ckpt} records {key}={json.dumps(value)} in its state.json, "
                              f"not a number of seconds; it is corrupt: {checkpoint.use_another(ckpt)}")
    return float(value)


def nothing_to_train(cfg: RunConfig, ckpt: Path, given: str,
                     overrides: dict[str, dict[str, str]] | None = None) -> str | None:
    """What a resume of `ckpt` with `cfg` says instead of training, where the checkpoint
    has already reached cfg's target loss, last step or time limit: that, and the
    command that goes further, `--resume GIVEN` with the `overrides` given (the command
    line's) and the options to add. Said before the run is set up, so its folder is
    left untouched, and only of a checkpoint whose files are whole: one that is damaged
    is refused as such, naming the file."""
    state = checkpoint.readable_state(ckpt)
    t, step = cfg.train, state["step"]
    used, best = _seconds(state, "limit_s", ckpt), state.get("best_val")
    reached = []                       # (what it reached, what to give, the option)
    if t.target_val_loss and type(best) in (int, float) and best <= t.target_val_loss:
        reached.append((f"its target (val loss {best:.4f} <= train.target_val_loss="
                        f"{t.target_val_loss:g})", "a lower target (0 for none)",
                        "--train.target_val_loss=0"))
    if t.time_limit and used >= t.time_limit:
        # The clock is the run's own, summed over resumes: a higher limit trains only for
        # the seconds it gives beyond those already trained, so the advice adds them.
        more = math.ceil(t.time_limit)
        reached.append((f"its time limit ({used:.1f} s trained, train.time_limit={t.time_limit:g} s)",
                        f"a limit past the {used:.1f} s trained (here {more} s more)",
                        f"--train.time_limit={math.ceil(used) + more}"))
    if step >= t.max_iters:
        reached.append((f"its last step (train.max_iters={t.max_iters})", "more steps",
                        f"--train.max_iters={2 * max(t.max_iters, 1)}"))
    if not reached:
        return None
    checkpoint.verify(ckpt)
    what, give, adds = zip(*reached)
    named = {o.partition("=")[0] for o in adds}
    # The options given stay in the command, so following it drops none of them.
    kept = options(overrides or {}, leave=named)
    return (f"nothing to train: {ckpt} had already reached {' and '.join(what)} at step "
            f"{step}; to train on, give {' and '.join(give)}: python train.py --resume "
            f"{' '.join([word(given), *kept, *adds])}")


def resume_config(resume: str, out_dir: str, overrides: dict[str, dict[str, str]]
                  ) -> tuple[RunConfig, Path, Path]:
    """(config, run directory, checkpoint) to resume: RESUME is a run directory (its
    latest checkpoint), one of its checkpoint folders, or empty (the latest run). The
    config is the checkpoint's own, hash-checked copy, with the command line's training
    options applied; a run-level config.json that disagrees about the model or data is
    refused, and so is a change to either on the command line, or to an option a resume
    cannot honour (FIXED_ON_RESUME). New checkpoints always go to a run directory, never
    inside a checkpoint: the checkpoint's own run when it is that run's latest, else (or
    when --train.run_name or --train.out_dir names another place) a new run that records
    it as its parent, so a run's history is never rewritten."""
    path = Path(resume) if resume else checkpoint.latest_run(out_dir, other="--resume DIR")
    if resume and not path.exists() and not path.is_absolute() and (Path(out_dir) / path).is_dir():
        path = Path(out_dir) / path                       # a run's name, as --run takes it
    if wrong := checkpoint.misplaced(path):
        raise CheckpointError(f"cannot resume: {wrong}")
    if (path / "state.json").is_file():                   # a checkpoint folder
        run_dir = path.parent.parent
        if path.parent.name != checkpoint.CKPT_DIR or not (run_dir / "config.json").is_file():
            raise CheckpointError(f"cannot resume: {path} is a checkpoint outside a run "
                                  "directory; start a new run from it with "
                                  f"{word(f'--train.init_from={path}')}")
        ckpt = path
    elif (path / "config.json").is_file():
        run_dir = path                   # partial writes are cleared by restore(), under the lock
        ckpt = checkpoint.resolve(run_dir, "latest")
    elif found := checkpoint.list_checkpoints(path):
        raise CheckpointError(f"cannot resume: {path / 'config.json'} is missing; copy its latest "
                              f"checkpoint's: cp {word(found[-1] / 'config.json')} {word(path / 'config.json')}")
    elif not path.exists():
        raise CheckpointError(f"cannot resume: {path} does not exist, nor a run of that name "
                              f"in {out_dir}/; give a run directory or its name, or one of its "
                              "checkpoint folders, or --resume alone for the latest run")
    else:
        raise CheckpointError(f"cannot resume: {path} is not a run directory (no config.json)")
    saved = migrate(checkpoint.verified_json(ckpt, "config.json"), str(ckpt / "config.json"))
    cfg = from_dict(saved, str(ckpt / "config.json"))
    run_level = read_json(run_dir / "config.json")
    restore_it = f"cp {word(ckpt / 'config.json')} {word(run_dir / 'config.json')}"
    if run_level is None or any(not isinstance(run_level.get(s, {}), dict)
                                for s in ("model", "data", "train")):     # else written over
        raise CheckpointError(f"{run_dir / 'config.json'} is not a readable run config "
                              "(corrupt or edited); put it back as it was, or copy the "
                              f"checkpoint's own: {restore_it}")
    run_level = migrate(run_level, str(run_dir / "config.json"))
    _refuse_changes(saved, run_level, f"{run_dir / 'config.json'} disagrees with the config "
                    f"{ckpt.name} was trained with", f"put config.json back as it was ({restore_it})")
    recorded = run_level.get("parent")
    if isinstance(recorded, dict) and recorded and not cfg.parent:
        # The checkpoint a branch starts with is its parent's copy, whose config names the
        # parent's run: where this run came from, its own name and the options it was
        # started with (--train.max_iters=N and the like) are in its config.json.
        cfg = from_dict({**saved, "train": {**saved.get("train", {}), **run_level.get("train", {})},
                         "parent": recorded}, str(run_dir / "config.json"))
    for section, values in overrides.items():
        apply(cfg, section, values, "the command line")
    cfg.validate()
    asked = cfg.to_dict()
    reshaped = [k for s, k in _changed_fields(saved, asked)
                if s == "model" and k not in SWAPPABLE_MODEL_FIELDS]
    # init_from keeps its source's shape, so it is the way on only for what it can change.
    way_on = (f"a model of another {', '.join(reshaped)} starts from scratch: a new run with "
              "--config PRESET and those options" if reshaped else
              f"start a new run from these weights with them: {word(f'--train.init_from={ckpt}')}")
    _refuse_changes(saved, asked, f"the checkpoint {ckpt} was trained with a "
                    "different model or data config", f"resume without those overrides, or {way_on}")
    fixed = [f"train.{k}: {saved.get('train', {}).get(k)!r} -> {getattr(cfg.train, k)!r} ({why})"
             for k, why in FIXED_ON_RESUME.items()
             if k in saved.get("train", {}) and saved["train"][k] != getattr(cfg.train, k)]
    if fixed:
        raise CheckpointError(f"a resume keeps these options of {ckpt}: {'; '.join(fixed)}; "
                              f"resume without them, or start a new run from its weights with "
                              f"{word(f'--train.init_from={ckpt}')}")
    step = (read_json(ckpt / "state.json") or {}).get("step", 0)
    if cfg.train.max_iters < step:
        raise ConfigError(f"train.max_iters={cfg.train.max_iters} is before step {step}, where "
                          f"{ckpt} stands; give a larger one to train on")
    name = overrides.get("train", {}).get("run_name") or ""
    out = overrides.get("train", {}).get("out_dir")
    latest = checkpoint.list_checkpoints(run_dir)[-1]
    # Another --train.out_dir is a wish to go on elsewhere: a new run there, as for another
    # run_name, rather than the option dropped while the old folder grows.
    elsewhere = out is not None and Path(out).resolve() != run_dir.parent.resolve()
    if elsewhere and (blocking := file_in_the_way(out)):   # before "nothing to train" offers it
        raise ConfigError(f"{blocking} is a file, where --train.out_dir={out} needs a folder "
                          "for the new run; give a folder (it is made if missing)")
    if elsewhere and Path(out).resolve().is_relative_to(run_dir.resolve()):
        raise ConfigError(f"--train.out_dir={out} is inside the run {run_dir}, where a new run "
                          "would mix with its files; drop it to continue the run in place, or "
                          f"give another folder for a new run there (not {run_dir} or below)")
    if ckpt.resolve() != latest.resolve() or (name and name != run_dir.name) or elsewhere:
        run_dir = _branch_dir(cfg, run_dir, ckpt, step, name, out)
    return cfg, run_dir, ckpt


def _branch_dir(cfg: RunConfig, run_dir: Path, ckpt: Path, step: int, name: str,
                out_dir: str | None) -> Path:
    """Where a resume from `ckpt`, not its run's latest checkpoint (or into another
    --train.run_name), goes on: a new run beside the old one, named for it and the step
    unless named, and recording `ckpt` as its parent."""
    out = Path(out_dir) if out_dir else run_dir.parent
    if name:
        target = out / name
        if checkpoint.list_checkpoints(target):
            raise CheckpointError(f"{target} already holds checkpoints; choose another "
                                  f"--train.run_name to continue {ckpt} in a new run")
    else:
        base = f"{run_dir.name}-from-{step}"
        target, n = out / base, 1
        while target.exists() and not _unfinished_branch(target, ckpt):
            n += 1
            target = out / f"{base}-{n}"
    previous = cfg.parent
    # Absolute: the record must lead back from wherever a later command runs.
    cfg.parent = {"path": os.path.abspath(ckpt), "step": step, **({"parent": previous} if previous else {})}
    cfg.train.run_name, cfg.train.out_dir = target.name, str(out)
    return target


def _unfinished_branch(folder: Path, ckpt: Path) -> bool:
    """Whether `folder` is a branch from `ckpt` stopped before the checkpoint was copied
    in: the same command takes it up again rather than leave it and make another."""
    recorded = (read_json(folder / "config.json") or {}).get("parent")
    return (isinstance(recorded, dict) and recorded.get("path") == os.path.abspath(ckpt)
            and not checkpoint.list_checkpoints(folder))


def resume_changes(cfg: RunConfig, ckpt: Path) -> list[str]:
    """The training options a resume changes from those `ckpt` was trained with, as
    `train.lr: 0.001 -> 1e-09`, so the run says what it now does differently."""
    trained = checkpoint.verified_json(ckpt, "config.json").get("train", {})
    now = cfg.to_dict()["train"]
    # Where the run goes on is not a change to its training: a branch names its new run
    # itself (_branch_dir), and the "run directory:" line says where it is.
    return [f"train.{k}: {v!r} -> {now[k]!r}" for k, v in trained.items()
            if k in now and now[k] != v and k not in ("run_name", "out_dir")]


def _changed_fields(trained: dict, other: dict) -> list[tuple[str, str]]:
    """(section, field) of each model or data field `other` gives another value."""
    return [(s, k) for s in ("model", "data") for k, v in trained.get(s, {}).items()
            if k in other.get(s, {}) and other[s][k] != v]


def _refuse_changes(trained: dict, other: dict, what: str, fix: str) -> None:
    changed = [f"{s}.{k}: {trained[s][k]!r} -> {other[s][k]!r}"
               for s, k in _changed_fields(trained, other)]
    if changed:
        raise CheckpointError(f"{what} ({'; '.join(changed)}); {fix}")
