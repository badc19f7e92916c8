"""The exercises' yardsticks: each idea written once from the article in float64 torch,
and beside it the mistakes learners make, each as a planted variant of that reference.

The checker runs the learner's function and the reference on the same inputs; when
they differ it runs every variant too, and the variant that matches the learner's
output names the mistake. The variants are written the way the mistake is made (one
changed line of the reference), so a match is evidence, not a guess.

Independent of model/: these are the article's formulas, not the project's code (the
project's code is the answer key in attnlab/exercises/solutions/ and must pass)."""
from __future__ import annotations

import math

import torch


# --- 1. scaled dot-product attention -------------------------------------------------

def attention(q, k, v, mask=None, scale=None, softmax_dim=-1, mask_how="before"):
    """softmax(Q·Kᵀ/√d_k)·V with hidden keys at -inf before the softmax; the keyword
    arguments plant one mistake each (the checker's variants)."""
    d_k = q.shape[-1]
    scores = q @ k.transpose(-2, -1) / (math.sqrt(d_k) if scale is None else scale)
    if mask is not None and mask_how == "before":
        scores = scores.masked_fill(~mask, float("-inf"))
    elif mask is not None and mask_how == "zero":          # hidden scores set to 0, not -inf
        scores = scores.masked_fill(~mask, 0.0)
    elif mask is not None and mask_how == "inverted":      # True read as hidden
        scores = scores.masked_fill(mask, float("-inf"))
    weights = torch.softmax(scores, dim=softmax_dim)
    if mask is not None and mask_how == "after":           # zeroed after the softmax
        weights = weights * mask
    return weights @ v, weights


ATTENTION_MISTAKES = {
    "unscaled": (lambda q, k, v, mask=None: attention(q, k, v, mask, scale=1.0),
                 "the scores are too large by exactly √d_k: divide Q·Kᵀ by √d_k before the "
                 "softmax (unscaled, large scores push the softmax into a one-hot corner)"),
    "by_d_k": (lambda q, k, v, mask=None: attention(q, k, v, mask, scale=q.shape[-1]),
               "the scores are divided by d_k instead of √d_k (too small by √d_k): the article "
               "scales by the square root of the key size"),
    "by_d_v": (lambda q, k, v, mask=None: attention(q, k, v, mask, scale=math.sqrt(v.shape[-1])),
               "the scores are divided by √d_v, the value size, instead of √d_k: the dot product "
               "sums d_k terms of the query and key, so its spread grows with √d_k"),
    "softmax_axis": (lambda q, k, v, mask=None: attention(q, k, v, mask, softmax_dim=-2),
                     "rows do not sum to 1: the softmax ran over the queries (dim=-2); it goes "
                     "over the keys, the last axis, so each query's weights sum to 1"),
    "mask_after": (lambda q, k, v, mask=None: attention(q, k, v, mask, mask_how="after"),
                   "the mask was applied after the softmax: hidden keys were zeroed, so the rows "
                   "no longer sum to 1; fill hidden scores with -inf before the softmax"),
    "mask_zero": (lambda q, k, v, mask=None: attention(q, k, v, mask, mask_how="zero"),
                  "hidden keys still get weight: their scores were set to 0, and exp(0) = 1; "
                  "fill them with -inf, since exp(-inf) = 0"),
    "mask_inverted": (lambda q, k, v, mask=None: attention(q, k, v, mask, mask_how="inverted"),
                      "the mask is read the wrong way round: True means the query may see the "
                      "key, so hide where the mask is False (masked_fill(~mask, -inf))"),
}


# --- 2. the causal mask --------------------------------------------------------------

def causal_mask(q_len, k_len, offset=None, diagonal=0, upper=False):
    """(q_len, k_len) bool, True where the key is not ahead of the query; the queries are
    the last q_len positions (they follow k_len - q_len cached keys)."""
    q_pos = torch.arange(q_len) + (k_len - q_len if offset is None else offset)
    k_pos = torch.arange(k_len)
    d = k_pos[None, :] - q_pos[:, None]                   # how far the key is ahead
    return d >= -diagonal if upper else d <= diagonal


