"""Exercise 9 of 12: linear attention as an RNN (Katharopoulos et al., arXiv:2006.16236).

After the article: its section 8 asks what attention's O(T²) costs; "Transformers are
RNNs" answers by replacing exp(q·k/√d) with a kernel φ(q)·φ(k), φ(x) = elu(x) + 1.
Then the output for token t,

    y_t = φ(q_t)ᵀ Σ_{j≤t} φ(k_j) v_jᵀ  /  φ(q_t)ᵀ Σ_{j≤t} φ(k_j),

reads two sums that do not depend on the query, so they can be carried from token to
token as a state of fixed size: S = Σ φ(k_j) v_jᵀ and z = Σ φ(k_j). Each token first
joins the state, then reads it. Decoding costs the same at token 10 as at token 10,000:
no KV cache grows.

Read first: docs/walkthrough.md, section 8 (the cost of attention), and the docstring of
model/linear_attention.py.
Check:      python -m attnlab.exercises check linear_rnn
(the checker runs your step token by token and compares it with the parallel form, the
masked T×T sum above computed at once).
Once it passes, read the project's own: model/linear_attention.py, recurrent (the RNN
form) and chunk (the parallel form, a chunk at a time).
"""
import torch


def linear_attention_step(q, k, v, S, z):
    """One token. q, k: (B, H, d_k) its query and key (before φ); v: (B, H, d_v) its
    value; S: (B, H, d_k, d_v) = Σ φ(k_j) v_jᵀ and z: (B, H, d_k) = Σ φ(k_j) over the
    tokens before it (zeros before the first).

    Returns (output (B, H, d_v), the new S, the new z), the new state including this
    token. Return new tensors (S = S + ...), not S changed in place: training
    backpropagates through every earlier state."""
    # phi_q, phi_k = ...   # φ(x) = elu(x) + 1 (torch.nn.functional.elu), positive everywhere
    # S = ...              # + φ(k) vᵀ: phi_k[..., :, None] * v[..., None, :]
    # z = ...              # + φ(k)
    # output = φ(q)ᵀ S / φ(q)·z
    raise NotImplementedError("exercise 9: write linear attention's recurrent step")
