"""Multi-token prediction, MTP (DeepSeek-V3, arXiv:2412.19437, section 2.2): after the
main stack, D small modules each predict one token further ahead, so every position
learns from D + 1 targets and the model plans a little beyond the next token.

Module k (k = 1..D) at position i joins two things the model already has, each put
through its own RMSNorm, and projects them back to the model's width with one matrix M_k:

    h'^k_i = M_k [RMSNorm(h^{k-1}_i) ; RMSNorm(Emb(t_{i+k}))]
    h^k_{1:T-k} = TRM_k(h'^k_{1:T-k})                      (one Transformer block)
    P^k_{i+k+1} = OutHead(h^k_i)                            (the main model's output layer)

h^0 is the main model's last hidden state (the one its output layer reads); Emb and
OutHead are the main model's own token embedding and output layer (its final norm, then
its head), shared, not copied: the module adds only M_k, two norms and a block. The
block is the model's (same mechanism, same kind), with a layer index after the main
ones, so it keeps its keys in a cache of its own while decoding. Its loss is the
cross-entropy against t_{i+k+1}, averaged over the T - k positions that have one;
L_MTP = λ/D · Σ_k L^k (equation 25) is added to the next-token loss while training
(left as `aux_loss`, as the sparse indexer's KL is, engine/objectives.py), and the
logged loss stays the next-token loss.

DeepSeek-V3 keeps the causal chain whole: module k reads module k-1's states, not
independent heads (as Gloeckle et al., arXiv:2404.19737, have). At inference the
modules can be dropped, or the first used to draft the token after next for
self-speculative decoding (model/decode.py, decode="mtp")."""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn as nn

from model.attention import at_least_fp32
from model.cache import KVCache
from model.config import ModelConfig
from model.layers import BLOCKS


class MTPModule(nn.Module):
    """One depth: the two norms, the projection M_k and the block."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.norm_hidden = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.norm_embed = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.proj = nn.Linear(2 * config.n_embd, config.n_embd, bias=False)   # M_k
        self.block = BLOCKS[config.block](config, layer_idx)

    def forward(self, h, embedded, positions, mask, cache=None):
        """h (B, T, C) the depth before's states at positions i; embedded (B, T, C) the
        tokens k ahead of them; returns h^k (B, T, C)."""
        joined = torch.cat([self.norm_hidden(h), self.norm_embed(embedded)], dim=-1)   # (B, T, 2C)
        x, _ = self.block(self.proj(joined), positions, mask, cache)
        return x


class MultiTokenPrediction(nn.Module):
    """model.mtp_depth modules in a chain; `aux_loss` after a training pass."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        # Layer indices after the main stack's: each depth's block keeps its own cache layer
        # and takes the mechanism the pattern would give the layers after the last.
        wider = replace(config, n_layer=config.n_layer + config.mtp_depth)
        self.depths = nn.ModuleList(MTPModule(wider, config.n_layer + k)
                                    for k in range(config.mtp_depth))
        self.n_layer, self.weight = config.n_layer, config.mtp_weight
        self.aux_loss: torch.Tensor | None = None   # λ/D · Σ_k L^k, after a training pass
        self.loss: torch.Tensor | None = None       # (1/D) Σ_k L^k, detached, for the log
        self.drafted = self.accepted = 0            # decode="mtp": drafts made and kept

    def depth(self, model, k: int, h, tokens, cache=None):
        """Depth k (0-based) over positions whose token k+1 ahead is `tokens` (B, T):
        returns (h^{k+1} (B, T, C), the logits it gives through the shared head)."""
        T = tokens.shape[1]
        mask = model.mask_for(T, tokens.device, cache, None)
        h = self.depths[k](h, model.wte(tokens), model.positions, mask, cache)
        if cache is not None:
            cache.end(T)
        # OutHead: the main model's final norm (a post-norm stack has none) and its head.
        return h, model.readout(h if model.norm_f is None else model.norm_f(h))

    def learn(self, model, h, idx, targets) -> None:
        """Leave λ/D · Σ_k L^k as aux_loss: depth k+1 reads h^k and Emb(idx[i+k+1]) at
        positions i = 0..T-k-2 and is scored on targets[i+k+1] (= t_{i+k+2})."""
        self.aux_loss = self.loss = None
        if targets is None or not (self.training and torch.is_grad_enabled()):
            return
        T, losses = idx.shape[1], []
        for k in range(len(self.depths)):
            n = T - 1 - k                    # positions with a token k+1 ahead in the window
            if n <= 0:
                break
            h, logits = self.depth(model, k, h[:, :n], idx[:, k + 1:])
            losses.append(nn.functional.cross_entropy(
                at_least_fp32(logits).flatten(0, 1), targets[:, k + 1:].reshape(-1), ignore_index=-1))
        if not losses:
            return
        mean = torch.stack(losses).mean()
        self.aux_loss, self.loss = self.weight * mean, mean.detach()

    def new_cache(self, model, max_len: int):
        """A cache for the modules' blocks alone, at the layer indices after the main ones;
        it runs behind the main model's (a position enters once its next token is known)."""
        return KVCache(self.n_layer + len(self.depths), max_len, model.kept_window(),
                       model.config.n_global)
