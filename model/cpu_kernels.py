"""Attention on a CPU in bf16 and fp16: which kernel to run for a given precision and
length. This is machine tuning, not part of the article's idea; model/attention.py
registers it as the `cpu` backend, which `auto` picks on a CPU.

torch's CPU attention kernels are slower in bf16/fp16 than in fp32 with the casts, up
to a few hundred queries, and on a CPU with native bf16 the article's formula written
as two bf16 batched matmuls is faster than both. So `sdpa` below takes one of three
routes (`cpu_route`). In fp32, and on any other device, it is torch's kernel as it is.
The timings behind the thresholds are in docs/benchmarks.md, "CPU attention routes"."""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from model.precision import cpu_compute_dtype

# Thresholds of the routes (docs/benchmarks.md, "CPU attention routes"): fp16 takes the
# fp32 copies up to this many queries, after which torch's fp16 kernel is as fast.
CPU_FP32_MAX_QUERIES = 256
# bf16 takes the two matmuls up to this many scores per batch row and head (queries x
# keys): past it torch's kernel wins again, and the scores would fill memory.
CPU_MATMUL_MAX_SCORES = 512 * 1024
# A one-query decoding step pays the matmuls' fixed cost; over a cache of up to this many
# elements of K the fp32 copies are faster, past it their cost jumps from run to run.
CPU_FP32_MAX_DECODE_KEYS = 2 ** 18


def cpu_route(q: torch.Tensor, k: torch.Tensor) -> str:
    """How `sdpa` computes attention for q over k: "fused" (torch's kernel as it is),
    "fp32" (that kernel on fp32 copies) or "matmul" (the formula as two bf16 matmuls).

    The matmuls keep the scores in bf16 (8 bits, where the kernels accumulate in fp32),
    an error about the size of bf16's own rounding of the output. fp16 keeps the fp32
    route (its CPU matmuls are not this fast), and so does bf16 on a CPU without native
    bf16 (model/precision.py), where its matmuls and torch's bf16 kernel are emulated."""
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
    """The precision `sdpa` computes q's attention over k in (an additive mask is built
    in it)."""
    return torch.float32 if cpu_route(q, k) == "fp32" else q.dtype


@functools.lru_cache(maxsize=8)
def causal_bias(T: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """(T, T): 0 on and below the diagonal, -inf above it (the causal mask, additive)."""
    hidden = torch.ones(T, T, dtype=torch.bool, device=device).triu(1)
    return torch.zeros(T, T, dtype=dtype, device=device).masked_fill(hidden, float("-inf"))


def matmul_sdpa(q, k, v, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False):
    """softmax(Q·Kᵀ/√d_k + mask)·V in q's precision, the mask added inside the first
    matmul (baddbmm, one oneDNN call) and torch's softmax (fp32 inside). attn_mask as
    SDPA takes it: bool (True = visible) or additive, broadcastable to (..., Tq, Tk)."""
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


def sdpa(q, k, v, attn_mask=None, **kw):
    """F.scaled_dot_product_attention's signature, through the route cpu_route picks."""
    route = cpu_route(q, k)
    if route == "matmul":
        return matmul_sdpa(q, k, v, attn_mask, **kw)
    if route == "fused":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **kw)
    with torch.autocast("cpu", enabled=False):
        out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                             attn_mask=attn_mask, **kw)
    return out.to(q.dtype)
