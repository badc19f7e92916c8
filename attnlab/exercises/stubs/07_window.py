"""Exercise 7 of 12: a sliding window with global tokens (Longformer, arXiv:2004.05150).

The article: "A sliding window of W keys per query costs O(T·W); local + global keeps
the first G tokens visible to all." A query sees itself and the W - 1 keys before it,
plus the first n_global keys, never a key ahead of it.

Read first: docs/walkthrough.md, section 8 (The cost of attention).
Check:      python -m attnlab.exercises check window
Once it passes, read the project's own: model/attention.py, rule.
"""
import torch


def window_mask(T, window, n_global=0):
    """A bool tensor (T, T), True where query q may see key k (both positions 0..T-1):
    k is not ahead of q, and k is fewer than `window` positions behind q (q itself
    included: W keys in all) or k is one of the first n_global positions."""
    # q = ...; k = ...  # (T, 1) and (1, T) positions
    # return ...        # (T, T) bool
    raise NotImplementedError("exercise 7: write the sliding-window mask")
