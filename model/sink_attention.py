"""Learned attention sinks (gpt-oss, arXiv:2508.10925; the sink of StreamingLLM,
arXiv:2309.17453, made a parameter): each head has one learned logit s_h that takes part
in the softmax's denominator and in nothing else,

    weights = exp(Q·Kᵀ/√d_k) / (Σ_keys exp(Q·Kᵀ/√d_k) + exp(s_h)),   out = weights · V,

so a head that finds nothing worth reading can put its weight on the sink, which hands
on no value, instead of on whichever token happens to score highest (a softmax row must
sum to 1; with the sink, the real keys' weights sum to less). The mask, sliding windows
and the KV cache are multi-head attention's: the sink is not a token, so no cache keeps
it and no window hides it."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.attention import Mask, MultiHeadAttention, at_least_fp32
from model.config import ModelConfig


class SinkAttention(MultiHeadAttention):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.kernel = None                  # its own softmax: no backend computes it
        self.sinks = nn.Parameter(torch.zeros(self.n_head))      # s_h, one logit a head

    def attend(self, q, k, v, mask: Mask, need_weights: bool = False):
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))   # (B, H, Tq, Tk)
        if mask.bias is not None:
            scores = scores + mask.bias
        scores = mask.hide(scores, float("-inf"))
        B, H, Tq, _ = scores.shape
        sink = self.sinks.view(1, H, 1, 1).expand(B, H, Tq, 1).to(scores.dtype)
        # The sink's logit joins each row's softmax as one more column, then is dropped.
        weights = torch.softmax(at_least_fp32(torch.cat([scores, sink], dim=-1)), dim=-1)
        weights = weights[..., :-1].to(q.dtype)
        out = F.dropout(weights, self.dropout if self.training else 0.0) @ v
        return out, (weights if need_weights else None)
