"""Attention mechanisms: what a layer computes to let positions read from each other.

A *backend* (model/attention.py: eager, sdpa, banded, flex) computes the same
softmax(Q·Kᵀ/√d_k)·V faster and is tested equal to the formula. A *mechanism* changes
the formula itself: plain multi-head attention (with grouped-query and multi-query as
its n_kv_head < n_head forms), differential attention, and the linear, delta-rule and
latent answers to attention's cost, and sigmoid, gated, sink and sparse (DSA) attention. One
config field, model.mechanism, names one, or a
comma-separated pattern cycled over the layers (a hybrid: `linear,linear,linear,mha`).

Each entry carries the facts the rest of the project asks about it, so a new mechanism
is its class, its entry and its test: blocks and the encoder-decoder build `layer`,
model/gpt.py counts `flops`, the decoders keep `cache`, attnlab's
lens, page and `heads` read `no_weights` (and `heads` `weights_sum_to_one`),
engine/interop.py reads `export_refusal`, model/registry.py checks `follows_mask`,
`head_multiple`, `takes_value_embed`, `takes_qk_norm` and `uses_kernel`, generate reads `stream_refusal`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch.nn as nn

from model.attention import MultiHeadAttention
from model.config import ModelConfig, ModelError
from model.deltanet import DeltaNet, GatedDeltaNet, NormedGatedDeltaNet
from model.differential import DifferentialAttention
from model.latent_attention import LatentAttention, latent_sizes
from model.latent_sparse_attention import LatentSparseAttention
from model.linear_attention import LinearAttention
from model.gated_attention import GatedAttention
from model.kda import KimiDeltaAttention
from model.sigmoid_attention import SigmoidAttention
from model.sink_attention import SinkAttention
from model.sparse_attention import SparseAttention, sparse_sizes


@dataclass(frozen=True)
class Cache:
    """What a mechanism keeps per layer while decoding, so a new token costs one step:
    numbers that grow with the text (keys and values, a latent) and numbers of a fixed
    size (a recurrent state). Counts of numbers, not bytes: times the element size."""
    what: str                                           # in words, for tools and docs
    per_token: Callable[[ModelConfig], int]             # numbers a layer keeps per token
    fixed: Callable[[ModelConfig], int] = lambda c: 0   # numbers a layer keeps at any length

    def __post_init__(self):
        # A number where a function of the config belongs fails only when a cache is sized.
        for name in ("per_token", "fixed"):
            if not callable(getattr(self, name)):
                raise TypeError(f"Cache {self.what!r}: {name} must be a function of the "
                                f"config (as keys_and_values is), not {getattr(self, name)!r}")


def keys_and_values(config: ModelConfig) -> int:
    # One key and one value of d_k per key/value head: n_kv_head < n_head shrinks it (GQA).
    return 2 * config.kv_heads * config.head_dim


def score_flops(config: ModelConfig, context: int) -> float:
    """Forward FLOPs per token of one layer beyond its weight matrices: Q·Kᵀ and the
    weighted sum, 2·d_model·T multiply-adds each (PaLM, arXiv:2204.02311, appendix B)."""
    return 4 * config.n_embd * context


def latent_and_rope_key(config: ModelConfig) -> int:
    # MLA keeps one latent c_kv of r and one rotated key of d_R per token, for every head.
    return sum(latent_sizes(config))


def latent_flops(config: ModelConfig, context: int) -> float:
    """Softmax attention's, with each head's query and key d_h + d_R long (arXiv:2405.04434)."""
    _, rope_dim = latent_sizes(config)
    return 2 * config.n_head * (2 * config.head_dim + rope_dim) * context


def keys_values_and_index_key(config: ModelConfig) -> int:
    # DSA keeps multi-head attention's keys and values and one indexer key of d_I a token.
    return keys_and_values(config) + sparse_sizes(config)[2]


def sparse_flops(config: ModelConfig, context: int) -> float:
    """A whole sequence's: softmax attention's masked scores and weighted sum (4·d·T), and
    the indexer's H_I dot products of d_I and their weighted sum per key (2·H_I·(d_I + 1)·T).
    A decoding step's softmax reads only k keys (arXiv:2512.02556, section 2.1)."""
    _, heads, dim = sparse_sizes(config)
    return score_flops(config, context) + 2 * heads * (dim + 1) * context


def sparse_maps(config: ModelConfig) -> int:
    # The heads' weights, the indexer's H_I products and their ReLU in fp32 (twice the
    # bytes of a 16-bit map each, so counted twice), and the chosen keys' mask.
    return config.n_head + 4 * sparse_sizes(config)[1] + 1


