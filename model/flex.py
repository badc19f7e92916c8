"""The mask rule through torch's FlexAttention (torch.nn.attention.flex_attention).

FlexAttention compiles the rule (`mask_mod`) and any score bias (`score_mod`) into
one fused kernel and, from a block mask, skips every tile of the T×T score matrix
that the rule hides entirely: with a sliding window, most of them. It is the fast
windowed path on GPUs. On CPUs torch 2.13 compiles its forward pass only, so its
registry entry (model/attention.py) says it does not train there, and the run config
refuses that before any work. Used for whole sequences only (queries and keys at
positions 0..T-1); model/attention.py sends a chunk after a cache to sdpa."""
from __future__ import annotations

import functools

import torch

from model.mask import Mask, rule


# From this length on, the block mask is built by a compiled function that never holds
# the T×T mask: at T = 16,384 the plain build took 2.4 GiB on a CPU (the whole boolean
# mask and its intermediates), the compiled one 14 MiB; below it, the few seconds of
# compiling cost more than the mask.
COMPILE_MASK_FROM = 4096


@functools.lru_cache(maxsize=1)
def _kernel():
    from torch.nn.attention.flex_attention import flex_attention
    # Automatic dynamic shapes: after a second length the kernel is compiled for any
    # length, instead of once per length (with dynamic=False, six prompt lengths were
    # six compilations of about 3 s each on a CPU, and past torch's recompile limit it
    # fell back to the slow unfused path; dynamic=None compiled three graphs).
    return torch.compile(flex_attention, dynamic=None)


@functools.lru_cache(maxsize=16)
def block_mask(length: int, window: int, n_global: int, device: str):
    """The block mask of a whole sequence of `length` tokens. It depends on nothing
    else, so every layer and every step of the same length reuses one."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        return rule(q_idx, kv_idx, window, n_global)

    return create_block_mask(mask_mod, None, None, length, length, device=device,
                             _compile=length >= COMPILE_MASK_FROM)


def attend(q, k, v, mask: Mask) -> torch.Tensor:
    """softmax(Q·Kᵀ/√d_k + bias, masked by the rule)·V for a whole sequence."""
    blocks = block_mask(mask.q_len, mask.window, mask.n_global, str(q.device))
    return _kernel()(q, k, v, score_mod=_score_mod(mask), block_mask=blocks)


def _score_mod(mask: Mask):
    """ALiBi's distance penalty, one score at a time; None when there is no bias."""
    if mask.bias_fn is None:
        return None
    bias_fn = mask.bias_fn

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias_fn(q_idx, kv_idx, head=h).to(score.dtype)
    return score_mod
