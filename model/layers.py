"""The rest of a Transformer block: normalisation, the feed-forward MLP, which attention
mechanism each layer gets, and the residual block that wraps attention and MLP (pre-norm
as GPT-2, post-norm as BERT). Parts a config adds beyond these are in model/extras.py."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.config import ModelConfig
from model.extras import TokenMix
from model.mechanisms import MECHANISMS, Mechanism
from model.moe import MixtureOfExperts


def layer_norm(config: ModelConfig, width: int | None = None) -> nn.Module:
    # `width`: another size than n_embd (a learned QK-norm over d_k, model.qk_norm_weight).
    return nn.LayerNorm(width or config.n_embd, eps=config.norm_eps, bias=config.bias)


def rms_norm(config: ModelConfig, width: int | None = None) -> nn.Module:
    # RMSNorm (arXiv:1910.07467) drops LayerNorm's mean subtraction and bias.
    return nn.RMSNorm(width or config.n_embd, eps=config.norm_eps)


class OffsetRMSNorm(nn.Module):
    """RMSNorm whose gain is stored as an offset from 1, x/rms(x)·(1 + w) with w starting
    at 0 (Gemma, arXiv:2503.19786; transformers' Gemma3RMSNorm): weight decay pulls the
    gain towards 1, not towards 0. Normalised and scaled in at least float32 and rounded
    once to the input's precision, Gemma's order, so bf16 weights give Gemma's numbers."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(width))

    def forward(self, x):
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.to(h.dtype))).to(x.dtype)


def offset_rms_norm(config: ModelConfig, width: int | None = None) -> nn.Module:
    return OffsetRMSNorm(width or config.n_embd, config.norm_eps)


NORMS = {"layernorm": layer_norm, "rmsnorm": rms_norm, "rmsnorm1p": offset_rms_norm}


