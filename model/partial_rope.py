"""Partial RoPE: rotary positions on part of each head (model.position=rope_partial).

Kept out of model/positions.py, which the default model's forward pass reads: this file is
met only when a config names it, and it registers itself among the position encodings
(model/registry.py imports it, so every config check and every model build sees it)."""
from __future__ import annotations

import torch

from model.positions import POSITION_ENCODINGS, RoPE


class PartialRoPE(RoPE):
    """RoPE on the first model.rope_dims dimensions of each head only (Qwen3-Next turns a
    quarter of them, GPT-NeoX's rotary_pct): those pairs carry the offset between tokens,
    the rest of q·k none, so part of each head matches by content alone. The pairs are
    rotate-half pairs within the turned part, (x[i], x[i + r/2]) for r turned dimensions."""

    def _build(self, dtype: torch.dtype, device=None):
        # RoPE's frequencies for r dimensions instead of d_k (model/registry.py refuses scaling).
        c = self.config
        r = self.dims = c.rope_dims or c.head_dim // 4
        inv_freq = c.rope_theta ** (-torch.arange(0, r, 2, dtype=dtype, device=device) / r)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rotate(self, x, start):
        return torch.cat((super().rotate(x[..., :self.dims], start), x[..., self.dims:]), -1)

    def rotate_in_pass(self, x, start, shared):
        turned = super().rotate_in_pass(x[..., :self.dims], start, shared)
        return torch.cat((turned, x[..., self.dims:]), -1)

    def shift(self, k, delta):
        return torch.cat((super().shift(k[..., :self.dims], delta), k[..., self.dims:]), -1)


POSITION_ENCODINGS["rope_partial"] = PartialRoPE
