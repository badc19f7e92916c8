"""Sigmoid attention (Ramapuram et al., "Theory, Analysis, and Best Practices for
Sigmoid Self-Attention", arXiv:2409.04431): each score through its own sigmoid instead of
a softmax over the row,

    SigmoidAttn(Q, K, V) = σ(Q·Kᵀ/√d_k + b) · V,   b = −log n,

so a key's weight no longer depends on the other keys' scores: weights need not sum to 1,
and a query may attend to many keys fully, or to none. With n keys of weight about σ(0)
each, the output would grow with n; the bias b = −log n (n the training context,
block_size, so cached decoding sees the same constant) starts every weight near 1/n, as
a uniform softmax would. Everything before the scores is multi-head attention's."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from model.attention import MultiHeadAttention, at_least_fp32
from model.config import ModelConfig
from model.attention import Mask


class SigmoidAttention(MultiHeadAttention):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.kernel = None                  # its own maths: no softmax kernel to run
        self.score_bias = -math.log(config.block_size)

    def attend(self, q, k, v, mask: Mask, need_weights: bool = False):
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))   # (B, H, Tq, Tk)
        weights = torch.sigmoid(at_least_fp32(scores) + self.score_bias)
        weights = mask.hide(weights, 0.0)    # σ gives a hidden key a weight above 0: set to 0
        weights = weights.to(q.dtype)
        out = F.dropout(weights, self.dropout if self.training else 0.0) @ v
        return out, (weights if need_weights else None)
