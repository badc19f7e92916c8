"""The article's attention in NumPy float64, forward and backward, written from the
formula alone: the yardstick every backend is measured against."""
import numpy as np


def mask_rule(q_pos, k_pos, window=0, n_global=0):
    """True where a query at q_pos may see a key at k_pos (written independently of
    model/attention.py: a loop over pairs, the rule in words)."""
    out = np.zeros((len(q_pos), len(k_pos)), dtype=bool)
    for i, q in enumerate(q_pos):
        for j, k in enumerate(k_pos):
            not_ahead = k <= q
            in_window = window == 0 or q - k <= window - 1 or k < n_global
            out[i, j] = not_ahead and in_window
    return out


def attention(q, k, v, visible, bias=None):
    """softmax(q·kᵀ/√d + bias, hidden = -inf)·v, returning the output and a function
    that maps d(output) to (dq, dk, dv). q: (..., Tq, d), k and v: (..., Tk, d)."""
    d = q.shape[-1]
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(d)
    if bias is not None:
        scores = scores + bias
    scores = np.where(visible, scores, -np.inf)
    scores = scores - scores.max(-1, keepdims=True)
    p = np.exp(scores)
    p = p / p.sum(-1, keepdims=True)
    out = p @ v

    def backward(d_out):
        dv = np.swapaxes(p, -1, -2) @ d_out
        dp = d_out @ np.swapaxes(v, -1, -2)
        ds = p * (dp - (dp * p).sum(-1, keepdims=True))       # softmax's Jacobian
        dq = ds @ k / np.sqrt(d)
        dk = np.swapaxes(ds, -1, -2) @ q / np.sqrt(d)
        return dq, dk, dv
    return out, p, backward
