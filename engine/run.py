"""How a training run is built (`setup_run`): device, data, model, its wrappers,
optimizer and run folder, in that order, from a config; with a source's weights
(engine/pretrained.py) or a checkpoint's state (engine/resume.py, engine/state.py).
What a run holds is engine/state.py's `Run`; the loop that trains it is engine/loop.py."""
from __future__ import annotations

from pathlib import Path

import torch

from common.errors import CheckpointError, ConfigError
from common.shell import word
from engine import checkpoint
from engine.budget import refuse_what_cannot_fit
from engine.config import RunConfig
from engine.device import pick_device, pick_dtype, setup_backends
from engine import machine
from engine.distributed import Dist
from engine.objectives import OBJECTIVES
from engine.optim import configure_optimizer
from engine.pretrained import Pretrained
from engine.resume import branch, record_parent_weights
from engine.rundir import claim_fresh_dir, fresh_name, lock_run_dir, stopped_line, write_run_files
from engine.state import Run, refuse_other_tokens, restore
from data.tokenizer import Tokenizer
from data.tokens import Batches, TokenData, load_tokens
from model import GPT
from model.readout import READOUTS, SHORTLIST_COVERAGE, shortlist_for


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
    device = _pick_device(train_cfg, dist)
    refuse_what_cannot_fit(cfg, device)       # before the data or the model costs anything
    torch.manual_seed(train_cfg.seed)
    data = _load_data(cfg, dist, log, _given_tokenizer(cfg, run_dir, resume, source))
    dtype = pick_dtype(train_cfg.dtype, device, cfg.model.n_embd,
                       experts=machine.routes_experts(cfg.model))
    model = _build_model(cfg, data, device, log, resume, source, dtype)
    distributed_model, sharded = _distribute(model, train_cfg, dist, device)
    kernel = machine.kernel_words(cfg.model, model.config.attention)
    run = Run(cfg, dist, device, dtype, data,
              batches=Batches(data.train, train_cfg.batch_size, cfg.model.block_size, device,
                              seed=train_cfg.seed, sampling=cfg.data.sampling),
              model=model, distributed_model=distributed_model,
              train_forward=machine.compiled(distributed_model, train_cfg.compile),
              eval_forward=machine.compiled(model, train_cfg.compile),
              optimizer=configure_optimizer(model, train_cfg, device),
              scaler=torch.amp.GradScaler(device.type, enabled=dtype == torch.float16),
              run_dir=Path(run_dir or Path(train_cfg.out_dir) / (train_cfg.run_name or fresh_name(cfg))),
              sharded=sharded, log=log, kernel=kernel)
    _open_run_dir(run, run_dir, resume)
    return run


def _pick_device(train_cfg, dist: Dist) -> torch.device:
    """The device this process trains on (under torchrun, its own GPU), its backends set."""
    device = pick_device(train_cfg.device)
    if dist.world > 1 and device.type == "cuda":
        device = torch.device("cuda", dist.local_rank)
    setup_backends(device)
    return device


def _given_tokenizer(cfg: RunConfig, run_dir: Path | None, resume: bool | Path,
                     source: Pretrained | None) -> Tokenizer | None:
    """The tokenizer the data must be encoded with: the source's, or on a fine-tuning
    run's resume its parent's (saved in the run); None where the corpus decides."""
    given = source.tokenizer if source else None
    if resume and cfg.train.init_from:        # a fine-tuning run keeps its parent's tokenizer
        given = Tokenizer.load(resume if isinstance(resume, Path)
                               else run_dir or Path(cfg.train.out_dir) / cfg.train.run_name)
    return given


