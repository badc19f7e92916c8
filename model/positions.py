"""Position encodings: how a model that otherwise sees a *set* of tokens learns order.

Attention by itself is permutation-equivariant: shuffle the input tokens and the
outputs shuffle the same way (tests/test_attention.py,
test_without_positions_attention_is_permutation_equivariant, proves it). Every
encoding here answers the same five hooks, so the attention code has no branches: the
three below, each where an encoding puts order in, and two around `rotate`
(`rotate_in_pass` is `rotate` reusing one pass's angles across layers; `shift` renumbers
cached keys):

* `embed(x, start)` adds a vector per absolute position to the token embeddings
  (sinusoidal, learned), as in "Attention Is All You Need" (arXiv:1706.03762);
* `rotate(x, start)` turns query vectors, and then key vectors, by an angle
  proportional to their position (RoPE, arXiv:2104.09864), so q·k depends only on
  the offset between them (on part of each head: model/partial_rope.py);
* `score_bias(q_pos, k_pos)` is added to the scores, for query and key positions
  (ALiBi, arXiv:2108.12409: a penalty growing with distance, no embedding at all).

`start` is the absolute position of the first token in the chunk, which is what lets
cached decoding (one new token at position start) use the same code as training. It
is an int, or a (1,) device tensor in a static-cache step (model/cache.py), whose
position must not be read back to Python: every hook computes from it with tensors.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from model.config import ModelConfig, ModelError
from model.rope_scaling import ROPE_SCALINGS


class PositionRangeError(ModelError):
    """A sequence longer than a fixed-size position table."""


class PositionEncoding(nn.Module):
    """No positions at all: every hook leaves its input as it is (the `none` encoding).

    The class attributes are the facts other code asks about an encoding, so nothing
    outside this registry compares an encoding's name with a string."""
    absolute = False        # adds a vector per absolute position to the input
    has_length_limit = False   # a table of block_size rows: nothing past it
    rotary = False          # turns q and k by pairs of dimensions (RoPE)
    biases_scores = False   # adds a bias to the attention scores, by causal distance (ALiBi)

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config

    def embed(self, x: torch.Tensor, start: int) -> torch.Tensor:
        return x

    def rotate(self, x: torch.Tensor, start: int) -> torch.Tensor:
        return x

    def rotate_in_pass(self, x: torch.Tensor, start: int, shared: dict) -> torch.Tensor:
        """`rotate` for one layer of a forward pass; `shared` (Mask.shared) keeps what the
        pass's layers can reuse. An encoding with nothing to reuse (a learner's) rotates."""
        return self.rotate(x, start)

    # ALiBi's bias(q_pos, k_pos), added to the scores (the Mask's bias_fn); None: no bias.
    score_bias = None

    def shift(self, k: torch.Tensor, delta: int) -> torch.Tensor:
        """Keys already encoded at their positions, moved by `delta` positions (a rolling
        cache that renumbers what it keeps). Nothing to do where keys carry no position."""
        return k


