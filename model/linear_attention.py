"""Causal linear attention (Katharopoulos et al., "Transformers are RNNs", arXiv:2006.16236).

The article's attention weighs value j for query i by exp(q_i·k_j/√d), normalised over
the keys. Replace that similarity by a kernel φ(q_i)·φ(k_j) with a positive feature map
φ(x) = elu(x) + 1, and the output becomes

    y_i = φ(q_i)ᵀ Σ_{j≤i} φ(k_j) v_jᵀ  /  φ(q_i)ᵀ Σ_{j≤i} φ(k_j)

(the paper's eq. 6 with the causal sum). The two sums do not depend on i's query, so
they can be carried from token to token: S_i = S_{i-1} + φ(k_i)v_iᵀ and
z_i = z_{i-1} + φ(k_i). Decoding is an RNN whose state (S, z) has a fixed size, d×d + d
per head, however long the text: no cache that grows. Training computes the same
outputs chunk by chunk (`chunked`): inside a chunk, the masked quadratic form; across
chunks, the state.

What it loses: the weights φ(q)·φ(k) are a kernel of rank d, not a softmax, so a query
cannot put nearly all its weight on one key among many (Zoology, arXiv:2312.04927,
measures the recall this costs). The causal sums carry order, so no position encoding
turns q and k here (a RoPE turn would make φ's products negative)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from model.attention import at_least_fp32
from model.config import ModelConfig, ModelError
from model.attention import Mask

# The paper's code adds 1e-6 to the normaliser: exp(x) underflows to 0 below x = -87 in
# fp32 and bf16, and a query whose every feature did would divide 0 by 0.
EPS = 1e-6


def feature_map(x: torch.Tensor) -> torch.Tensor:
    """φ(x) = elu(x) + 1: positive everywhere, so every weight φ(q)·φ(k) is positive and
    the normaliser cannot cancel to zero (the paper, section 3.2.1). Written as x + 1
    above zero and exp(x) below, the same function: elu's exp(x) - 1, plus 1, rounds to
    exactly 0 below x = -8 in bf16 (-17 in fp32), where exp(x) stays positive to -87."""
    return torch.where(x > 0, x + 1, torch.exp(x.clamp(max=0)))


@dataclass
class LinearState:
    """The recurrent state of one layer: S = Σ φ(k)vᵀ (B, H, D, D) and z = Σ φ(k)
    (B, H, D) over every token so far, a fixed size. The model's cache keeps it as one
    tensor (`packed`): z is S's extra column, Σ φ(k)·1, as if each value had a 1 appended."""
    S: torch.Tensor
    z: torch.Tensor

    @classmethod
    def empty(cls, like: torch.Tensor) -> "LinearState":
        B, H, _, D = like.shape
        return cls(like.new_zeros(B, H, D, D), like.new_zeros(B, H, D))

    @classmethod
    def unpacked(cls, state: torch.Tensor) -> "LinearState":
        return cls(state[..., :-1], state[..., -1])                # (B, H, D, D), (B, H, D)

    def packed(self) -> torch.Tensor:
        return torch.cat([self.S, self.z.unsqueeze(-1)], dim=-1)    # (B, H, D, D + 1)


def chunk(phi_q, phi_k, v, state: LinearState):
    """One chunk of C tokens after `state`: (B, H, C, D) outputs and the state after it.

    Each query reads the state of the tokens before the chunk and, inside the chunk, the
    masked quadratic form: tril keeps key j ≤ i only, so no sum sees the future."""
    within = (phi_q @ phi_k.transpose(-2, -1)).tril()                # (B, H, C, C)
    numerator = phi_q @ state.S + within @ v                         # (B, H, C, D)
    normaliser = (phi_q @ state.z.unsqueeze(-1)).squeeze(-1) + within.sum(-1)  # (B, H, C)
    y = numerator / (normaliser.unsqueeze(-1) + EPS)
    # Only then does the chunk join the state, for the chunks after it.
    after = LinearState(state.S + phi_k.transpose(-2, -1) @ v, state.z + phi_k.sum(-2))
    return y, after


