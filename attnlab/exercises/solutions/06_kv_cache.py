"""The answer to exercise 6, through the project's own code: the cache appends (as
model/cache.py's KVCache.update does) and eager_attention reads the mask rule from
absolute positions, so the new queries at T_past.. see every cached key."""
import torch

from model.attention import eager_attention
from model.attention import Mask


def decode_step(q, k, v, cache_k, cache_v):
    T_past, T_new = cache_k.shape[-2], q.shape[-2]
    keys, values = torch.cat([cache_k, k], dim=-2), torch.cat([cache_v, v], dim=-2)
    out, _ = eager_attention(q, keys, values, Mask.over(T_past, T_new, T_past + T_new,
                                                        device=q.device))
    return out, keys, values