class Sinusoidal(PositionEncoding):
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(same angle).

    Computed from the positions themselves, so it has no table and works at any
    length; each pair of dimensions is a clock turning at its own speed. The table's
    values are of size 1 while token embeddings start near 0.02, so, as in the paper,
    the token embeddings are multiplied by √d_model first; otherwise the positions
    drown the tokens."""
    absolute = True

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        d = config.n_embd
        inv_freq = torch.exp(-math.log(10000.0) * torch.arange(0, d, 2).float() / d)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def embed(self, x, start):
        T, d = x.shape[1], x.shape[2]
        pos = (start + torch.arange(T, device=x.device)).float()
        angle = pos[:, None] * self.inv_freq[None, :]            # (T, d/2)
        pe = torch.empty(T, d, device=x.device)
        pe[:, 0::2] = torch.sin(angle)
        pe[:, 1::2] = torch.cos(angle[:, : d // 2])
        return x * math.sqrt(d) + pe.to(x.dtype)


class Learned(PositionEncoding):
    """One trained vector per position (GPT-2, BERT). The table has block_size rows, so
    it cannot say anything about a position it never saw: longer input is refused.
    With model.position_offset, position p reads row p + offset (RoBERTa's table has
    two rows before the first position, for padding)."""
    absolute = True
    has_length_limit = True

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.offset = config.position_offset
        self.table = nn.Embedding(config.block_size + self.offset, config.n_embd)

    def embed(self, x, start):
        T = x.shape[1]
        # (A static cache's step has at most block_size slots, so it cannot get here.)
        if isinstance(start, int) and start + T > self.table.num_embeddings - self.offset:
            raise PositionRangeError(
                f"learned positions have a table of {self.table.num_embeddings - self.offset} "
                f"positions (model.block_size) but this sequence reaches position "
                f"{start + T - 1}; use a context of at most block_size tokens, or an "
                "encoding that works at any length (rope, sinusoidal, none)")
        return x + self.table(self.offset + start + torch.arange(T, device=x.device))


class RoPE(PositionEncoding):
    """Rotary position embedding (Su et al., arXiv:2104.09864).

    Pair i of a head's dimensions is rotated by the angle pos * theta^(-2i/d_k). A
    rotation by a at the query and b at the key leaves q·k depending on a - b only:
    the score sees the offset between tokens, never their absolute positions. Pairs
    are (x[i], x[i + d/2]), the "rotate half" layout used by GPT-NeoX and Llama.

    `rope_scaling` stretches a trained model to a longer context at evaluation time
    (factor s = new context / rope_original_context):
      linear  position interpolation, every frequency divided by s (arXiv:2306.15595);
      ntk     NTK-aware: the base grows to theta·s^(d/(d-2)), so high frequencies (local
              order) stay and only the slow ones are interpolated;
      yarn    per-frequency blend: pairs that turn many times within the original
              context keep their frequency, slow ones are interpolated, a ramp in
              between, and scores are sharpened by (0.1·ln s + 1)² (arXiv:2309.00071);
      yarn_by_pairs  the same with the ramp over the pair index, as transformers and
              gpt-oss compute it."""

    rotary = True

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self._build(torch.promote_types(torch.get_default_dtype(), torch.float32))

    def _build(self, dtype: torch.dtype, device=None):
        """The frequencies, computed in `dtype`: float32 for a model that trains in float32
        or bf16, float64 for a float64 model, whose angles would otherwise carry float32's
        error (7e-7 of a radian at position 1000), a million times what its checks against
        references allow."""
        c = self.config
        d = c.n_embd // c.n_head                       # each head's d_k
        inv_freq = c.rope_theta ** (-torch.arange(0, d, 2, dtype=dtype, device=device) / d)
        if ROPE_SCALINGS[c.rope_scaling].stretches:    # past the training context, on request
            inv_freq, self.mscale = ROPE_SCALINGS[c.rope_scaling].scale(inv_freq, c)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    # YaRN's temperature, set by a scaling that has one: q and k each scaled by mscale,
    # scores by mscale².
    mscale = 1.0

    def turns_at(self, pos: torch.Tensor, dtype: torch.dtype):
        """(cos, cos) and (-sin, sin) of the angles of positions `pos`, (len(pos), d), in
        `dtype`: what `turn` takes. The angles are made in the frequencies' precision."""
        angle = pos.to(self.inv_freq.dtype)[:, None] * self.inv_freq
        cos, sin = (angle.cos() * self.mscale).to(dtype), (angle.sin() * self.mscale).to(dtype)
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)

    def _apply(self, fn, recurse=True):
        # model.double() casts the frequencies' numbers, not the way they were made: float32
        # frequencies cast up keep their float32 error. Cast to float64, they are made again
        # from the formula in float64; any other cast keeps what it gives, as before.
        super()._apply(fn, recurse)
        if self.inv_freq.dtype == torch.float64:
            self._build(torch.float64, self.inv_freq.device)
        return self

    def rotate(self, x, start):
        # x: (B, heads, T, D), the queries or the keys of T positions from start.
        return Turn.apply(x, *self.turns_at(start + torch.arange(x.shape[-2], device=x.device), x.dtype))

    def rotate_in_pass(self, x, start, shared):
        # The queries and keys of every layer of a pass are the same positions, so one pair
        # of turning tensors, made for these positions alone, serves them all: nothing is
        # kept that grows with position or limits it. Kept by table and precision: a model
        # with two tables (Gemma 3's local and global frequencies) may turn by both in one
        # pass, and a layer that turns in another precision gets its own.
        if (self, x.dtype) not in shared:
            shared[self, x.dtype] = self.turns_at(start + torch.arange(x.shape[-2], device=x.device), x.dtype)
        return Turn.apply(x, *shared[self, x.dtype])

    def shift(self, k, delta):
        # Rotations compose: turning a key at p by delta·θ_i more puts it at p + delta.
        # (YaRN's mscale is a length, not an angle: already in k, it stays.)
        angle = delta * self.inv_freq
        cos, sin = angle.cos().to(k.dtype), angle.sin().to(k.dtype)
        return turn(k, torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1))


