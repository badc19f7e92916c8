"""Exercise 3 of 12: multi-head attention.

The article: "Several attentions run side by side, each on its own d_k = d_model /
n_head slice; W_O mixes their outputs." Split into heads, attend per head (causally),
concatenate, then W_O.

Read first: docs/walkthrough.md, section 6 (Multi-head attention and W_O).
Check:      python -m attnlab.exercises check multi_head
Once it passes, read the project's own: model/attention.py, MultiHeadAttention.forward.
"""
import math

import torch


def multi_head_attention(x, w_q, w_k, w_v, w_o, n_head):
    """x: (B, T, d_model) token vectors; w_q, w_k, w_v, w_o: (d_model, d_model), used as
    x @ w_q; n_head divides d_model. Head h owns columns h·d_k .. (h+1)·d_k - 1 of the
    projections, d_k = d_model / n_head. Causal: a token sees itself and earlier ones.

    Returns (B, T, d_model)."""
    # q, k, v = ...     # (B, T, d_model) each
    # split: ...        # (B, T, n_head, d_k), then (B, n_head, T, d_k)
    # attend per head   # softmax(q·kᵀ/√d_k, causal)·v: (B, n_head, T, d_k)
    # concatenate: ...  # back to (B, T, n_head, d_k), then (B, T, d_model)
    # return ... @ w_o  # (B, T, d_model)
    raise NotImplementedError("exercise 3: write multi-head attention")
