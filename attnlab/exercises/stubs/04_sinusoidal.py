"""Exercise 4 of 12: sinusoidal positions.

The article ("Attention Is All You Need", arXiv:1706.03762):
PE(pos, 2i) = sin(pos / 10000^(2i/d)),  PE(pos, 2i+1) = cos(pos / 10000^(2i/d)).
Each pair of dimensions is a clock turning at its own speed.

Read first: docs/walkthrough.md, section 7 (Positions).
Check:      python -m attnlab.exercises check sinusoidal
Once it passes, read the project's own: model/positions.py, Sinusoidal; then train with
yours: python train.py --config exercise --model.position=yours (RoPE is used instead
once exercise 5 passes too).
"""
import math

import torch


def sinusoidal_positions(T, d, start=0):
    """The table for positions start, start+1, ..., start+T-1: a float tensor (T, d),
    d even; row t is PE(start + t)."""
    # pos = ...         # (T,): start .. start+T-1
    # angle = ...       # (T, d/2): pos / 10000^(2i/d) for pair i
    # pe[:, 0::2] = sin(angle); pe[:, 1::2] = cos(angle)
    raise NotImplementedError("exercise 4: write sinusoidal positions")
