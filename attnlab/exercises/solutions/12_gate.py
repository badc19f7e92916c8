"""The answer to exercise 12, through the project's own code: model/gated_attention.py's
GatedAttention.output, run with the given W_G and W_O in place of a layer's own."""
from types import SimpleNamespace

from model.gated_attention import GatedAttention


def gated_output(x, y, w_gate, w_o):
    layer = SimpleNamespace(w_gate=lambda t: t @ w_gate, w_o=lambda t: t @ w_o)
    return GatedAttention.output(layer, x, y)
