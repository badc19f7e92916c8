"""The mask rule through torch's FlexAttention (torch.nn.attention.flex_attention).

FlexAttention compiles the rule (`mask_mod`) and any score bias (`score_mod`) into
one fused kernel and, from a block mask, skips every tile of the T×T score matrix
that the rule hides entirely: with a sliding window, most of them. It is the fast
windowed path on GPUs. On CPUs torch 2.13 compiles its forward pass only, so
training with it on a CPU is refused up front (attnlab/training.py)."""
from __future__ import annotations

import torch

_compiled = None


def _kernel():
    global _compiled
    if _compiled is None:
        from torch.nn.attention.flex_attention import flex_attention
        _compiled = torch.compile(flex_attention, dynamic=False)
    return _compiled


def block_mask_for(mask, device):
    """One block mask per forward pass, shared by every layer (kept on the Mask)."""
    cached = mask.__dict__.get("_flex_block_mask")
    if cached is None:
        from model.attention import rule
        from torch.nn.attention.flex_attention import create_block_mask
        q_start, k_pos, window, n_global = mask.q_start, mask.k_pos, mask.window, mask.n_global

        def mask_mod(b, h, q_idx, kv_idx):
            return rule(q_start + q_idx, k_pos[kv_idx], window, n_global)

        cached = create_block_mask(mask_mod, None, None, mask.q_len, mask.k_len, device=device)
        mask.__dict__["_flex_block_mask"] = cached
    return cached


def flex_attention(q, k, v, mask, dropout_p: float = 0.0, need_weights: bool = False):
    """Full sequences (training, evaluation, prefill) go through FlexAttention. A
    chunk after a cache, whose key count changes every step and would compile a new
    kernel each time, goes to sdpa with the same rule."""
    if mask.q_start != 0 or mask.q_len != mask.k_len:
        from model.attention import sdpa_attention
        return sdpa_attention(q, k, v, mask, dropout_p, need_weights)
    if need_weights:
        raise ValueError("the flex backend never forms the attention weights; use eager")
    if dropout_p:
        raise ValueError("the flex backend has no attention dropout")
    out = _kernel()(q, k, v, score_mod=_score_mod(mask), block_mask=block_mask_for(mask, q.device))
    return out, None


def _score_mod(mask):
    """ALiBi's distance penalty, one score at a time; None when there is no bias."""
    if mask.bias_fn is None:
        return None
    bias_fn, q_start, k_pos = mask.bias_fn, mask.q_start, mask.k_pos

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias_fn(q_start + q_idx, k_pos[kv_idx], head=h).to(score.dtype)
    return score_mod