def chunked(phi_q, phi_k, v, state: LinearState, size: int):
    """The parallel form for training and prefill: chunks of `size` tokens, each reading
    the state of those before it. Memory grows with T·size, not T²; size ≥ T is the
    paper's masked quadratic form in one piece. Returns (B, H, T, D) and the state."""
    ys = []
    for start in range(0, phi_q.shape[-2], size):
        part = slice(start, start + size)
        y, state = chunk(phi_q[:, :, part], phi_k[:, :, part], v[:, :, part], state)
        ys.append(y)
    return torch.cat(ys, dim=2), state


def recurrent(phi_q, phi_k, v, state: LinearState):
    """The RNN form, one token at a time (the paper's eqs. 18-20): add the token's φ(k)vᵀ
    and φ(k) to the state, then read the state with its φ(q). Returns (B, H, T, D)."""
    ys = []
    S, z = state.S, state.z
    for t in range(phi_q.shape[-2]):
        S = S + phi_k[:, :, t, :, None] * v[:, :, t, None, :]       # (B, H, D, D)
        z = z + phi_k[:, :, t]                                       # (B, H, D)
        numerator = (phi_q[:, :, t, None, :] @ S).squeeze(-2)        # (B, H, D)
        normaliser = (phi_q[:, :, t] * z).sum(-1, keepdim=True)      # (B, H, 1)
        ys.append(numerator / (normaliser + EPS))
    return torch.stack(ys, dim=2), LinearState(S, z)


def weights(phi_q, phi_k) -> torch.Tensor:
    """The weights linear attention gives each earlier token: φ(q_i)·φ(k_j) for j ≤ i,
    divided by their sum, so each row is positive and sums to 1 as softmax's do.
    (B, H, T, T), for the tools that draw attention; training never forms them."""
    within = (phi_q @ phi_k.transpose(-2, -1)).tril()
    return within / (within.sum(-1, keepdim=True) + EPS)


class LinearAttention(nn.Module):
    """Multi-head causal linear attention: the projections of MultiHeadAttention, with
    the softmax replaced by the kernel φ(q)·φ(k), and with a fixed-size state
    (LinearState, through `cache.state`/`cache.keep`) instead of keys and values. Windows,
    global tokens and an encoder's both directions are refused by the registry: the
    state is a sum over every earlier token (its entry's follows_mask=False)."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        if config.linear_chunk <= 0:
            raise ModelError(f"model.linear_chunk must be a positive integer, got "
                             f"{config.linear_chunk}")
        self.layer_idx, self.chunk_size = layer_idx, config.linear_chunk
        self.n_head, self.head_dim = config.n_head, config.head_dim
        self.w_qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.w_o = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, positions, mask: Mask, cache=None, need_weights: bool = False,
                value_embed=None):
        B, T, C = x.shape
        H, D = self.n_head, self.head_dim
        q, k, v = self.w_qkv(x).view(B, T, 3 * H, D).transpose(1, 2).split(H, dim=1)  # (B, H, T, D)
        if value_embed is not None:              # a per-token vector added to the value
            v = v + value_embed.view(B, T, H, D).transpose(1, 2)
        # φ and the sums in at least fp32, outside autocast: the state adds up a whole text,
        # which bf16's 8-bit mantissa would round away.
        q, k, v = (at_least_fp32(t) for t in (q, k, v))
        state = None if cache is None else cache.state(self.layer_idx)
        state = LinearState.empty(q) if state is None else LinearState.unpacked(state)
        with torch.autocast(x.device.type, enabled=False):
            y, state = self.sums(q, k, v, state)
        if cache is not None:
            cache.keep(self.layer_idx, state.packed())
        w = None
        if need_weights:
            if cache is not None:
                raise ModelError("linear attention keeps a sum over earlier tokens, not their "
                                 "keys: it has weights to draw for a whole text, without a cache")
            w = weights(feature_map(q), feature_map(k)).to(x.dtype)
        y = y.to(x.dtype).transpose(1, 2).reshape(B, T, C)          # heads side by side
        return self.resid_dropout(self.w_o(y)), w

    def sums(self, q, k, v, state: LinearState):
        """The outputs (B, H, T, D) and the state after them, from the heads' q, k, v
        before φ. Training and prefill in chunks, a decoded token as a chunk of one: the
        same sums. The one place they are made, so a subclass can make them another way:
        attnlab/exercises/plug.py runs the learner's recurrent step here (exercise 9)."""
        return chunked(feature_map(q), feature_map(k), v, state, self.chunk_size)
