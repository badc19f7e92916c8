"""Exercise 12 of 12: the output gate of gated attention (Qwen3-Next; arXiv:2505.06708).

The paper (Qiu et al., "Gated Attention for Large Language Models"): each head's output
is multiplied, element by element, by a sigmoid gate computed from the layer's own
input x, before W_O mixes the heads,

    out = W_O · (Attention(Q, K, V) ⊙ σ(x·W_G)),

so a head can switch itself off for a token (the gate near 0), where plain attention
must always hand on a weighted average of the values. Qwen3-Next's softmax layers have it.

Read first: docs/after_the_article.md, "Sigmoid, gated and sink attention", and
exercise 3 (multi-head attention: the heads side by side, then W_O).
Check:      python -m attnlab.exercises check gate
Once it passes, read the project's own: model/gated_attention.py, GatedAttention.output;
then train the Qwen3-Next card with yours in its softmax layers:
    python train.py --config qwen3-next --model.mechanism=gated_deltanet,gated_deltanet,gated_deltanet,yours_gated
"""
import torch


def gated_output(x, y, w_gate, w_o):
    """x: (B, T, C) the layer's input; y: (B, T, C) the heads' outputs side by side (the
    attention's output, before W_O); w_gate: (C, C) W_G and w_o: (C, C) W_O, each applied
    as x @ w, as exercise 3's projections are.

    Returns (B, T, C): W_O applied to y gated element by element by σ(x·W_G)."""
    # gate = ...      # (B, T, C): σ(x·W_G), from the layer's input, between 0 and 1
    # output = ...    # (B, T, C): (y ⊙ gate) · W_O
    raise NotImplementedError("exercise 12: write gated attention's output gate")
