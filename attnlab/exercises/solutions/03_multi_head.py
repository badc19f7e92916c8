"""The answer to exercise 3, through the project's own code: model/attention.py's
MultiHeadAttention, its W_Q, W_K, W_V and W_O set to the exercise's matrices."""
import torch

from model.attention import MultiHeadAttention
from model.config import ModelConfig
from model.attention import Mask
from model.positions import PositionEncoding


def multi_head_attention(x, w_q, w_k, w_v, w_o, n_head):
    B, T, C = x.shape
    config = ModelConfig(n_embd=C, n_head=n_head, block_size=T, attention="eager")
    layer = MultiHeadAttention(config, 0).to(x.dtype)
    with torch.no_grad():                       # nn.Linear computes x @ weight.T
        layer.w_qkv.weight.copy_(torch.cat([w_q, w_k, w_v], dim=1).T)
        layer.w_o.weight.copy_(w_o.T)
    out, _ = layer(x, PositionEncoding(config), Mask.over(0, T, T, device=x.device))
    return out
