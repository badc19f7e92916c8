"""DeltaNet (model/deltanet.py; the delta rule, Yang et al., arXiv:2406.06484): both forms
against a float64 reference of the paper's recurrence, the chunked (UT transform) form
against the recurrent form for several chunk sizes, the layer against the reference from its
own weights, decoding with the fixed-size state, causality, a long text that does not blow
the state up, and, planted one at a time into a copy of the module, the bugs each check is for."""
import numpy as np
import pytest
import torch

import model.deltanet as delta
import reference
from mechanism_checks import (B, HEADS, T, TOLERANCE, WIDTH, bias, causality_leak, decode_error,
                              decoded, inputs, layer, matrix, planted, whole)
from model.mask import Mask

D = WIDTH // HEADS
CHUNKS = [1, 3, 4, 64]                       # T = 11 is a multiple of none; 64 > T: one chunk


def rule_inputs(length: int = T, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(3, B, HEADS, length, D, generator=g, dtype=torch.float64)
    beta = torch.rand(B, HEADS, length, generator=g, dtype=torch.float64)
    return delta.unit(q), delta.unit(k), v, beta


def rule_error(module=delta) -> float:
    """The recurrent form and the chunked form (every chunk size) against
    reference.delta_rule, sequence by sequence and head by head, from S_0 = 0."""
    q, k, v, beta = rule_inputs()
    want = np.stack([np.stack([reference.delta_rule(q[b, h].numpy(), k[b, h].numpy(),
                                                    v[b, h].numpy(), beta[b, h].numpy())
                               for h in range(HEADS)]) for b in range(B)])
    S0 = module.empty_state(q)
    outs = [module.recurrent(q, k, v, beta, S0)[0]]
    outs += [module.chunked(q, k, v, beta, S0, size)[0] for size in CHUNKS]
    return max(float(np.abs(o.numpy() - want).max()) for o in outs)


def recurrent_error(module=delta) -> float:
    """The chunked form against the recurrent form, outputs and final state, both from the
    state an earlier text left (so a state read wrongly at a chunk start shows)."""
    q, k, v, beta = rule_inputs(T + 5)
    _, before = module.recurrent(q[:, :, :5], k[:, :, :5], v[:, :, :5], beta[:, :, :5],
                                 module.empty_state(q))
    rest = (q[:, :, 5:], k[:, :, 5:], v[:, :, 5:], beta[:, :, 5:])
    want, want_state = module.recurrent(*rest, before)
    errors = []
    for size in CHUNKS:
        got, state = module.chunked(*rest, before, size)
        errors += [(got - want).abs().max().item(), (state - want_state).abs().max().item()]
    return max(errors)


def layer_error(module=delta, chunk: int = 4) -> float:
    """The layer against the reference from its own weights: q and k through SiLU to unit
    length, β = sigmoid(x·w_β + b), the delta rule per head, then W_O."""
    m = layer(module.DeltaNet, linear_chunk=chunk)
    x = inputs()
    y = whole(m, x).detach().numpy()
    ref = np.zeros_like(y)
    for b in range(B):
        xb = x[b].numpy()
        q, k, v = np.split(xb @ matrix(m.w_qkv) + bias(m.w_qkv), 3, axis=1)      # (T, H·D) each
        beta = reference.sigmoid(xb @ matrix(m.w_beta) + bias(m.w_beta))       # (T, H)
        heads = []
        for h in range(HEADS):
            cut = slice(h * D, (h + 1) * D)
            qh, kh = (reference.l2_normalise(reference.silu(t[:, cut])) for t in (q, k))
            heads.append(reference.delta_rule(qh, kh, v[:, cut], beta[:, h]))
        ref[b] = np.concatenate(heads, axis=1) @ matrix(m.w_o) + bias(m.w_o)
    return float(np.abs(y - ref).max())


def leak(module=delta) -> float:
    return causality_leak(layer(module.DeltaNet, linear_chunk=4), inputs())


def blow_up(module=delta) -> float:
    """How far past 100 the layer's outputs grow over 256 tokens of large inputs; 0 while
    unit keys keep every erase step I − β k kᵀ from lengthening the state."""
    m = layer(module.DeltaNet, linear_chunk=16)
    y = whole(m, 3 * inputs(length=256)).detach()
    return float(torch.nan_to_num(y.abs().max() - 100, nan=1e30).clamp(min=0))


def test_both_forms_match_the_float64_reference_of_the_recurrence():
    assert rule_error() < TOLERANCE


def test_the_chunked_form_equals_the_recurrent_form_at_every_chunk_size():
    assert recurrent_error() < TOLERANCE


@pytest.mark.parametrize("chunk", CHUNKS)
def test_the_layer_matches_the_float64_reference(chunk):
    assert layer_error(chunk=chunk) < TOLERANCE


@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_a_changed_later_token_leaves_earlier_outputs_as_they_were(chunk):
    assert causality_leak(layer(delta.DeltaNet, linear_chunk=chunk), inputs()) < TOLERANCE


def test_a_long_text_does_not_blow_the_state_up():
    assert blow_up() == 0


def test_decoding_with_the_state_equals_the_whole_pass_and_the_state_does_not_grow():
    m = layer(delta.DeltaNet, linear_chunk=4)
    x = inputs()
    assert decode_error(m, x) < TOLERANCE
    assert decode_error(m, x, pieces=(1,) * T) < TOLERANCE
    short, long = decoded(m, x, (2, 1))[1].get(0), decoded(m, x)[1].get(0)
    assert short.bytes() == long.bytes() == B * HEADS * D * D * 8     # S: D x D per head
    assert long.bytes_per_token() == 0


def test_it_refuses_to_draw_weights_in_one_line():
    with pytest.raises(ValueError, match="no attention weights"):
        layer(delta.DeltaNet)(inputs(), None, Mask.over(0, T, T), need_weights=True)


ERASE = "        state = state + k_t.unsqueeze(-1) * (b_t * (v_t - held)).unsqueeze(-2)\n"
A_LINE = "    A = (beta.unsqueeze(-1) * (k @ k.transpose(-2, -1))).tril(-1)"
# (what the bug is, the text as written, the text with the bug, the check that catches it)
PLANTED = [
    ("beta missing from the erase term", ERASE,
     "        state = state + k_t.unsqueeze(-1) * (b_t * v_t - held).unsqueeze(-2)\n", rule_error),
    ("beta missing from the UT transform", A_LINE, "    A = (k @ k.transpose(-2, -1)).tril(-1)",
     rule_error),
    ("keys not normalised", "        k = unit(F.silu(k))\n", "        k = F.silu(k)\n", layer_error),
    ("keys not normalised: the state blows up", "        k = unit(F.silu(k))\n",
     "        k = F.silu(k)\n", blow_up),
    ("beta not squashed into (0, 1)", "beta = torch.sigmoid(self.w_beta(x))",
     "beta = self.w_beta(x)", layer_error),
    ("chunk: o_t reads the state before its own write (off by one)",
     ".tril() @ new", ".tril(-1) @ new", recurrent_error),
    ("chunk boundary: the next chunk's state misses this chunk's last token",
     "    return out, state + k.transpose(-2, -1) @ new\n",
     "    return out, state + k[:, :, :-1].transpose(-2, -1) @ new[:, :, :-1]\n", recurrent_error),
    ("the UT transform's matrix not strictly lower (its diagonal kept)", A_LINE,
     "    A = beta.unsqueeze(-1) * (k @ k.transpose(-2, -1))", rule_error),
    ("a chunk's outputs read the writes of later tokens in it",
     "(q @ k.transpose(-2, -1)).tril() @ new", "(q @ k.transpose(-2, -1)) @ new", leak),
]


@pytest.mark.parametrize("name,line,wrong,check", PLANTED, ids=[p[0] for p in PLANTED])
def test_each_planted_bug_is_caught_by_its_check(name, line, wrong, check, monkeypatch):
    assert check() < TOLERANCE                                # the module as written passes
    caught = check(planted("deltanet", line, wrong, monkeypatch))
    print(f"{name}: {caught:.3g}")
    assert not caught < 1e-6, f"{name}: the check moved only {caught}"   # NaN counts as caught
