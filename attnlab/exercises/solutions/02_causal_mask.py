"""The answer to exercise 2, through the project's own code: model/attention.py's rule,
written on absolute positions so a short query after a cache is handled right."""
import torch

from model.attention import visible


def causal_mask(q_len, k_len):
    q_pos = torch.arange(k_len - q_len, k_len)                # the queries follow the cache
    return visible(q_pos, torch.arange(k_len))
