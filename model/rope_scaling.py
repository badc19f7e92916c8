"""RoPE past its training context: ways to stretch its frequencies (model.rope_scaling),
each `scale(inv_freq, config) -> (new inv_freq, the factor q and k are multiplied by)`.
model/positions.py's RoPE explains each; docs/long_context.md measures them."""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch


class RopeScaling(NamedTuple):
    """A way to stretch RoPE past its training context: `scale(inv_freq, config)`
    returns the new frequencies and the factor q and k are multiplied by."""
    scale: Callable
    label: str                       # the name a plot or table shows
    stretches: bool = True           # False for the identity


def _no_scaling(inv_freq, config):
    return inv_freq, 1.0


def _linear(inv_freq, config):
    # Position interpolation: every frequency divided by s (arXiv:2306.15595).
    return inv_freq / config.rope_factor, 1.0


def _ntk(inv_freq, config):
    # NTK-aware: the base grows to theta·s^(d/(d-2)); the fastest pair keeps its speed.
    d = 2 * inv_freq.numel()
    base = config.rope_theta * config.rope_factor ** (d / (d - 2))
    return base ** (-torch.arange(0, d, 2, dtype=inv_freq.dtype, device=inv_freq.device) / d), 1.0


def _yarn(inv_freq, config):
    # Pairs that turn more than 32 times within the original context keep their
    # frequency, those turning less than once are interpolated, a ramp between;
    # scores are sharpened by (0.1·ln s + 1)² (arXiv:2309.00071).
    s = config.rope_factor
    original = config.rope_original_context or config.block_size
    turns = original * inv_freq / (2 * math.pi)        # rotations within the original context
    keep = ((turns - 1.0) / (32.0 - 1.0)).clamp(0.0, 1.0)   # 0 = interpolate, 1 = keep
    mscale = 0.1 * math.log(s) + 1.0 if s > 1 else 1.0
    return (1 - keep) * inv_freq / s + keep * inv_freq, mscale


def _yarn_by_pairs(inv_freq, config):
    # YaRN as its reference code and transformers compute it (gpt-oss was trained so): the
    # ramp runs linearly over the pair index, from the pair turning 32 times within the
    # original context (kept) to the pair turning once (interpolated), where the paper's
    # ramp runs linearly in the turns themselves; the same temperature.
    s, d = config.rope_factor, 2 * inv_freq.numel()
    original = config.rope_original_context or config.block_size

    def pair(turns):            # the (fractional) pair index that turns `turns` times
        return d * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(config.rope_theta))
    low, high = max(pair(32.0), 0.0), min(pair(1.0), d - 1.0)
    high = high if high != low else high + 0.001
    index = torch.arange(d // 2, dtype=inv_freq.dtype, device=inv_freq.device)
    interpolate = ((index - low) / (high - low)).clamp(0.0, 1.0)     # 0 = keep, 1 = interpolate
    mscale = 0.1 * math.log(s) + 1.0 if s > 1 else 1.0
    return interpolate * inv_freq / s + (1 - interpolate) * inv_freq, mscale


ROPE_SCALINGS = {
    "none": RopeScaling(_no_scaling, "rope", stretches=False),
    "linear": RopeScaling(_linear, "rope + PI"),
    "ntk": RopeScaling(_ntk, "rope + NTK"),
    "yarn": RopeScaling(_yarn, "rope + YaRN"),
    "yarn_by_pairs": RopeScaling(_yarn_by_pairs, "rope + YaRN (ramp over pairs)"),
}
