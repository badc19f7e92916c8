"""Sigmoid attention (model/sigmoid_attention.py) against a float64 NumPy reference written
from the paper (arXiv:2409.04431): σ(Q·Kᵀ/√d_k − log n)·V, hidden keys weighing exactly 0."""
import math

import numpy as np
import pytest
import torch

from mechanism_checks import B, HEADS, T, WIDTH, config, inputs, layer, planted
from model.attention import Mask
from model.positions import POSITION_ENCODINGS
from model.sigmoid_attention import SigmoidAttention


def reference(module, x: np.ndarray, window: int = 0) -> np.ndarray:
    """The paper's formula in float64, head by head, from the layer's own weights."""
    W_qkv = module.w_qkv.weight.detach().numpy()
    b_qkv = module.w_qkv.bias.detach().numpy() if module.w_qkv.bias is not None else 0
    W_o = module.w_o.weight.detach().numpy()
    d = WIDTH // HEADS
    n = config().block_size
    q, k, v = np.split(x @ W_qkv.T + b_qkv, 3, axis=-1)
    pos = np.arange(x.shape[1])
    visible = pos[None, :] <= pos[:, None]
    if window:
        visible &= pos[:, None] - pos[None, :] < window
    heads = []
    for h in range(HEADS):
        part = slice(h * d, (h + 1) * d)
        scores = q[..., part] @ k[..., part].transpose(0, 2, 1) / math.sqrt(d)
        weights = np.where(visible, 1 / (1 + np.exp(-(scores - np.log(n)))), 0.0)
        heads.append(weights @ v[..., part])
    return np.concatenate(heads, axis=-1) @ W_o.T


def disagreement(cls, window: int = 0) -> float:
    module = layer(cls).eval()
    x = inputs()
    none = POSITION_ENCODINGS["none"](config())
    with torch.no_grad():
        out = module(x, none, Mask.over(0, T, T, window=window))[0].numpy()
    return float(np.abs(out - reference(module, x.numpy(), window)).max())


@pytest.mark.parametrize("window", [0, 3])
def test_sigmoid_attention_is_the_papers_formula(window):
    assert disagreement(SigmoidAttention, window) < 1e-12


@pytest.mark.parametrize("old, new", [
    ("+ self.score_bias)", "- self.score_bias)"),                 # the bias's sign
    ("mask.hide(weights, 0.0)", "weights"),                      # hidden keys keep σ's weight
    ("/ math.sqrt(q.size(-1))", "/ q.size(-1)"),                 # the wrong scale
])
def test_the_reference_catches_each_planted_slip(old, new, monkeypatch):
    copy = planted("sigmoid_attention", old, new, monkeypatch)
    assert disagreement(copy.SigmoidAttention) > 1e-3


def test_weights_are_not_a_distribution_and_start_near_one_over_n():
    """σ per score: a row need not sum to 1; at zero scores every weight is 1/(1 + n)."""
    module = layer(SigmoidAttention).eval()
    q = torch.zeros(1, HEADS, 4, WIDTH // HEADS, dtype=torch.float64)
    _, weights = module.attend(q, q, q, Mask.over(0, 4, 4), need_weights=True)
    n = config().block_size
    assert torch.allclose(weights[0, 0].tril(), torch.full((4, 4), 1 / (1 + n), dtype=torch.float64).tril())
    assert weights[0, 0, 0, 1:].abs().max() == 0                 # the future weighs nothing
