"""Scaled dot-product attention, the causal mask and multi-head attention.

    Attention(Q, K, V) = softmax(Q·Kᵀ / √d_k) · V

Each backend computes exactly that and shares one signature,
`backend(q, k, v, mask, dropout_p, need_weights) -> (out, weights | None)`:
`eager` writes the formula out step by step and can hand back the weights;
`sdpa` calls torch's fused kernel (FlashAttention on supported GPUs, a fused
C++ kernel on CPU), which never materialises the T×T weights. Tests prove the two equal.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.config import ModelConfig


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int = 0) -> torch.Tensor:
    """The mask rule, from absolute positions: a query may look at a key that is not
    ahead of it and, with a sliding window W, at most W-1 positions behind it.
    Returns a bool (Tq, Tk) matrix, True where the key is visible."""
    offset = q_pos[:, None] - k_pos[None, :]                 # how far back the key is
    ok = offset >= 0
    if window:
        ok &= offset < window
    return ok


@dataclass
class Mask:
    """Which keys each query may see, for queries at positions [q_start, q_start+q_len)
    against keys at [0, k_len). Built once per forward pass and shared by every layer.

    Kept as positions rather than a tensor because the fast paths need no tensor:
    training (q_start = 0, q_len = k_len) is plain causal, and decoding one token
    after a cache sees every key. Working from absolute positions keeps the rule right
    when a short query attends to a long cache, where SDPA's `is_causal` (which aligns
    the triangle to the top-left corner) would be wrong."""
    q_start: int
    q_len: int
    k_len: int
    window: int = 0
    device: torch.device | str = "cpu"

    @property
    def is_square_causal(self) -> bool:
        return self.q_start == 0 and self.q_len == self.k_len and not self.window

    @property
    def sees_everything(self) -> bool:
        # Nothing to hide: the last key is not ahead of the first query, and the first
        # key is still inside the window of the last query.
        last_query = self.q_start + self.q_len - 1
        return self.k_len - 1 <= self.q_start and (not self.window or last_query < self.window)

    @cached_property
    def dense(self) -> torch.Tensor:
        q_pos = torch.arange(self.q_start, self.q_start + self.q_len, device=self.device)
        k_pos = torch.arange(self.k_len, device=self.device)
        return visible(q_pos, k_pos, self.window)


def eager_attention(q, k, v, mask: Mask, dropout_p: float = 0.0, need_weights: bool = False):
    """The article's formula, one line per idea. q: (B, H, Tq, d_k), k and v: (B, H, Tk, d_k)."""
    d_k = q.size(-1)
    # Q·Kᵀ: how well each query matches each key. Divide by √d_k because a dot product
    # of d_k unit-variance terms has a spread of √d_k; unscaled, large scores would
    # push the softmax into a one-hot corner where its gradients vanish.
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(d_k)              # (B, H, Tq, Tk)
    if not mask.sees_everything:
        # Future keys get -inf before the softmax: exp(-inf) = 0, so their weight is
        # exactly zero and no information flows backwards from the future.
        scores = scores.masked_fill(~mask.dense, float("-inf"))
    # Softmax over the keys turns each row of scores into weights that sum to 1
    # (computed in fp32 so low-precision rows still sum to 1).
    weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    # The output is the weighted average of the values.
    out = F.dropout(weights, dropout_p) @ v                          # (B, H, Tq, d_k)
    return out, (weights if need_weights else None)


def sdpa_attention(q, k, v, mask: Mask, dropout_p: float = 0.0, need_weights: bool = False):
    """The same function through torch.nn.functional.scaled_dot_product_attention,
    which picks FlashAttention or memory-efficient kernels where it can."""
    if need_weights:
        raise ValueError("the sdpa backend never forms the attention weights; use eager")
    if mask.sees_everything:           # decoding after a cache: no mask at all
        attn_mask, is_causal = None, False
    elif mask.is_square_causal:        # training: the kernel's built-in triangle
        attn_mask, is_causal = None, True
    else:                              # a chunk after a cache: the explicit rule
        attn_mask, is_causal = mask.dense, False
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                         dropout_p=dropout_p, is_causal=is_causal)
    return out, None


ATTENTION_BACKENDS = {
    "eager": eager_attention,
    "sdpa": sdpa_attention,
}


class MultiHeadAttention(nn.Module):
    """n_head attentions side by side, each on its own d_k = n_embd / n_head slice.

    W_Q, W_K and W_V are stored as one (n_embd → (H + 2·H_kv)·d_k) linear layer so a
    single matmul projects all three; W_O mixes the heads' outputs back together.
    With n_kv_head < n_head, groups of query heads share one key/value head (GQA,
    arXiv:2305.13245), which shrinks the KV cache by n_head / n_kv_head."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.kv_heads, config.head_dim
        qkv_out = (self.n_head + 2 * self.n_kv_head) * self.head_dim
        self.w_qkv = nn.Linear(config.n_embd, qkv_out, bias=config.bias)
        self.w_o = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.backend = ATTENTION_BACKENDS[config.attention]
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, positions, mask: Mask, cache=None, need_weights: bool = False):
        B, T, C = x.shape
        H, H_kv, D = self.n_head, self.n_kv_head, self.head_dim
        qkv = self.w_qkv(x).view(B, T, H + 2 * H_kv, D).transpose(1, 2)   # (B, heads, T, D)
        qk, v = qkv.split([H + H_kv, H_kv], dim=1)
        # Queries and keys get their positions in one call (RoPE turns both alike).
        q, k = positions.rotate(qk, mask.q_start).split([H, H_kv], dim=1)   # (B, H|H_kv, T, D)
        if cache is not None:                # keys and values of every earlier token too
            k, v = cache.update(self.layer_idx, k, v)
        if H_kv != H:                        # each key/value head serves H / H_kv query heads
            k = k.repeat_interleave(H // H_kv, dim=1)
            v = v.repeat_interleave(H // H_kv, dim=1)
        # Only eager forms the weights; the fused kernels never materialise them.
        backend = eager_attention if need_weights else self.backend
        dropout_p = self.dropout if self.training else 0.0
        y, weights = backend(q, k, v, mask, dropout_p, need_weights)
        y = y.transpose(1, 2).reshape(B, T, C)                       # heads side by side
        return self.resid_dropout(self.w_o(y)), weights
