"""Exercise 6 of 12: a KV-cache decode step.

The article: "Generation reuses the keys and values of earlier tokens: the KV cache."
A step appends the new tokens' keys and values to the cache, then lets the new
queries attend to every key at or before them: the same output as the full forward
pass at those positions, without recomputing the past.

Read first: docs/walkthrough.md, section 8 (the KV cache).
Check:      python -m attnlab.exercises check kv_cache
Once it passes, read the project's own: model/cache.py, KVCache.update, and
model/attention.py, Mask (absolute positions, so a short query after a long cache is right).
"""
import math

import torch


def decode_step(q, k, v, cache_k, cache_v):
    """q, k, v: (B, H, T_new, d) the new tokens' queries, keys and values (T_new >= 1,
    at positions T_past .. T_past + T_new - 1); cache_k, cache_v: (B, H, T_past, d) the
    earlier tokens' keys and values.

    Returns (output (B, H, T_new, d), new cache_k, new cache_v (B, H, T_past + T_new, d))."""
    # keys = ...; values = ...   # (B, H, T_past + T_new, d): the cache, then the new
    # visible = ...              # (T_new, T_past + T_new): causal, aligned to the end
    # output = softmax(q·keysᵀ/√d, hidden = -inf)·values
    raise NotImplementedError("exercise 6: write a KV-cache decode step")
