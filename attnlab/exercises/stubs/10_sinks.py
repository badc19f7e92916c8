"""Exercise 10 of 12: a learned attention sink, as gpt-oss has (arXiv:2508.10925).

The model card: every head has one learned logit s_h that joins its softmax's
denominator and nothing else,

    weight(q, key) = exp(q·key/√d_k) / (Σ_keys exp(q·key/√d_k) + exp(s_h)),

so a head that finds nothing worth reading puts its weight on the sink, which hands on
no value, instead of on whichever key happens to score highest: a row's weights over the
keys sum to less than 1. The sink is no key: no mask hides it, no cache keeps it.

Read first: docs/after_the_article.md, "Sigmoid, gated and sink attention", and
exercise 1 (this is scaled dot-product attention with one more term below the line).
Check:      python -m attnlab.exercises check sinks
Once it passes, read the project's own: model/sink_attention.py, SinkAttention.attend;
then train the gpt-oss card with yours (with exercise 11's routing too, if it passes):
    python train.py --config gpt-oss --model.mechanism=yours_sinks
"""
import math

import torch


def sink_attention(q, k, v, sinks, mask=None):
    """q: (B, H, Tq, d_k) queries; k: (B, H, Tk, d_k) keys; v: (B, H, Tk, d_v) values;
    sinks: (H,), one learned logit per head. mask: None (every key visible) or a bool
    tensor broadcastable to (B, H, Tq, Tk), True where the query may see the key.

    Returns (output, weights): output (B, H, Tq, d_v), weights (B, H, Tq, Tk), exactly 0
    on hidden keys, each row summing to less than 1 (the rest is the sink's)."""
    # scores = ...      # (B, H, Tq, Tk): Q·Kᵀ / √d_k, hidden keys at -inf
    # sink = ...        # (B, H, Tq, 1): head h's s_h in every row of that head, unscaled
    # weights = ...     # softmax over the keys and the sink together, the sink's column dropped
    # output = ...      # (B, H, Tq, d_v): weights @ V
    raise NotImplementedError("exercise 10: write attention with a learned sink")
