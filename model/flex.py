"""The mask rule through torch's FlexAttention (torch.nn.attention.flex_attention).

FlexAttention compiles the rule (`mask_mod`) and any score bias (`score_mod`) into
one fused kernel and, from a block mask, skips every tile of the T×T score matrix
that the rule hides entirely: with a sliding window, most of them. It is the fast
windowed path on GPUs. On CPUs torch 2.13 compiles its forward pass only, so its
registry entry (model/attention.py) says it does not train there, and the run config
refuses that before any work. Used for whole sequences only (queries and keys at
positions 0..T-1); model/attention.py sends a chunk after a cache to sdpa."""
from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F



# From this length on, the block mask is built by a compiled function that never holds
# the T×T mask, which the plain build does (gigabytes at T = 16,384); below it, the few
# seconds of compiling cost more than the mask (docs/benchmarks.md, "FlexAttention").
COMPILE_MASK_FROM = 4096


@functools.lru_cache(maxsize=1)
def _kernel():
    from torch.nn.attention.flex_attention import flex_attention
    # Automatic dynamic shapes: after a second length the kernel is compiled for any
    # length, instead of once per length, which costs seconds each and past torch's
    # recompile limit falls back to the slow unfused path.
    return torch.compile(flex_attention, dynamic=None)


@functools.lru_cache(maxsize=16)
def block_mask(length: int, window: int, n_global: int, device: str, rule):
    """The block mask of a whole sequence of `length` tokens under the mask rule (model/
    attention.py's `rule`, handed in). It depends on nothing else, so every layer and
    every step of the same length reuses one."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        return rule(q_idx, kv_idx, window, n_global)

    return create_block_mask(mask_mod, None, None, length, length, device=device,
                             _compile=length >= COMPILE_MASK_FROM)


# torch 2.13's compiled CPU kernel reads scratch memory it never wrote at some lengths
# that are not multiples of 16 (wrong numbers or NaN, depending on what memory it is
# handed), so no single check can vouch for a length; padding to a multiple of 16 can.
# The padded keys lie after every real query, so the causal rule hides them, and the
# padded queries' rows are dropped. bench/flex_cpu_repro.py reproduces it with torch alone.
CPU_LENGTH_MULTIPLE = 16

# torch's CUDA kernel refuses heads narrower than 16 when it compiles ("NYI: embedding
# dimension ... at least 16", torch 2.11); such heads, a tiny model's, take the dense path.
CUDA_MIN_HEAD_DIM = 16


def fits(q: torch.Tensor) -> bool:
    """Whether the fused kernel takes these queries' head width on their device."""
    return not q.is_cuda or q.shape[-1] >= CUDA_MIN_HEAD_DIM


# Whether the kernel agreed with the rule, per call signature (shapes, dtype, device,
# window, bias). Each signature is checked on its first call, against the dense path on
# float32 copies (`_expected`): a kernel fault that padding does not cover, on any
# device, gives a warning and the dense path instead of wrong numbers.
_verdicts: dict[tuple, bool] = {}
# Bounds the check's score matrix (B·H·rows·T elements, 64 MiB of float32): past it the
# check compares evenly spaced query rows, first and last included.
CHECK_ELEMENTS = 1 << 24


def attend(q, k, v, mask: Mask) -> torch.Tensor:
    """softmax(Q·Kᵀ/√d_k + bias, masked by the mask's rule)·V for a whole sequence."""
    if not fits(q):                              # decided by shapes alone: traces as well
        if not torch.compiler.is_compiling():
            _warn_once(q, f"heads narrower than {CUDA_MIN_HEAD_DIM} on a GPU")
        return _dense(q, k, v, mask)
    if torch.compiler.is_compiling():            # inside a compiled model: traced as it is
        return _fused(q, k, v, mask)
    bias = None if mask.bias_fn is None else getattr(mask.bias_fn, "__qualname__", "bias")
    # A kernel that does not compile fails at every length, so that verdict leaves T out.
    kind = (q.shape[1], q.shape[-1], q.dtype, str(q.device), mask.window, mask.n_global, bias)
    key = (tuple(q.shape), tuple(k.shape), *kind)
    if _verdicts.get(key) is False or _verdicts.get(kind) is False:
        return _dense(q, k, v, mask)
    if key in _verdicts:
        return _fused(q, k, v, mask)
    try:
        out = _fused(q, k, v, mask)
    except torch._dynamo.exc.TorchDynamoException as err:     # the kernel did not compile
        _verdicts[kind] = False
        _warn_once(q, f"it did not compile ({type(err).__name__}: "
                      f"{str(err).splitlines()[0][:160]})")
        return _dense(q, k, v, mask)
    _verdicts[key] = _agrees(q, k, v, mask, out)
    if _verdicts[key]:
        return out
    _warn_once(q, "its compiled kernel disagrees with the mask rule")
    return _dense(q, k, v, mask)