CAUSAL_MISTAKES = {
    "upper": (lambda q_len, k_len: causal_mask(q_len, k_len, upper=True),
              "the wrong triangle: keys ahead of the query are visible and the past is hidden; "
              "a query may see keys at or before its own position (the lower triangle, tril)"),
    "top_left": (lambda q_len, k_len: causal_mask(q_len, k_len, offset=0),
                 "the causal triangle is aligned top-left: when q_len queries follow a cache, "
                 "query i sits at position k_len - q_len + i and sees every cached key "
                 "(tril(diagonal=k_len - q_len))"),
    "no_self": (lambda q_len, k_len: causal_mask(q_len, k_len, diagonal=-1),
                "the diagonal is hidden: a token may attend to itself (keys at or before the "
                "query, not strictly before it)"),
    "inverted": (lambda q_len, k_len: ~causal_mask(q_len, k_len),
                 "True and False are swapped: the mask is True where the query may see the key"),
}


# --- 3. multi-head attention ---------------------------------------------------------

def multi_head(x, w_q, w_k, w_v, w_o, n_head, split="right", merge="right", scale_by=None,
               use_w_o=True, causal=True):
    """Split into n_head heads, attend per head (causal), concatenate, W_O."""
    B, T, C = x.shape
    H = n_head
    D = C // H

    def heads(t, which):                                  # (B, T, C) -> (B, H, T, D)
        if split == "right" or which not in split:
            return t.view(B, T, H, D).transpose(1, 2)
        return t.reshape(B, H, T, D)                      # planted: reshape, no transpose
    q, k, v = heads(x @ w_q, "q"), heads(x @ w_k, "k"), heads(x @ w_v, "v")
    visible = torch.ones(T, T, dtype=torch.bool).tril() if causal else None
    out, _ = attention(q, k, v, visible, scale=None if scale_by is None else math.sqrt(scale_by))
    if merge == "right":
        out = out.transpose(1, 2).reshape(B, T, C)        # heads side by side
    else:
        out = out.reshape(B, T, C)                        # planted: no transpose back
    return out @ w_o if use_w_o else out


def _heads_mixed(split: str, merge: str):
    """The reshape-without-transpose mistakes: in the projections named in `split`
    (any of q, k, v), and/or when concatenating."""
    def variant(x, wq, wk, wv, wo, h):
        return multi_head(x, wq, wk, wv, wo, h, split=split or "right", merge=merge)
    where = " and ".join(split)
    if split and merge == "reshape":
        text = (f"heads mixed: a reshape without the transpose, both when splitting {where} "
                "into heads and when concatenating them (view as (B, T, H, d_k), then "
                "transpose(1, 2))")
    elif split:
        text = (f"heads mixed when splitting {where}: reshape(B, H, T, d_k) cuts across "
                "tokens; view as (B, T, H, d_k), then transpose(1, 2) to (B, H, T, d_k)")
    else:
        text = ("heads mixed when concatenating: (B, H, T, d_k) must be transposed back to "
                "(B, T, H, d_k) before the reshape to (B, T, d_model)")
    return variant, text


MULTI_HEAD_MISTAKES = {
    f"mixed_{split or 'none'}_{merge}": _heads_mixed(split, merge)
    for merge in ("right", "reshape")
    for split in ("qkv", "q", "k", "v", "qk", "qv", "kv", "")
    if split or merge == "reshape"
} | {
    "no_w_o": (lambda x, wq, wk, wv, wo, h: multi_head(x, wq, wk, wv, wo, h, use_w_o=False),
               "W_O is missing: after concatenating the heads, multiply by W_O, which mixes "
               "the heads' outputs"),
    "width_scale": (lambda x, wq, wk, wv, wo, h: multi_head(x, wq, wk, wv, wo, h,
                                                            scale_by=x.shape[-1]),
                    "each head's scores are divided by √d_model; a head's keys have d_k = "
                    "d_model / n_head dimensions, so divide by √d_k"),
    "one_head": (lambda x, wq, wk, wv, wo, h: multi_head(x, wq, wk, wv, wo, 1),
                 "this is one head of size d_model: split the projections into n_head heads "
                 "of d_k = d_model / n_head and attend in each separately"),
    "not_causal": (lambda x, wq, wk, wv, wo, h: multi_head(x, wq, wk, wv, wo, h, causal=False),
                   "future tokens are visible: each head needs the causal mask"),
}


# --- 4. sinusoidal positions ---------------------------------------------------------

