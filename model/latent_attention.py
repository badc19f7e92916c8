"""Multi-head latent attention, MLA (DeepSeek-V2, arXiv:2405.04434, section 2.1).

The article's formula is untouched, softmax(Q·Kᵀ/√d)·V, per head; what changes is what a
decoder must keep for earlier tokens. Multi-head attention caches every head's key and
value, 2·H·d_h numbers per token and layer. MLA caches one latent vector per token,

    c_kv = RMSNorm(x·W_DKV)             (r numbers, r = model.mla_kv_rank ≪ 2·H·d_h)

and rebuilds every head's key and value from it when they are read:
k_C = c_kv·W_UK, v = c_kv·W_UV. The norm is DeepSeek-V2's (section 3.1.2: "additional
RMS Norm layers after the compressed latent vectors"; `kv_a_layernorm` in its code).
Without it a key or value is x through two small random matrices, so it starts 0.02·√r
times the size of multi-head attention's, and a small model learned no recall in the
steps that taught multi-head attention (measured in docs/benchmarks.md).

A key rebuilt from c_kv cannot carry RoPE: a rotation depends on the key's position, so
it would have to sit between W_UK and the query, and the up-projection could no longer
be folded into the query's weights at inference time
(the paper's reason, section 2.1.3). So position travels in a separate, small key,

    k_rope = RoPE(x·W_KR)               (d_R numbers, shared by every head),

rotated once, by the token's own position, when it is made, and cached rotated. Each
head's key is [k_C; k_rope], each head's query [q_C; RoPE(q_R)], and the scores are
divided by √(d_h + d_R), the length of the dot product. The cache holds c_kv and k_rope:
(r + d_R) numbers per token and layer (its entry's Cache in model/mechanisms.py).

Decoding never rebuilds the cache's keys and values (section 2.1.2). For head h,
q_C·k_Cᵀ = q_C·(c_kv·W_UK,h)ᵀ = (q_C·W_UK,hᵀ)·c_kvᵀ, and the weighted sum of values is
Σ_j w_j·c_kv,j·W_UV,h = (w·c_kv)·W_UV,h: W_UK is folded into the query and W_UV into
the output, so a step reads the r + d_R cached numbers per token and nothing larger
(`absorbed`). A whole sequence still rebuilds k_C and v once (`up_projected`); `absorbs`
counts which of the two is less work.

The queries are projected at full rank unless model.mla_q_rank is set; the paper also
compresses them (section 2.1.3, DeepSeek-V3's q_lora_rank), down to a latent, RMSNorm, up
(`QueryLatent`), which saves activation memory in training and changes nothing in the
cache."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.attention import Mask, eager_attention, sdpa_attention
from model.config import ModelConfig, ModelError
from model.positions import turn


@dataclass
class LatentState:
    """What one layer reads for the tokens so far: each token's latent c_kv (r numbers)
    and rotated shared key k_rope (d_R) side by side, one row of r + d_R a token,
    (B, T, r + d_R). Side by side, the absorbed form's scores are one product over the
    row, where two products and a sum would pass over the scores twice more."""
    latent: torch.Tensor
    rank: int

    @property
    def c_kv(self) -> torch.Tensor:                                   # (B, T, r)
        return self.latent[..., :self.rank]

    @property
    def k_rope(self) -> torch.Tensor:                                 # (B, T, d_R)
        return self.latent[..., self.rank:]


def latent_sizes(config: ModelConfig) -> tuple[int, int]:
    """(r, d_R): the latent's width and the shared rotary key's. By default r = 4·d_h,
    a quarter of MHA's 2·H·d_h at 8 heads (DeepSeek-V2 uses 4·d_h with 128 heads), and
    d_R = d_h/2, as the paper's d_R = 64 against d_h = 128, rounded down to even: RoPE
    turns pairs, and a head of 18 would give 9."""
    return (config.mla_kv_rank or 4 * config.head_dim,
            config.mla_rope_dim or max(2, config.head_dim // 4 * 2))


class DecoupledRoPE(nn.Module):
    """RoPE on the d_R dimensions of the position part: pair i, the dimensions (i, i + d_R/2),
    turns by position · θ^(-2i/d_R), so q_rope·k_rope depends on the offset alone. The
    angles are computed in at least fp32 (in bf16 an angle is off by a radian or more
    past position 256), and in float64 for a float64 model, as no buffer is cast with it."""

    def __init__(self, dim: int, theta: float):
        super().__init__()
        self.dim, self.theta = dim, theta

    def forward(self, x: torch.Tensor, start: int, shared: dict | None = None) -> torch.Tensor:
        """x: (..., T, d_R), the T positions from `start`. `shared` (Mask.shared) keeps the
        turning tensors for the pass: the queries and the new key of every layer turn by
        the same angles, so a decoding step computes them once, not twice a layer."""
        if shared is None:
            return turn(x, *self.turns(x, start))
        key = ("latent rope", self.dim, self.theta, x.shape[-2], x.dtype, x.device)
        if key not in shared:
            shared[key] = self.turns(x, start)
        return turn(x, *shared[key])

    def turns(self, x: torch.Tensor, start: int):
        """(cos, cos) and (-sin, sin) of the angles of x's T positions from start."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        pairs = torch.arange(0, self.dim, 2, dtype=dtype, device=x.device)
        inv_freq = self.theta ** (-pairs / self.dim)
        pos = start + torch.arange(x.shape[-2], device=x.device)
        angle = pos[:, None].to(dtype) * inv_freq                     # (T, d_R/2)
        cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
        return torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)


