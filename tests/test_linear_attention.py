"""Causal linear attention (model/linear_attention.py; Katharopoulos et al., arXiv:2006.16236):
the layer against a float64 reference written from the paper's eq. 6, the chunked parallel
form against the RNN form, decoding with the fixed-size state against the whole pass,
causality, and, planted one at a time into a copy of the module, the bugs each check is for."""
import numpy as np
import pytest
import torch

import model.linear_attention as linear
import reference
from mechanism_checks import (B, HEADS, T, TOLERANCE, WIDTH, bias, causality_leak, decode_error,
                              decoded, inputs, layer, matrix, planted, whole)
from model.attention import Mask

# Tiny models spend their time in dispatch: a second thread only adds waiting for it.
pytestmark = pytest.mark.usefixtures("one_thread")

D = WIDTH // HEADS
CHUNKS = [1, 3, 4, 64]                       # 64 > T: the masked quadratic form in one piece


def reference_error(module=linear, chunk: int = 4) -> float:
    """The layer against reference.linear_attention, head by head, from its own weights."""
    m = layer(module.LinearAttention, linear_chunk=chunk)
    x = inputs()
    y = whole(m, x).detach().numpy()
    ref = np.zeros_like(y)
    for b in range(B):
        qkv = x[b].numpy() @ matrix(m.w_qkv) + bias(m.w_qkv)               # (T, 3·H·D)
        q, k, v = np.split(qkv, 3, axis=1)
        heads = [reference.linear_attention(*(t[:, h * D:(h + 1) * D] for t in (q, k, v)))
                 for h in range(HEADS)]
        ref[b] = np.concatenate(heads, axis=1) @ matrix(m.w_o) + bias(m.w_o)
    return float(np.abs(y - ref).max())


def recurrent_error(module=linear) -> float:
    """The chunked form (several chunk sizes, T a multiple of none) against the RNN form,
    outputs and final state, both starting from the state an earlier text left."""
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(3, B, HEADS, T + 5, D, generator=g, dtype=torch.float64)
    phi_q, phi_k = module.feature_map(q), module.feature_map(k)
    _, before = module.recurrent(phi_q[:, :, :5], phi_k[:, :, :5], v[:, :, :5],
                                 module.LinearState.empty(phi_q))
    want, want_state = module.recurrent(phi_q[:, :, 5:], phi_k[:, :, 5:], v[:, :, 5:], before)
    errors = []
    for size in CHUNKS:
        got, state = module.chunked(phi_q[:, :, 5:], phi_k[:, :, 5:], v[:, :, 5:], before, size)
        errors += [(got - want).abs().max(), (state.S - want_state.S).abs().max(),
                   (state.z - want_state.z).abs().max()]
    return max(e.item() for e in errors)


def not_positive(module=linear) -> float:
    """How many of φ's values are not strictly positive, from x = -30 to 30, in float64
    and in bf16 (the precision CPU training runs in where the CPU has it)."""
    x = torch.linspace(-30, 30, 601, dtype=torch.float64)
    return float(sum((module.feature_map(x.to(dtype)) <= 0).sum() for dtype in
                     (torch.float64, torch.bfloat16)))


def leak(module=linear) -> float:
    return causality_leak(layer(module.LinearAttention, linear_chunk=4), inputs())


@pytest.mark.parametrize("chunk", CHUNKS)
def test_the_layer_matches_the_float64_reference(chunk):
    assert reference_error(chunk=chunk) < TOLERANCE


def test_the_chunked_form_equals_the_recurrent_form():
    assert recurrent_error() < TOLERANCE


def test_phi_is_elu_plus_one_and_positive_everywhere():
    x = torch.linspace(-30, 30, 601, dtype=torch.float64)
    assert np.allclose(linear.feature_map(x).numpy(), reference.elu_plus_one(x.numpy()),
                       rtol=1e-15, atol=0)
    assert not_positive() == 0


@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_a_changed_later_token_leaves_earlier_outputs_as_they_were(chunk):
    assert causality_leak(layer(linear.LinearAttention, linear_chunk=chunk), inputs()) < TOLERANCE


