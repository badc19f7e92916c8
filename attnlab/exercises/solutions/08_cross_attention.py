"""The answer to exercise 8, through the project's own code: model/attention.py's
CrossAttention with one head, its W_Q, W_K, W_V and W_O set to the exercise's."""
import torch

from model.attention import CrossAttention
from model.config import ModelConfig


def cross_attention(x, memory, key_padding, w_q, w_k, w_v, w_o):
    C = x.shape[-1]
    layer = CrossAttention(ModelConfig(n_embd=C, n_head=1, attention="eager")).to(x.dtype)
    with torch.no_grad():                       # nn.Linear computes x @ weight.T
        layer.w_q.weight.copy_(w_q.T)
        layer.w_kv.weight.copy_(torch.cat([w_k, w_v], dim=1).T)
        layer.w_o.weight.copy_(w_o.T)
    out, weights = layer(x, memory, key_padding, need_weights=True)
    return out, weights[:, 0]                                   # (B, T, S): the one head