def latent_and_index_key(config: ModelConfig) -> int:
    # DeepSeek-V3.2: MLA's latent and rotary key, and the indexer's key of d_I, a token.
    return latent_and_rope_key(config) + sparse_sizes(config)[2]


def latent_sparse_flops(config: ModelConfig, context: int) -> float:
    """MLA's scores and weighted sum, and the indexer's, as sparse_flops counts them."""
    _, heads, dim = sparse_sizes(config)
    return latent_flops(config, context) + 2 * heads * (dim + 1) * context


def linear_state(config: ModelConfig) -> int:
    # S = Σ φ(k)vᵀ (d_k × d_k) and z = Σ φ(k) (d_k) per head, at any length (arXiv:2006.16236).
    return config.n_head * config.head_dim * (config.head_dim + 1)


def delta_state(config: ModelConfig) -> int:
    # One d_k × d_k state per head, rewritten by each token (arXiv:2406.06484), and with
    # model.delta_conv = K the last K-1 rows of q, k and v its convolution reads again.
    return config.n_head * config.head_dim ** 2 + max(config.delta_conv - 1, 0) * 3 * config.n_embd


def linear_flops(config: ModelConfig, context: int) -> float:
    """Per token, the chunked form: the masked C×C kernel and its product with V (4·d·C,
    C = min(linear_chunk, T)), and reading and writing the d_k × d_k state (4·d·d_k):
    linear in T overall, where softmax attention's 4·d·T grows with it."""
    chunk = min(config.linear_chunk, context)
    return 4 * config.n_embd * (chunk + config.head_dim)


def delta_flops(config: ModelConfig, context: int) -> float:
    """Per token, the UT-transform chunk (arXiv:2406.06484, section 3): K·Kᵀ, Q·Kᵀ, the
    triangular solve's C² per head and T·K, T·V (about 10·d·C), and the state read for
    W, for q and written back (6·d·d_k)."""
    chunk = min(config.linear_chunk, context)
    return (10 * config.n_embd * chunk + 6 * config.n_embd * config.head_dim
            + config.n_head * chunk ** 2)


