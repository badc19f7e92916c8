"""Parts a config adds to the plain GPT, each built only when its field asks for it:
a causal mix of the newest positions before attention (model.token_mix), BERT's segment
embeddings (model.n_token_types), value embeddings (model.value_embeds) and U-net skips
across the stack (model.skip_connections). The default model holds none of them."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.config import ModelConfig


class TokenMix(nn.Module):
    """Each position plus a learned per-channel weighting of itself and the width-1
    positions before it: a causal depthwise convolution in front of attention (the
    Canon layers of Allen-Zhu, "Physics of Language Models: Part 4.1"; RWKV's token
    shift is its width-2 case). Attention can look back too, but only through its
    scores; this hands every query, key and value its neighbours' features directly,
    which a small model otherwise spends a head on. The weights start at zero, so a new
    model is the plain one until training finds a use for them.

    With a KV cache, the rows before a chunk come from the cache (`recent`), so decoding
    one token at a time gives the same output as reading the whole text at once."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.width, self.layer_idx = config.token_mix, layer_idx
        # One vector, as norm gains are: AdamW without weight decay, not Muon, which
        # orthogonalises maps and this is none.
        self.taps = nn.Parameter(torch.zeros(self.width * config.n_embd))

    def forward(self, h: torch.Tensor, cache=None) -> torch.Tensor:
        T, back = h.shape[1], self.width - 1
        w = self.taps.view(self.width, -1).to(h.dtype)
        # (B, back + T, C): the chunk after the rows before it (zeros before the first).
        full = F.pad(h, (0, 0, back, 0)) if cache is None else cache.recent(self.layer_idx, h, back)
        out = h + w[0] * h
        for j in range(1, self.width):          # w[j] weighs the row j places back
            out = out + w[j] * full[:, back - j:back - j + T]
        return out


class TokenTypes(nn.Module):
    """BERT's segment embeddings: one learned vector per token type (sentence A = 0,
    sentence B = 1), added to the token embedding so the model can tell the two
    sentences of a pair apart. Without token types given, every token is type 0."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.table = nn.Embedding(config.n_token_types, config.n_embd)

    def forward(self, x, token_types=None):
        if token_types is None:                   # row 0 for every token, no index tensor
            return x + self.table.weight[0]
        return x + self.table(token_types)


class ValueEmbeddings(nn.ModuleList):
    """Value embeddings (modded-nanogpt): per layer, a learned vector per token added to
    that token's value, V = x·W_V + E_V[token], so a token's identity reaches every
    layer's weighted sum directly. Lookups like wte, not hidden matrices, kept outside
    the blocks so the optimizer treats them as embeddings."""

    def __init__(self, config: ModelConfig):
        kv_width = config.kv_heads * config.head_dim
        super().__init__(nn.Embedding(config.vocab_size, kv_width) for _ in range(config.n_layer))



class UNetSkips(nn.Module):
    """U-net skips (modded-nanogpt): the output of block i of the first half is added,
    times a learned weight, to the input of its mirror block n_layer-1-i, so a late
    layer reads early features without the middle layers carrying them. `saved` is the
    forward pass's own list of first-half outputs; the weights are the model's
    `skip_weights` (kept there so checkpoints keep their names)."""

    def __init__(self, n_layer: int):
        super().__init__()
        self.n_layer = n_layer

    def join(self, layer: int, x, saved: list, weights):
        mirror = self.n_layer - 1 - layer
        return x + weights[mirror] * saved[mirror] if mirror < len(saved) else x

    def keep(self, layer: int, x, saved: list) -> None:
        if layer < self.n_layer // 2:
            saved.append(x)