def turn(x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> torch.Tensor:
    """(x1·cos - x2·sin, x2·cos + x1·sin) for the halves x1, x2 of x's last dimension,
    given cos2 = (cos, cos) and sin2 = (-sin, sin): x·cos2 + (x2, x1)·sin2, the same
    numbers as the rotation written out, in three passes over x instead of seven (and
    three kernels, where a GPU's decoding step is counted in kernels)."""
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos2).addcmul_(torch.cat((x2, x1), dim=-1), sin2)


class Turn(torch.autograd.Function):
    """RoPE's rotation with its backward written out: the gradient turns back by the
    opposite angle (a rotation's transpose is its inverse), three passes again, where
    autograd's backward of the written-out rotation takes about a dozen and keeps x's
    halves (the time it saves is measured in docs/benchmarks.md)."""

    @staticmethod
    def forward(ctx, x, cos2, sin2):
        ctx.save_for_backward(cos2, sin2)
        return turn(x, cos2, sin2)

    @staticmethod
    def backward(ctx, grad):
        cos2, sin2 = ctx.saved_tensors
        return turn(grad, cos2, -sin2), None, None


class ALiBi(PositionEncoding):
    """Attention with linear biases (Press et al., arXiv:2108.12409): no position
    vectors at all; head h subtracts slope_h · (distance to the key) from each score.
    Slopes form a geometric series 2^(-8/n), 2^(-16/n), ...: some heads look far, some
    near. Distances, not positions, so it extrapolates to longer inputs."""
    biases_scores = True

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.register_buffer("slopes", alibi_slopes(config.n_head), persistent=False)

    def score_bias(self, q_pos, k_pos, head=None):
        """(H, *shape) penalties for broadcastable query and key positions; for one head's
        score (flex), pass `head`."""
        distance = (q_pos - k_pos).to(self.slopes.dtype)
        if head is not None:
            return -self.slopes[head] * distance
        return -self.slopes.view(-1, *([1] * distance.dim())) * distance


def alibi_slopes(n_head: int) -> torch.Tensor:
    """The paper's slopes; for a head count that is not a power of two, those of the
    next lower power of two, then every other slope of the next higher one."""
    def power_of_two(n):
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]
    low = 2 ** math.floor(math.log2(n_head))
    slopes = power_of_two(low) + power_of_two(2 * low)[0::2][: n_head - low]
    return torch.tensor(slopes)


POSITION_ENCODINGS = {
    "none": PositionEncoding,
    "sinusoidal": Sinusoidal,
    "learned": Learned,
    "rope": RoPE,
    "alibi": ALiBi,
}
