"""Gated attention (Qiu et al., "Gated Attention for Large Language Models", arXiv:2505.06708;
Qwen3-Next's softmax layers): each head's output is multiplied, element by element, by a
sigmoid gate computed from the layer's own input before W_O mixes the heads,

    out = W_O · (Attention(Q, K, V) ⊙ σ(x·W_G)),

so a head can switch itself off for a token (the gate near 0) where plain attention must
always hand on a weighted average; the paper finds it removes the attention sink and the
loss spikes it comes with. The gate adds one n_embd × n_embd matrix and touches nothing
before the weighted sum: queries, keys, values and the cache are multi-head attention's."""
from __future__ import annotations

import torch
import torch.nn as nn

from model.attention import Mask, MultiHeadAttention
from model.config import ModelConfig


class GatedAttention(MultiHeadAttention):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.w_gate = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)   # W_G

    def forward(self, x, positions, mask: Mask, cache=None, need_weights: bool = False,
                value_embed=None):
        B, T, C = x.shape
        q, k, v = self.project(x, positions, mask, cache, value_embed)
        y, weights = self.attend(q, k, v, mask, need_weights)        # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, C)                       # heads side by side
        return self.resid_dropout(self.output(x, y)), weights

    def output(self, x, y):
        """W_O · (y ⊙ σ(x·W_G)): the heads' outputs y (B, T, C), side by side, each gated
        element by element from the layer input x, then mixed by W_O."""
        return self.w_o(y * torch.sigmoid(self.w_gate(x)))
