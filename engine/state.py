"""A run's state: what a training run holds (`Run`), what changes as it trains and is
saved with every checkpoint (`Progress`), and how that state goes to a checkpoint and
comes back (`save`, `restore`, the random streams with it), each field of a checkpoint's
state.json checked before any is used. engine/run.py builds a `Run`; engine/loop.py
trains it."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from common.errors import CheckpointError
from common.shell import word
from engine import checkpoint
from engine.config import RunConfig
from engine.device import DTYPES, autocast, dtype_name
from engine import machine
from engine.distributed import Dist
from engine.objectives import OBJECTIVES, draw_generator
from engine.optim import Optimizers
from data.tokens import Batches, TokenData
from model import GPT
from model.readout import READOUTS
from model.layers import MLPS


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
        no_mlp = "" if MLPS[c.mlp].has_weights else ", no MLP (attention only)"
        return (f"model: {c.n_layer} layers x {c.n_head} heads, {c.n_embd} wide, context "
                f"{c.block_size}, {position_words(c)}{mix}, {mechanism_words(c)}{no_mlp}, "
                f"{attention_words(c, self.kernel)}{readout}: "
                f"{m.num_params() / 1e6:.2f}M parameters ({m.num_params(True) / 1e6:.2f}M "
                f"non-embedding), {m.flops_per_token() / 1e6:.1f} MFLOPs per token (train)")

    def describe_setup(self) -> str:
        tok = self.data.tokenizer
        world = f", {self.dist.world} processes" if self.dist.world > 1 else ""
        why = machine.why_dtype(self.device, self.dtype, self.cfg.train.dtype, self.cfg.model.n_embd,
                                experts=machine.routes_experts(self.cfg.model))
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


def attention_words(c, kernel: str) -> str:
    """model.attention for the summary line, with the kernel it runs where that is not the
    name itself (`auto`, chosen for this machine: the device line says why)."""
    if not kernel or kernel == c.attention:
        return f"{c.attention} attention"
    return f"{c.attention} attention ({kernel} on this machine: see device)"


def mechanism_words(c) -> str:
    """model.mechanism with the settings that change what it attends to, for the summary
    line: 'mha mechanism (2 key/value heads; a window of 16, plus 2 global tokens)'."""
    said = []
    if c.n_kv_head not in (0, c.n_head):
        said.append(f"{c.n_kv_head} key/value head{'s' if c.n_kv_head > 1 else ''} "
                    f"for {c.n_head} query heads")
    if c.sliding_window:
        said.append(f"a window of {c.sliding_window}"
                    + (f", plus {c.n_global} global tokens" if c.n_global else ""))
    return f"{c.mechanism} mechanism" + (f" ({'; '.join(said)})" if said else "")


def position_words(c) -> str:
    """model.position for the summary line, and the mechanisms that do not turn q and k by
    a rotary one: linear attention and the delta rule take order from their causal sums,
    MLA from a decoupled key of its own (their entries' takes_rotary)."""
    from model.mechanisms import MECHANISMS
    from model.layers import layer_names
    from model.positions import POSITION_ENCODINGS
    encoding = POSITION_ENCODINGS[c.position]
    if not (encoding.absolute or encoding.rotary or encoding.biases_scores):
        return f"no positions (model.position={c.position})"
    if not encoding.rotary:
        return f"{c.position} positions"
    unturned = [n for n in dict.fromkeys(layer_names(c)) if not MECHANISMS[n].takes_rotary]
    if not unturned:
        return f"{c.position} positions"
    names = ", ".join(unturned)
    # Their own way: MLA turns a small key of its own (decoupled RoPE), a recurrent layer
    # reads its tokens in order.
    own = "a rotary key of its own or the order of its recurrence"
    if len(unturned) == len(set(layer_names(c))):
        return f"{c.position} positions (model.mechanism={names} finds order its own way: {own})"
    return (f"{c.position} positions (not in the {names} layers, which find order their own "
            f"way: {own})")


def mixing(c) -> str:
    """model.token_mix in the words of a summary line: ', each token mixed with the 3
    before it', or nothing for a model without it."""
    return (f", each token mixed with the {c.token_mix - 1} before it" if c.token_mix > 1 else
            ", each token's features rescaled (token_mix=1)" if c.token_mix else "")


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
             "autocast": dtype_name(run.dtype),        # what a resume of `auto` keeps
             "tokens": tokens_record(run.data)}
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
    refuse_other_tokens(run.data, run.cfg.data.path, state, ckpt)
    _check_train_state(run, tensors, state, ckpt)
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
        raise CheckpointError(f"checkpoint file {ckpt / checkpoint.TRAIN_STATE} holds an optimizer state "
                              f"that does not fit this model ({err}); {checkpoint.use_another(ckpt)}") from None
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
                            recorded_seconds(state, "elapsed_s", ckpt), state.get("wandb_id"),
                            state.get("last_eval", state["step"]),
                            recorded_seconds(state, "limit_s", ckpt), recorded_seconds(state, "last_eval_s", ckpt))
    run.log(f"resuming {run.run_dir} from {ckpt.name} (step {run.progress.step})")


