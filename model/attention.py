"""Scaled dot-product attention, the mask rule and multi-head attention.

    Attention(Q, K, V) = softmax(Q·Kᵀ / √d_k) · V

Each backend computes exactly that and shares one signature,
`backend(q, k, v, mask, dropout_p, need_weights) -> (out, weights | None)`:

* `eager` writes the formula out step by step and can hand back the weights;
* `sdpa` calls torch's fused kernel (FlashAttention on supported GPUs, a fused C++
  kernel on CPU), which never materialises the T×T weights; in bf16 on a CPU with
  native bf16, where torch's kernel is slow, up to a few hundred queries it is the
  formula as two batched matmuls instead (cpu_route);
* `banded` computes only the band a sliding window can see, so time and memory grow
  with T·W instead of T² (Longformer's banded attention, arXiv:2004.05150);
* `flex` hands the same rule to torch's FlexAttention, which compiles it into a
  kernel that skips fully masked blocks (model/flex.py);
* `auto` (the default) is sdpa, except for a whole windowed sequence: flex on a CUDA
  GPU, banded elsewhere or when attention dropout is on.

The mask rule they all follow is in model/mask.py. Each backend is registered with
the facts other code asks about it (can it return weights, does it need a window).

tests/test_attention.py proves every backend equal to a float64 NumPy reference.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.flex import attend as flex_attend
from model.config import ModelConfig
from model.mask import Mask, rule
from model.precision import cpu_compute_dtype


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def eager_attention(q, k, v, mask: Mask, dropout_p: float = 0.0, need_weights: bool = False):
    """The article's formula, one line per idea. q: (B, H, Tq, d_k), k and v: (B, H, Tk, d_k)."""
    d_k = q.size(-1)
    # Q·Kᵀ: how well each query matches each key. Divide by √d_k because a dot product
    # of d_k unit-variance terms has a spread of √d_k; unscaled, large scores would
    # push the softmax into a one-hot corner where its gradients vanish.
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(d_k)              # (B, H, Tq, Tk)
    if mask.bias is not None:
        scores = scores + mask.bias                                   # ALiBi: farther is fainter
    if not mask.sees_everything:
        # Hidden keys get -inf before the softmax: exp(-inf) = 0, so their weight is
        # exactly zero and no information flows from the future (or beyond the window).
        scores = scores.masked_fill(~mask.dense, float("-inf"))
    # Softmax over the keys turns each row of scores into weights that sum to 1
    # (computed in at least fp32 so low-precision rows still sum to 1).
    weights = torch.softmax(at_least_fp32(scores), dim=-1).to(q.dtype)
    # The output is the weighted average of the values.
    out = F.dropout(weights, dropout_p) @ v                          # (B, H, Tq, d_k)
    return out, (weights if need_weights else None)


CPU_FP32_MAX_QUERIES = 256
CPU_MATMUL_MAX_SCORES = 512 * 1024      # per batch row and head: queries x keys
CPU_FP32_MAX_DECODE_KEYS = 2 ** 18      # elements of K in a one-query step


