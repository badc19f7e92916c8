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


def rms_norm(x, gain, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * gain


def differential_attention(x, w_qkv, w_o, lambdas, gain, layer, n_head, n_kv_head, visible,
                           eps=1e-5):
    """Differential attention for one sequence x (T, C), from the paper (arXiv:2410.05258,
    §2.1 eqs. 1-3), with the layout of model/differential.py's weights: W_QKV's rows hold
    every query head, then every key head, then every value head, d_k = C / n_head each;
    of a head's d_k query (key) dimensions, Q₁ (K₁) takes those whose place in their half,
    i mod d_k/2, is even, Q₂ (K₂) those where it is odd. Returns (out (T, C), maps
    (n_head, T, T) of softmax₁ − λ·softmax₂)."""
    T, C = x.shape
    D = C // n_head
    d = D // 2
    half1 = [i for i in range(D) if (i % (D // 2)) % 2 == 0]
    half2 = [i for i in range(D) if (i % (D // 2)) % 2 == 1]
    qkv = x @ w_qkv.T
    q = qkv[:, :n_head * D].reshape(T, n_head, D)
    k = qkv[:, n_head * D:(n_head + n_kv_head) * D].reshape(T, n_kv_head, D)
    v = qkv[:, (n_head + n_kv_head) * D:].reshape(T, n_kv_head, D)
    l = layer + 1                                             # the paper counts layers from 1
    lambda_init = 0.8 - 0.6 * np.exp(-0.3 * (l - 1))
    lq1, lk1, lq2, lk2 = lambdas
    lam = np.exp(lq1 @ lk1) - np.exp(lq2 @ lk2) + lambda_init

    def softmax_map(qh, kh):
        s = np.where(visible, qh @ kh.T / np.sqrt(d), -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        return p / p.sum(-1, keepdims=True)

    heads, maps = [], []
    for h in range(n_head):
        g = h // (n_head // n_kv_head)                        # the key/value head it reads
        a1 = softmax_map(q[:, h, half1], k[:, g, half1])
        a2 = softmax_map(q[:, h, half2], k[:, g, half2])
        diff = a1 - lam * a2
        heads.append((1 - lambda_init) * rms_norm(diff @ v[:, g], gain, eps))
        maps.append(diff)
    return np.concatenate(heads, -1) @ w_o.T, np.stack(maps)
