"""Exercise 2 of 12: the causal mask.

The article: "A language model must not see the future: scores of keys ahead of the
query are set to −∞ before the softmax, so those keys get exactly zero weight."

Read first: docs/walkthrough.md, section 5 (The causal mask).
Check:      python -m attnlab.exercises check causal_mask
Once it passes, read the project's own: model/attention.py, rule (one rule on absolute
positions, used by every backend).
"""
import torch


def causal_mask(q_len, k_len):
    """The visibility of k_len keys to q_len queries: a bool tensor (q_len, k_len), True
    where the query may see the key.

    The keys are positions 0 .. k_len-1. The queries are the LAST q_len of them: with
    q_len < k_len they follow k_len - q_len cached keys (decoding), so query i is at
    position k_len - q_len + i. A key is visible when it is not ahead of the query."""
    # q_pos = ...       # (q_len,): the queries' positions
    # k_pos = ...       # (k_len,)
    # return ...        # (q_len, k_len) bool
    raise NotImplementedError("exercise 2: write the causal mask")