def kda_maps(config: ModelConfig) -> int:
    """T×T maps' worth of what a KDA layer keeps for backward (5 bytes a map entry, as
    engine/budget.py counts): its chunk's fading and faded keys, two fp32 tensors of
    C × C × d_k per head for each of T/C chunks (model/kda.py), at least a map a head."""
    chunk = min(config.linear_chunk, config.block_size)
    return config.n_head * max(1, (2 * 4 * chunk * config.head_dim) // (5 * config.block_size))


@dataclass(frozen=True)
class Mechanism:
    """An attention mechanism and the facts other code asks about it."""
    layer: Callable[[ModelConfig, int], nn.Module]   # built as layer(config, layer_idx)
    cache: Cache                                     # what it keeps per layer to decode
    no_weights: str | None = None      # why it has no attention weights to draw; None: it has
    export_refusal: str | None = None  # why no transformers architecture computes it; None:
                                       # the plain attention of engine/interop.py's architectures
    flops: Callable[[ModelConfig, int], float] = score_flops   # (config, context T) -> forward
    follows_mask: bool = True          # obeys the mask rule: windows, global tokens, padding,
                                       # both directions (an encoder); else causal over all
    head_multiple: int = 1             # the head size d_k must be a multiple of this
    takes_score_bias: bool = True      # adds a position's score bias (ALiBi) head by head
    takes_value_embed: bool = True     # adds model.value_embeds' per-token vector to its values
    takes_kv_heads: bool = True        # shares keys and values over model.n_kv_head groups (GQA)
    takes_qk_norm: bool = True         # scales its queries and keys to unit RMS (model.qk_norm)
    takes_rotary: bool = True          # turns q and k by the model's RoPE; else order comes
                                       # another way (its causal sums, or a RoPE of its own)
    stream_refusal: str | None = None  # why a streaming cache (generate's sinks), which turns
                                       # kept keys back by the model's RoPE, cannot keep it
    uses_kernel: bool = True           # its softmax runs on the backend set by name
                                       # (model.attention.use_backend); else its own maths
    weights_sum_to_one: bool = True    # each row of its weights is a distribution (none below
                                       # 0, summing to 1): entropy applies, the scale is 0-1
    score_maps: Callable[[ModelConfig], int] = lambda c: c.n_head   # T×T maps a layer keeps
                                       # for backward, for engine/budget.py's memory bound

    def __post_init__(self):
        problems = entry_problems(self)
        if problems:
            raise TypeError(f"Mechanism({getattr(self.layer, '__name__', self.layer)}): "
                            + "; ".join(problems))


def entry_problems(entry: Mechanism) -> list[str]:
    """What makes an entry unusable, found when it is written rather than when a tool
    first asks it: each reason is the one line a user reads after "error: ...: "."""
    problems = [f"{name} must be callable" for name in ("layer", "flops", "score_maps")
                if not callable(getattr(entry, name))]
    if not isinstance(entry.cache, Cache):
        problems.append("cache must be a Cache(what, per_token, fixed)")
    if type(entry.head_multiple) is not int or entry.head_multiple < 1:
        problems.append(f"head_multiple must be a whole number from 1, not {entry.head_multiple!r}")
    for name in ("no_weights", "export_refusal", "stream_refusal"):
        reason = getattr(entry, name)
        if reason is not None and (not isinstance(reason, str) or not reason.strip()
                                   or "\n" in reason):
            problems.append(f"{name} must be None or the reason in one line of words")
    return problems


# The facts every fixed-state mechanism shares: a state, not a mask or scores, so no score
# bias, no key/value heads, no model RoPE on its keys, no QK-norm and no attention kernel.
RECURRENT = dict(follows_mask=False, takes_score_bias=False, takes_kv_heads=False,
                 takes_rotary=False, takes_qk_norm=False, uses_kernel=False)

MECHANISMS = {
    "mha": Mechanism(MultiHeadAttention, Cache("keys and values", keys_and_values)),
    # Two softmax maps subtracted (arXiv:2410.05258): the same keys and values are cached.
    "differential": Mechanism(
        DifferentialAttention, Cache("keys and values", keys_and_values),
        export_refusal="differential attention (two softmax maps subtracted, arXiv:2410.05258) "
                       "is in no transformers architecture",
        head_multiple=4, takes_score_bias=False, weights_sum_to_one=False),
    # A sigmoid per score in place of the softmax over the row (arXiv:2409.04431).
    "sigmoid": Mechanism(
        SigmoidAttention, Cache("keys and values", keys_and_values),
        export_refusal="sigmoid attention (arXiv:2409.04431) is in no transformers architecture",
        takes_score_bias=False, uses_kernel=False, weights_sum_to_one=False),
    # A sigmoid gate from the layer's input on each head's output (arXiv:2505.06708).
    "gated": Mechanism(
        GatedAttention, Cache("keys and values", keys_and_values),
        export_refusal="gated attention (arXiv:2505.06708) comes in transformers only inside "
                       "Qwen3-Next, which needs the rest of its card too (--config qwen3-next "
                       "exports as Qwen3NextForCausalLM)"),
    # One learned logit per head in the softmax's denominator (gpt-oss).
    "sinks": Mechanism(
        SinkAttention, Cache("keys and values", keys_and_values),
        export_refusal="learned attention sinks come in transformers only inside gpt-oss, "
                       "which needs the rest of its card too (--config gpt-oss exports as "
                       "GptOssForCausalLM)",
        uses_kernel=False, weights_sum_to_one=False),
    # Each query's softmax over the k keys a lightning indexer scores highest (DeepSeek-V3.2).
    "sparse": Mechanism(
        SparseAttention, Cache("keys and values, and one indexer key", keys_values_and_index_key),
        export_refusal="DeepSeek sparse attention (arXiv:2512.02556) comes in transformers only "
                       "inside DeepSeek-V3.2, on latent attention: model.mechanism=mla_sparse "
                       "(--config deepseek-v3.2 exports as DeepseekV32ForCausalLM)",
        flops=sparse_flops, score_maps=sparse_maps,
        stream_refusal="its cache keeps each token's indexer key beside its keys, in one row "
                       "the model's RoPE cannot turn back as a whole",
        uses_kernel=False),
    # One latent per token, keys and values rebuilt from it (arXiv:2405.04434).
    "mla": Mechanism(
        LatentAttention, Cache("a latent and one rotated key", latent_and_rope_key),
        export_refusal="latent attention (arXiv:2405.04434) comes in transformers only inside "
                       "DeepSeek-V3, which needs the rest of its card too (--config deepseek-v3 "
                       "exports as DeepseekV3ForCausalLM)",
        flops=latent_flops, takes_score_bias=False, takes_value_embed=False,
        stream_refusal="its cache holds latents, which a rolling cache has no way to renumber "
                       "(beside them a shared key, turned by its own small RoPE unless "
                       "model.mla_nope)",
        takes_kv_heads=False, takes_rotary=False, takes_qk_norm=False, uses_kernel=False),
    # MLA whose queries each read the k keys a lightning indexer picks (DeepSeek-V3.2's own).
    "mla_sparse": Mechanism(
        LatentSparseAttention, Cache("a latent, one rotated key and one indexer key",
                                     latent_and_index_key),
        export_refusal="DeepSeek sparse attention on latent attention comes in transformers only "
                       "inside DeepSeek-V3.2, which needs the rest of its card too "
                       "(--config deepseek-v3.2 exports as DeepseekV32ForCausalLM)",
        flops=latent_sparse_flops, score_maps=sparse_maps, takes_score_bias=False,
        takes_value_embed=False,
        stream_refusal="its cache holds latents and indexer keys, turned by its own small RoPE, "
                       "not the model's",
        takes_kv_heads=False, takes_rotary=False, takes_qk_norm=False, uses_kernel=False),
    # A kernel φ(q)·φ(k) in place of the softmax, a fixed-size sum as its cache. It has
    # weights to draw (normalised kernel rows) for a whole text; decoding keeps no keys.
    "linear": Mechanism(
        LinearAttention, Cache("a fixed-size state S, z", lambda c: 0, linear_state),
        export_refusal="causal linear attention (arXiv:2006.16236) is in no transformers "
                       "architecture",
        flops=linear_flops, **RECURRENT),
    # The delta rule: a state corrected, not only added to, by each token.
    "deltanet": Mechanism(
        DeltaNet, Cache("a fixed-size state S", lambda c: 0, delta_state),
        no_weights="each token rewrites a d_k x d_k state, so no weight per earlier token "
                   "exists (arXiv:2406.06484)",
        export_refusal="DeltaNet (arXiv:2406.06484) is in no transformers architecture",
        flops=delta_flops, **RECURRENT),
    "gated_deltanet": Mechanism(
        GatedDeltaNet, Cache("a fixed-size state S", lambda c: 0, delta_state),
        no_weights="each token fades and rewrites a d_k x d_k state, so no weight per "
                   "earlier token exists (arXiv:2412.06464)",
        export_refusal="Gated DeltaNet without its paper's output norm and gate "
                       "(arXiv:2412.06464) is in no transformers architecture; "
                       "model.mechanism=gated_deltanet_norm is Qwen3-Next's",
        flops=delta_flops, **RECURRENT),
    # Gated DeltaNet's whole layer: Mamba2's decay, the output RMS-normed and SiLU-gated.
    "gated_deltanet_norm": Mechanism(
        NormedGatedDeltaNet, Cache("a fixed-size state S", lambda c: 0, delta_state),
        no_weights="each token fades and rewrites a d_k x d_k state, so no weight per "
                   "earlier token exists (arXiv:2412.06464)",
        export_refusal="Gated DeltaNet's whole layer (arXiv:2412.06464) comes in transformers "
                       "only inside Qwen3-Next, which needs the rest of its card too "
                       "(--config qwen3-next exports as Qwen3NextForCausalLM)",
        flops=delta_flops, **RECURRENT),
    # The gated delta rule with a decay per key channel (Kimi Linear): the same state, and
    # the same matrix products in its chunk (its fading per channel is elementwise).
    "kda": Mechanism(
        KimiDeltaAttention, Cache("a fixed-size state S", lambda c: 0, delta_state),
        no_weights="each token fades (channel by channel) and rewrites a d_k x d_k state, so "
                   "no weight per earlier token exists (arXiv:2510.26692)",
        export_refusal="Kimi Delta Attention (arXiv:2510.26692) comes in transformers only "
                       "inside Kimi Linear, which needs the rest of its card too (--config "
                       "kimi-linear exports as KimiLinearForCausalLM)",
        flops=delta_flops, score_maps=kda_maps, **RECURRENT),
}


# Names the field (and the frontier's rows) give to multi-head attention with one setting
# changed, or to a pattern of layers: a learner types them as mechanisms, and is told how.
NOT_MECHANISMS = {
    "gqa": "use --model.mechanism=mha --model.n_kv_head=K, K key/value heads each shared by "
           "a group of query heads (K divides model.n_head)",
    "mqa": "use --model.mechanism=mha --model.n_kv_head=1, one key/value head for all query heads",
    "window": "use --model.mechanism=mha --model.sliding_window=W, each query sees its W newest "
              "tokens",
    "hybrid": "name one mechanism per layer, cycled over the layers, e.g. "
              "--model.mechanism=linear,mha",
}
NOT_MECHANISMS["sliding_window"] = NOT_MECHANISMS["window"]


def names_used(config: ModelConfig) -> list[str]:
    """The mechanisms some layer uses, each once: read from the pattern, never a list as long as
    n_layer, so a config asking for absurdly many layers is refused by its size, not by a hang."""
    names = [n.strip() for n in config.mechanism.split(",")]
    return list(dict.fromkeys(names[:max(config.n_layer, 0)]))