def test_decoding_with_the_state_equals_the_whole_pass_and_the_state_does_not_grow():
    m = layer(linear.LinearAttention, linear_chunk=4)
    x = inputs()
    assert decode_error(m, x) < TOLERANCE
    assert decode_error(m, x, pieces=(1,) * T) < TOLERANCE
    short, long = decoded(m, x, (2, 1))[1], decoded(m, x)[1]
    # S: D x D and z: D per head, float64: the same after 3 tokens as after 11.
    assert short.nbytes() == long.nbytes() == B * HEADS * (D * D + D) * 8
    assert short.k == long.k == [None]                        # nothing that grows


def test_the_weights_are_the_normalised_kernel_rows_of_a_causal_average():
    m = layer(linear.LinearAttention)
    x = inputs()
    _, w = m(x, None, Mask.over(0, T, T), need_weights=True)
    assert w.shape == (B, HEADS, T, T)
    assert torch.allclose(w.sum(-1), torch.ones(B, HEADS, T, dtype=torch.float64))
    assert (w.triu(1) == 0).all() and (w.tril() > 0).sum() == B * HEADS * T * (T + 1) // 2


PHI = "    return torch.where(x > 0, x + 1, torch.exp(x.clamp(max=0)))\n"
# (what the bug is, the line as written, the line with the bug, the check that catches it)
PLANTED = [
    ("no normaliser", "    y = numerator / (normaliser.unsqueeze(-1) + EPS)\n",
     "    y = numerator\n", reference_error),
    ("no normaliser in the RNN form", "        ys.append(numerator / (normaliser + EPS))\n",
     "        ys.append(numerator)\n", recurrent_error),
    ("phi the identity, negative below 0", PHI, "    return x\n", not_positive),
    ("phi the identity, against the reference", PHI, "    return x\n", reference_error),
    ("phi = relu, zero below 0", PHI, "    return torch.relu(x)\n", not_positive),
    ("phi = elu(x) + 1 as written, zero in bf16 below -8", PHI,
     "    return torch.nn.functional.elu(x) + 1\n", not_positive),
    ("the sums see the future", ").tril()                # (B, H, C, C)", ")  # (B, H, C, C)", leak),
    ("the state updated before the chunk reads it",
     "    numerator = phi_q @ state.S + within @ v",
     "    state = LinearState(state.S + phi_k.transpose(-2, -1) @ v, state.z + phi_k.sum(-2))\n"
     "    numerator = phi_q @ state.S + within @ v", leak),
    ("the RNN reads the state before the token's own k, v join it (off by one)",
     "        numerator = (phi_q[:, :, t, None, :] @ S).squeeze(-2)",
     "        numerator = (phi_q[:, :, t, None, :] @ (S - phi_k[:, :, t, :, None] * v[:, :, t, None, :])).squeeze(-2)",
     recurrent_error),
]


@pytest.mark.parametrize("name,line,wrong,check", PLANTED, ids=[p[0] for p in PLANTED])
def test_each_planted_bug_is_caught_by_its_check(name, line, wrong, check, monkeypatch):
    assert check() < TOLERANCE                                # the module as written passes
    caught = check(planted("linear_attention", line, wrong, monkeypatch))
    print(f"{name}: {caught:.3g}")
    assert not caught < 1e-6, f"{name}: the check moved only {caught}"   # NaN counts as caught


def test_the_chunked_forms_gradients_equal_the_recurrent_forms():
    def grads(form):
        g = torch.Generator().manual_seed(3)
        tensors = [t.requires_grad_() for t in torch.randn(3, B, HEADS, T, D, generator=g,
                                                            dtype=torch.float64)]
        q, k, v = tensors
        out, state = form(linear.feature_map(q), linear.feature_map(k), v,
                          linear.LinearState.empty(q))
        (out.sin().sum() + state.S.cos().sum()).backward()
        return [t.grad for t in tensors]
    want, got = grads(linear.recurrent), grads(lambda *a: linear.chunked(*a, 4))
    for w, g in zip(want, got):
        assert (g - w).abs().max() < TOLERANCE
