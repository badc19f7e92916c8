"""Position encodings: how a model that otherwise sees a *set* of tokens learns order.

Attention by itself is permutation-equivariant: shuffle the input tokens and the
outputs shuffle the same way (tests/test_positions.py proves it for `none`). Every
encoding here is one of two hooks, so the attention code has no branches:

* `embed(x, start)` adds a vector per absolute position to the token embeddings
  (sinusoidal, learned), as in "Attention Is All You Need" (arXiv:1706.03762);
* `rotate(x, start)` turns query and key vectors (passed together, one call per
  layer) by an angle proportional to their position (RoPE, arXiv:2104.09864), so
  q·k depends only on the offset between them.

`start` is the absolute position of the first token in the chunk, which is what lets
cached decoding (one new token at position start) use the same code as training.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from attnlab.errors import AttnlabError
from model.config import ModelConfig


class PositionRangeError(AttnlabError, ValueError):
    """A sequence longer than a fixed-size position table."""


class PositionEncoding(nn.Module):
    """No positions at all: both hooks do nothing (the `none` encoding)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config

    def embed(self, x: torch.Tensor, start: int) -> torch.Tensor:
        return x

    def rotate(self, x: torch.Tensor, start: int) -> torch.Tensor:
        return x


class Sinusoidal(PositionEncoding):
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(same angle).

    Computed from the positions themselves, so it has no table and works at any
    length; each pair of dimensions is a clock turning at its own speed."""

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        d = config.n_embd
        inv_freq = torch.exp(-math.log(10000.0) * torch.arange(0, d, 2).float() / d)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def embed(self, x, start):
        T, d = x.shape[1], x.shape[2]
        pos = torch.arange(start, start + T, device=x.device, dtype=torch.float32)
        angle = pos[:, None] * self.inv_freq[None, :]            # (T, d/2)
        pe = torch.empty(T, d, device=x.device)
        pe[:, 0::2] = torch.sin(angle)
        pe[:, 1::2] = torch.cos(angle[:, : d // 2])
        return x + pe.to(x.dtype)


class Learned(PositionEncoding):
    """One trained vector per position (GPT-2). The table has block_size rows, so it
    cannot say anything about a position it never saw: longer input is refused."""

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.table = nn.Embedding(config.block_size, config.n_embd)

    def embed(self, x, start):
        T = x.shape[1]
        if start + T > self.table.num_embeddings:
            raise PositionRangeError(
                f"learned positions have a table of {self.table.num_embeddings} positions "
                f"(model.block_size) but this sequence reaches position {start + T - 1}; "
                "use a context of at most block_size tokens, or an encoding that works "
                "at any length (rope, sinusoidal, none)")
        pos = torch.arange(start, start + T, device=x.device)
        return x + self.table(pos)


class RoPE(PositionEncoding):
    """Rotary position embedding (Su et al., arXiv:2104.09864).

    Pair i of a head's dimensions is rotated by the angle pos * theta^(-2i/d_k). A
    rotation by a at the query and b at the key leaves q·k depending on a - b only:
    the score sees the offset between tokens, never their absolute positions. Pairs
    are (x[i], x[i + d/2]), the "rotate half" layout used by GPT-NeoX and Llama."""

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        d = config.head_dim
        inv_freq = config.rope_theta ** (-torch.arange(0, d, 2).float() / d)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._build(config.block_size)

    def _build(self, length: int):
        angle = torch.arange(length, device=self.inv_freq.device).float()[:, None] * self.inv_freq
        self.register_buffer("cos", angle.cos(), persistent=False)   # (length, d/2)
        self.register_buffer("sin", angle.sin(), persistent=False)

    def rotate(self, x, start):
        # x: (B, heads, T, D), queries and keys of the same T positions.
        T = x.shape[-2]
        if start + T > self.cos.shape[0]:     # past the table: extend it (works at any length)
            self._build(max(start + T, 2 * self.cos.shape[0]))
        cos = self.cos[start:start + T].to(x.dtype)
        sin = self.sin[start:start + T].to(x.dtype)
        # Each pair (x1[i], x2[i]) turns by its angle: a 2-D rotation matrix, written out.
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


POSITION_ENCODINGS = {
    "none": PositionEncoding,
    "sinusoidal": Sinusoidal,
    "learned": Learned,
    "rope": RoPE,
}