def _build_model(cfg: RunConfig, data: TokenData, device: torch.device, log,
                 resume: bool | Path, source: Pretrained | None, dtype: torch.dtype) -> GPT:
    """The model on its device with the attention kernel chosen for this machine and
    precision: a source's weights, or new ones, an adaptive readout's shortlist ranked by
    the training tokens (a new model only)."""
    counts = None
    if READOUTS[cfg.model.readout].shortlisted and not resume and source is None:
        counts = torch.from_numpy(data.train.counts(cfg.model.vocab_size))
        fit_readout(cfg.model, counts, log)
        cfg.validate()                        # the shortlist against the vocabulary
    refuse_what_cannot_fit(cfg, device)       # again, now that the vocabulary is known
    # built_for names the attention backend that pays on this machine (`auto` becomes eager
    # or sdpa, model/attention.py); the run's `device:` line says which and why.
    model = GPT(machine.built_for(cfg.model, device, dtype))
    if counts is not None:
        model.adaptive.set_frequencies(counts)
    if source is not None:
        model.load_state_dict(source.model.state_dict())
    return model.to(device)


def _distribute(model: GPT, train_cfg, dist: Dist, device: torch.device
                ) -> tuple[torch.nn.Module, bool]:
    """(what backward runs through, whether sharded): under torchrun the model sharded
    (FSDP) in place, or wrapped in DDP; in one process the model itself."""
    sharded = dist.world > 1 and train_cfg.parallel == "fsdp"
    if sharded:                               # before the optimizer sees the parameters
        from engine.sharding import shard
        shard(model)
    distributed_model = model
    if dist.world > 1 and not sharded:        # gradients averaged across processes
        from torch.nn.parallel import DistributedDataParallel
        distributed_model = DistributedDataParallel(
            model, device_ids=[dist.local_rank] if device.type == "cuda" else None)
    return distributed_model, sharded


def _open_run_dir(run: Run, run_dir: Path | None, resume: bool | Path) -> None:
    """The run's folder locked for this process (a fresh name where none was given),
    then started: a branch, a checkpoint's state, or refused over another run's
    checkpoints; its config and tokenizer written. A Ctrl-C here says which folder to
    go on with."""
    dist, train_cfg = run.dist, run.cfg.train
    if isinstance(resume, Path):              # before a branch's folder is made for it
        refuse_other_tokens(run.data, run.cfg.data.path, checkpoint.readable_state(resume), resume)
    run.made_dir = dist.is_main and not run.run_dir.exists()
    try:
        if dist.is_main and not (run_dir or train_cfg.run_name or resume) and dist.world == 1:
            claim_fresh_dir(run)
        elif dist.is_main:
            run.lock = lock_run_dir(run.run_dir)
        if isinstance(resume, Path) and resume.parent.parent.resolve() != run.run_dir.resolve():
            branch(run, resume)
        elif resume:
            restore(run, resume if isinstance(resume, Path) else None)
            record_parent_weights(run)
        elif checkpoint.list_checkpoints(run.run_dir):
            raise CheckpointError(f"{run.run_dir} already holds checkpoints; continue it with "
                                  f"--resume {word(run.run_dir)}, or choose another train.run_name")
        if dist.is_main:
            write_run_files(run)
    except KeyboardInterrupt as err:          # before training: say which folder to go on with
        run.release()                         # for a caller that goes on (a notebook)
        if err.args:
            raise
        raise type(err)(stopped_line(run, "stopped before training")) from None


def fit_readout(model_cfg, counts: torch.Tensor, log) -> None:
    """An adaptive readout's shortlist from the training tokens' counts, where the
    config leaves it to the data (0)."""
    if not model_cfg.readout_shortlist:
        model_cfg.readout_shortlist = min(shortlist_for(counts), model_cfg.vocab_size - 1)
        log(f"adaptive readout: the {model_cfg.readout_shortlist:,} most frequent of "
            f"{model_cfg.vocab_size:,} tokens make up {SHORTLIST_COVERAGE:.0%} of the training "
            "tokens and get the full softmax; the rest go through its tail")


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
        log("warning: model.causal=false with a next-token objective: every position sees the token "
            "it is asked to predict, so the loss collapses and the model learns nothing it "
            "can generate with (the article's §04; python -m attnlab.article leak shows it)")
    if given is not None:                     # the model's vocabulary may be padded past it
        return data
    if cfg.model.vocab_size not in (0, data.tokenizer.vocab_size):
        log(f"model.vocab_size={cfg.model.vocab_size} replaced by the tokenizer's "
            f"{data.tokenizer.vocab_size}")
    cfg.model.vocab_size = data.tokenizer.vocab_size
    return data
