"""The answer to exercise 5, the lines of model/positions.py's RoPE.rotate for any
positions: pair i, (x[i], x[i + d/2]), turned by position · theta^(-2i/d)."""
import torch


def apply_rope(q, k, positions, theta=10000.0):
    d = q.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64, device=q.device) / d)
    angle = positions.to(inv_freq)[:, None] * inv_freq             # (T, d/2)
    cos, sin = angle.cos().to(q.dtype), angle.sin().to(q.dtype)

    def rotate(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotate(q), rotate(k)