def _warn_once(q, why: str) -> None:
    # What was said is kept beside the verdicts, so clearing those clears it too.
    said = (why, q.dtype, str(q.device), q.shape[-1])
    if said in _verdicts:
        return
    _verdicts[said] = False
    warnings.warn(f"FlexAttention for queries {tuple(q.shape)} in {q.dtype} on {q.device} "
                  f"(torch {torch.__version__}): {why}; dense attention instead",
                  RuntimeWarning, stacklevel=3)


def _fused(q, k, v, mask: Mask) -> torch.Tensor:
    T = mask.q_len
    padded = T
    if q.device.type == "cpu":
        padded = -(-T // CPU_LENGTH_MULTIPLE) * CPU_LENGTH_MULTIPLE
    if padded != T:
        # The same tensor passed twice stays one tensor: the kernel guards on that.
        padded_q = F.pad(q, (0, 0, 0, padded - T))
        padded_k = padded_q if k is q else F.pad(k, (0, 0, 0, padded - T))
        v = padded_q if v is q else padded_k if v is k else F.pad(v, (0, 0, 0, padded - T))
        q, k = padded_q, padded_k
    blocks = block_mask(padded, mask.window, mask.n_global, str(q.device), mask.rule)
    out = _kernel()(q, k, v, score_mod=_score_mod(mask), block_mask=blocks)
    return out[:, :, :T] if padded != T else out


def _dense(q, k, v, mask: Mask) -> torch.Tensor:
    """The same attention through SDPA with the whole mask (and bias) as a matrix."""
    attn_mask = mask.additive(q.dtype) if mask.bias_fn is not None else mask.dense
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)


@torch.no_grad()
def _expected(q, k, v, mask: Mask, rows: torch.Tensor) -> torch.Tensor:
    """The query rows `rows` through the dense path on float32 copies: what the compiled
    kernel must agree with (tests/test_attention.py holds both to the float64 reference)."""
    q, k, v = (x.detach().float() for x in (q, k, v))
    attn_mask = mask.additive(torch.float32) if mask.bias_fn is not None else mask.dense
    return F.scaled_dot_product_attention(q[:, :, rows], k, v, attn_mask=attn_mask[..., rows, :])


def _agrees(q, k, v, mask: Mask, out: torch.Tensor) -> bool:
    B, H, T, _ = q.shape
    n_rows = max(2, min(T, CHECK_ELEMENTS // max(1, B * H * T)))
    rows = torch.linspace(0, T - 1, n_rows, device=q.device).round().long().unique()
    expected = _expected(q, k, v, mask, rows)
    got = out.detach()[:, :, rows].float()
    # The output is a weighted mean of the values, so its error scales with them.
    scale = max(1.0, v.detach().abs().amax().item())
    tol = scale * (1e-3 if q.dtype == torch.float32 else 3e-2)
    return bool(torch.isfinite(got).all()) and (got - expected).abs().amax().item() <= tol


def _score_mod(mask: Mask):
    """ALiBi's distance penalty, one score at a time; None when there is no bias."""
    if mask.bias_fn is None:
        return None
    bias_fn = mask.bias_fn

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias_fn(q_idx, kv_idx, head=h).to(score.dtype)
    return score_mod