class GeluMLP(nn.Module):
    """Position-wise feed-forward: widen 4×, GELU, project back (GPT-2, BERT). GELU in its
    exact form, x·Φ(x) with Φ the normal CDF (Hendrycks & Gimpel, arXiv:1606.08415),
    as torch and transformers name it `gelu`. The default: on a CPU torch vectorises
    erf and not the tanh form, so the exact form is also the cheaper there
    (docs/benchmarks.md, "GELU")."""
    has_weights = True
    matrices = 2            # n_embd x hidden matrices: in and out
    approximate = "none"

    @staticmethod
    def width(config: ModelConfig) -> int:
        """The hidden width: model.mlp_hidden, or 4 x n_embd when it is 0."""
        return config.mlp_hidden or 4 * config.n_embd

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.hidden = self.width(config)
        self.fc = nn.Linear(config.n_embd, self.hidden, bias=config.bias)
        self.proj = nn.Linear(self.hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        h = self.fc(x)
        # Without autograd nothing else reads the widened activations, so GELU overwrites
        # them: one (B, T, 4C) buffer fewer to allocate, fault in and stream through.
        h = (F.gelu(h, approximate=self.approximate) if torch.is_grad_enabled()
             else torch.ops.aten.gelu_(h, approximate=self.approximate))
        return self.dropout(self.proj(h))


class GeluTanhMLP(GeluMLP):
    """The same MLP with GELU's tanh approximation, as GPT-2 computed it (transformers'
    `gelu_new`), so GPT-2's weights give GPT-2's outputs."""
    approximate = "tanh"


class SwiGLU(nn.Module):
    """Gated feed-forward silu(x·W_gate) ⊙ (x·W_up) (arXiv:2002.05202). The hidden
    width is 8/3 of n_embd (rounded up to a multiple of 32) so the three matrices
    hold about as many weights as the GELU MLP's two; model.mlp_hidden sets another
    (Llama's and Mistral's checkpoints each bring their own)."""
    has_weights = True
    matrices = 3            # gate, up and down

    @staticmethod
    def width(config: ModelConfig) -> int:
        return config.mlp_hidden or -(-8 * config.n_embd // 3 // 32) * 32

    def __init__(self, config: ModelConfig):
        super().__init__()
        hidden = self.hidden = self.width(config)
        self.fc = nn.Linear(config.n_embd, 2 * hidden, bias=config.bias)   # gate and up, fused
        self.proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        gate, up = self.fc(x).split(self.hidden, dim=-1)
        return self.dropout(self.proj(F.silu(gate) * up))


class GeGLU(SwiGLU):
    """The gated feed-forward with GELU (tanh form) as the gate, gelu(x·W_gate) ⊙ (x·W_up)
    (arXiv:2002.05202's GEGLU; Gemma's MLP, transformers' gelu_pytorch_tanh). Widths as
    SwiGLU's; checkpoints bring their own."""

    def forward(self, x):
        gate, up = self.fc(x).split(self.hidden, dim=-1)
        return self.dropout(self.proj(F.gelu(gate, approximate="tanh") * up))


class ReluSquaredMLP(GeluMLP):
    """The GELU MLP with relu(x)² in place of GELU (Primer, arXiv:2109.08668; the
    activation of modded-nanogpt's speed records): as good or better per step, and two
    cheap element-wise operations."""

    def forward(self, x):
        return self.dropout(self.proj(F.relu(self.fc(x)).square()))


class AttentionOnly:
    """No feed-forward at all: an attention-only Transformer, the setting in which
    Olsson et al. (2022, "In-context Learning and Induction Heads") found induction
    heads: every computation is attention, so each can be read off the patterns. The
    entry's facts only: a block with it builds no MLP and no norm in front of one."""
    has_weights = False
    matrices = 0

    @staticmethod
    def width(config: ModelConfig) -> int:
        return 0


MLPS = {"gelu": GeluMLP, "gelu_tanh": GeluTanhMLP, "swiglu": SwiGLU, "geglu": GeGLU,
        "relu2": ReluSquaredMLP, "none": AttentionOnly, "moe": MixtureOfExperts}


def layer_names(config: ModelConfig) -> list[str]:
    """The mechanism of each layer: model.mechanism's names cycled over the layers."""
    names = [n.strip() for n in config.mechanism.split(",")]
    return [names[i % len(names)] for i in range(config.n_layer)]


def mechanisms_of(config: ModelConfig) -> list[Mechanism]:
    """Each layer's entry, in order (names checked by model/registry.py first)."""
    return [MECHANISMS[n] for n in layer_names(config)]


def build_layer(config: ModelConfig, layer_idx: int) -> nn.Module:
    """The attention module of layer `layer_idx`, as model.mechanism says."""
    return mechanisms_of(config)[layer_idx].layer(config, layer_idx)


class Block(nn.Module):
    """x + attention(norm(x)), then x + mlp(norm(x)): pre-norm residual (GPT-2), which
    keeps an identity path from input to output so deep stacks train stably. The
    stream leaves the last block unnormalised, so the model norms it once at the end.
    The parts a config adds to a block are BlockWithVariants', below.

    The class attributes are the facts the model asks about a block."""
    norms_embeddings = False   # a norm between the embeddings and the first block
    final_norm = True          # a norm after the last block
    norms_outputs = False      # a norm on each sublayer's output too, before the residual sum
    plain = True               # GPT-2's arrangement, which the plain GPT builds as this class

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.norm_attn = NORMS[config.norm](config)
        # model.mechanism's entry (its facts), and the layer it builds. The default, `mha`,
        # builds MultiHeadAttention of model/attention.py.
        self.mechanism = MECHANISMS[config.mechanism]
        self.attn = self.mechanism.layer(config, layer_idx)
        self.norm_mlp = NORMS[config.norm](config)
        self.mlp = MLPS[config.mlp](config)

    @property
    def has_weights(self) -> bool:
        """Has attention weights to return: a recurrent layer (DeltaNet) has none."""
        return self.mechanism.no_weights is None

    def forward(self, x, positions, mask, cache=None, need_weights=False, value_embed=None):
        a, weights = self.attn(self.norm_attn(x), positions, mask, cache, need_weights, value_embed)
        x = x + a
        x = x + self.mlp(self.norm_mlp(x))
        return x, weights


class BlockWithVariants(Block):
    """The pre-norm block with the parts a config adds to GPT-2's, each built only when its
    field asks for it: a mechanism per layer (a hybrid, model.mechanism=linear,mha), Canon
    layers' mix of the newest positions before attention (model.token_mix), no MLP at all
    (model.mlp=none, an attention-only model), and DeepSeek-V3's dense first layers before
    the experts (model.moe_dense_layers).
    GPTWithVariants builds it, and the post-norm and sandwich blocks below are built on
    it. Its parts have the plain Block's names and order, so a checkpoint reads the same."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        nn.Module.__init__(self)
        self.norm_attn = NORMS[config.norm](config)
        self.mechanism = MECHANISMS[layer_names(config)[layer_idx]]     # this layer's entry
        self.attn = self.mechanism.layer(config, layer_idx)
        mlp = MLPS["swiglu" if layer_idx < config.moe_dense_layers else config.mlp]
        # An attention-only model (model.mlp=none) has no MLP and no norm in front of it.
        self.norm_mlp = NORMS[config.norm](config) if mlp.has_weights else None
        self.mlp = mlp(config) if mlp.has_weights else None
        self.mix = TokenMix(config, layer_idx) if config.token_mix else None

    def forward(self, x, positions, mask, cache=None, need_weights=False, value_embed=None):
        h = self.norm_attn(x)
        if self.mix is not None:               # Canon layers' mix of the newest positions
            h = self.mix(h, cache)
        a, weights = self.attn(h, positions, mask, cache, need_weights, value_embed)
        x = x + a
        if self.mlp is not None:
            x = x + self.mlp(self.norm_mlp(x))
        return x, weights


class PostNormBlock(BlockWithVariants):
    """norm(x + attention(x)), then norm(x + mlp(x)): post-norm residual, as in "Attention
    Is All You Need" and BERT (arXiv:1810.04805). Every block hands on a normalised
    stream, so there is no final norm; BERT also normalises the summed embeddings
    before the first block. The same modules as Block, in another order, so a BERT
    checkpoint's two LayerNorms per layer map one to one onto norm_attn and norm_mlp."""
    norms_embeddings = True
    final_norm = False
    plain = False

    def forward(self, x, positions, mask, cache=None, need_weights=False, value_embed=None):
        h = x if self.mix is None else self.mix(x, cache)
        a, weights = self.attn(h, positions, mask, cache, need_weights, value_embed)
        x = self.norm_attn(x + a)
        if self.mlp is not None:
            x = self.norm_mlp(x + self.mlp(x))
        return x, weights


class SandwichBlock(BlockWithVariants):
    """x + norm(attention(norm(x))), then x + norm(mlp(norm(x))): pre-norm with a second
    norm on each sublayer's output before it joins the stream ("sandwich" norm, CogView,
    arXiv:2105.13290; Gemma 2 and 3, whose four norms a layer are transformers'
    input_layernorm, post_attention_layernorm, pre_feedforward_layernorm and
    post_feedforward_layernorm). What a sublayer adds is bounded whatever its weights
    grow to, and the stream still keeps its identity path."""
    norms_outputs = True
    plain = False

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.norm_attn_out = NORMS[config.norm](config)
        self.norm_mlp_out = NORMS[config.norm](config) if self.mlp is not None else None

    def forward(self, x, positions, mask, cache=None, need_weights=False, value_embed=None):
        h = self.norm_attn(x)
        if self.mix is not None:
            h = self.mix(h, cache)
        a, weights = self.attn(h, positions, mask, cache, need_weights, value_embed)
        x = x + self.norm_attn_out(a)
        if self.mlp is not None:
            x = x + self.norm_mlp_out(self.mlp(self.norm_mlp(x)))
        return x, weights


BLOCKS = {"prenorm": BlockWithVariants, "postnorm": PostNormBlock, "sandwich": SandwichBlock}
