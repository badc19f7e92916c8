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


# -- after the article: attention's other answers to its cost ----------------------------
# Each written from its paper's equations for one sequence (one batch row, one head) at a
# time, with loops where the paper has a sum or a recurrence, so that none of them shares
# a line with model/linear_attention.py, model/deltanet.py or model/latent_attention.py.

def elu_plus_one(x):
    """φ(x) = elu(x) + 1 (arXiv:2006.16236, eq. 7): x + 1 above zero, exp(x) at or below."""
    return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))


def linear_attention(q, k, v, eps=1e-6):
    """Causal linear attention, Katharopoulos et al. eq. 6 with the sum over j ≤ i:
    y_i = Σ_j φ(q_i)·φ(k_j) v_j / Σ_j φ(q_i)·φ(k_j). q, k, v: (T, d). The eps is the
    paper's code's, added to the normaliser."""
    fq, fk = elu_plus_one(q), elu_plus_one(k)
    out = np.zeros_like(v)
    for i in range(len(q)):
        sim = np.array([fq[i] @ fk[j] for j in range(i + 1)])       # kernel, keys j ≤ i
        out[i] = (sim[:, None] * v[: i + 1]).sum(0) / (sim.sum() + eps)
    return out


def l2_normalise(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def silu(x):
    return x / (1.0 + np.exp(-x))


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def delta_rule(q, k, v, beta, alpha=None):
    """The delta rule as Yang et al. (arXiv:2406.06484, eq. 1) write it, column vectors:
    S_t = S_{t-1}(I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ, o_t = S_t q_t, from S_0 = 0; with
    `alpha` (T,), the gated form of Gated DeltaNet (arXiv:2412.06464),
    S_t = S_{t-1}(α_t(I − β_t k_t k_tᵀ)) + β_t v_t k_tᵀ.
    q, k: (T, d_k) (keys as the layer gives them: unit length); v: (T, d_v); beta: (T,)."""
    d_k, d_v = k.shape[1], v.shape[1]
    alpha = np.ones(len(q)) if alpha is None else alpha
    S = np.zeros((d_v, d_k))
    out = np.zeros((len(q), d_v))
    for t in range(len(q)):
        kt, vt = k[t][:, None], v[t][:, None]                         # columns
        S = S @ (alpha[t] * (np.eye(d_k) - beta[t] * kt @ kt.T)) + beta[t] * vt @ kt.T
        out[t] = (S @ q[t][:, None])[:, 0]
    return out


def kda_rule(q, k, v, beta, alpha):
    """Kimi Delta Attention as Kimi Linear (arXiv:2510.26692) writes it, S of
    d_k × d_v: S_t = (I − β_t k_t k_tᵀ) Diag(α_t) S_{t-1} + β_t k_t v_tᵀ, o_t = S_tᵀ q_t,
    from S_0 = 0. q, k: (T, d_k) (unit keys); v: (T, d_v); beta: (T,); alpha: (T, d_k),
    one decay per key channel."""
    d_k, d_v = k.shape[1], v.shape[1]
    S = np.zeros((d_k, d_v))
    out = np.zeros((len(q), d_v))
    for t in range(len(q)):
        kt, vt = k[t][:, None], v[t][:, None]                         # columns
        S = (np.eye(d_k) - beta[t] * kt @ kt.T) @ np.diag(alpha[t]) @ S + beta[t] * kt @ vt.T
        out[t] = (S.T @ q[t][:, None])[:, 0]
    return out


def rope(x, positions, theta):
    """RoPE (arXiv:2104.09864) on the rows of x (T, d): pair i, the dimensions i and
    i + d/2 ("rotate half"), turned by the 2-D rotation of angle position·θ^(-2i/d)."""
    d = x.shape[1]
    out = x.copy()
    for t, p in enumerate(positions):
        for i in range(d // 2):
            a = p * theta ** (-2.0 * i / d)
            x1, x2 = x[t, i], x[t, i + d // 2]
            out[t, i] = x1 * np.cos(a) - x2 * np.sin(a)
            out[t, i + d // 2] = x2 * np.cos(a) + x1 * np.sin(a)
    return out


def latent_attention(x, W, n_head, head_dim, rope_dim, theta, eps):
    """Multi-head latent attention, DeepSeek-V2 (arXiv:2405.04434) eqs. 9-19, for one
    sequence x (T, C), queries at full rank. W holds the matrices as x @ W: "q"
    (C, H·(d_h + d_R)), per head [q_C | q_R]; "dkv" (C, r); "ukv" (r, 2·H·d_h), every
    head's k_C and then every head's v; "kr" (C, d_R); "o" (H·d_h, C); and "kv_norm" (r,),
    the gain of the RMS norm on the latent (section 3.1.2; its code's kv_a_layernorm)."""
    T, H, D, R = len(x), n_head, head_dim, rope_dim
    c_kv = rms_norm(x @ W["dkv"], W["kv_norm"], eps)                  # eq. 9: the latent
    kv = c_kv @ W["ukv"]                                              # eqs. 10, 11
    k_rope = rope(x @ W["kr"], range(T), theta)                       # eq. 15: one, shared
    q_all = x @ W["q"]
    visible = np.tril(np.ones((T, T), dtype=bool))
    heads = []
    for h in range(H):
        q_h = q_all[:, h * (D + R):(h + 1) * (D + R)]
        q_h = np.concatenate([q_h[:, :D], rope(q_h[:, D:], range(T), theta)], axis=1)
        k_h = np.concatenate([kv[:, h * D:(h + 1) * D], k_rope], axis=1)   # eq. 17
        v_h = kv[:, (H + h) * D:(H + h + 1) * D]
        out, _, _ = attention(q_h, k_h, v_h, visible)                 # eq. 18: √(d_h + d_R)
        heads.append(out)
    return np.concatenate(heads, axis=1) @ W["o"]                     # eq. 19

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
