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


@functools.lru_cache(maxsize=1)
def _kernel():
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=False)


@functools.lru_cache(maxsize=16)
def block_mask(length: int, window: int, n_global: int, device: str):
    """The block mask of a whole sequence of `length` tokens. It depends on nothing
    else, so every layer and every step of the same length reuses one."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        return rule(q_idx, kv_idx, window, n_global)

    return create_block_mask(mask_mod, None, None, length, length, device=device)


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
