"""The answer to exercise 1, through the project's own code: model/attention.py's
eager_attention, the article's formula one line per idea."""
import torch

from model.attention import eager_attention
from model.attention import Mask


def scaled_dot_product_attention(q, k, v, mask=None):
    # eager_attention reads its mask from positions (model/attention.py). An arbitrary
    # pattern goes in as the Mask's dense matrix; an all-False padding row tells the Mask
    # that something may be hidden, so eager applies that matrix.
    rule = Mask.over(0, q.shape[-2], k.shape[-2], device=q.device, causal=False)
    if mask is not None:
        rule.key_padding = torch.zeros(1, k.shape[-2], dtype=torch.bool, device=q.device)
        rule.__dict__["dense"] = mask          # the cached property, set to this pattern
    return eager_attention(q, k, v, rule, need_weights=True)
