"""Differential attention (Ye et al., "Differential Transformer", arXiv:2410.05258).

Each head splits its query and key into two halves of d = d_k/2 and forms two softmax
maps over the same values; the output is their difference,

    DiffAttn(X) = (softmax(Q₁K₁ᵀ/√d) − λ·softmax(Q₂K₂ᵀ/√d)) · V,

so attention that both maps give to irrelevant context (the common-mode "noise" of a
softmax, which can never put exactly zero weight anywhere) cancels, as a differential
amplifier cancels noise common to its two inputs. λ is learned, re-parameterised as
λ = exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init with λ_init = 0.8 − 0.6·exp(−0.3·(l−1))
for layer l counted from 1 (the paper's §2.1). Each head's output is normalised on its
own (RMSNorm per head, the paper's GroupNorm) and scaled by (1 − λ_init), so the
gradient flows as in a plain Transformer at the start (the paper's §2.2).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.attention import MultiHeadAttention, eager_attention
from model.config import ModelConfig, ModelError
from model.attention import Mask


def lambda_init(layer_idx: int) -> float:
    """λ_init = 0.8 − 0.6·exp(−0.3·(l−1)), l = layer_idx + 1: deeper layers subtract more."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer_idx)


def halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., d_k) -> two (..., d_k/2): the even and the odd rotation pairs. RoPE turns
    dimension i with i + d_k/2 ("rotate half"), so each half takes whole pairs, laid out
    rotate-half again; half 1's frequencies are exactly those of RoPE at d_k/2, half 2's
    lie between them, and both maps see near and far offsets alike.

    The paper's code turns each half by a RoPE of its own at d_k/2, so its two maps turn
    at the same frequencies. Here q and k are turned once, by the model's RoPE at d_k, in
    the prologue every mechanism shares: the cache then holds keys turned as every other
    layer's are, and a streaming cache renumbers them with the model's one shift. The
    price is maps at interleaved frequencies (tests/test_mechanisms.py pins which)."""
    pairs = x.unflatten(-1, (2, x.shape[-1] // 4, 2))       # (..., rotate half, pair j, parity)
    return pairs[..., 0].flatten(-2), pairs[..., 1].flatten(-2)


class DifferentialAttention(MultiHeadAttention):
    """n_head differential heads, each with d_k = n_embd / n_head: queries and keys split
    into two halves of d_k/2, values d_k wide (the paper's 2d). The projections, hook
    points, positions, cache and backends are multi-head attention's (`project`); the
    maths after them (`attend`) and QK-norm per half (`normalise`) are its own."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.lambda_init = lambda_init(layer_idx)
        # The paper's (1 − λ_init): with it the normalised heads start at the scale of a
        # plain Transformer's, so its learning rates and initialisation carry over.
        self.out_scale = 1.0 - self.lambda_init
        d = self.head_dim // 2
        # λ's four vectors, drawn from N(0, 0.1²) as in the paper's code: at exactly zero
        # both exp terms have zero gradient and λ could never move from λ_init.
        self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = (
            nn.Parameter(torch.empty(d).normal_(0.0, 0.1)) for _ in range(4))
        self.head_norm = nn.RMSNorm(self.head_dim, eps=config.norm_eps)   # one per head, shared gains

    def lam(self) -> torch.Tensor:
        """λ = exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init, a scalar for the layer."""
        return (torch.exp(self.lambda_q1 @ self.lambda_k1) - torch.exp(self.lambda_q2 @ self.lambda_k2)
                + self.lambda_init)

    def normalise(self, x, which: str = "q"):
        """Each half is a query or key of its own, so QK-norm scales each half to unit RMS
        (a rotation keeps each pair's length, so before or after RoPE is the same)."""
        first, second = halves(x)
        d = first.shape[-1]
        pairs = torch.stack((F.rms_norm(first, (d,)).unflatten(-1, (2, -1)),
                             F.rms_norm(second, (d,)).unflatten(-1, (2, -1))), dim=-1)
        return pairs.flatten(-3)                       # back to the rotate-half layout

    def attend(self, q, k, v, mask: Mask, need_weights: bool = False):
        (q1, q2), (k1, k2) = halves(q), halves(k)                    # each (B, H, T*, D/2)
        y1, y2, weights = self.two_maps(q1, k1, q2, k2, v, mask, need_weights)
        lam = self.lam().to(y1.dtype)
        y = y1 - lam * y2                                            # (B, H, T, D)
        y = self.head_norm(y) * self.out_scale
        if weights is not None:              # what the heatmaps draw: the difference map
            weights = weights[0] - lam * weights[1]
        return y, weights

    def two_maps(self, q1, k1, q2, k2, v, mask: Mask, need_weights: bool):
        """softmax(Q₁K₁ᵀ/√d)·V and softmax(Q₂K₂ᵀ/√d)·V through the model's backend (and
        the two maps when asked for). A backend wants q, k and v of one width, so V's two
        halves go through as heads of their own: four attentions of d_k/2 in one call."""
        H = q1.shape[1]
        # Its entry says takes_score_bias=False: a bias handed in is refused, not misapplied.
        if mask.bias_fn is not None:
            raise ModelError("differential attention runs its two maps as four sets of heads, "
                             "which ALiBi's per-head score bias does not fit; use another "
                             "model.position")
        va, vb = v.chunk(2, dim=-1)
        backend = eager_attention if need_weights else self.kernel
        dropout_p = self.dropout if self.training else 0.0
        y, w = backend(torch.cat([q1, q1, q2, q2], 1), torch.cat([k1, k1, k2, k2], 1),
                       torch.cat([va, vb, va, vb], 1), mask, dropout_p, need_weights)
        y1 = torch.cat([y[:, :H], y[:, H:2 * H]], dim=-1)              # (B, H, T, D)
        y2 = torch.cat([y[:, 2 * H:3 * H], y[:, 3 * H:]], dim=-1)
        return y1, y2, (None if w is None else (w[:, :H], w[:, 2 * H:3 * H]))
