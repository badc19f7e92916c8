"""DeepSeek Sparse Attention, DSA (DeepSeek-V3.2, arXiv:2512.02556, section 2.1): each query
attends, with the article's softmax, to only k of the keys it may see, chosen by a small
and cheap *lightning indexer*,

    I_{t,s} = Σ_j w_{t,j} · ReLU(q^I_{t,j} · k^I_s)       (j over the indexer's few heads)
    u_t = Attention(q_t, {k_s, v_s : I_{t,s} among the k largest of row t}).

The indexer has projections of its own from the layer's input: a query q^I_{t,j} and a
weight w_{t,j} per indexer head from the query token, and one key k^I_s per token shared
by all its heads. ReLU, not a softmax, so a row of scores costs one product per head and
key, which DeepSeek runs in FP8; what it must get right is the order, not the values. As in
DeepSeek's released indexer (`DeepseekV32Indexer` in transformers), the key passes through
a LayerNorm, the weights are scaled by 1/√(heads) and the products by 1/√(d_I), and the
first d_k dimensions of q^I and k^I turn by the model's RoPE (DeepSeek turns 64 of 128).

Every query's k keys are chosen among those the model's mask lets it see (causal order,
the window, padding): hidden keys score -inf, so they are picked only when fewer than k
are visible, and then still masked. All heads of the main attention share the choice
(DeepSeek's MLA runs in its one-key-head MQA mode). Ties, common where ReLU gives exact
zeros, go to the newest key, so a decoding step picks what the whole pass picked.

How the indexer learns (section 2.1.1). The top-k choice passes no gradient, so the
language-model loss cannot train it. Its target is the main attention itself: at query t,
the weights summed over the heads and L1-normalised, p_{t,:}, and its loss the KL
divergence D_KL(p_{t,S} ‖ softmax(I_{t,S})). In DeepSeek's dense warm-up the main model is
frozen, attention is dense and S is every visible key; in sparse training S is the chosen
set, and "we detach the indexer input from the computational graph": the indexer learns
from this loss only, the main model from the language-model loss only. That is what a
training pass here does: the indexer reads x.detach(), the target p is detached, and the
loss, a mean over queries, is left on the layer as `aux_loss` for the training step to
add (engine/loop.py); `dense_warmup = True` makes S every visible key and the attention
dense.

Cost. A training pass forms the masked T×T scores, as transformers' eager path does. A
decoding step scores every cached indexer key (d_I numbers a key) and then gathers only the
k chosen keys and values of the main cache, so its softmax attention costs O(k), not
O(T). The cache keeps the indexer's key beside the main keys (`remember`)."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.attention import Mask, MultiHeadAttention, at_least_fp32
from model.config import ModelConfig, ModelError
from model.positions import POSITION_ENCODINGS


def sparse_sizes(config: ModelConfig) -> tuple[int, int, int]:
    """(k, indexer heads, d_I): k = model.sparse_top_k, or a quarter of block_size for 0;
    d_I = model.indexer_dim, or the head size d_k for 0."""
    return (config.sparse_top_k or max(1, config.block_size // 4), config.indexer_heads,
            config.indexer_dim or config.head_dim)


class SparseAttention(MultiHeadAttention):
    selects_keys = True     # model/registry.py: the model.sparse_top_k and indexer_* fields are its
    # DeepSeek's first stage when True: dense attention, the indexer's loss over every visible
    # key (set by the training step for train.indexer_warmup's steps).
    dense_warmup = False

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.kernel = None                  # its own masked softmax: no backend computes it
        self.top_k, self.indexer_heads, self.indexer_dim = sparse_sizes(config)
        if POSITION_ENCODINGS[config.position].rotary and self.indexer_dim < self.head_dim:
            raise ModelError(f"model.indexer_dim={self.indexer_dim} is below the head size "
                             f"d_k = {self.head_dim}: its first d_k dimensions turn by the model's "
                             "RoPE; give at least d_k, or 0 for d_k")
        H_I, d_I = self.indexer_heads, self.indexer_dim
        self.w_iq = nn.Linear(config.n_embd, H_I * d_I, bias=config.bias)    # q^I_{t,j}
        self.w_ik = nn.Linear(config.n_embd, d_I, bias=config.bias)          # k^I_s
        self.ik_norm = nn.LayerNorm(d_I, eps=config.norm_eps, bias=config.bias)
        self.w_iw = nn.Linear(config.n_embd, H_I, bias=config.bias)          # w_{t,j}
        self.aux_loss: torch.Tensor | None = None   # the indexer's KL, after a training pass

    def forward(self, x, positions, mask: Mask, cache=None, need_weights: bool = False,
                value_embed=None):
        B, T, C = x.shape
        q, k, v = self.project(x, positions, mask, None, value_embed)   # this chunk's own
        # project repeats each key/value head for its group of query heads (GQA); the cache
        # and the gather keep one of each, so take the first of every group (a view).
        group = self.n_head // self.n_kv_head
        k, v = k[:, ::group], v[:, ::group]                          # (B, H_kv, T, D)
        # Sparse training's rule: the indexer's input is cut from the main model's graph.
        q_i, k_i, w = self.indexer_inputs(x.detach(), positions, mask)
        if cache is not None:
            k, v, k_i = self.remember(cache, k, v, k_i)
        index = self.index_scores(q_i, k_i, w)                       # (B, Tq, Tk)
        visible = mask.dense if mask.dense.dim() == 4 else mask.dense[None, None]
        chosen = self.select(index, visible, mask.k_pos)             # (B, 1, Tq, k)
        # Whether each chosen key is one the query may see: with fewer than k visible, not all.
        seen = visible.expand(B, 1, T, visible.shape[-1]).gather(-1, chosen)
        # A decoding step (few queries, a long cache) gathers its k keys; a whole sequence
        # forms the masked T×T scores, where T gathers of k keys would copy more than it saves.
        attend = self.gathered if T * chosen.shape[-1] < k.shape[2] else self.masked
        y, weights = attend(q, k, v, mask, chosen, seen)              # (B, H, T, D)
        self.aux_loss = (self.indexer_loss(index, weights, chosen, seen)
                         if self.training and torch.is_grad_enabled() else None)
        y = y.transpose(1, 2).reshape(B, T, C)                       # heads side by side
        return self.resid_dropout(self.w_o(y)), (self.spread(weights, chosen, k.shape[2])
                                                  if need_weights else None)

    def indexer_inputs(self, x, positions, mask: Mask):
        """The indexer's queries (B, H_I, T, d_I), keys (B, T, d_I) and head weights (B, T, H_I)."""
        B, T, _ = x.shape
        H_I, d_I, D = self.indexer_heads, self.indexer_dim, self.head_dim
        q_i = self.w_iq(x).view(B, T, H_I, d_I).transpose(1, 2)      # (B, H_I, T, d_I)
        k_i = self.ik_norm(self.w_ik(x)).unsqueeze(1)                # (B, 1, T, d_I)

        def turned(t):                       # the first d_k dimensions by the model's RoPE
            return torch.cat([positions.rotate_in_pass(t[..., :D], mask.q_start, mask.shared),
                              t[..., D:]], dim=-1)
        return turned(q_i), turned(k_i).squeeze(1), self.w_iw(x) * H_I ** -0.5

    def remember(self, cache, k, v, k_i):
        """Keep this chunk's keys, values and indexer keys; return every token's so far.
        The cache holds two tensors a layer, so each token's indexer key rides beside its
        main keys, as one (B, 1, T, H_kv·d_k + d_I) row; the rolling and static caches move
        rows whole, so what they do to keys they do to both."""
        B, H_kv, T, D = k.shape
        row = torch.cat([k.transpose(1, 2).reshape(B, T, H_kv * D), k_i.to(k.dtype)], dim=-1)
        rows, v = cache.update(self.layer_idx, row.unsqueeze(1), v)  # (B, 1, Tk, H_kv·D + d_I)
        keys = rows[:, 0, :, :H_kv * D].unflatten(-1, (H_kv, D)).transpose(1, 2)
        return keys, v, rows[:, 0, :, H_kv * D:]                     # views: nothing copied

    def index_scores(self, q_i, k_i, w):
        """I_{t,s} = Σ_j w_{t,j} · ReLU(q^I_{t,j}·k^I_s / √d_I), in at least fp32: (B, Tq, Tk)."""
        dots = at_least_fp32(q_i) @ at_least_fp32(k_i).unsqueeze(1).transpose(-2, -1)
        return torch.einsum("bjts,btj->bts", F.relu(dots / math.sqrt(self.indexer_dim)),
                            at_least_fp32(w))

    def select(self, index, visible, k_pos):
        """The k keys of each query's row with the highest index scores among those it may
        see (B, 1, Tq, k), as key slots; ties to the newest key, wherever it is stored."""
        k = index.shape[-1] if self.dense_warmup else min(self.top_k, index.shape[-1])
        scores = index[:, None].masked_fill(~visible, float("-inf"))  # (B, 1, Tq, Tk)
        newest_first = k_pos.argsort(descending=True, stable=True)
        ranked = scores[..., newest_first].sort(dim=-1, descending=True, stable=True).indices
        return newest_first[ranked[..., :k]]

    def scaled(self, scores, mask: Mask, chosen=None):
        """Scores over √d_k, with ALiBi's bias (at the chosen keys) where the model has one."""
        scores = scores / math.sqrt(self.head_dim)
        if mask.bias is not None:
            bias = mask.bias.expand(scores.shape[0], *mask.bias.shape)
            scores = scores + (bias if chosen is None else
                               bias.gather(-1, chosen.expand(*scores.shape)))
        return scores

    def masked(self, q, k, v, mask: Mask, chosen, seen):
        """Softmax over the chosen keys as the article's formula over every key with the
        rest hidden: a whole sequence, where one T×T product beats T gathers of k keys."""
        if self.n_kv_head != self.n_head:
            k = k.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
            v = v.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
        scores = self.scaled(q @ k.transpose(-2, -1), mask)           # (B, H, Tq, Tk)
        keep = torch.zeros_like(scores[:, :1], dtype=torch.bool).scatter(-1, chosen, seen)
        # exp(-inf) = 0: a key not chosen (or not visible) gets exactly no weight.
        weights = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1).to(q.dtype)
        out = F.dropout(weights, self.dropout if self.training else 0.0) @ v
        return out, weights.gather(-1, chosen.expand(*weights.shape[:3], chosen.shape[-1]))

    def gathered(self, q, k, v, mask: Mask, chosen, seen):
        """Softmax over the chosen keys read alone: each query gathers its k keys and values
        from the cache, (B, H, Tq, k, d_k), so a decoding step costs O(k), not O(T)."""
        B, H_kv, Tk, D = k.shape
        Tq, n = chosen.shape[2], chosen.shape[3]
        at = chosen[..., None].expand(B, H_kv, Tq, n, D)
        k_sel = k[:, :, None].expand(B, H_kv, Tq, Tk, D).gather(3, at)
        v_sel = v[:, :, None].expand(B, H_kv, Tq, Tk, D).gather(3, at)
        if self.n_kv_head != self.n_head:    # only the gathered rows are repeated (GQA)
            k_sel = k_sel.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
            v_sel = v_sel.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
        scores = self.scaled(torch.einsum("bhtd,bhtnd->bhtn", q, k_sel), mask, chosen)
        weights = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1).to(q.dtype)
        dropped = F.dropout(weights, self.dropout if self.training else 0.0)
        return torch.einsum("bhtn,bhtnd->bhtd", dropped, v_sel), weights

    @staticmethod
    def spread(weights, chosen, k_len: int):
        """The weights over the chosen keys (B, H, Tq, k) laid out over every key (B, H, Tq,
        Tk), 0 where a key was not chosen: the map the lens and the page draw."""
        full = weights.new_zeros(*weights.shape[:3], k_len)
        return full.scatter(-1, chosen.expand(*weights.shape), weights)

    def indexer_loss(self, index, weights, chosen, seen):
        """Σ_s p_{t,s} · log(p_{t,s} / softmax(I_{t,S})_s) over the chosen set S, averaged
        over the queries: p is the main attention at the chosen keys, summed over heads and
        L1-normalised, detached (the main model learns from the language-model loss alone)."""
        seen = seen[:, 0]                                            # (B, Tq, k)
        p = at_least_fp32(weights.detach()).sum(1)                   # (B, Tq, k)
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-30)
        rows = seen.any(-1)                  # a query that sees a key (padding may leave none)
        logits = index.gather(-1, chosen[:, 0]).masked_fill(~seen, float("-inf"))
        log_q = torch.log_softmax(logits.masked_fill(~rows[..., None], 0.0), dim=-1)
        kl = torch.where(seen & (p > 0), p * (p.clamp_min(1e-30).log() - log_q), 0.0)
        return kl.sum(-1)[rows].mean() if rows.any() else index.new_zeros(())
