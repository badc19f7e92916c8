"""FSDP2 (`torch.distributed.fsdp.fully_shard`) for models too large to copy per GPU.

With `--train.parallel=fsdp` under torchrun, each block and then the whole model are
sharded: every process keeps 1/N of each parameter, gradient and optimizer state, and
gathers a block's full weights just before using them (Zhao et al., arXiv:2304.11277).
Training maths is unchanged, so the losses match DDP's and a single process's.

Checkpoints stay in the one format every run uses: before a save all processes gather
full tensors (a collective), and the main process writes them; on resume each process
cuts its own shard out of the full tensors it read. A checkpoint therefore moves freely
between one process, DDP and FSDP, and across process counts.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor


def shard(model) -> None:
    """Blocks first, so each block's weights are gathered and freed on their own; the
    root then holds the embeddings (tied to the output layer) and the final norm."""
    from torch.distributed.fsdp import fully_shard
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective for a DTensor: every process must call it)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def full_model_state(model) -> dict[str, torch.Tensor]:
    """Full weights, tied ones once, on the CPU."""
    from engine.checkpoint import model_tensors
    return model_tensors(model, whole=full)


def full_optimizer_state(optimizers) -> dict:
    """Each optimizer's state_dict with its sharded state tensors made whole."""
    out = {}
    for name, opt in optimizers.named.items():
        sd = opt.state_dict()
        sd["state"] = {idx: {k: full(v) for k, v in s.items()} for idx, s in sd["state"].items()}
        out[name] = sd
    return out


def like(value: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """A full tensor cut to ref's shard (no communication: each process has the whole)."""
    if not isinstance(ref, DTensor) or value.shape != ref.shape:
        return value
    return distribute_tensor(value.to(ref.device, ref.dtype), ref.device_mesh, ref.placements,
                             src_data_rank=None)


def shard_weights(model, weights: dict) -> dict:
    own = model.state_dict()
    return {k: like(v, own[k]) if k in own else v for k, v in weights.items()}


def shard_optimizer_state(optimizers, state: dict) -> dict:
    """Full optimizer states cut to the shards of the parameters they belong to (state
    index i is the i-th parameter across the optimizer's groups)."""
    out = {}
    for name, sd in state.items():
        opt = optimizers.named.get(name)
        if opt is None:
            out[name] = sd
            continue
        params = [p for g in opt.param_groups for p in g["params"]]
        sd = dict(sd)
        sd["state"] = {idx: {k: like(v, params[int(idx)]) if torch.is_tensor(v) and v.dim() else v
                             for k, v in s.items()} for idx, s in sd["state"].items()}
        out[name] = sd
    return out


class Snapshot:
    """Stands in for a model or optimizer whose full state was gathered already."""

    def __init__(self, state: dict):
        self.state = state

    def state_dict(self) -> dict:
        return self.state
