"""DeltaNet and Gated DeltaNet (model/deltanet.py; the delta rule, Yang et al.,
arXiv:2406.06484; its gated form, arXiv:2412.06464): both forms against a float64 reference
of the papers' recurrence, the chunked (UT transform) form against the recurrent form for
several chunk sizes, each layer against the reference from its own weights, decoding with the
fixed-size state, causality, a long text that does not blow the state up, and, planted one at
a time into a copy of the module, the bugs each check is for."""
import numpy as np
import pytest
import torch

import model.deltanet as delta
import reference
from mechanism_checks import (B, HEADS, T, TOLERANCE, WIDTH, bias, causality_leak, decode_error,
                              decoded, inputs, layer, matrix, planted, whole)
from model.attention import Mask

# Tiny models spend their time in dispatch: a second thread only adds waiting for it.
pytestmark = pytest.mark.usefixtures("one_thread")

D = WIDTH // HEADS
CHUNKS = [1, 3, 4, 64]                       # T = 11 is a multiple of none; 64 > T: one chunk
LAYERS = ["DeltaNet", "GatedDeltaNet"]


def rule_inputs(gated: bool, length: int = T, seed: int = 2):
    """Unit queries and keys, values, β in (0, 1) and ln α: 0, or α in (0.5, 1)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(3, B, HEADS, length, D, generator=g, dtype=torch.float64)
    beta, alpha = torch.rand(2, B, HEADS, length, generator=g, dtype=torch.float64)
    log_alpha = (0.5 + alpha / 2).log() if gated else torch.zeros_like(alpha)
    return delta.unit(q), delta.unit(k), v, beta, log_alpha


def rule_error(module=delta, gated: bool = False) -> float:
    """The recurrent form and the chunked form (every chunk size) against
    reference.delta_rule, sequence by sequence and head by head, from S_0 = 0."""
    q, k, v, beta, log_alpha = rule_inputs(gated)
    want = np.stack([np.stack([
        reference.delta_rule(*(t[b, h].numpy() for t in (q, k, v, beta)),
                             alpha=log_alpha[b, h].exp().numpy())
        for h in range(HEADS)]) for b in range(B)])
    S0 = module.empty_state(q)
    outs = [module.recurrent(q, k, v, beta, log_alpha, S0)[0]]
    outs += [module.chunked(q, k, v, beta, log_alpha, S0, size)[0] for size in CHUNKS]
    return max(float(np.abs(o.numpy() - want).max()) for o in outs)


def recurrent_error(module=delta, gated: bool = False) -> float:
    """The chunked form against the recurrent form, outputs and final state, both from the
    state an earlier text left (so a state read wrongly at a chunk start shows)."""
    inputs_ = rule_inputs(gated, T + 5)
    first = [t[:, :, :5] for t in inputs_]
    rest = [t[:, :, 5:] for t in inputs_]
    _, before = module.recurrent(*first, module.empty_state(inputs_[0]))
    want, want_state = module.recurrent(*rest, before)
    errors = []
    for size in CHUNKS:
        got, state = module.chunked(*rest, before, size)
        errors += [(got - want).abs().max().item(), (state - want_state).abs().max().item()]
    return max(errors)


def gated_rule_error(module=delta) -> float:
    return rule_error(module, gated=True)


def gated_recurrent_error(module=delta) -> float:
    return recurrent_error(module, gated=True)


def layer_error(module=delta, chunk: int = 4, name: str = "DeltaNet") -> float:
    """The layer against the reference from its own weights: q and k through SiLU to unit
    length, β = sigmoid(x·w_β + b), α = sigmoid(x·w_α + b_α) when gated, the delta rule
    per head, then W_O."""
    m = layer(getattr(module, name), linear_chunk=chunk)
    x = inputs()
    y = whole(m, x).detach().numpy()
    ref = np.zeros_like(y)
    for b in range(B):
        xb = x[b].numpy()
        q, k, v = np.split(xb @ matrix(m.w_qkv) + bias(m.w_qkv), 3, axis=1)      # (T, H·D) each
        beta = reference.sigmoid(xb @ matrix(m.w_beta) + bias(m.w_beta))       # (T, H)
        alpha = (reference.sigmoid(xb @ matrix(m.w_alpha) + m.alpha_bias.detach().numpy())
                 if hasattr(m, "w_alpha") else np.ones_like(beta))
        heads = []
        for h in range(HEADS):
            cut = slice(h * D, (h + 1) * D)
            qh, kh = (reference.l2_normalise(reference.silu(t[:, cut])) for t in (q, k))
            heads.append(reference.delta_rule(qh, kh, v[:, cut], beta[:, h], alpha[:, h]))
        ref[b] = np.concatenate(heads, axis=1) @ matrix(m.w_o) + bias(m.w_o)
    return float(np.abs(y - ref).max())


def gated_layer_error(module=delta) -> float:
    return layer_error(module, name="GatedDeltaNet")


def leak(module=delta) -> float:
    return causality_leak(layer(module.DeltaNet, linear_chunk=4), inputs())


def blow_up(module=delta) -> float:
    """How far past 100 the layer's outputs grow over 256 tokens of large inputs; 0 while
    unit keys keep every erase step I − β k kᵀ from lengthening the state."""
    m = layer(module.DeltaNet, linear_chunk=16)
    y = whole(m, 3 * inputs(length=256)).detach()
    return float(torch.nan_to_num(y.abs().max() - 100, nan=1e30).clamp(min=0))


@pytest.mark.parametrize("gated", [False, True], ids=["deltanet", "gated"])
def test_both_forms_match_the_float64_reference_of_the_recurrence(gated):
    assert rule_error(gated=gated) < TOLERANCE


@pytest.mark.parametrize("gated", [False, True], ids=["deltanet", "gated"])
def test_the_chunked_form_equals_the_recurrent_form_at_every_chunk_size(gated):
    assert recurrent_error(gated=gated) < TOLERANCE


@pytest.mark.parametrize("name", LAYERS)
@pytest.mark.parametrize("chunk", CHUNKS)
def test_the_layer_matches_the_float64_reference(chunk, name):
    assert layer_error(chunk=chunk, name=name) < TOLERANCE


@pytest.mark.parametrize("name", LAYERS)
@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_a_changed_later_token_leaves_earlier_outputs_as_they_were(chunk, name):
    assert causality_leak(layer(getattr(delta, name), linear_chunk=chunk), inputs()) < TOLERANCE


def test_a_long_text_does_not_blow_the_state_up():
    assert blow_up() == 0


@pytest.mark.parametrize("name", LAYERS)
def test_decoding_with_the_state_equals_the_whole_pass_and_the_state_does_not_grow(name):
    m = layer(getattr(delta, name), linear_chunk=4)
    x = inputs()
    assert decode_error(m, x) < TOLERANCE
    assert decode_error(m, x, pieces=(1,) * T) < TOLERANCE
    short, long = decoded(m, x, (2, 1))[1], decoded(m, x)[1]
    assert short.nbytes() == long.nbytes() == B * HEADS * D * D * 8   # S: D x D per head
    assert short.k == long.k == [None]                        # nothing that grows


def test_the_gated_heads_start_with_memories_of_different_lengths():
    m = delta.GatedDeltaNet(delta.ModelConfig(vocab_size=8, n_head=4, n_embd=16), 0)
    alpha = m.gate(torch.zeros(1, 1, 16)).exp().flatten()             # α with x = 0
    assert 0.85 < alpha[0] < alpha[1] < alpha[2] < alpha[3] < 0.999


def test_it_refuses_to_draw_weights_in_one_line():
    with pytest.raises(ValueError, match="no attention weights"):
        layer(delta.DeltaNet)(inputs(), None, Mask.over(0, T, T), need_weights=True)


ERASE = "        state = state + k_t.unsqueeze(-1) * (b_t * (v_t - held)).unsqueeze(-2)\n"
A_LINE = "    A = (beta.unsqueeze(-1) * (k @ k.transpose(-2, -1)) * left).tril(-1)"
CARRY = "    return out, Gamma[:, :, -1, None, None] * state + k.transpose(-2, -1) @ (last * new)\n"
FADE = "        state = log_alpha[:, :, t, None, None].exp() * state         # the gate: all fades\n"
# (what the bug is, the text as written, the text with the bug, the check that catches it)
PLANTED = [
    ("beta missing from the erase term", ERASE,
     "        state = state + k_t.unsqueeze(-1) * (b_t * v_t - held).unsqueeze(-2)\n", rule_error),
    ("beta missing from the UT transform", A_LINE,
     "    A = ((k @ k.transpose(-2, -1)) * left).tril(-1)", rule_error),
    ("keys not normalised", "        k = unit(F.silu(k))\n", "        k = F.silu(k)\n", layer_error),
    ("keys not normalised: the state blows up", "        k = unit(F.silu(k))\n",
     "        k = F.silu(k)\n", blow_up),
    ("beta not squashed into (0, 1)", "beta = torch.sigmoid(self.w_beta(x))",
     "beta = self.w_beta(x)", layer_error),
    ("chunk: o_t reads the state before its own write (off by one)",
     "* left) @ new", "* left).tril(-1) @ new", recurrent_error),
    ("chunk boundary: the next chunk's state misses this chunk's last token", CARRY,
     CARRY.replace("k.transpose(-2, -1) @ (last * new)",
                   "k[:, :, :-1].transpose(-2, -1) @ (last * new)[:, :, :-1]"), recurrent_error),
    ("the UT transform's matrix not strictly lower (its diagonal kept)", A_LINE,
     A_LINE.replace(".tril(-1)", ""), rule_error),
    ("a chunk's outputs read the writes of later tokens in it",
     "device=gap.device).tril()", "device=gap.device)", leak),
    ("gated: the state fades after the delta step, not before", FADE + "        held",
     "        held", gated_rule_error),
    ("gated: the faded state before the chunk read unfaded in the erase",
     "W, U = T @ (Gamma.unsqueeze(-1) * k), T @ v", "W, U = T @ k, T @ v", gated_recurrent_error),
    ("gated: the state handed to the next chunk not faded", CARRY,
     CARRY.replace("Gamma[:, :, -1, None, None] * state", "state"), gated_recurrent_error),
    ("gated: the fading counted from one token late (off by one)",
     "    gamma = log_alpha.cumsum(-1)", "    gamma = log_alpha.cumsum(-1) - log_alpha",
     gated_recurrent_error),
    ("gated: alpha not taken from the gate", "return F.logsigmoid(self.w_alpha(x) + self.alpha_bias)",
     "return F.logsigmoid(self.alpha_bias).expand(*x.shape[:2], -1)", gated_layer_error),
]


@pytest.mark.parametrize("name,line,wrong,check", PLANTED, ids=[p[0] for p in PLANTED])
def test_each_planted_bug_is_caught_by_its_check(name, line, wrong, check, monkeypatch):
    assert check() < TOLERANCE                                # the module as written passes
    caught = check(planted("deltanet", line, wrong, monkeypatch))
    print(f"{name}: {caught:.3g}")
    assert not caught < 1e-6, f"{name}: the check moved only {caught}"   # NaN counts as caught


@pytest.mark.parametrize("gated", [False, True], ids=["deltanet", "gated"])
def test_the_chunked_forms_gradients_equal_the_recurrent_forms(gated):
    # Equal outputs give equal gradients in exact arithmetic; this checks that the chunked
    # backward (through the triangular solve and the masked fading) stays finite and close.
    def grads(form):
        tensors = [t.clone().requires_grad_() for t in rule_inputs(gated)]
        out, state = form(*tensors)
        (out.sin().sum() + state.cos().sum()).backward()
        return [t.grad for t in tensors]
    want = grads(lambda *t: delta.recurrent(*t, delta.empty_state(t[0])))
    got = grads(lambda *t: delta.chunked(*t, delta.empty_state(t[0]), 4))
    for w, g in zip(want, got):
        assert torch.isfinite(g).all() and (g - w).abs().max() < TOLERANCE
