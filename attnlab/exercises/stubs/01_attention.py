"""Exercise 1 of 12: scaled dot-product attention.

The article: "Attention(Q, K, V) = softmax(Q·Kᵀ/√d_k)·V: the output is a weighted
average of the values, weighted by how well each key matches the query."

Read first: docs/walkthrough.md, sections 2-4 (Scores, Softmax, The weighted sum).
Check:      python -m attnlab.exercises check attention
Once it passes, read the project's own: model/attention.py, eager_attention; then train
with yours (this exercise alone is enough):
    python train.py --config exercise --model.attention=yours
"""
import math

import torch


def scaled_dot_product_attention(q, k, v, mask=None):
    """q: (..., Tq, d_k) queries; k: (..., Tk, d_k) keys; v: (..., Tk, d_v) values.
    mask: None (every key visible) or a bool tensor broadcastable to (..., Tq, Tk),
    True where the query may see the key.

    Returns (output, weights): output (..., Tq, d_v), weights (..., Tq, Tk), each row
    of weights summing to 1 and exactly 0 on hidden keys."""
    # scores = ...      # (..., Tq, Tk): Q·Kᵀ, divided by √d_k
    # hidden keys: -inf before the softmax (exp(-inf) = 0)
    # weights = ...     # (..., Tq, Tk): softmax over the keys
    # output = ...      # (..., Tq, d_v): the weighted sum of the values
    raise NotImplementedError("exercise 1: write scaled dot-product attention")
