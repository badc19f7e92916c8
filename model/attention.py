"""Attention, the article's formula, and multi-head attention.

    Attention(Q, K, V) = softmax(Q·Kᵀ / √d_k + mask) · V

`eager_attention` below writes it out one line per idea; it is the only place this
formula is written. A mechanism that changes the formula writes its change in a module of
its own beside its paper (model/sigmoid_attention.py, model/sink_attention.py) and is
registered in model/mechanisms.py. The other backends compute the same thing faster and
share its signature, `backend(q, k, v, mask, dropout_p, need_weights) -> (out, weights | None)`:

* `sdpa` is torch's F.scaled_dot_product_attention (FlashAttention on supported GPUs,
  a fused C++ kernel on CPU), which never materialises the T×T weights;
* `banded` computes only the band a sliding window can see, so time and memory grow
  with T·W instead of T² (Longformer's banded attention, arXiv:2004.05150);
* `flex` hands the same rule to torch's FlexAttention, which compiles it into a
  kernel that skips fully masked blocks (model/flex.py);
* `auto`, the default, is the engine's choice: a run's engine picks, once, the entry
  that pays on its machine (engine/machine.py, `attention_backend`: `eager` itself, this
  file's formula in bf16, for a bf16 run on a CPU that computes bf16 natively; `sdpa` in
  fp32, on GPUs and on CPUs without native bf16) and names it in the config it builds the
  model from, so each layer takes it when built (`use_backend` sets it on a model that
  already exists); its `device:` line names the entry. A model built without the engine
  runs `auto` as sdpa (its entry below). No copy of this formula runs outside this file.

The mask rule they all follow is written once below (`rule`), and `Mask` is one pass's use
of it. One case does not run it: for a plain causal pass over a whole sequence `sdpa_mask`
hands torch `is_causal=True` instead, whose triangle is the same rule there. Each backend
is registered with the facts other code asks about it (can it return weights, does it need
a window).
tests/test_attention.py::test_every_backend_matches_the_float64_reference proves every
backend equal to a float64 NumPy reference, forward and backward.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.config import ModelConfig, ModelError
from model.flex import attend as flex_attend


def rule(q, k, window: int = 0, n_global: int = 0, causal: bool = True):
    """The one mask rule, on absolute positions (broadcastable tensors): a query at
    position q may look at a key at position k when the key is not ahead of it and,
    with a sliding window W, at most W-1 positions behind it, unless the key is one
    of the first n_global positions, which every later query may see (global tokens /
    attention sinks, arXiv:2004.05150, arXiv:2309.17453). Not causal (an encoder):
    every key, ahead or behind (a window needs causal order; the config refuses both)."""
    ok = k <= q
    if window:
        near = (q - k) < window
        if n_global:
            near = near | (k < n_global)
        ok = ok & near
    return ok if causal else torch.ones(torch.broadcast_shapes(q.shape, k.shape), dtype=torch.bool,
                                        device=k.device)


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int = 0, n_global: int = 0,
            causal: bool = True):
    """The rule as a bool (Tq, Tk) matrix, True where the key is visible."""
    return rule(q_pos[:, None], k_pos[None, :], window, n_global, causal)


@dataclass
class Mask:
    """What each query may see: queries at positions [q_start, q_start + q_len),
    keys at the absolute positions `k_pos` (in the order they are stored; a rolling
    cache keeps only some). Built once per forward pass and shared by every layer.

    Kept as positions rather than a tensor because the fast paths need none: training
    (keys 0..T-1, no window) is plain causal, and one decoded token with no window sees
    every cached key. Absolute positions keep the rule right when a short query meets a
    long cache, where SDPA's `is_causal` (aligned to the top-left corner) would not be.
    `bias_fn(q_pos, k_pos)` adds a score bias per head (ALiBi).

    Cross-attention (decoder queries over encoder keys, the article's third kind) and an
    encoder's self-attention are not causal: every key is visible except padding,
    given as `key_padding`, (B, Tk) and True where a key is only filler.

    A step over a StaticKVCache passes `q_start` as a (1,) device tensor: its position
    changes from one replay of a recorded CUDA graph to the next, so no decision may
    depend on its value; such a mask always applies `dense` (it also hides empty slots)."""
    q_start: int | torch.Tensor
    q_len: int
    k_pos: torch.Tensor
    k_first: int = 0                 # the smallest key position (known without a sync)
    window: int = 0
    n_global: int = 0
    bias_fn: Callable | None = None
    causal: bool = True
    key_padding: torch.Tensor | None = None
    rule = staticmethod(rule)        # the one rule, for a kernel that compiles its own mask
    # What every layer of this pass would compute alike from the positions (RoPE's
    # angles), made by the first layer that asks: one set of kernels a pass, not one a
    # layer, which is most of a decoding step's launches on a GPU.
    shared: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def over(cls, q_start: int, q_len: int, k_len: int, device=None, **kw) -> "Mask":
        """Queries at [q_start, q_start + q_len) against keys at positions 0..k_len-1."""
        return cls(q_start, q_len, torch.arange(k_len, device=device), **kw)

    @property
    def k_len(self) -> int:
        return self.k_pos.shape[0]

    @property
    def on_device(self) -> bool:
        """The query position is a device tensor (a static-cache step)."""
        return isinstance(self.q_start, torch.Tensor)

    @cached_property
    def q_pos(self) -> torch.Tensor:
        return self.q_start + torch.arange(self.q_len, device=self.k_pos.device)

    @property
    def is_whole_sequence(self) -> bool:
        """Causal attention whose queries and keys are the same positions 0..T-1
        (training, evaluation, a prefill with no cache before it): the case the
        block-wise paths (banded, flex) handle."""
        return (self.causal and self.key_padding is None and isinstance(self.q_start, int)
                and self.q_start == 0 and self.q_len == self.k_pos.shape[0])

    @property
    def sees_everything(self) -> bool:
        if self.key_padding is not None:
            return False
        if not self.causal:                        # no padding, no order: every key counts
            return True
        if self.on_device:                         # empty slots and the window: mask always
            return False
        # One query, every key at or before it and inside its window: nothing to hide.
        return self.q_len == 1 and (not self.window or self.q_start - self.k_first < self.window)

    @cached_property
    def dense(self) -> torch.Tensor:
        """True where a key is visible: (Tq, Tk), or (B, 1, Tq, Tk) with padding."""
        ok = rule(self.q_pos[:, None], self.k_pos[None, :], self.window, self.n_global, self.causal)
        return ok if self.key_padding is None else ok & ~self.key_padding[:, None, None, :]

    @cached_property
    def bias(self) -> torch.Tensor | None:
        if self.bias_fn is None:
            return None
        return self.bias_fn(self.q_pos[:, None], self.k_pos[None, :])      # (H, Tq, Tk)

    def hide(self, x: torch.Tensor, value: float) -> torch.Tensor:
        """x (..., Tq, Tk), scores or weights, with every hidden key's entry set to `value`:
        -inf before a softmax, 0 after a function of each score alone (a sigmoid). Where no
        key is hidden, x itself, and `dense` is never made."""
        return x if self.sees_everything else x.masked_fill(~self.dense, value)

    def additive(self, dtype) -> torch.Tensor:
        """Bias and mask as one float matrix: bias where visible, -inf elsewhere."""
        bias = self.bias if self.bias is not None else torch.zeros((), device=self.k_pos.device)
        return bias.to(dtype).masked_fill(~self.dense, float("-inf"))


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def eager_attention(q, k, v, mask: Mask, dropout_p: float = 0.0, need_weights: bool = False):
    """The article's formula, one line per idea. q: (B, H, Tq, d_k), k and v: (B, H, Tk, d_k)."""
    # Q·Kᵀ: how well each query matches each key. Divide by √d_k because a dot product
    # of d_k unit-variance terms has a spread of √d_k; unscaled, large scores would
    # push the softmax into a one-hot corner where its gradients vanish.
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))       # (B, H, Tq, Tk)
    if mask.bias_fn is not None:
        scores = scores + mask.bias                                   # ALiBi: farther is fainter
    # Hidden keys get -inf before the softmax: exp(-inf) = 0, so their weight is exactly
    # zero and no information flows from the future (or beyond the window).
    scores = scores.masked_fill(~mask.dense, float("-inf"))
    # Softmax over the keys turns each row of scores into weights that sum to 1 (torch
    # computes a bf16 or fp16 softmax in fp32 inside and rounds once, so low-precision
    # rows still sum to 1 up to that rounding; ALiBi's fp32 bias makes fp32 scores, and
    # the weights are rounded to q's precision once, after the softmax).
    weights = torch.softmax(scores, dim=-1).to(q.dtype)
    # The output is the weighted average of the values.
    out = F.dropout(weights, dropout_p) @ v                          # (B, H, Tq, d_k)
    return out, (weights if need_weights else None)


