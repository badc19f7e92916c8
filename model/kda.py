"""Kimi Delta Attention: the gated delta rule with one decay per channel of the key, not
one per head (Kimi Team, "Kimi Linear", arXiv:2510.26692).

Gated DeltaNet (model/deltanet.py) fades the whole state by one α_t per head before each
delta step. KDA gives every one of the d_k key channels its own α_t[c] ∈ (0, 1):

    S_t = (I − β_t k_t k_tᵀ) Diag(α_t) S_{t-1} + β_t k_t v_tᵀ,    o_t = S_tᵀ q_t,

with S_t of d_k × d_v (a row per key channel, the layout of model/deltanet.py's state), so
Diag(α_t) fades row c of the state, what the keys wrote along channel c, by α_t[c]. A
head can then keep some channels for thousands of tokens and clear others at once, where
a scalar α must choose one memory length for the whole head (the paper's "fine-grained"
gate; Gated DeltaNet is the case of α equal across channels, DeltaNet of α = 1).

The decay comes from the input through a low-rank map, as the paper and
flash-linear-attention's `fla/ops/kda` (and transformers' KimiLinear) write it:
ln α_t = −exp(A_h) · softplus(W_up W_down x_t + b_dt), per head h and channel, with
W_down of rank d_k. Each head's output is RMS-normed and gated by a second low-rank map,
o ← RMSNorm(o) ⊙ sigmoid(W_up' W_down' x_t), before W_O. The kernels also scale q by
1/√d_k; the RMSNorm after the rule undoes any scale of q (all but its ε), so it is left
out here unless model.delta_conv builds the paper's short convolution before q, k and v
(model/deltanet.py), which brings the kernels' form whole, that scale included.

Training uses the chunked form (`chunk`): the UT transform of Gated DeltaNet, with each
product k_iᵀ k_t inside a chunk taken through the fading between i and t channel by
channel. That fading is a C × C × d_k tensor per head and chunk (masked before exp, so
a strong decay cannot overflow), where Gated DeltaNet's is C × C: d_k times the memory
and elementwise work of its chunk, the same matrix products. (The paper's kernel avoids
that tensor with a constrained diagonal-plus-low-rank form worked in sub-chunks: faster,
not simpler.) Decoding keeps S, d_k × d_v per head, as DeltaNet does."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.attention import at_least_fp32
from model.config import ModelConfig
from model.deltanet import DeltaNet, chunked as delta_chunked, inverse_softplus  # noqa: F401

# The state is stored as in model/deltanet.py: (B, H, D_k, D_v), row c for key channel c.


def recurrent(q, k, v, beta, log_alpha, state):
    """KDA one token at a time. q, k, v: (B, H, T, D); beta: (B, H, T); log_alpha:
    (B, H, T, D), ln α_t per key channel; state: (B, H, D, D). Returns the outputs
    (B, H, T, D) and the state after them."""
    outs = []
    for t in range(q.shape[-2]):
        k_t, v_t, b_t = k[:, :, t], v[:, :, t], beta[:, :, t, None]  # (B, H, D), (B, H, 1)
        # Diag(α_t) S: row c, what was written along key channel c, fades by α_t[c].
        state = log_alpha[:, :, t, :, None].exp() * state
        held = (k_t.unsqueeze(-2) @ state).squeeze(-2)               # (Diag(α)S)ᵀ k_t: (B, H, D)
        # Erase β of what the faded state holds at k_t and write β of the new value there.
        state = state + k_t.unsqueeze(-1) * (b_t * (v_t - held)).unsqueeze(-2)
        outs.append((q[:, :, t].unsqueeze(-2) @ state).squeeze(-2))  # o_t = S_tᵀ q_t
    return torch.stack(outs, dim=2), state


def fading(log_alpha):
    """Within a chunk, channel by channel, how much of what token i wrote is left at token
    t ≥ i: exp(γ_t − γ_i) with γ the running sum of ln α (B, H, C, C, D; 0 for t < i,
    masked before exp so that a strong decay's upper corner cannot overflow), and
    Γ_t = exp(γ_t) itself (B, H, C, D)."""
    gamma = log_alpha.cumsum(-2)                                     # (B, H, C, D)
    gap = gamma.unsqueeze(-2) - gamma.unsqueeze(-3)                  # (B, H, C_t, C_i, D)
    C = gap.shape[-2]
    later = torch.ones(C, C, dtype=torch.bool, device=gap.device).tril().unsqueeze(-1)
    return gap.masked_fill(~later, float("-inf")).exp(), gamma.exp()


def chunk(q, k, v, beta, log_alpha, state):
    """C tokens at once, equal to C steps of `recurrent`: Gated DeltaNet's UT transform
    (model/deltanet.py, `chunk`) with Γ a vector per token.

    Diag(α_t) S_{t-1} = Diag(Γ_t) S_0 + Σ_{i<t} Diag(Γ_t/Γ_i) k_i u_iᵀ, where
    u_i = β_i(v_i − (Diag(α_i) S_{i-1})ᵀ k_i) is what token i writes. So
    (I + A) U = diag(β)(V − (Γ ⊙ K) S_0) with A[t, i] = β_t k_tᵀ Diag(Γ_t/Γ_i) k_i for
    i < t: the same triangular system, each key product faded channel by channel.
    q, k, v: (B, H, C, D); beta: (B, H, C); log_alpha: (B, H, C, D); state: (B, H, D, D)."""
    C = q.shape[-2]
    left, Gamma = fading(log_alpha)                                  # (B, H, C, C, D), (B, H, C, D)
    faded = left * k.unsqueeze(-3)        # [t, i]: k_i ⊙ Γ_t/Γ_i, 0 for i > t: (B, H, C, C, D)
    # Each row t of `faded` against k_t (for A) and q_t (for the outputs), in one product
    # per token, (C × D) @ (D × 2): two columns, as a CPU runs a batch of matrix-vector
    # products many times slower than one of thin matrices.
    with_k, with_q = (faded @ torch.stack([k, q], dim=-1)).unbind(-1)  # (B, H, C_t, C_i) each
    A = (beta.unsqueeze(-1) * with_k).tril(-1)                       # i < t only
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    T = torch.linalg.solve_triangular(eye + A, torch.diag_embed(beta), upper=False)
    W, U = T @ (Gamma * k), T @ v                                    # (B, H, C, D) each
    new = U - W @ state                    # u_t: each token's write, after the state's part
    # o_t = S_tᵀ q_t: the faded state before the chunk, plus what is left of every write
    # up to and including t.
    out = (Gamma * q) @ state + with_q @ new
    last = left[:, :, -1]                                            # (B, H, C, D): Γ_C/Γ_i
    return out, Gamma[:, :, -1, :, None] * state + (last * k).transpose(-2, -1) @ new


def chunked(q, k, v, beta, log_alpha, state, size: int):
    """The parallel form for training and prefill, DeltaNet's chunk loop over this file's
    `chunk`. Returns (B, H, T, D), state."""
    return delta_chunked(q, k, v, beta, log_alpha, state, size, step=chunk)


class KimiDeltaAttention(DeltaNet):
    """Multi-head KDA: DeltaNet's q, k, v and β (model/deltanet.py), a decay per key
    channel from a low-rank map of the input (`gate`), and each head's output RMS-normed
    and gated before W_O (`read`)."""

    rule = staticmethod(chunked)

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        H, D = config.n_head, config.head_dim
        self.norm_eps = config.norm_eps
        # Both low-rank maps go through d_k numbers, the paper's rank.
        self.w_decay_down = nn.Linear(config.n_embd, D, bias=False)
        self.w_decay_up = nn.Linear(D, H * D, bias=False)
        self.w_gate_down = nn.Linear(config.n_embd, D, bias=False)
        self.w_gate_up = nn.Linear(D, H * D, bias=False)
        # Plain parameters, which the model's initialisation of linear layers leaves as they
        # are. The decay starts as fla's does, spread out and not drawn: exp(A) from 1 to 16
        # over the heads, softplus(b_dt) from 0.001 to 0.1 over each head's channels, so at
        # x = 0 the channels of a head keep what they hold for about 1 to 1,000 tokens.
        self.decay_log_rate = nn.Parameter(torch.linspace(1.0, 16.0, H).log())      # A, (H,)
        self.decay_bias = nn.Parameter(inverse_softplus(torch.logspace(-3, -1, D)).repeat(H))
        self.out_norm = nn.Parameter(torch.ones(D))                 # RMSNorm's gain, per channel

    def gate(self, x):
        """ln α per token, head and key channel, (B, T, H, D): −exp(A_h) · softplus(f(x) + b_dt),
        each ≤ 0, so every α is in (0, 1]."""
        B, T, _ = x.shape
        f = at_least_fp32(self.w_decay_up(self.w_decay_down(x))) + self.decay_bias
        rate = self.decay_log_rate.exp()[:, None]                    # exp(A): (H, 1)
        return -rate * F.softplus(f.view(B, T, self.n_head, self.head_dim))

    def read(self, y, x):
        """Each head's output RMS-normed over its channels (so its size no longer follows
        how much the state holds) and gated channel by channel by sigmoid(W_up' W_down' x)."""
        B, T, _ = x.shape
        gate = self.w_gate_up(self.w_gate_down(x)).view(B, T, self.n_head, self.head_dim)
        normed = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        return normed * self.out_norm * torch.sigmoid(at_least_fp32(gate)).transpose(1, 2)