class QueryLatent(nn.Module):
    """The compressed queries of DeepSeek-V2 (arXiv:2405.04434, eqs. 12-13):
    q = RMSNorm(x·W_DQ)·W_UQ, through a latent of r_q = model.mla_q_rank numbers, the same
    RMSNorm as the key latent's (`q_a_layernorm` in DeepSeek's code)."""

    def __init__(self, config: ModelConfig, out_features: int):
        super().__init__()
        self.w_dq = nn.Linear(config.n_embd, config.mla_q_rank, bias=config.bias)   # W_DQ: down
        self.q_norm = nn.RMSNorm(config.mla_q_rank, eps=config.norm_eps)
        self.w_uq = nn.Linear(config.mla_q_rank, out_features, bias=config.bias)   # W_UQ: up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_uq(self.q_norm(self.w_dq(x)))


def unturned(x: torch.Tensor, start: int, shared: dict | None = None) -> torch.Tensor:
    """DecoupledRoPE's place with model.mla_nope: x as it is, at every position."""
    return x


class LatentAttention(nn.Module):
    """Multi-head attention whose cache is a latent c_kv and one shared rotary key."""
    compresses_queries = True      # model.mla_q_rank is this layer's (model/registry.py)

    has_latent = True          # model.mla_nope applies (model/registry.py asks)

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        H, D = self.n_head, self.head_dim = config.n_head, config.head_dim
        self.rank, self.rope_dim = latent_sizes(config)
        if self.rope_dim % 2 or self.rank < 0:
            raise ModelError(f"model.mla_rope_dim must be even (RoPE turns pairs) and "
                             f"model.mla_kv_rank not negative; got {self.rope_dim}, {self.rank}")
        if config.mla_q_rank:
            self.w_q = QueryLatent(config, H * (D + self.rope_dim))
        else:
            self.w_q = nn.Linear(config.n_embd, H * (D + self.rope_dim), bias=config.bias)
        self.w_dkv = nn.Linear(config.n_embd, self.rank, bias=config.bias)    # W_DKV: down
        self.kv_norm = nn.RMSNorm(self.rank, eps=config.norm_eps)          # the latent at unit RMS
        self.w_kr = nn.Linear(config.n_embd, self.rope_dim, bias=config.bias)  # W_KR
        self.w_ukv = nn.Linear(self.rank, 2 * H * D, bias=config.bias)       # W_UK, W_UV: up
        self.w_o = nn.Linear(H * D, config.n_embd, bias=config.bias)
        # model.mla_nope (Kimi Linear): no positions here; the part stays, unturned.
        self.rope = unturned if config.mla_nope else DecoupledRoPE(self.rope_dim, config.rope_theta)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def cache_entry(self, x, start, shared: dict | None = None):
        """What a token leaves behind (B, T, r + d_R): its latent, normalised, and its
        shared key, turned once, by its own position."""
        latent = self.kv_norm(self.w_dkv(x))
        return torch.cat([latent, self.rope(self.w_kr(x), start, shared)], dim=-1)

    def keys_values(self, state: LatentState):
        """Every head's keys (B, H, Tk, d_h + d_R) and values (B, H, Tk, d_h), rebuilt
        from the cached latents; the cached k_rope is used as it is (already turned)."""
        B, Tk, _ = state.c_kv.shape
        H, D = self.n_head, self.head_dim
        k_c, v = self.w_ukv(state.c_kv).view(B, Tk, 2 * H, D).transpose(1, 2).split(H, dim=1)
        k_rope = state.k_rope.unsqueeze(1).expand(B, H, Tk, self.rope_dim)  # one key, every head
        return torch.cat([k_c, k_rope], dim=-1), v

    def forward(self, x, positions, mask: Mask, cache=None, need_weights: bool = False,
                value_embed=None):
        if value_embed is not None:
            raise ModelError("latent attention rebuilds values from the cached latent, which holds "
                             "no token ids for value embeddings: set model.value_embeds=false")
        # Its entry says takes_score_bias=False: a bias handed in is refused, not misapplied.
        if mask.bias_fn is not None:
            raise ModelError("latent attention's heads have no place for ALiBi's per-head score "
                             "bias; use model.position=rope, or none")
        B, T, _ = x.shape
        H, D, R = self.n_head, self.head_dim, self.rope_dim
        q = self.w_q(x).view(B, T, H, D + R).transpose(1, 2)         # (B, H, T, D + R)
        q_c, q_r = q.split([D, R], dim=-1)
        q_r = self.rope(q_r, mask.q_start, mask.shared)
        latent = self.cache_entry(x, mask.q_start, mask.shared)
        if cache is not None:
            # Kept once, as a (B, 1, T, r + d_R) "head" of keys. The values are the latent
            # itself, so the cache's value slot keeps nothing: (B, 1, T, 0).
            latent = cache.update(self.layer_idx, latent.unsqueeze(1),
                                  latent.new_empty(B, 1, T, 0))[0].squeeze(1)
        state = LatentState(latent, self.rank)
        attend = self.absorbed if self.absorbs(T, latent.shape[1]) else self.up_projected
        y, weights = attend(q_c, q_r, state, mask, need_weights)      # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, H * D)                    # heads side by side
        return self.resid_dropout(self.w_o(y)), weights

    def absorbs(self, q_len: int, k_len: int) -> bool:
        """Whether the absorbed form is fewer multiplications for q_len queries over k_len
        keys (per head, the shared rotary part costing both the same). Rebuilding k_C and
        v costs k_len·r·d_h, and each score and output then reads d_h numbers; absorbing
        folds each query and output through an r×d_h matrix, q_len·r·d_h, but each score
        and output reads the r-wide latent instead. One query over a long cache: absorb.
        A whole sequence (training, a prefill): with r > d_h its T² scores outweigh
        rebuilding T keys, so it is up-projected, as the paper does for training (both
        forms timed in docs/latent_attention.md)."""
        r, D = self.rank, self.head_dim
        return q_len * k_len * (r - D) + q_len * r * D < k_len * r * D

    def up_projected(self, q_c, q_r, state: LatentState, mask: Mask, need_weights: bool):
        """Every head's keys and values rebuilt from the latents, then the article's
        formula, per head; eager when the weights are wanted. The scale is 1/√(d_h + d_R),
        the length of q and k, as the paper has it."""
        q = torch.cat([q_c, q_r], dim=-1)                             # (B, H, Tq, D + R)
        k, v = self.keys_values(state)
        backend = eager_attention if need_weights else sdpa_attention
        dropout_p = self.dropout if self.training else 0.0
        return backend(q, k, v, mask, dropout_p, need_weights)

    def absorbed(self, q_c, q_r, state: LatentState, mask: Mask, need_weights: bool):
        """The same attention computed on the latents (arXiv:2405.04434, section 2.1.2):
        W_UK folded into each query, W_UV applied after the weighted sum. Every head reads
        the one latent and the one rotary key, so the heads are rows of one product:
        the cache is read once a step, not once a head."""
        B, H, Tq, D = q_c.shape
        w_uk, w_uv = self.w_ukv.weight.view(2, H, D, self.rank).unbind(0)   # (H, D, r) each
        # [q_C·W_UK | q_R]·[c_kv | k_R]ᵀ = q_C·k_Cᵀ + q_R·k_Rᵀ, every head's row at once. The
        # scale 1/√(d_h + d_R) goes on the queries, H·(r + d_R) numbers instead of H·Tk.
        # W_UK's bias, if any, would add q_C·b_K to every score of a row alike, which the
        # softmax does not see: it is left out.
        q = torch.cat([q_c @ w_uk, q_r], dim=-1) / math.sqrt(D + self.rope_dim)
        if need_weights or (self.training and self.dropout):
            mixed, weights, dropped = self._absorbed_weights(q, state, mask)
        else:
            mixed, weights, dropped = self._absorbed_fused(q, state, mask), None, None
        out = mixed @ w_uv.transpose(-2, -1)                          # (B, H, Tq, D)
        if self.w_ukv.bias is not None:      # Σ_j w_j·b_V: b_V itself, unless dropout thinned w
            b_v = self.w_ukv.bias.view(2, H, 1, D)[1]
            out = out + (b_v if dropped is None else dropped.sum(-1, keepdim=True) * b_v)
        return out, weights

    def _absorbed_fused(self, q, state: LatentState, mask: Mask):
        """w·c_kv, (B, H, Tq, r), through SDPA's fused kernel: the heads' queries are rows
        of one query block against the one latent, which is both the keys and (its first
        r numbers) the values. The kernel reads each block of the latent once for both,
        where two products (`_absorbed_weights`) read the whole cache twice a step."""
        B, H, Tq, _ = q.shape
        latent = state.latent.unsqueeze(1)                            # (B, 1, Tk, r + d_R)
        seen = None
        if not mask.sees_everything:          # the rule's rows, once for each head's queries
            seen = mask.dense.repeat(*([1] * (mask.dense.dim() - 2)), H, 1)
        mixed = F.scaled_dot_product_attention(q.reshape(B, 1, H * Tq, -1), latent, latent,
                                               attn_mask=seen, scale=1.0)
        return mixed[..., :self.rank].view(B, H, Tq, self.rank)

    def _absorbed_weights(self, q, state: LatentState, mask: Mask):
        """(w·c_kv, w, w after dropout): the scores against the latent, their softmax w, and the weighted sum
        of latents, as two products, when the weights are wanted or dropped out."""
        B, H, Tq, _ = q.shape
        Tk = state.latent.shape[1]
        scores = torch.bmm(q.reshape(B, H * Tq, -1), state.latent.transpose(1, 2))
        scores = scores.view(B, H, Tq, Tk)
        # Hidden keys get -inf: exp(-inf) = 0, no weight from the future or an empty slot.
        scores = mask.hide(scores, float("-inf"))
        weights = torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)),
                                dim=-1).to(q.dtype)
        dropped = F.dropout(weights, self.dropout) if self.training and self.dropout else weights
        # (w·c_kv)·W_UV: the weighted sum of latents here, each head's value projection after.
        mixed = torch.bmm(dropped.view(B, H * Tq, Tk), state.c_kv).view(B, H, Tq, self.rank)
        return mixed, weights, dropped