def cpu_route(q: torch.Tensor, k: torch.Tensor) -> str:
    """How fused_sdpa computes attention for q over k: "fused" (torch's kernel as it is),
    "fp32" (that kernel on fp32 copies) or "matmul" (the formula as two bf16 matmuls).

    torch's CPU attention kernels are slower in bf16/fp16 than in fp32 with the casts,
    until a few hundred queries (a 2-core AVX-512 BF16 CPU, forward + backward: B=16,
    H=3, T=128, d_k=32: bf16 8.4 ms, fp32 4.1 ms; B=64, H=6, T=256, d_k=64: 162 vs 159
    ms; T=512: 66 vs 75 ms). Faster than both in bf16 is the article's formula itself:
    Q·Kᵀ with the mask added in one oneDNN batched matmul, torch's softmax (which
    computes in fp32 inside), then the matmul with V, the scores kept in bf16. Forward +
    backward on the same CPU, best of three (matmul / fp32 kernel / bf16 kernel): B=16,
    H=3, T=128, d_k=32: 1.3-2.3 / 2.7-2.8 / 6.4 ms; B=8, H=6, T=512, d_k=64: 45 / 75 /
    62 ms; at T=1024 the kernel wins again (103 / 97 / 71 ms), and the scores would fill
    memory. A decoding step (one query) pays the matmuls' fixed 35-45 us: over a small
    cache the fp32 kernel is faster (batch 1, 6 heads of 64, 256 keys: 50 / 23 / 62 us),
    over a large one it is at best a little faster and at worst far slower: the fp32
    copies' cost jumps from run to run (1,024 keys: 56-67 / 64-864 / 267 us; 12 heads,
    512 keys: 67 / 838; 640 keys: 74 / 1,075), so past 2^18 elements of K the matmuls'
    steady cost wins (batch 8, 12 heads, 1,024 keys: 697 / 2,807 / 4,409 us). The
    price of the matmuls is the scores' precision: bf16 keeps 8 bits, where the kernels
    accumulate in fp32 (output error against float64 4.2e-3 relative instead of 3.0e-3,
    gradients 5.6e-3 instead of 4.0e-3: about the size of bf16's own rounding of the
    output). fp16 keeps the fp32 route (its CPU matmuls are not this fast), and so does
    bf16 on a CPU without native bf16 (model/precision.py), where both its matmuls and
    torch's bf16 kernel would be emulated."""
    if q.device.type != "cpu" or q.dtype not in (torch.bfloat16, torch.float16):
        return "fused"
    if cpu_compute_dtype(q.dtype) != q.dtype:
        return "fp32"
    if q.dtype == torch.bfloat16:
        if q.shape[-2] == 1 and k.numel() <= CPU_FP32_MAX_DECODE_KEYS:
            return "fp32"
        return "matmul" if q.shape[-2] * k.shape[-2] <= CPU_MATMUL_MAX_SCORES else "fused"
    return "fp32" if q.shape[-2] <= CPU_FP32_MAX_QUERIES else "fused"


def kernel_dtype(q: torch.Tensor, k: torch.Tensor) -> torch.dtype:
    """The precision fused_sdpa computes q's attention over k in (an additive mask is
    built in it)."""
    return torch.float32 if cpu_route(q, k) == "fp32" else q.dtype


@functools.lru_cache(maxsize=8)
def causal_bias(T: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """(T, T): 0 on and below the diagonal, -inf above it (the causal mask, additive)."""
    hidden = torch.ones(T, T, dtype=torch.bool, device=device).triu(1)
    return torch.zeros(T, T, dtype=dtype, device=device).masked_fill(hidden, float("-inf"))


def matmul_sdpa(q, k, v, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False):
    """softmax(Q·Kᵀ/√d_k + mask)·V in q's precision, the mask added inside the first
    matmul (baddbmm). attn_mask as SDPA takes it: bool (True = visible) or additive,
    broadcastable to (..., Tq, Tk)."""
    *lead, Tq, D = q.shape
    Tk = k.shape[-2]
    if is_causal:
        attn_mask = causal_bias(Tq, q.dtype, str(q.device))
    elif attn_mask is None:
        attn_mask = torch.zeros((), dtype=q.dtype, device=q.device)
    elif attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device) \
            .masked_fill(~attn_mask, float("-inf"))
    bias = attn_mask.to(q.dtype)
    if bias.dim() > 2:                 # per batch row or head: one (Tq, Tk) per matmul
        bias = bias.expand(*lead, Tq, Tk).reshape(-1, Tq, Tk)
    scores = torch.baddbmm(bias, q.reshape(-1, Tq, D), k.reshape(-1, Tk, D).transpose(1, 2),
                           alpha=1 / math.sqrt(D))
    weights = F.dropout(torch.softmax(scores, dim=-1), dropout_p)
    return torch.bmm(weights, v.reshape(-1, Tk, v.shape[-1])).view(*lead, Tq, v.shape[-1])


