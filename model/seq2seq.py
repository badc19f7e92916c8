"""An encoder-decoder Transformer ("Attention Is All You Need", arXiv:1706.03762): the
encoder reads the whole input with self-attention that sees in both directions; the
decoder writes the output token by token with masked self-attention and, in each
block, cross-attention over the encoder's output. The decoder-only GPT of gpt.py is
this model with the encoder and the cross-attention taken away."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.registry import check as check_config
from model.attention import CrossAttention
from model.config import ModelConfig, ModelError
from model.mechanisms import MECHANISMS, names_used
from model.layers import MLPS, NORMS, build_layer
from model.attention import Mask
from model.positions import POSITION_ENCODINGS


class Seq2SeqOutput(NamedTuple):
    logits: torch.Tensor                     # (B, T, vocab_size)
    loss: torch.Tensor | None                # mean cross-entropy over targets != -1
    cross_attentions: list | None            # per decoder layer (B, H, T, S) when asked


class EncoderBlock(nn.Module):
    """Self-attention over the whole input (no causal mask, padding hidden), then MLP."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.norm_attn, self.norm_mlp = NORMS[config.norm](config), NORMS[config.norm](config)
        self.attn = build_layer(config, layer_idx)
        self.mlp = MLPS[config.mlp](config) if MLPS[config.mlp].has_weights else None

    def forward(self, x, positions, mask):
        x = x + self.attn(self.norm_attn(x), positions, mask)[0]
        return x + self.mlp(self.norm_mlp(x)) if self.mlp is not None else x


class DecoderBlock(nn.Module):
    """Masked self-attention, cross-attention over the encoder output, MLP: each a
    pre-norm residual sublayer."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.norm_self, self.norm_cross, self.norm_mlp = (NORMS[config.norm](config) for _ in range(3))
        self.self_attn = build_layer(config, layer_idx)
        self.cross = CrossAttention(config)
        self.mlp = MLPS[config.mlp](config) if MLPS[config.mlp].has_weights else None

    def forward(self, x, positions, mask, memory, key_padding, need_weights=False):
        x = x + self.self_attn(self.norm_self(x), positions, mask)[0]
        a, weights = self.cross(self.norm_cross(x), memory, key_padding, need_weights)
        x = x + a
        return (x + self.mlp(self.norm_mlp(x)) if self.mlp is not None else x), weights


# Decoder-only options this model does not build, and model.causal, which it sets per
# stack (its encoder sees both ways, its decoder is masked); refused rather than ignored,
# so a setting never looks as though it changed the model when it did not.
GPT_ONLY = ("value_embeds", "token_mix", "skip_connections", "zero_head", "logit_softcap",
            "readout", "readout_shortlist", "tie_embeddings", "block", "sliding_window",
            "n_global", "n_token_types", "position_offset", "causal", "mtp_depth")


class EncoderDecoder(nn.Module):
    """n_layer encoder blocks and n_layer decoder blocks sharing one vocabulary, one
    embedding (tied to the output layer) and one position encoding."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        default = ModelConfig()
        changed = [f"model.{name}={getattr(config, name)!r}" for name in GPT_ONLY
                   if getattr(config, name) != getattr(default, name)]
        if changed:                  # first: the variants' own checks would ask for more of them
            many = len(changed) > 1
            raise ModelError(f"the encoder-decoder does not build {', '.join(changed)} "
                             f"({'options' if many else 'an option'} of the decoder-only GPT; "
                             "its encoder sees both ways and its decoder is masked); leave "
                             f"{'them' if many else 'it'} at the default here")
        check_config(config)
        if config.vocab_size <= 0:
            raise ModelError("model.vocab_size must be set")
        if POSITION_ENCODINGS[config.position].biases_scores:
            raise ModelError(f"model.position={config.position} biases scores by causal "
                             "distance, and the encoder sees in both directions; use positions "
                             "that go into the vectors (learned, sinusoidal, rope)")
        one_way = [n for n in names_used(config) if not MECHANISMS[n].follows_mask]
        if one_way:
            raise ModelError(f"model.mechanism={one_way[0]} reads only earlier tokens, and the "
                             "encoder sees in both directions; use a mechanism that follows the "
                             "mask (" + ", ".join(n for n, m in MECHANISMS.items() if m.follows_mask) + ")")
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.positions = POSITION_ENCODINGS[config.position](config)
        self.encoder = nn.ModuleList(EncoderBlock(config, i) for i in range(config.n_layer))
        self.decoder = nn.ModuleList(DecoderBlock(config, i) for i in range(config.n_layer))
        self.norm_enc, self.norm_dec = NORMS[config.norm](config), NORMS[config.norm](config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def encode(self, src: torch.Tensor, src_padding: torch.Tensor | None = None) -> torch.Tensor:
        """(B, S) input ids -> (B, S, C) memory; src_padding (B, S) is True at filler."""
        S = src.shape[1]
        x = self.positions.embed(self.wte(src), 0)
        mask = Mask(q_start=0, q_len=S, k_pos=torch.arange(S, device=src.device), causal=False,
                    key_padding=src_padding)
        for block in self.encoder:
            x = block(x, self.positions, mask)
        return self.norm_enc(x)

    def decode(self, tgt, memory, src_padding=None, return_attention=False):
        T = tgt.shape[1]
        x = self.positions.embed(self.wte(tgt), 0)
        mask = Mask(q_start=0, q_len=T, k_pos=torch.arange(T, device=tgt.device))
        maps = [] if return_attention else None
        for block in self.decoder:
            x, weights = block(x, self.positions, mask, memory, src_padding, return_attention)
            if return_attention:
                maps.append(weights)
        return self.lm_head(self.norm_dec(x)), maps

    def forward(self, src, tgt, targets=None, src_padding=None, return_attention=False):
        logits, maps = self.decode(tgt, self.encode(src, src_padding), src_padding, return_attention)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-1)
        return Seq2SeqOutput(logits, loss, maps)

    @torch.no_grad()
    def generate(self, src, bos: int, max_len: int, src_padding=None) -> torch.Tensor:
        """Greedy decoding: (B, max_len) output ids after the start token."""
        memory = self.encode(src, src_padding)
        out = torch.full((src.shape[0], 1), bos, dtype=torch.long, device=src.device)
        for _ in range(max_len):
            logits, _ = self.decode(out, memory, src_padding)
            out = torch.cat([out, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        return out[:, 1:]
