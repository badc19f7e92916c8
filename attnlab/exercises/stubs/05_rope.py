"""Exercise 5 of 12: RoPE, rotary position embedding (arXiv:2104.09864).

The article: "RoPE rotates q and k by position·θ_i, so the score sees only the offset
between tokens." Pair i of a head's dimensions turns by the angle position ·
theta^(-2i/d). This project pairs x[i] with x[i + d/2] ("rotate half", as GPT-NeoX
and Llama do).

Read first: docs/walkthrough.md, section 7 (Positions).
Check:      python -m attnlab.exercises check rope
Once it passes, read the project's own: model/positions.py, RoPE.rotate; then train
with yours: python train.py --config exercise --model.position=yours
"""
import torch


def apply_rope(q, k, positions, theta=10000.0):
    """q: (..., T, d) queries; k: (..., T, d) keys, d even; positions: (T,) integer
    positions of the T vectors (not always 0..T-1: a chunk after a cache starts later).

    Returns (q_rotated, k_rotated), the same shapes: (x1, x2) = (x[..., :d/2],
    x[..., d/2:]) becomes (x1·cos - x2·sin, x2·cos + x1·sin) of each pair's angle."""
    # inv_freq = ...    # (d/2,): theta^(-2i/d)
    # angle = ...       # (T, d/2): positions · inv_freq
    # rotate q and k alike
    raise NotImplementedError("exercise 5: write RoPE")
