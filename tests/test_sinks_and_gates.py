"""Learned attention sinks (model/sink_attention.py, gpt-oss) and gated attention
(model/gated_attention.py, arXiv:2505.06708), each against a float64 NumPy reference
written from its paper, and the sink against transformers' own gpt-oss attention."""
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mechanism_checks import HEADS, T, WIDTH, config, inputs, layer, planted
from model.attention import Mask
from model.gated_attention import GatedAttention
from model.positions import POSITION_ENCODINGS
from model.sink_attention import SinkAttention

D = WIDTH // HEADS


def heads_of(module, x):
    W = module.w_qkv.weight.detach().numpy()
    b = module.w_qkv.bias.detach().numpy() if module.w_qkv.bias is not None else 0
    return np.split(x @ W.T + b, 3, axis=-1)


def visible(length: int, window: int) -> np.ndarray:
    pos = np.arange(length)
    ok = pos[None, :] <= pos[:, None]
    return ok & (pos[:, None] - pos[None, :] < window) if window else ok


def sink_reference(module, x, window=0):
    """softmax over [scores, s_h], the sink's column dropped, then the weighted sum."""
    q, k, v = heads_of(module, x)
    sinks = module.sinks.detach().numpy()
    ok = visible(x.shape[1], window)
    out = []
    for h in range(HEADS):
        part = slice(h * D, (h + 1) * D)
        s = np.where(ok, q[..., part] @ k[..., part].transpose(0, 2, 1) / math.sqrt(D), -np.inf)
        e = np.exp(s - s.max(-1, keepdims=True))
        sink = np.exp(sinks[h] - s.max(-1, keepdims=True))
        out.append(e / (e.sum(-1, keepdims=True) + sink) @ v[..., part])
    return np.concatenate(out, -1) @ module.w_o.weight.detach().numpy().T


def gate_reference(module, x, window=0):
    """Plain softmax attention, each head's output times σ(x·W_G), then W_O."""
    q, k, v = heads_of(module, x)
    ok = visible(x.shape[1], window)
    out = []
    for h in range(HEADS):
        part = slice(h * D, (h + 1) * D)
        s = np.where(ok, q[..., part] @ k[..., part].transpose(0, 2, 1) / math.sqrt(D), -np.inf)
        e = np.exp(s - s.max(-1, keepdims=True))
        out.append(e / e.sum(-1, keepdims=True) @ v[..., part])
    gate = 1 / (1 + np.exp(-(x @ module.w_gate.weight.detach().numpy().T)))
    return (np.concatenate(out, -1) * gate) @ module.w_o.weight.detach().numpy().T


REFERENCES = {"sinks": (SinkAttention, sink_reference), "gated": (GatedAttention, gate_reference)}


def disagreement(cls, reference, window=0) -> float:
    module = layer(cls).eval()
    x = inputs()
    none = POSITION_ENCODINGS["none"](config())
    with torch.no_grad():
        out = module(x, none, Mask.over(0, T, T, window=window))[0].numpy()
    return float(np.abs(out - reference(module, x.numpy(), window)).max())


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_each_is_its_papers_formula(name, window):
    assert disagreement(*REFERENCES[name], window) < 1e-12


@pytest.mark.parametrize("module, old, new", [
    ("sink_attention", "weights[..., :-1]", "weights[..., 1:]"),                  # the sink kept
    ("sink_attention", "torch.cat([scores, sink], dim=-1)", "torch.cat([scores, 0 * sink], dim=-1)"),
    ("gated_attention", "y * torch.sigmoid(self.w_gate(x))", "y * torch.sigmoid(self.w_gate(y))"),
    ("gated_attention", "y * torch.sigmoid(self.w_gate(x))", "y * self.w_gate(x)"),
])
def test_the_reference_catches_each_planted_slip(module, old, new, monkeypatch):
    copy = planted(module, old, new, monkeypatch)
    cls = getattr(copy, "SinkAttention" if module == "sink_attention" else "GatedAttention")
    reference = sink_reference if module == "sink_attention" else gate_reference
    assert disagreement(cls, reference) > 1e-3


def test_the_sink_equals_transformers_gpt_oss_attention():
    """transformers' own eager gpt-oss attention, handed the same q, k, v and sinks."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward
    module = layer(SinkAttention).eval()
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, HEADS, T, D, generator=g, dtype=torch.float64) for _ in range(3))
    mask = Mask.over(0, T, T, window=4)
    ours, _ = module.attend(q, k, v, mask)
    additive = torch.zeros(T, T, dtype=torch.float64).masked_fill(~mask.dense, float("-inf"))
    theirs, _ = eager_attention_forward(
        SimpleNamespace(sinks=module.sinks.detach(), num_key_value_groups=1, training=False),
        q, k, v, additive[None, None], scaling=D ** -0.5)
    assert torch.allclose(ours.transpose(1, 2), theirs, atol=1e-12, rtol=0)


def test_a_sink_takes_weight_from_every_row_and_the_gate_can_close_a_head():
    module = layer(SinkAttention).eval()
    with torch.no_grad():
        module.sinks.fill_(3.0)
    q = torch.zeros(1, HEADS, 4, D, dtype=torch.float64)
    _, weights = module.attend(q, q, q, Mask.over(0, 4, 4), need_weights=True)
    rows = weights.sum(-1)                                # below 1: the sink took the rest
    expected = torch.tensor([n / (n + math.exp(3.0)) for n in range(1, 5)], dtype=torch.float64)
    assert torch.allclose(rows[0, 0], expected)


def test_a_gate_of_zero_weights_halves_every_head():
    """σ(0) = 1/2: with W_G = 0 the layer is plain multi-head attention at half strength."""
    from model.attention import MultiHeadAttention
    gated, plain = layer(GatedAttention).eval(), layer(MultiHeadAttention).eval()
    plain.load_state_dict({k: v for k, v in gated.state_dict().items() if "gate" not in k})
    with torch.no_grad():
        gated.w_gate.weight.zero_()
    x, none = inputs(), POSITION_ENCODINGS["none"](config())
    with torch.no_grad():
        halved = gated(x, none, Mask.over(0, T, T))[0]
        whole = plain(x, none, Mask.over(0, T, T))[0]
    assert torch.allclose(halved, whole / 2, atol=1e-12, rtol=0)
