"""Data parallelism across processes, GPUs and machines through torchrun.

    torchrun --standalone --nproc_per_node=4 train.py --config gpu
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \\
             --rdzv-endpoint=HOST:29500 train.py --config gpu      # on each machine

Every process holds the whole model (DDP), or with train.parallel=fsdp a shard of it
(engine/sharding.py). The global batch stays what the config
says, batch_size × grad_accum sequences per step, whatever the number of processes:
all ranks draw the same sequence of micro-batches and rank r trains on micro-batches
r, r + N, r + 2N, ..., so N processes do the work of one with the same data, and a
checkpoint resumes on any number of processes.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor


def world_size() -> int:
    """Processes torchrun started (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def setup() -> Dist:
    """Join the process group when launched by torchrun; a single process otherwise."""
    world = world_size()
    if world <= 1:
        return Dist()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    return Dist(rank, world, local_rank)


def cleanup(d: Dist) -> None:
    if d.world > 1 and dist.is_initialized():
        dist.destroy_process_group()
