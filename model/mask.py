"""The one mask rule and the Mask every attention backend reads it from.

A query may look at a key when the key is not ahead of it (the causal mask) and, with
a sliding window, not too far behind it. An encoder (model.causal=false, BERT) drops
the first part: every query sees every key, except padding in a batch of unequal
lengths. The rule is written once, here, on absolute
positions; the eager mask, SDPA's mask, the banded path and FlexAttention's `mask_mod`
all call it, so they cannot disagree."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

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


@dataclass
class Mask:
    """What each query may see: queries at positions [q_start, q_start + q_len),
    keys at the absolute positions `k_pos` (in the order they are stored; a rolling
    cache keeps only some). Built once per forward pass and shared by every layer.

    Kept as positions rather than a tensor because the fast paths need none: training
    (keys 0..T-1, no window) is plain causal, and one decoded token with no window sees
    every cached key. Absolute positions keep the rule right when a short query meets a
    long cache, where SDPA's `is_causal` (aligned to the top-left corner) would not be.
    `bias_fn(q_pos, k_pos)` adds a score bias per head (ALiBi).

    Cross-attention (decoder queries over encoder keys, the article's third kind) and an
    encoder's self-attention are not causal: every key is visible except padding,
    given as `key_padding`, (B, Tk) and True where a key is only filler.

    A step over a StaticKVCache passes `q_start` as a (1,) device tensor: its position
    changes from one replay of a recorded CUDA graph to the next, so no decision may
    depend on its value; such a mask always applies `dense` (it also hides empty slots)."""
    q_start: int | torch.Tensor
    q_len: int
    k_pos: torch.Tensor
    k_first: int = 0                 # the smallest key position (known without a sync)
    window: int = 0
    n_global: int = 0
    bias_fn: Callable | None = None
    causal: bool = True
    key_padding: torch.Tensor | None = None
    # What every layer of this pass would compute alike from the positions (RoPE's
    # angles), made by the first layer that asks: one set of kernels a pass, not one a
    # layer, which is most of a decoding step's launches on a GPU.
    shared: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def over(cls, q_start: int, q_len: int, k_len: int, device=None, **kw) -> "Mask":
        """Queries at [q_start, q_start + q_len) against keys at positions 0..k_len-1."""
        return cls(q_start, q_len, torch.arange(k_len, device=device), **kw)

    @property
    def k_len(self) -> int:
        return self.k_pos.shape[0]

    @property
    def on_device(self) -> bool:
        """The query position is a device tensor (a static-cache step)."""
        return isinstance(self.q_start, torch.Tensor)

    @cached_property
    def q_pos(self) -> torch.Tensor:
        return self.q_start + torch.arange(self.q_len, device=self.k_pos.device)

    @property
    def is_whole_sequence(self) -> bool:
        """Causal attention whose queries and keys are the same positions 0..T-1
        (training, evaluation, a prefill with no cache before it): the case the
        block-wise paths (banded, flex) handle."""
        return (self.causal and self.key_padding is None and not self.on_device
                and self.q_start == 0 and self.q_len == self.k_len)

    @property
    def is_square_causal(self) -> bool:
        return self.is_whole_sequence and not self.window and self.bias_fn is None

    @property
    def sees_everything(self) -> bool:
        if self.key_padding is not None:
            return False
        if not self.causal:                        # no padding, no order: every key counts
            return True
        if self.on_device:                         # empty slots and the window: mask always
            return False
        # One query, every key at or before it and inside its window: nothing to hide.
        return self.q_len == 1 and (not self.window or self.q_start - self.k_first < self.window)

    @cached_property
    def dense(self) -> torch.Tensor:
        """True where a key is visible: (Tq, Tk), or (B, 1, Tq, Tk) with padding."""
        ok = visible(self.q_pos, self.k_pos, self.window, self.n_global, self.causal)
        if self.key_padding is not None:
            ok = ok & ~self.key_padding[:, None, None, :]
        return ok

    @cached_property
    def bias(self) -> torch.Tensor | None:
        if self.bias_fn is None:
            return None
        return self.bias_fn(self.q_pos[:, None], self.k_pos[None, :])      # (H, Tq, Tk)

    def additive(self, dtype) -> torch.Tensor:
        """Bias and mask as one float matrix: bias where visible, -inf elsewhere."""
        bias = self.bias if self.bias is not None else torch.zeros((), device=self.k_pos.device)
        return bias.to(dtype).masked_fill(~self.dense, float("-inf"))