def sinusoidal(T, d, start=0, swap=False, exponent=2, halves=False, use_start=True):
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d))."""
    pos = torch.arange(T, dtype=torch.float64) + (start if use_start else 0)
    i = torch.arange((d + 1) // 2, dtype=torch.float64)
    angle = pos[:, None] / 10000.0 ** (exponent * i / d)            # (T, ceil(d/2))
    first, second = (torch.cos, torch.sin) if swap else (torch.sin, torch.cos)
    if halves:
        return torch.cat([first(angle), second(angle)], dim=1)[:, :d]
    pe = torch.empty(T, d, dtype=torch.float64)
    pe[:, 0::2] = first(angle)
    pe[:, 1::2] = second(angle[:, : d // 2])
    return pe


SINUSOIDAL_MISTAKES = {
    "swapped": (lambda T, d, start=0: sinusoidal(T, d, start, swap=True),
                "sin and cos are swapped: sin goes in the even dimensions 2i, cos in the odd "
                "ones 2i+1"),
    "exponent": (lambda T, d, start=0: sinusoidal(T, d, start, exponent=1),
                 "the frequencies are wrong: pair i turns at 1/10000^(2i/d), where 2i is the "
                 "even dimension's index (you used i/d)"),
    "exponent_twice": (lambda T, d, start=0: sinusoidal(T, d, start, exponent=4),
                       "the frequencies are wrong: the exponent doubles the index twice; with i "
                       "stepping 0, 2, 4, ... (the even dimension) it is 10000^(i/d), with i "
                       "the pair index 10000^(2i/d)"),
    "halves": (lambda T, d, start=0: sinusoidal(T, d, start, halves=True),
               "sin and cos are in two halves: they interleave, sin at dimension 2i and cos at "
               "2i+1 of the same angle"),
    "start": (lambda T, d, start=0: sinusoidal(T, d, start, use_start=False),
              "`start` is ignored: the rows are positions start, start+1, ... (a chunk after "
              "a cache begins at start)"),
}


# --- 5. RoPE -------------------------------------------------------------------------

def rope(q, k, positions, theta=10000.0, pairs="half", sign=1, exponent=2, which="both"):
    """Pair i, (x[i], x[i + d/2]), turned by positions · theta^(-2i/d)."""
    d = q.shape[-1]
    i = torch.arange(d // 2, dtype=torch.float64)
    angle = positions.to(torch.float64)[:, None] * theta ** (-exponent * i / d)   # (T, d/2)
    cos, sin = angle.cos(), sign * angle.sin()

    def turn(x):
        if pairs == "half":
            x1, x2 = x[..., : d // 2], x[..., d // 2:]
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        x1, x2 = x[..., 0::2], x[..., 1::2]                # planted: neighbours as pairs,
        turned = (x1 * cos - x2 * sin, x2 * cos + x1 * sin)
        if pairs == "neighbours":                          # put back in place
            return torch.stack(turned, dim=-1).flatten(-2)
        return torch.cat(turned, dim=-1)                   # or written out as halves
    return (turn(q) if which != "k" else q), (turn(k) if which != "q" else k)


ROPE_MISTAKES = {
    "interleaved": (lambda q, k, p, theta=10000.0: rope(q, k, p, theta, pairs="neighbours"),
                    "RoPE rotates the wrong pairs: this project pairs x[i] with x[i + d/2] "
                    "(rotate half, as GPT-NeoX and Llama), not neighbours x[2i], x[2i+1]"),
    "interleaved_halves": (lambda q, k, p, theta=10000.0: rope(q, k, p, theta,
                                                               pairs="neighbours_halves"),
                           "RoPE rotates the wrong pairs: this project pairs x[i] with "
                           "x[i + d/2] (rotate half), not neighbours x[2i], x[2i+1]"),
    "only_q": (lambda q, k, p, theta=10000.0: rope(q, k, p, theta, which="q"),
               "only the queries are rotated: RoPE turns the keys too, so that q·k depends on "
               "the offset between them alone"),
    "only_k": (lambda q, k, p, theta=10000.0: rope(q, k, p, theta, which="k"),
               "only the keys are rotated: RoPE turns the queries too, so that q·k depends on "
               "the offset between them alone"),
    "direction": (lambda q, k, p, theta=10000.0: rope(q, k, p, theta, sign=-1),
                  "the rotation goes the wrong way (by -angle): (x1, x2) -> (x1·cos - x2·sin, "
                  "x2·cos + x1·sin)"),
    "exponent": (lambda q, k, p, theta=10000.0: rope(q, k, p, theta, exponent=1),
                 "the frequencies are wrong: pair i turns by position · theta^(-2i/d), with "
                 "i the pair index (you used i/d)"),
    "exponent_twice": (lambda q, k, p, theta=10000.0: rope(q, k, p, theta, exponent=4),
                       "the frequencies are wrong: the exponent doubles the index twice; with i "
                       "stepping 0, 2, 4, ... it is theta^(-i/d), with i the pair index "
                       "theta^(-2i/d)"),
    "positions": (lambda q, k, p, theta=10000.0: rope(q, k, torch.arange(q.shape[-2]), theta),
                  "the positions given are ignored: each vector turns by its own position "
                  "(a chunk after a cache does not start at 0)"),
}


# --- 6. a KV-cache decode step -------------------------------------------------------

def decode(q, k, v, cache_k, cache_v, how="right"):
    """Append the new keys and values to the cache, then attend from the new queries
    (positions T_past .. T_past + T_new - 1) to every key at or before each."""
    T_past, T_new = cache_k.shape[-2], q.shape[-2]
    if how == "prepend":
        keys, values = torch.cat([k, cache_k], -2), torch.cat([v, cache_v], -2)
    else:
        keys, values = torch.cat([cache_k, k], -2), torch.cat([cache_v, v], -2)
    visible = causal_mask(T_new, T_past + T_new)
    if how == "top_left":
        visible = causal_mask(T_new, T_past + T_new, offset=0)
    elif how == "no_mask":
        visible = None
    if how == "before_append":            # the new tokens see only the old cache
        out, _ = attention(q, cache_k, cache_v)
        return out, keys, values
    out, _ = attention(q, keys, values, visible)
    return out, keys, values


DECODE_MISTAKES = {
    "before_append": (lambda *a: decode(*a, how="before_append"),
                      "the step attended before appending: the new token's own key and value "
                      "go into the cache first, so it sees itself as the full forward pass does"),
    "top_left": (lambda *a: decode(*a, how="top_left"),
                 "the causal triangle is aligned top-left: the new queries follow T_past cached "
                 "keys, so query i sits at position T_past + i and sees every cached key"),
    "no_mask": (lambda *a: decode(*a, how="no_mask"),
                "weight on future keys: in a chunk of several new tokens each must not see the "
                "ones after it (the causal mask, aligned to the end of the cache)"),
    "prepend": (lambda *a: decode(*a, how="prepend"),
                "the new keys went in front of the cache: they belong at the end, after the "
                "T_past earlier tokens"),
}


# --- 7. a sliding window with global tokens -----------------------------------------

def window_mask(T, window, n_global=0, reach=0, causal_globals=True, globals_=True,
                causal=True, global_reach=0):
    """(T, T) bool: key not ahead of the query and fewer than `window` positions behind
    it (itself included), unless it is one of the first n_global keys."""
    q = torch.arange(T)[:, None]
    k = torch.arange(T)[None, :]
    near = (q - k).abs() < window + reach if not causal else (q - k) < window + reach
    glob = (k < n_global + global_reach) if globals_ else torch.zeros(T, T, dtype=torch.bool)
    if not causal:
        return near | glob
    if causal_globals:
        return (k <= q) & (near | glob)
    return ((k <= q) & near) | glob


WINDOW_MISTAKES = {
    "one_wide": (lambda T, W, G=0: window_mask(T, W, G, reach=1),
                 "the window is off by one: it sees W + 1 keys; a window of W holds W keys, the "
                 "query itself included, so a key is in it when q - k < W"),
    "one_narrow": (lambda T, W, G=0: window_mask(T, W, G, reach=-1),
                   "the window is off by one: it sees W - 1 keys; a window of W holds W keys, "
                   "the query itself included (q - k < W, not q - k < W - 1)"),
    "globals_one_more": (lambda T, W, G=0: window_mask(T, W, G, global_reach=1),
                         "one too many global tokens: the first n_global keys are global, so a "
                         "key is global when k < n_global (k <= n_global makes n_global + 1)"),
    "globals_one_fewer": (lambda T, W, G=0: window_mask(T, W, G, global_reach=-1),
                          "one too few global tokens: the first n_global keys are global, so a "
                          "key is global when k < n_global (k < n_global - 1 makes n_global - 1)"),
    "globals_future": (lambda T, W, G=0: window_mask(T, W, G, causal_globals=False),
                       "weight on future keys: the global tokens are visible to queries before "
                       "them; a global key is still causal (k <= q)"),
    "no_globals": (lambda T, W, G=0: window_mask(T, W, G, globals_=False),
                   "the global tokens are missing: the first n_global keys stay visible to "
                   "every later query, however far behind the window"),
    "both_sides": (lambda T, W, G=0: window_mask(T, W, G, causal=False),
                   "weight on future keys: the window reaches ahead of the query too; it "
                   "covers the W - 1 keys before the query and the query itself"),
}


# --- 8. cross-attention with a padding mask -----------------------------------------

def cross(x, memory, key_padding, w_q, w_k, w_v, w_o, padding="hide", causal=False,
          keys_from="memory", use_w_o=True):
    """Decoder queries x·W_Q over encoder keys memory·W_K and values memory·W_V, padded
    input positions hidden; one head, so d_k = d_model."""
    source = memory if keys_from == "memory" else x
    q, k, v = x @ w_q, source @ w_k, source @ w_v                   # (B, T|S, C)
    visible = torch.ones(x.shape[1], memory.shape[1], dtype=torch.bool)[None]
    if padding == "hide":
        visible = visible & ~key_padding[:, None, :]                # (B, 1|T, S)
    elif padding == "inverted":
        visible = visible & key_padding[:, None, :]
    elif padding == "queries":                                      # laid along the queries
        visible = visible & ~key_padding[:, :, None]
    if causal:
        visible = visible & torch.ones(x.shape[1], memory.shape[1], dtype=torch.bool).tril()
    out, weights = attention(q, k, v, visible)
    return (out @ w_o if use_w_o else out), weights


CROSS_MISTAKES = {
    "padding_visible": (lambda *a: cross(*a, padding="none"),
                        "padding is visible to cross-attention: padded input positions are only "
                        "filler; give them -inf where key_padding is True"),
    "padding_inverted": (lambda *a: cross(*a, padding="inverted"),
                         "the real input is hidden and the padding seen: key_padding is True at "
                         "padded positions, so hide where it is True"),
    "padding_queries": (lambda *a: cross(*a, padding="queries"),
                        "the padding mask is shaped for the wrong axis: it hides decoder queries; "
                        "key_padding marks encoder positions, the keys, which are the last axis "
                        "of the scores (key_padding[:, None, :], shaped (B, 1, S))"),
    "no_w_o": (lambda *a: cross(*a, use_w_o=False),
               "W_O is missing: after the weighted sum of the values, multiply by W_O, the "
               "output projection"),
    "keys_from_decoder": (lambda *a: cross(*a, keys_from="x"),
                          "this is self-attention: in cross-attention the keys and values "
                          "come from the encoder's output (memory), only the queries from the "
                          "decoder (x)"),
    "causal": (lambda *a: cross(*a, causal=True),
               "a causal mask on cross-attention: the whole input is known before decoding "
               "starts, so every query may see every real input position"),
}


# --- 9. linear attention as an RNN ---------------------------------------------------
# Katharopoulos et al., "Transformers are RNNs" (arXiv:2006.16236): softmax's exp(q·k)
# replaced by the kernel φ(q)·φ(k), φ(x) = elu(x) + 1, so the causal sums over earlier
# tokens can be carried from token to token as a state (S, z).

def elu_plus_one(x):
    return torch.nn.functional.elu(x) + 1


def linear_step(q, k, v, S, z, phi=elu_plus_one, normalise=True, read="new", returns="new"):
    """One token: q, k (B, H, d_k), v (B, H, d_v), S = Σ φ(k_j)v_jᵀ (B, H, d_k, d_v) and
    z = Σ φ(k_j) (B, H, d_k) over the tokens before it. The token joins the state, then
    its φ(q) reads it: y = φ(q)ᵀS / φ(q)·z. Returns (y, the new S, the new z)."""
    phi_q, phi_k = phi(q), phi(k)
    S_new = S + phi_k[..., :, None] * v[..., None, :]          # + φ(k)vᵀ, (B, H, d_k, d_v)
    z_new = z + phi_k                                          # + φ(k), (B, H, d_k)
    S_read, z_read = (S_new, z_new) if read == "new" else (S, z)
    y = (phi_q[..., None, :] @ S_read).squeeze(-2)             # (B, H, d_v)
    if normalise:
        y = y / (phi_q * z_read).sum(-1, keepdim=True)
    return (y, S_new, z_new) if returns == "new" else (y, S, z)


def over_tokens(step, q, k, v, S, z):
    """Run `step` over the tokens of q, k, v (B, H, T, d) in order, each reading the state
    the one before it returned: (outputs (B, H, T, d_v), the last S, the last z)."""
    ys = []
    for t in range(q.shape[-2]):
        y, S, z = step(q[:, :, t], k[:, :, t], v[:, :, t], S, z)
        ys.append(y)
    return torch.stack(ys, dim=2), S, z


def linear_parallel(q, k, v, S, z):
    """The parallel form, the paper's eq. 6 after a state (S, z) of earlier tokens:
    y_i = (φ(q_i)ᵀS + Σ_{j≤i} φ(q_i)·φ(k_j) v_j) / (φ(q_i)·z + Σ_{j≤i} φ(q_i)·φ(k_j))
    (tril keeps j ≤ i), and the state after the last token."""
    phi_q, phi_k = elu_plus_one(q), elu_plus_one(k)
    within = (phi_q @ phi_k.transpose(-2, -1)).tril()                      # (B, H, T, T)
    numerator = phi_q @ S + within @ v                                     # (B, H, T, d_v)
    normaliser = (phi_q @ z[..., None]).squeeze(-1) + within.sum(-1)       # (B, H, T)
    return (numerator / normaliser[..., None], S + phi_k.transpose(-2, -1) @ v,
            z + phi_k.sum(-2))


# Each slip as the reference's settings it changes, so two of them can be planted at once.
LINEAR_SLIPS = {
    "no_normaliser": (dict(normalise=False),
                      "the output is not normalised: divide φ(q)ᵀS by φ(q)·z, the sum of the "
                      "weights φ(q)·φ(k_j), so the output is a weighted average of the values "
                      "(as a softmax row sums to 1)"),
    "phi_elu": (dict(phi=torch.nn.functional.elu),
                "φ goes negative: elu(x) lies between -1 and 0 below zero; φ(x) = elu(x) + 1 "
                "is positive everywhere, so every weight φ(q)·φ(k) is positive and the "
                "normaliser φ(q)·z cannot cancel towards 0"),
    "phi_none": (dict(phi=lambda x: x),
                 "no feature map: q and k are used as they are, so a weight q·k can be "
                 "negative and the normaliser can cross 0; apply φ(x) = elu(x) + 1 (positive "
                 "everywhere) to both first"),
    "phi_relu": (dict(phi=torch.relu),
                 "φ = relu is 0 for every negative input: a query whose features are all "
                 "negative reads 0/0; φ(x) = elu(x) + 1 is positive everywhere"),
    "read_before_update": (dict(read="old"),
                           "off by one: the output read the state before this token's φ(k)vᵀ "
                           "and φ(k) joined it, so a token does not see itself; add them first "
                           "(S_t = S_{t-1} + φ(k_t)v_tᵀ, z_t = z_{t-1} + φ(k_t)), then read "
                           "y_t = φ(q_t)ᵀS_t / φ(q_t)·z_t"),
    "old_state_returned": (dict(returns="old"),
                           "the state returned is the one passed in: return the new S and z, "
                           "which the next token reads (the state carries every earlier token)"),
}


def _planted(**slip):
    return lambda *a: linear_step(*a, **slip)


LINEAR_MISTAKES = {name: (_planted(**slip), why) for name, (slip, why) in LINEAR_SLIPS.items()}
# Two slips in one step (the feature maps are one choice, so never two of those).
LINEAR_PAIRS = {(a, b): _planted(**LINEAR_SLIPS[a][0], **LINEAR_SLIPS[b][0])
                for i, a in enumerate(LINEAR_SLIPS) for b in list(LINEAR_SLIPS)[i + 1:]
                if not set(LINEAR_SLIPS[a][0]) & set(LINEAR_SLIPS[b][0])}


# --- 10. a learned attention sink (gpt-oss) -------------------------------------------
# gpt-oss (arXiv:2508.10925): each head h has one learned logit s_h that joins its
# softmax's denominator and nothing else, so a row's weights over the keys sum to less
# than 1 and the rest goes to a sink that hands on no value.

def sink_attention(q, k, v, sinks, mask=None, sink="denominator", per="head", scale_sink=False,
                   use_mask=True):
    """weights = exp(Q·Kᵀ/√d_k) / (Σ_keys exp(Q·Kᵀ/√d_k) + exp(s_h)), hidden keys at
    exp(-inf) = 0, out = weights·V. q: (B, H, Tq, d_k), k: (B, H, Tk, d_k), v: (B, H, Tk, d_v),
    sinks: (H,). The keyword arguments plant one mistake each."""
    B, H, Tq, d_k = q.shape
    scores = q @ k.transpose(-2, -1) / math.sqrt(d_k)                   # (B, H, Tq, Tk)
    if mask is not None and use_mask:
        scores = scores.masked_fill(~mask, float("-inf"))
    s = sinks.view(1, H, 1, 1) if per == "head" else sinks.view(1, 1, Tq, 1)   # planted: per query
    if scale_sink:
        s = s / math.sqrt(d_k)
    e = torch.exp(scores)                   # the inputs are small: no max to subtract in float64
    total = e.sum(-1, keepdim=True)
    if sink == "denominator":
        weights = e / (total + torch.exp(s))
    elif sink == "missing":
        weights = e / total
    elif sink == "numerator":               # exp(s_h) added above the line as well as below
        weights = (e + torch.exp(s)) / (total + torch.exp(s))
    else:                                   # "logit": s_h added as it is, not exp(s_h)
        weights = e / (total + s)
    return weights @ v, weights


SINK_MISTAKES = {
    "missing": (lambda q, k, v, s, mask=None: sink_attention(q, k, v, s, mask, sink="missing"),
                "the sink is missing from the denominator: each row still sums to 1 over the "
                "keys; add exp(s_h) to the row's sum, so weight = exp(score) / (Σ exp(scores) + "
                "exp(s_h)) (adding s_h to every score changes nothing: a softmax ignores a shift "
                "common to its row)"),
    "numerator": (lambda q, k, v, s, mask=None: sink_attention(q, k, v, s, mask, sink="numerator"),
                  "the sink went into the numerator too: exp(s_h) joins the denominator only, so "
                  "the sink takes weight and hands on no value; each key's weight is "
                  "exp(score) / (Σ exp(scores) + exp(s_h))"),
    "logit": (lambda q, k, v, s, mask=None: sink_attention(q, k, v, s, mask, sink="logit"),
              "the sink was added as it is: s_h is a logit like a score, so exp(s_h) joins the "
              "denominator (torch.cat it to the scores as one more column before the softmax, "
              "then drop that column)"),
    "scaled": (lambda q, k, v, s, mask=None: sink_attention(q, k, v, s, mask, scale_sink=True),
               "the sink was divided by √d_k with the scores: it is a learned logit of its own, "
               "added to the softmax unscaled"),
    "per_query": (lambda q, k, v, s, mask=None: sink_attention(q, k, v, s, mask, per="query"),
                  "the sinks are laid along the queries: there is one sink per head, the same "
                  "for every query of that head, so shape it (1, H, 1, 1), not (1, 1, H, 1)"),
    "no_mask": (lambda q, k, v, s, mask=None: sink_attention(q, k, v, s, mask, use_mask=False),
                "hidden keys get weight: the mask still applies (fill their scores with -inf "
                "before the softmax); only the sink, which is no key, no mask hides"),
}


# --- 11. top-k routing of a mixture of experts (gpt-oss) ------------------------------
# gpt-oss's router (arXiv:2508.10925): the k largest router logits pick the experts and a
# softmax over those k alone weights them; the token's output is their weighted sum, plus
# every shared expert's output at weight 1 (DeepSeek-V3's shared experts, arXiv:2412.19437).

def moe(x, logits, experts, shared, k, weigh="softmax_top", pick=None, use_shared=True):
    """x: (N, C) tokens; logits: (N, E) the router's; experts: E functions and shared: any
    number, each (n, C) -> (n, C); k: experts a token goes to. The keyword arguments plant
    one mistake each."""
    top = logits.topk(k if pick is None else pick, dim=-1)              # (N, k)
    if weigh == "softmax_top":
        weights = torch.softmax(top.values, dim=-1)
    elif weigh == "softmax_all":                                        # not renormalised
        weights = torch.softmax(logits, dim=-1).gather(-1, top.indices)
    elif weigh == "sigmoid":                                            # DeepSeek-V3's rule
        s = torch.sigmoid(top.values)
        weights = s / s.sum(-1, keepdim=True)
    elif weigh == "sigmoid_alone":                                      # ... not renormalised
        weights = torch.sigmoid(top.values)
    else:                                                               # the raw logits
        weights = top.values
    out = torch.zeros_like(x)
    for slot in range(top.indices.shape[-1]):
        for e, expert in enumerate(experts):
            rows = top.indices[:, slot] == e
            if rows.any():
                out[rows] += weights[rows, slot, None] * expert(x[rows])
    if use_shared:
        for expert in shared:
            out = out + expert(x)
    return out


MOE_MISTAKES = {
    "softmax_all": (lambda x, l, ex, sh, k: moe(x, l, ex, sh, k, weigh="softmax_all"),
                    "the weights are a softmax over all the experts, not renormalised over the "
                    "chosen ones: the k weights sum to less than 1; take the softmax of the k "
                    "chosen logits alone (or divide the chosen k by their sum)"),
    "dense": (lambda x, l, ex, sh, k: moe(x, l, ex, sh, k, pick=l.shape[-1]),
              "every expert runs for every token, weighted by a softmax over all of them: a "
              "token goes to its top k experts only (logits.topk(k)), the softmax over those k"),
    "top1": (lambda x, l, ex, sh, k: moe(x, l, ex, sh, k, pick=1),
             "each token went to one expert (top-1, at weight 1): it goes to its top k, each "
             "weighted by a softmax over the k chosen logits"),
    "k_fixed": (lambda x, l, ex, sh, k: moe(x, l, ex, sh, k, pick=2),
                "the token went to 2 experts whatever k is: use k, the number the layer is "
                "given (model.moe_top_k; 2 in the cards)"),
    "no_shared": (lambda x, l, ex, sh, k: moe(x, l, ex, sh, k, use_shared=False),
                  "the shared experts are missing: every token also goes through each shared "
                  "expert, added at weight 1 beside the routed ones"),
    "sigmoid": (lambda x, l, ex, sh, k: moe(x, l, ex, sh, k, weigh="sigmoid"),
                "the weights are sigmoids normalised over the k chosen (DeepSeek-V3's rule): "
                "this card's router takes a softmax over the k chosen logits"),
    "sigmoid_alone": (lambda x, l, ex, sh, k: moe(x, l, ex, sh, k, weigh="sigmoid_alone"),
                      "the weights are each chosen expert's sigmoid, not renormalised: the k "
                      "weights must sum to 1; this card's router takes a softmax over the k "
                      "chosen logits"),
    "raw": (lambda x, l, ex, sh, k: moe(x, l, ex, sh, k, weigh="raw"),
            "the chosen experts are weighted by their raw logits: the weights are a softmax "
            "over the k chosen logits, positive and summing to 1"),
}


# --- 12. the output gate of gated attention (Qwen3-Next) ------------------------------
# Qiu et al., "Gated Attention for Large Language Models" (arXiv:2505.06708): each head's
# output is multiplied, element by element, by σ(x·W_G) computed from the layer's input x,
# before W_O mixes the heads.

def gated_output(x, y, w_gate, w_o, source="input", act="sigmoid", how="times", where="before",
                 transposed=False, use_w_o=True):
    """x: (B, T, C) the layer's input; y: (B, T, C) the heads' outputs side by side;
    w_gate, w_o: (C, C), applied as x @ w. W_O · (y ⊙ σ(x·W_G)). The keyword arguments
    plant one mistake each."""
    logits = (x if source == "input" else y) @ (w_gate.T if transposed else w_gate)
    gate = {"sigmoid": torch.sigmoid, "silu": torch.nn.functional.silu,
            "none": lambda t: t}[act](logits)
    if where == "after":                                    # gated after the heads are mixed
        return (y @ w_o) * gate
    gated = y * gate if how == "times" else y + gate
    return gated @ w_o if use_w_o else gated


GATE_MISTAKES = {
    "from_output": (lambda x, y, wg, wo: gated_output(x, y, wg, wo, source="output"),
                    "the gate was computed from the attention's output: it comes from the layer's "
                    "input, σ(x·W_G), so it can switch a head off whatever the head read"),
    "after_w_o": (lambda x, y, wg, wo: gated_output(x, y, wg, wo, where="after"),
                  "the gate was applied after W_O: it gates each head's own output, so it goes "
                  "on y before W_O mixes the heads (W_O · (y ⊙ σ(x·W_G)))"),
    "no_sigmoid": (lambda x, y, wg, wo: gated_output(x, y, wg, wo, act="none"),
                   "the gate has no sigmoid: x·W_G is any real number; σ(x·W_G) lies between 0 "
                   "(the head switched off) and 1 (passed as it is)"),
    "silu": (lambda x, y, wg, wo: gated_output(x, y, wg, wo, act="silu"),
             "the gate is SiLU, x·σ(x), the MLP's activation: the paper's gate is the sigmoid "
             "σ(x·W_G), between 0 and 1"),
    "added": (lambda x, y, wg, wo: gated_output(x, y, wg, wo, how="plus"),
              "the gate was added to the heads' output: it multiplies it, element by element "
              "(y * σ(x·W_G))"),
    "transposed": (lambda x, y, wg, wo: gated_output(x, y, wg, wo, transposed=True),
                   "W_G is transposed: the gate's logits are x @ w_gate, as the queries are "
                   "x @ W_Q"),
    "no_w_o": (lambda x, y, wg, wo: gated_output(x, y, wg, wo, use_w_o=False),
               "W_O is missing: after the gate, W_O mixes the heads' gated outputs"),
}
