"""Exercise 8 of 12: cross-attention with a padding mask.

The article: "Cross-attention lets the decoder's queries look at the encoder's keys
and values." The whole input is known before decoding starts (no causal mask), but
padded input positions are only filler: they must get no weight.

Read first: docs/walkthrough.md, section 10 (Self, masked self and cross-attention).
Check:      python -m attnlab.exercises check cross_attention
Once it passes, read the project's own: model/attention.py, CrossAttention.forward.
"""
import math

import torch


def cross_attention(x, memory, key_padding, w_q, w_k, w_v, w_o):
    """One head (d_k = d_model). x: (B, T, d_model) decoder states; memory: (B, S,
    d_model) encoder output; key_padding: (B, S) bool, True at padded input positions;
    w_q, w_k, w_v, w_o: (d_model, d_model), used as x @ w_q.

    Returns (output (B, T, d_model), weights (B, T, S))."""
    # q = ...           # (B, T, d_model), from the decoder
    # k, v = ...        # (B, S, d_model), from the encoder's output
    # scores = ...      # (B, T, S), padded keys -inf
    # output = (softmax(scores)·v) @ w_o
    raise NotImplementedError("exercise 8: write cross-attention")