# The kinds state.json's own fields must be, checked before any is used: valid JSON of the
# wrong kind (a hand edit) would otherwise fail mid-run, after the run wrote to its folder.
STATE_KINDS = {"best_val": (int, float), "elapsed_s": (int, float), "last_eval": (int,),
               "data_position": (int,),
               "wandb_id": (str,), "scaler": (dict,), "optimizer": (dict,), "autocast": (str,),
               "tokens": (dict,)}


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


def tokens_record(data: TokenData) -> dict:
    """What a checkpoint records of the tokens its run trains on: their folder, and the
    fingerprint of the tokenizer they were prepared with, which gives each id its text."""
    return {"folder": str(Path(data.directory).resolve()),
            "tokenizer_fingerprint": data.meta.get("tokenizer_fingerprint", "")}


def refuse_other_tokens(data: TokenData, data_path: str, state: dict, ckpt: Path) -> None:
    """Refuse to go on from `ckpt` (its state.json `state`) on `data` (data.path
    `data_path`) where those tokens were prepared with another tokenizer than the ones it
    trained on: a folder prepared again after the run started holds the same ids for
    other text, and where the vocabulary's size is the same nothing else would notice.
    A checkpoint from before the record is not checked."""
    recorded = state.get("tokens")
    if not isinstance(recorded, dict):
        return
    was, now = recorded.get("tokenizer_fingerprint"), tokens_record(data)
    if was == now["tokenizer_fingerprint"]:
        return
    given = data_path or now["folder"]
    raise CheckpointError(
        f"{now['folder']} holds tokens prepared with another tokenizer (fingerprint "
        f"{now['tokenizer_fingerprint'][:16]}) than {ckpt} was trained on "
        f"({str(recorded.get('folder'))[:300]}, fingerprint {str(was)[:16]}): its ids would stand "
        "for other text. Put back the tokens the run trained on, or train a new run on these "
        f"(python train.py --data.path={word(given)}), or start one from its weights with the "
        f"corpus's text as data.path, which encodes it with the run's own tokenizer "
        f"({word(f'--train.init_from={ckpt}')})")


def _check_train_state(run: Run, tensors: dict, state: dict, ckpt: Path) -> None:
    """Every tensor of the checkpoint's train state checked against what this run keeps
    before any is loaded: the optimizer's (checkpoint.refuse_unfit_optimizer_state), and
    the random streams', each the size and dtype of a generator's state here."""
    checkpoint.refuse_unfit_optimizer_state(run.optimizer, tensors, state.get("optimizer"), ckpt)
    own = {"data.generator": run.batches.generator.get_state(), **rng_tensors(run.device)}
    wrong = [f"{key} is missing" for key in ("data.generator", "rng.cpu") if key not in tensors]
    for key, tensor in tensors.items():
        ref = own.get(key)
        # A GPU's streams on a machine without that GPU: kept, never restored here.
        other_gpu = ref is None and re.fullmatch(r"rng\.cuda\.\d+", key)
        if key.startswith("optim."):
            continue
        if ref is None and not other_gpu:
            wrong.append(f"{key[:200]} is no tensor a run keeps")
        elif tensor.dtype != torch.uint8 or tensor.dim() != 1 or (ref is not None and tensor.shape != ref.shape):
            wrong.append(f"{key} is {tuple(tensor.shape)} {tensor.dtype}, not a generator's state"
                         + (f" ({tuple(ref.shape)} torch.uint8)" if ref is not None else ""))
        elif key in ("data.generator", "rng.cpu") and (refused := _refused_state(tensor)):
            wrong.append(f"{key} is a state torch refuses ({refused})")
    if wrong:
        raise CheckpointError(f"checkpoint file {ckpt / checkpoint.TRAIN_STATE} does not hold "
                              f"the random streams of a run ({'; '.join(wrong[:3])}); it is "
                              f"corrupt or edited: {checkpoint.use_another(ckpt)}")


def _refused_state(tensor: torch.Tensor) -> str:
    """Why torch will not take `tensor` as a CPU generator's state ("" where it will): the
    right size can still be an invalid Mersenne Twister state (all zeros)."""
    try:
        torch.Generator().set_state(tensor)
    except (ValueError, RuntimeError) as err:
        return str(err)[:200]
    return ""


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


def recorded_seconds(state: dict, key: str, ckpt: Path) -> float:
    value = state.get(key, 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < MAX_SECONDS:
        raise CheckpointError(f"checkpoint {ckpt} records {key}={json.dumps(value)[:100]} in its "
                              f"state.json ({ckpt / 'state.json'}), not a number of seconds; it is "
                              f"corrupt: {checkpoint.use_another(ckpt)}")
    return float(value)