def fused_sdpa(q, k, v, attn_mask=None, **kw):
    """torch's fused kernel, or in bf16 on a CPU the route cpu_route picks (every backend
    that calls the kernel comes through here)."""
    route = cpu_route(q, k)
    if route == "matmul":
        return matmul_sdpa(q, k, v, attn_mask, **kw)
    if route == "fused":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **kw)
    with torch.autocast("cpu", enabled=False):
        out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                             attn_mask=attn_mask, **kw)
    return out.to(q.dtype)


def sdpa_attention(q, k, v, mask: Mask, dropout_p: float = 0.0, need_weights: bool = False):
    """The same function through torch.nn.functional.scaled_dot_product_attention,
    which picks FlashAttention or memory-efficient kernels where it can."""
    if need_weights:
        raise ValueError("the sdpa backend never forms the attention weights; use eager")
    attn_mask, is_causal = None, False
    if mask.is_square_causal:                              # training: the built-in triangle
        is_causal = True
    elif mask.bias is not None:                            # ALiBi: bias and mask in one
        attn_mask = mask.additive(kernel_dtype(q, k))
    elif not mask.sees_everything:                         # window, or a chunk after a cache
        attn_mask = mask.dense
    out = fused_sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal)
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
        attn_mask = bias.to(kernel_dtype(qb, keys)).masked_fill(~ok, float("-inf"))
        attn_mask = attn_mask.expand(B, H, n, W, n_keys).reshape(B * H, n, W, n_keys)
    else:
        attn_mask = ok[None]                                          # (1, n, W, keys)
    out = fused_sdpa(qb, keys, values, attn_mask=attn_mask, dropout_p=dropout_p)   # (B·H, n, W, D)
    return out.reshape(B, H, n * W, D)[:, :, :T], None


def flex_attention(q, k, v, mask: Mask, dropout_p: float = 0.0, need_weights: bool = False):
    """The rule compiled by FlexAttention (model/flex.py) for whole sequences (training,
    evaluation, prefill). A chunk after a cache, whose key count changes every step and
    would compile a new kernel each time, goes to sdpa with the same rule."""
    if not mask.is_whole_sequence:
        return sdpa_attention(q, k, v, mask, dropout_p, need_weights)
    if need_weights:
        raise ValueError("the flex backend never forms the attention weights; use eager")
    if dropout_p:
        raise ValueError("the flex backend has no attention dropout")
    return flex_attend(q, k, v, mask), None


def auto_attention(q, k, v, mask: Mask, dropout_p: float = 0.0, need_weights: bool = False):
    """The fastest backend for this call. Full causal attention and decoding steps go
    to sdpa (FlashAttention on GPUs). A sliding window over a whole sequence computes
    only its band: with FlexAttention's block-sparse kernel on CUDA, where flash causal
    would do all T²/2 scores and a banded batch of small attentions is bound by launch
    overhead; with `banded` on CPUs (flex has no backward there) and with dropout, once
    the band (2·W keys per query block) is at most half the T keys a masked sdpa reads:
    on this project's 2-core CPU, fwd+bwd at T=1024, W=128 takes 24 ms banded against
    69 ms for sdpa with the window's mask, while at T=256, W=128 sdpa wins (30 vs 37 ms)."""
    if mask.window and mask.is_whole_sequence and not need_weights:
        if q.is_cuda and not dropout_p:
            return flex_attention(q, k, v, mask)
        if mask.q_len >= 4 * mask.window:
            return banded_attention(q, k, v, mask, dropout_p)
    return sdpa_attention(q, k, v, mask, dropout_p, need_weights)


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
        return self.attend(q, k, v, mask, dropout_p, need_weights)


ATTENTION_BACKENDS = {
    "auto": Backend(auto_attention),
    "eager": Backend(eager_attention, returns_weights=True),
    "sdpa": Backend(sdpa_attention),
    "banded": Backend(banded_attention, needs_window=True),
    # torch compiles FlexAttention's forward only on CPUs: it samples there, trains on GPUs.
    "flex": Backend(flex_attention, has_dropout=False, trains_on_cpu=False),
}


