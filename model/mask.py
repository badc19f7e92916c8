"""The one mask rule (the Mask each forward pass builds from it is in model/attention.py).

A query may look at a key when the key is not ahead of it (the causal mask) and, with
a sliding window, not too far behind it. An encoder (model.causal=false, BERT) drops
the first part: every query sees every key, except padding in a batch of unequal
lengths. The rule is written once, here, on absolute
positions; the eager mask, SDPA's mask, the banded path and FlexAttention's `mask_mod`
all call it, so they cannot disagree."""
from __future__ import annotations

import torch


def rule(q, k, window: int = 0, n_global: int = 0, causal: bool = True):
    """The one mask rule, on absolute positions (broadcastable tensors): a query at
    position q may look at a key at position k when the key is not ahead of it and,
    with a sliding window W, at most W-1 positions behind it, unless the key is one
    of the first n_global positions, which every later query may see (global tokens /
    attention sinks, arXiv:2004.05150, arXiv:2309.17453). Not causal (an encoder):
    every key, ahead or behind (a window needs causal order; the config refuses both)."""
    if not causal:
        return torch.ones(torch.broadcast_shapes(q.shape, k.shape), dtype=torch.bool,
                          device=k.device)
    ok = k <= q
    if window:
        near = (q - k) < window
        if n_global:
            near = near | (k < n_global)
        ok = ok & near
    return ok


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int = 0, n_global: int = 0,
            causal: bool = True):
    """The rule as a bool (Tq, Tk) matrix, True where the key is visible."""
    return rule(q_pos[:, None], k_pos[None, :], window, n_global, causal)
