"""DeepSeek Sparse Attention on latent attention, as DeepSeek-V3.2 has it (arXiv:2512.02556,
section 2.1: "we instantiate DSA based on MLA"): model/latent_attention.py's MLA, whose
queries each attend to only the k keys a lightning indexer (model/sparse_attention.py)
scores highest.

The indexer is model/sparse_attention.py's, I_{t,s} = Σ_j w_{t,j} · ReLU(q^I_{t,j}·k^I_s/√d_I),
fed as V3.2's is: its queries come from the query latent c_q = RMSNorm(x·W_DQ) that the main
queries are made from (model.mla_q_rank; with full-rank queries, from the input), its key and head weights from the
layer's input, the key through a LayerNorm with a bias; the first d_R dimensions of its
queries and key turn by the layer's own small RoPE (rotate-half, the same angles as the
main rotary key). It learns as there: from its own KL divergence to the main attention's
distribution, on detached inputs (`aux_loss`).

The cache holds each token's latent, its rotated key and its indexer key side by side,
(r + d_R + d_I) numbers a token and layer. A whole sequence rebuilds the keys and values
from the latents and hides the keys not chosen (`masked`), the up-projected form of MLA. A
decoding step (few queries against a long cache) gathers the k chosen rows of latent and
rotary key and attends over them alone in MLA's absorbed form (`gathered`): W_UK folded
into the query, W_UV applied after the weighted sum, so its softmax attention reads k rows
of r + d_R numbers, O(k), not O(T). The indexer still scores every cached indexer key."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.attention import Mask, at_least_fp32
from model.config import ModelConfig, ModelError
from model.latent_attention import LatentAttention, LatentState, QueryLatent
from model.sparse_attention import SparseAttention, sparse_sizes


class LatentSparseAttention(LatentAttention):
    """MLA whose queries each read the k keys a lightning indexer chooses."""
    selects_keys = True     # model/registry.py: the sparse_top_k and indexer_* fields are its
    dense_warmup = False    # DeepSeek's dense first stage, set by the training step
    # The indexer's scores, its choice of keys and its loss are sparse attention's own.
    index_scores = SparseAttention.index_scores
    select = SparseAttention.select
    indexer_loss = SparseAttention.indexer_loss
    spread = staticmethod(SparseAttention.spread)

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.top_k, self.indexer_heads, self.indexer_dim = sparse_sizes(config)
        if self.indexer_dim < self.rope_dim:
            raise ModelError(f"model.indexer_dim={self.indexer_dim} is below the rotary width "
                             f"d_R = {self.rope_dim}: its first d_R dimensions turn by RoPE")
        H_I, d_I = self.indexer_heads, self.indexer_dim
        q_input = config.mla_q_rank or config.n_embd
        self.w_iq = nn.Linear(q_input, H_I * d_I, bias=config.bias)            # q^I from c_q
        self.w_ik = nn.Linear(config.n_embd, d_I, bias=config.bias)             # k^I_s
        self.ik_norm = nn.LayerNorm(d_I, eps=config.norm_eps)                  # with its bias
        self.w_iw = nn.Linear(config.n_embd, H_I, bias=config.bias)             # w_{t,j}
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x, positions, mask: Mask, cache=None, need_weights: bool = False,
                value_embed=None):
        if value_embed is not None or mask.bias_fn is not None:
            raise ModelError("latent attention has no place for value embeddings or ALiBi: set "
                             "model.value_embeds=false and model.position=rope")
        B, T, _ = x.shape
        H, D, R = self.n_head, self.head_dim, self.rope_dim
        c_q, q = self.queries(x)                                     # (B, T, r_q), (B, T, H·(D + R))
        q = q.view(B, T, H, D + R).transpose(1, 2)                   # (B, H, T, D + R)
        q_c, q_r = q.split([D, R], dim=-1)
        q_r = self.rope(q_r, mask.q_start, mask.shared)
        row = torch.cat([self.cache_entry(x, mask.q_start, mask.shared),
                         self.indexer_key(x.detach(), mask).to(x.dtype)], dim=-1)
        if cache is not None:        # one row a token: latent, rotary key, indexer key
            row = cache.update(self.layer_idx, row.unsqueeze(1), row.new_empty(B, 1, T, 0))[0].squeeze(1)
        width = self.rank + R
        state, k_i = LatentState(row[..., :width], self.rank), row[..., width:]
        q_i, w = self.indexer_query(c_q.detach(), x.detach(), mask)
        index = self.index_scores(q_i, k_i, w)                       # (B, Tq, Tk)
        visible = mask.dense if mask.dense.dim() == 4 else mask.dense[None, None]
        chosen = self.select(index, visible, mask.k_pos)             # (B, 1, Tq, k)
        seen = visible.expand(B, 1, T, visible.shape[-1]).gather(-1, chosen)
        k_len = state.latent.shape[1]
        attend = self.gathered if self.gathers(T, chosen.shape[-1], k_len) else self.rebuilt
        out, weights = attend(q_c, q_r, state, mask, chosen, seen)   # (B, H, T, D), (B, H, T, k)
        y = out.transpose(1, 2).reshape(B, T, H * D)                 # heads side by side
        self.aux_loss = (self.indexer_loss(index, weights, chosen, seen)
                         if self.training and torch.is_grad_enabled() else None)
        return self.resid_dropout(self.w_o(y)), (self.spread(weights, chosen, k_len)
                                                  if need_weights else None)

    def scaled(self, scores, mask: Mask, chosen=None):
        """Scores over √(d_h + d_R), the length of q and k (latent attention has no ALiBi)."""
        return at_least_fp32(scores) / math.sqrt(self.head_dim + self.rope_dim)

    @staticmethod
    def gathers(q_len: int, k: int, k_len: int) -> bool:
        """Whether q_len queries over k_len keys read their k chosen latents alone: a decoding
        step (few queries, a long cache) does; a whole sequence forms the masked T×T scores,
        where T gathers of k latents would copy more than they save."""
        return q_len * k < k_len

    def rebuilt(self, q_c, q_r, state: LatentState, mask: Mask, chosen, seen):
        """Every head's keys and values rebuilt from the latents (the up-projected form),
        then the softmax over the chosen keys with the rest hidden (`masked`)."""
        k, v = self.keys_values(state)                               # (B, H, Tk, D + R), (B, H, Tk, D)
        return self.masked(torch.cat([q_c, q_r], dim=-1), k, v, mask, chosen, seen)

    def masked(self, q, k, v, mask: Mask, chosen, seen):
        """(out (B, H, Tq, D), weights at the chosen keys (B, H, Tq, k)): the softmax over
        the chosen keys, as the article's formula over every key with the rest hidden: a
        whole sequence, where one T×T product beats T gathers of k latents."""
        scores = self.scaled(q @ k.transpose(-2, -1), mask)          # (B, H, Tq, Tk)
        keep = torch.zeros_like(scores[:, :1], dtype=torch.bool).scatter(-1, chosen, seen)
        # exp(-inf) = 0: a key not chosen (or not visible) gets exactly no weight.
        weights = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1).to(q.dtype)
        dropped = F.dropout(weights, self.dropout) if self.training and self.dropout else weights
        return dropped @ v, weights.gather(-1, chosen.expand(*weights.shape[:3], chosen.shape[-1]))

    def gathered(self, q_c, q_r, state: LatentState, mask: Mask, chosen, seen):
        """The same softmax over the chosen keys read alone, in MLA's absorbed form
        (model/latent_attention.py, arXiv:2405.04434 section 2.1.2): each query gathers its k
        rows of latent and rotary key from the cache, (B, Tq, k, r + d_R), one set for every
        head, and no key or value is rebuilt. For head h, q_C·k_Cᵀ = (q_C·W_UK,hᵀ)·c_kvᵀ and
        Σ_j w_j·v_j = (Σ_j w_j·c_kv,j)·W_UV,h + (Σ_j w_j)·b_V,h, so a decoding step reads
        k·(r + d_R) numbers of the main cache, not T·(r + d_R)."""
        B, H, Tq, D = q_c.shape
        n, width = chosen.shape[-1], state.latent.shape[-1]
        rows = chosen[:, 0].reshape(B, Tq * n, 1).expand(B, Tq * n, width)
        picked = state.latent.gather(1, rows).view(B, Tq, n, width)  # (B, Tq, k, r + d_R)
        w_uk, w_uv = self.w_ukv.weight.view(2, H, D, self.rank).unbind(0)   # (H, D, r) each
        # W_UK's bias would add q_C·b_K to every score of a row alike, which the softmax
        # does not see: it is left out, as in the absorbed form of plain MLA.
        q = torch.cat([q_c @ w_uk, q_r], dim=-1)                     # (B, H, Tq, r + d_R)
        scores = self.scaled(torch.einsum("bhtc,btnc->bhtn", q, picked), mask)
        # exp(-inf) = 0: a chosen key the query may not see (fewer than k visible) gets none.
        weights = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1).to(q.dtype)
        dropped = F.dropout(weights, self.dropout) if self.training and self.dropout else weights
        mixed = torch.einsum("bhtn,btnr->bhtr", dropped, picked[..., :self.rank])   # w·c_kv
        out = mixed @ w_uv.transpose(-2, -1)                         # (B, H, Tq, D)
        if self.w_ukv.bias is not None:
            out = out + dropped.sum(-1, keepdim=True) * self.w_ukv.bias.view(2, H, 1, D)[1]
        return out, weights

    def queries(self, x):
        """The query latent c_q the indexer reads, and the main queries made from it; with
        full-rank queries (model.mla_q_rank=0) the indexer reads the layer's input instead."""
        if not isinstance(self.w_q, QueryLatent):
            return x, self.w_q(x)
        c_q = self.w_q.q_norm(self.w_q.w_dq(x))
        return c_q, self.w_q.w_uq(c_q)

    def turned(self, t: torch.Tensor, mask: Mask) -> torch.Tensor:
        """The first d_R dimensions turned by the layer's RoPE, the rest as they are."""
        R = self.rope_dim
        return torch.cat([self.rope(t[..., :R], mask.q_start, mask.shared), t[..., R:]], dim=-1)

    def indexer_key(self, x, mask: Mask) -> torch.Tensor:
        """k^I_s (B, T, d_I): LayerNorm(x·W_IK), its first d_R dimensions turned."""
        return self.turned(self.ik_norm(self.w_ik(x)), mask)

    def indexer_query(self, c_q, x, mask: Mask):
        """The indexer's queries (B, H_I, T, d_I) from the query latent, and its head
        weights (B, T, H_I) from the input, scaled by 1/√H_I."""
        B, T, _ = x.shape
        q_i = self.w_iq(c_q).view(B, T, self.indexer_heads, self.indexer_dim).transpose(1, 2)
        return self.turned(q_i, mask), self.w_iw(x) * self.indexer_heads ** -0.5