def sdpa_mask(mask: Mask, dtype: torch.dtype):
    """The rule as F.scaled_dot_product_attention takes it: (attn_mask, is_causal), an
    additive mask built in `dtype` where ALiBi's bias rides along."""
    if mask.is_whole_sequence and not mask.window and mask.bias_fn is None:   # the triangle
        return None, True
    if mask.bias is not None:                              # ALiBi: bias and mask in one
        return mask.additive(dtype), False
    if not mask.sees_everything:                           # window, or a chunk after a cache
        return mask.dense, False
    return None, False


def sdpa_attention(q, k, v, mask: Mask, dropout_p: float = 0.0, need_weights: bool = False):
    """The same function through torch.nn.functional.scaled_dot_product_attention,
    which picks FlashAttention or memory-efficient kernels where it can."""
    attn_mask, is_causal = sdpa_mask(mask, q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal=is_causal)
    return out, None


@functools.lru_cache(maxsize=16)
def band(T: int, W: int, G: int, device: str):
    """Positions and visibility inside banded attention's blocks for a sequence of T
    tokens: queries (n, W), keys (n, keys) and the rule on them (n, W, keys), with the
    G global keys first in each block. They depend on nothing else, so every layer and
    step of the same length reuses them instead of launching a dozen small kernels to
    rebuild them (on a GPU those launches, not the band's arithmetic, set the time)."""
    n = -(-T // W)
    q_pos = torch.arange(n * W, device=device).view(n, W)
    k_pos = torch.arange(-W, n * W, device=device).unfold(0, 2 * W, W)       # (n, 2W)
    ok = rule(q_pos[:, :, None], k_pos[:, None, :], W) & (k_pos >= G)[:, None, :] \
        & (k_pos < T)[:, None, :]
    if G:
        g = min(G, T)
        g_pos = torch.arange(g, device=device).expand(n, g)
        ok = torch.cat([rule(q_pos[:, :, None], g_pos[:, None, :]), ok], dim=2)
        k_pos = torch.cat([g_pos, k_pos], dim=1)
    return q_pos, k_pos, ok


def banded_attention(q, k, v, mask: Mask, dropout_p: float = 0.0, need_weights: bool = False):
    """Sliding-window attention that computes only the band.

    Cut the sequence into blocks of W queries. With a window of W, the keys a block can
    see lie in its own block and the one before, so each block attends to 2·W keys
    (plus the n_global first ones), never to all T: time and memory grow with T·W.
    The mask inside the band is the same rule as everywhere else, and the blocks run
    as one batch through the fused SDPA kernel. Used for full sequences; a chunk after
    a cache goes to sdpa, which costs O(W) per query there."""
    W, G = mask.window, mask.n_global
    if not W or not mask.is_whole_sequence:
        return sdpa_attention(q, k, v, mask, dropout_p, need_weights)
    B, H, T, D = q.shape
    n = -(-T // W)
    pad = n * W - T                           # < W: every padded query still sees a real key

    # Batch and heads merge into one dimension and the blocks take the place of heads:
    # SDPA treats both leading dimensions as independent attentions, so no transposed
    # copies are needed (they cost more time and memory than the band itself).
    def blocks(x):                                                    # (B·H, n, W, D)
        return (F.pad(x, (0, 0, 0, pad)) if pad else x).reshape(B * H, n, W, D)

    def beside_previous(x):                                           # (B·H, n, 2W, D)
        return torch.cat([F.pad(x, (0, 0, 0, 0, 1, 0))[:, :-1], x], dim=2)

    qb, keys, values = blocks(q), beside_previous(blocks(k)), beside_previous(blocks(v))
    q_pos, k_pos, ok = band(T, W, G, str(q.device))
    if G:                            # the global keys, beside every block (band excludes them)
        g = min(G, T)

        def first(x):                                                 # (B·H, n, g, D)
            return x[:, :, :g].reshape(B * H, 1, g, D).expand(B * H, n, g, D)
        keys = torch.cat([first(k), keys], dim=2)
        values = torch.cat([first(v), values], dim=2)
    n_keys = keys.shape[2]
    if mask.bias_fn is not None:                                      # ALiBi inside the band
        bias = mask.bias_fn(q_pos[:, :, None], k_pos[:, None, :])      # (H, n, W, keys)
        attn_mask = bias.to(qb.dtype).masked_fill(~ok, float("-inf"))
        attn_mask = attn_mask.expand(B, H, n, W, n_keys).reshape(B * H, n, W, n_keys)
    else:
        attn_mask = ok[None]                                          # (1, n, W, keys)
    out = F.scaled_dot_product_attention(qb, keys, values, attn_mask=attn_mask,
                                         dropout_p=dropout_p)        # (B·H, n, W, D)
    return out.reshape(B, H, n * W, D)[:, :, :T], None


def flex_attention(q, k, v, mask: Mask, dropout_p: float = 0.0, need_weights: bool = False):
    """The rule compiled by FlexAttention (model/flex.py) for whole sequences (training,
    evaluation, prefill). A chunk after a cache, whose key count changes every step and
    would compile a new kernel each time, goes to sdpa with the same rule."""
    if not mask.is_whole_sequence:
        return sdpa_attention(q, k, v, mask, dropout_p, need_weights)
    if dropout_p:
        raise ValueError("the flex backend has no attention dropout")
    return flex_attend(q, k, v, mask), None


@dataclass(frozen=True)
class Backend:
    """An attention backend and the facts the rest of the project asks about it, so
    no code outside this registry compares a backend's name with a string."""
    attend: Callable                 # (q, k, v, mask, dropout_p, need_weights) -> (out, weights)
    returns_weights: bool = False    # can hand back the (B, H, Tq, Tk) weights
    needs_window: bool = False       # computes only a sliding window's band
    has_dropout: bool = True         # applies attention dropout while training
    trains_on_cpu: bool = True       # has a backward pass on a CPU in this torch

    def __call__(self, q, k, v, mask: Mask, dropout_p: float = 0.0, need_weights: bool = False):
        if need_weights and not self.returns_weights:
            raise ValueError(f"{self.attend.__name__} never forms the attention weights (a fused "
                             "kernel never holds them); use eager")
        return self.attend(q, k, v, mask, dropout_p, need_weights)


ATTENTION_BACKENDS = {
    # What the engine replaces with the kernel that pays on the machine (engine/machine.py).
    "auto": Backend(sdpa_attention),
    "eager": Backend(eager_attention, returns_weights=True),
    "sdpa": Backend(sdpa_attention),
    "banded": Backend(banded_attention, needs_window=True),
    # torch compiles FlexAttention's forward only on CPUs: it samples there, trains on GPUs.
    "flex": Backend(flex_attention, has_dropout=False, trains_on_cpu=False),
}


def use_backend(model: nn.Module, name: str) -> None:
    """Every softmax-attention layer of `model` runs ATTENTION_BACKENDS[name] from now on:
    the engine's pick for `auto`, made once when a run places the model on its machine. A
    layer with no kernel (a mechanism with maths of its own) keeps none."""
    attend = ATTENTION_BACKENDS[name].attend
    for module in model.modules():
        if isinstance(module, (MultiHeadAttention, CrossAttention)) and module.kernel is not None:
            module.kernel = attend


class MultiHeadAttention(nn.Module):
    """n_head attentions side by side, each on its own d_k = n_embd / n_head slice.

    W_Q, W_K and W_V are stored as one (n_embd → (H + 2·H_kv)·d_k) linear layer so a
    single matmul projects all three; W_O mixes the heads' outputs back together.
    With n_kv_head < n_head, groups of query heads share one key/value head (GQA,
    arXiv:2305.13245), which shrinks the KV cache by n_head / n_kv_head."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head or config.n_head          # 0: one per query head
        self.head_dim = config.n_embd // config.n_head               # d_k
        qkv_out = (self.n_head + 2 * self.n_kv_head) * self.head_dim
        self.w_qkv = nn.Linear(config.n_embd, qkv_out, bias=config.bias)
        self.w_o = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.kernel = ATTENTION_BACKENDS[config.attention].attend
        self.qk_norm = config.qk_norm
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    # Where a tool reads q, k and v (attnlab/capture.py sets it while it reads, on this one
    # layer): exactly as the softmax and the weighted sum use them, after positions, QK-norm
    # and value embeddings, before the cache and GQA. None otherwise, so nothing runs for it.
    hook_qkv = None

    def forward(self, x, positions, mask: Mask, cache=None, need_weights: bool = False,
                value_embed=None):
        q, k, v = self.project(x, positions, mask, cache, value_embed)
        y, weights = self.attend(q, k, v, mask, need_weights)        # (B, H, T, D)
        y = y.transpose(1, 2).flatten(2)                             # heads side by side: (B, T, C)
        return self.resid_dropout(self.w_o(y)), weights

    def project(self, x, positions, mask: Mask, cache=None, value_embed=None):
        """What every mechanism built on multi-head attention shares (differential,
        sigmoid): q (B, H, T, D) and the keys and values (B, H, T_keys, D) it attends to,
        earlier tokens' from the cache included, with positions and QK-norm applied."""
        H, H_kv, D = self.n_head, self.n_kv_head, self.head_dim
        # Q = x·W_Q, K = x·W_K, V = x·W_V as one matmul, its output cut into heads of d_k
        # (B, heads, T, d_k), then into the three: q has H heads, k and v have H_kv.
        q, k, v = self.w_qkv(x).unflatten(-1, (-1, D)).transpose(1, 2).split([H, H_kv, H_kv], dim=1)
        if value_embed is not None:
            # Value embeddings: what a token hands on when attended to is no longer only a
            # function of the residual stream; a per-token vector is added to it, so the
            # token's identity reaches every layer's weighted sum directly.
            v = v + value_embed.unflatten(-1, (H_kv, D)).transpose(1, 2)
        if self.qk_norm:
            # QK-norm (arXiv:2302.05442; the modded-nanogpt speedruns): every query and key
            # scaled to unit RMS, so |q·k|/√d_k <= √d_k whatever the weights grow to, and
            # the softmax cannot saturate into the one-hot corner at a high learning rate.
            q, k = self.normalise(q, "q"), self.normalise(k, "k")
        # Positions: RoPE turns queries and keys by their positions (others leave them).
        q, k = (positions.rotate_in_pass(t, mask.q_start, mask.shared) for t in (q, k))
        if self.hook_qkv is not None:
            q, k, v = self.hook_qkv(q, k, v)
        if cache is not None:                # keys and values of the earlier tokens too
            k, v = cache.update(self.layer_idx, k, v)
        if H_kv != H:                        # each key/value head serves H / H_kv query heads
            k = k.repeat_interleave(H // H_kv, dim=1)
            v = v.repeat_interleave(H // H_kv, dim=1)
        return q, k, v

    # The queries' factor after QK-norm: 1 but where learn_qk_norms sets a score scale.
    query_gain = 1.0

    def normalise(self, x, which: str):
        """QK-norm of the queries or keys (`which`: "q" or "k"), (B, heads, T, D): each head's
        vector to unit RMS, or by the layer's learned norm where it has one (learn_qk_norms)."""
        learned = self._modules.get(which + "_norm")
        x = F.rms_norm(x, (x.shape[-1],)) if learned is None else learned(x)
        return x * self.query_gain if which == "q" and self.query_gain != 1.0 else x

    def learn_qk_norms(self, make_norm=None, score_scale: float = 0.0) -> None:
        """Gemma 3's queries and keys, given by the model when its config asks for them: a
        learned norm each over d_k (q_norm, k_norm; model.qk_norm_weight) and scores scaled
        by `score_scale` instead of 1/√d_k (model.score_scale; Gemma 3 divides by
        √query_pre_attn_scalar, arXiv:2503.19786). The scale rides on the normalised
        queries, as score_scale·√d_k, so every backend's division by √d_k gives it and
        none of them takes a scale of its own."""
        if make_norm is not None:
            self.q_norm, self.k_norm = make_norm(), make_norm()
        if score_scale:
            self.query_gain = score_scale * math.sqrt(self.head_dim)

    def attend(self, q, k, v, mask: Mask, need_weights: bool = False):
        """softmax(Q·Kᵀ/√d_k)·V through the backend (only eager forms the weights, the
        fused kernels never materialise them). A mechanism that changes the formula
        overrides this (model/sigmoid_attention.py); one that changes what is done with
        its output overrides forward and calls project and attend
        (model/gated_attention.py)."""
        dropout_p = self.dropout if self.training else 0.0
        return (eager_attention if need_weights else self.kernel)(q, k, v, mask, dropout_p, need_weights)


class CrossAttention(nn.Module):
    """Cross-attention, the article's third kind: the decoder's queries look at the
    encoder's keys and values, so each output token can draw on any input token. The
    same backends and mask rule as self-attention, without the causal part (the whole
    input is known before decoding starts), and padded input positions hidden."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_head, self.head_dim = config.n_head, config.head_dim
        self.w_q = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.w_kv = nn.Linear(config.n_embd, 2 * config.n_embd, bias=config.bias)   # W_K, W_V
        self.w_o = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.kernel = ATTENTION_BACKENDS[config.attention].attend

    def forward(self, x, memory, key_padding=None, need_weights: bool = False):
        """x: (B, T, C) decoder states; memory: (B, S, C) encoder output; key_padding:
        (B, S), True at padded input positions."""
        B, T, C = x.shape
        S, H, D = memory.shape[1], self.n_head, self.head_dim
        q = self.w_q(x).view(B, T, H, D).transpose(1, 2)                      # (B, H, T, D)
        k, v = self.w_kv(memory).view(B, S, 2 * H, D).transpose(1, 2).split([H, H], dim=1)
        mask = Mask(q_start=0, q_len=T, k_pos=torch.arange(S, device=x.device), causal=False,
                    key_padding=key_padding)
        y, weights = (eager_attention if need_weights else self.kernel)(q, k, v, mask, 0.0, need_weights)
        return self.w_o(y.transpose(1, 2).reshape(B, T, C)), weights