class MultiHeadAttention(nn.Module):
    """n_head attentions side by side, each on its own d_k = n_embd / n_head slice.

    W_Q, W_K and W_V are stored as one (n_embd → (H + 2·H_kv)·d_k) linear layer so a
    single matmul projects all three; W_O mixes the heads' outputs back together.
    With n_kv_head < n_head, groups of query heads share one key/value head (GQA,
    arXiv:2305.13245), which shrinks the KV cache by n_head / n_kv_head."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.kv_heads, config.head_dim
        qkv_out = (self.n_head + 2 * self.n_kv_head) * self.head_dim
        self.w_qkv = nn.Linear(config.n_embd, qkv_out, bias=config.bias)
        self.w_o = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.backend = ATTENTION_BACKENDS[config.attention]
        self.qk_norm = config.qk_norm
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)
        # Named places a tool can read (attnlab/lens.py hooks them): q, k and v exactly as
        # the softmax and the weighted sum use them, after positions, QK-norm and value
        # embeddings. Identities, so a model with no hook set computes what it did.
        self.hook_q, self.hook_k, self.hook_v = nn.Identity(), nn.Identity(), nn.Identity()

    def forward(self, x, positions, mask: Mask, cache=None, need_weights: bool = False,
                value_embed=None):
        B, T, C = x.shape
        H, H_kv, D = self.n_head, self.n_kv_head, self.head_dim
        qkv = self.w_qkv(x).view(B, T, H + 2 * H_kv, D).transpose(1, 2)   # (B, heads, T, D)
        qk, v = qkv.split([H + H_kv, H_kv], dim=1)
        if value_embed is not None:
            # Value embeddings: what a token hands on when attended to is no longer only a
            # function of the residual stream; a per-token vector is added to it, so the
            # token's identity reaches every layer's weighted sum directly.
            v = v + value_embed.view(B, T, H_kv, D).transpose(1, 2)
        if self.qk_norm:
            # QK-norm (arXiv:2302.05442; the modded-nanogpt speedruns): every query and key
            # scaled to unit RMS, so |q·k|/√d_k <= √d_k whatever the weights grow to, and
            # the softmax cannot saturate into the one-hot corner at a high learning rate.
            qk = F.rms_norm(qk, (D,))
        # Queries and keys get their positions in one call (RoPE turns both alike).
        q, k = positions.rotate(qk, mask.q_start).split([H, H_kv], dim=1)   # (B, H|H_kv, T, D)
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
        if cache is not None:                # keys and values of the earlier tokens too
            k, v = cache.update(self.layer_idx, k, v)
        if H_kv != H:                        # each key/value head serves H / H_kv query heads
            k = k.repeat_interleave(H // H_kv, dim=1)
            v = v.repeat_interleave(H // H_kv, dim=1)
        # Only eager forms the weights; the fused kernels never materialise them.
        backend = eager_attention if need_weights else self.backend
        dropout_p = self.dropout if self.training else 0.0
        y, weights = backend(q, k, v, mask, dropout_p, need_weights)
        y = y.transpose(1, 2).reshape(B, T, C)                       # heads side by side
        return self.resid_dropout(self.w_o(y)), weights


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
        self.backend = ATTENTION_BACKENDS[config.attention]

    def forward(self, x, memory, key_padding=None, need_weights: bool = False):
        """x: (B, T, C) decoder states; memory: (B, S, C) encoder output; key_padding:
        (B, S), True at padded input positions."""
        B, T, C = x.shape
        S, H, D = memory.shape[1], self.n_head, self.head_dim
        q = self.w_q(x).view(B, T, H, D).transpose(1, 2)                      # (B, H, T, D)
        k, v = self.w_kv(memory).view(B, S, 2 * H, D).transpose(1, 2).split([H, H], dim=1)
        mask = Mask(q_start=0, q_len=T, k_pos=torch.arange(S, device=x.device), causal=False,
                    key_padding=key_padding)
        backend = eager_attention if need_weights else self.backend
        y, weights = backend(q, k, v, mask, 0.0, need_weights)
        return self.w_o(y.transpose(1, 2).reshape(B, T, C)), weights
