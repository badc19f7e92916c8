"""Kimi Delta Attention (model/kda.py; Kimi Linear, arXiv:2510.26692): both forms of the
channel-wise gated delta rule against a float64 reference of the paper's recurrence, the
chunked form against the recurrent one at every chunk size and from a state left by an
earlier text, the layer against the reference from its own weights, the layer reduced to
the project's DeltaNet (α ≡ 1) and Gated DeltaNet (α equal across channels) with copied
weights, the rule, the decay and the output gate against transformers' own KimiLinear
pieces, decoding with the fixed-size state, causality, and the slips each check is for,
planted one at a time into a copy of the module."""
import numpy as np
import pytest
import torch

import model.deltanet as delta
import model.kda as kda
import reference
from conftest import ROOT
from mechanism_checks import (B, HEADS, T, WIDTH, bias, causality_leak, decode_error, decoded,
                              inputs, layer, matrix, planted, whole)

# Tiny models spend their time in dispatch: a second thread only adds waiting for it.
pytestmark = pytest.mark.usefixtures("one_thread")

D = WIDTH // HEADS
CHUNKS = [1, 3, 4, 64]                       # T = 11 is a multiple of none; 64 > T: one chunk
EXACT = 1e-12                                # float64 throughout: agreement to ~1e-15


def rule_inputs(length: int = T, seed: int = 2, strongest: float = 0.5):
    """Unit queries and keys, values, β in (0, 1), and ln α per key channel with α in
    (strongest, 1): a different decay on every channel."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(3, B, HEADS, length, D, generator=g, dtype=torch.float64)
    beta = torch.rand(B, HEADS, length, generator=g, dtype=torch.float64)
    alpha = strongest + (1 - strongest) * torch.rand(B, HEADS, length, D, generator=g,
                                                     dtype=torch.float64)
    return delta.unit(q), delta.unit(k), v, beta, alpha.log()


def rule_error(module=kda) -> float:
    """The recurrent form and the chunked form (every chunk size) against
    reference.kda_rule, sequence by sequence and head by head, from S_0 = 0."""
    q, k, v, beta, log_alpha = rule_inputs()
    want = np.stack([np.stack([
        reference.kda_rule(*(t[b, h].numpy() for t in (q, k, v, beta)),
                           alpha=log_alpha[b, h].exp().numpy())
        for h in range(HEADS)]) for b in range(B)])
    S0 = delta.empty_state(q)
    outs = [module.recurrent(q, k, v, beta, log_alpha, S0)[0]]
    outs += [module.chunked(q, k, v, beta, log_alpha, S0, size)[0] for size in CHUNKS]
    return max(float(np.abs(o.numpy() - want).max()) for o in outs)


def recurrent_error(module=kda, strongest: float = 0.5) -> float:
    """The chunked form against the recurrent form, outputs and final state, both from the
    state an earlier text left (so a state read or faded wrongly at a chunk start shows)."""
    inputs_ = rule_inputs(T + 5, strongest=strongest)
    first = [t[:, :, :5] for t in inputs_]
    rest = [t[:, :, 5:] for t in inputs_]
    _, before = module.recurrent(*first, delta.empty_state(inputs_[0]))
    want, want_state = module.recurrent(*rest, before)
    errors = []
    for size in CHUNKS:
        got, state = module.chunked(*rest, before, size)
        errors += [(got - want).abs().max().item(), (state - want_state).abs().max().item()]
    return max(errors)


def numpy_decay(m, xb):
    """ln α, (T, H·D): −exp(A_h) · softplus(x W_down W_up + b_dt), the paper's form."""
    f = xb @ matrix(m.w_decay_down) @ matrix(m.w_decay_up) + m.decay_bias.detach().numpy()
    rate = np.repeat(np.exp(m.decay_log_rate.detach().numpy()), D)
    return -rate * np.logaddexp(0.0, f)


def numpy_read(m, xb, heads):
    """What the heads hand W_O, then W_O: each head's output RMS-normed over its channels
    with the gain, times sigmoid(x W_down' W_up'), side by side, times W_O."""
    gate = reference.sigmoid(xb @ matrix(m.w_gate_down) @ matrix(m.w_gate_up))      # (T, H·D)
    normed = [reference.rms_norm(o, m.out_norm.detach().numpy(), m.norm_eps) for o in heads]
    return (np.concatenate(normed, axis=1) * gate) @ matrix(m.w_o) + bias(m.w_o)


def layer_error(module=kda, chunk: int = 4) -> float:
    """The layer against the reference from its own weights: q and k through SiLU to unit
    length, β = sigmoid(x·w_β + b), α per channel from the low-rank decay, the rule per
    head, the output norm and gate, then W_O."""
    m = layer(module.KimiDeltaAttention, linear_chunk=chunk)
    x = inputs()
    y = whole(m, x).detach().numpy()
    ref = np.zeros_like(y)
    for b in range(B):
        xb = x[b].numpy()
        q, k, v = np.split(xb @ matrix(m.w_qkv) + bias(m.w_qkv), 3, axis=1)      # (T, H·D) each
        beta = reference.sigmoid(xb @ matrix(m.w_beta) + bias(m.w_beta))       # (T, H)
        alpha = np.exp(numpy_decay(m, xb))                                     # (T, H·D)
        heads = []
        for h in range(HEADS):
            cut = slice(h * D, (h + 1) * D)
            qh, kh = (reference.l2_normalise(reference.silu(t[:, cut])) for t in (q, k))
            heads.append(reference.kda_rule(qh, kh, v[:, cut], beta[:, h], alpha[:, cut]))
        ref[b] = numpy_read(m, xb, heads)
    return float(np.abs(y - ref).max())


def leak(module=kda) -> float:
    return causality_leak(layer(module.KimiDeltaAttention, linear_chunk=4), inputs())


def test_both_forms_match_the_float64_reference_of_the_papers_recurrence():
    assert rule_error() < EXACT


def test_the_chunked_form_equals_the_recurrent_form_at_every_chunk_size():
    assert recurrent_error() < EXACT


def test_a_strong_decay_neither_overflows_nor_loses_the_chunked_form():
    """α down to 1e-6 per token: over a chunk of 64 the fading spans e^(-800) and more,
    which a form dividing by Γ_i (k_i / Γ_i) would overflow to inf; masked before exp,
    the chunked form stays equal to the recurrent one."""
    assert recurrent_error(strongest=1e-6) < EXACT


@pytest.mark.parametrize("chunk", CHUNKS)
def test_the_layer_matches_the_float64_reference(chunk):
    assert layer_error(chunk=chunk) < EXACT


def copy_prologue(source, m):
    """Give `source` (a DeltaNet or GatedDeltaNet) KDA's W_Q, W_K, W_V and β, and W_O = I,
    so its output is its heads' side by side."""
    with torch.no_grad():
        for name in ("w_qkv", "w_beta"):
            getattr(source, name).load_state_dict(getattr(m, name).state_dict())
        source.w_o.weight.copy_(torch.eye(WIDTH))
        if source.w_o.bias is not None:
            source.w_o.bias.zero_()


def through_read(m, source, x):
    """`source`'s heads (the project's DeltaNet path), then KDA's output norm, gate and W_O
    in NumPy."""
    heads = whole(source, x).detach().numpy()                       # (B, T, H·D)
    return np.stack([numpy_read(m, x[b].numpy(), np.split(heads[b], HEADS, axis=1))
                     for b in range(B)])


def test_with_no_decay_it_is_deltanet():
    """exp(A) = 0 gives ln α = 0 on every channel: the state fades nowhere, and the rule is
    DeltaNet's, computed by the project's own DeltaNet module with KDA's weights."""
    m = layer(kda.KimiDeltaAttention, linear_chunk=4)
    with torch.no_grad():
        m.decay_log_rate.fill_(float("-inf"))
    source = layer(delta.DeltaNet, seed=5, linear_chunk=3)
    copy_prologue(source, m)
    x = inputs()
    assert np.abs(whole(m, x).detach().numpy() - through_read(m, source, x)).max() < EXACT


def test_with_one_decay_across_a_heads_channels_it_is_gated_deltanet():
    """ln α = −softplus(−(x·w_α + b_α)) = logsigmoid(x·w_α + b_α), Gated DeltaNet's gate,
    when exp(A) = 1, W_down's first rows are −w_α, W_up copies head h's row to each of
    its channels and b_dt = −b_α: the project's GatedDeltaNet with KDA's weights agrees."""
    m = layer(kda.KimiDeltaAttention, linear_chunk=4)
    source = layer(delta.GatedDeltaNet, seed=5, linear_chunk=3)
    copy_prologue(source, m)
    with torch.no_grad():
        m.decay_log_rate.zero_()
        m.w_decay_down.weight.zero_()
        m.w_decay_down.weight[:HEADS] = -source.w_alpha.weight
        m.w_decay_up.weight.zero_()
        for h in range(HEADS):
            m.w_decay_up.weight[h * D:(h + 1) * D, h] = 1.0
        m.decay_bias.copy_(-source.alpha_bias.repeat_interleave(D))
    x = inputs()
    assert np.abs(whole(m, x).detach().numpy() - through_read(m, source, x)).max() < EXACT
    alpha = m.gate(x).exp()
    assert not torch.allclose(alpha, torch.ones_like(alpha))        # it does fade


# -- transformers' own KimiLinear pieces ---------------------------------------------------
# transformers' KDA layer (KimiLinearDeltaAttention) runs on a CPU through its PyTorch
# fallbacks, and puts q, k and v all through a short convolution and SiLU, which this layer
# builds only with model.delta_conv (the whole layer with it: tests/test_kimi_linear.py);
# without it the layer is compared piece by piece: the rule (its
# chunked and recurrent forms), the decay (KimiLinearForgetGate) and the output norm and
# gate (KimiLinearRMSNormGated), each with this layer's weights. The pieces cast to fp32
# inside, so they agree to fp32's rounding.
FP32 = 1e-5


def test_the_rule_matches_transformers_kimi_linear_forms():
    kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    q, k, v, beta, log_alpha = rule_inputs(length=20, strongest=0.2)
    S0 = torch.randn(B, HEADS, D, D, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    want, want_state = kda.chunked(q, k, v, beta, log_alpha, S0, 4)
    # transformers takes (B, T, H, D) and scales q by 1/√d_k; this layer's RMSNorm makes
    # that scale moot, so q goes in √d_k larger.
    ours = [t.transpose(1, 2) for t in (q * D ** 0.5, k, v, log_alpha)]
    b = beta.transpose(1, 2)
    for form, extra in ((kimi.chunk_kimi_delta_attention, {"chunk_size": 8}),
                        (kimi.recurrent_kimi_delta_attention, {})):
        got, state = form(*ours[:3], g=ours[3], beta=b, initial_state=S0,
                          output_final_state=True, **extra)
        assert (got.transpose(1, 2).double() - want).abs().max() < FP32
        assert (state.double() - want_state).abs().max() < FP32


def test_the_decay_and_the_output_gate_match_transformers_kimi_linear():
    kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    from transformers import KimiLinearConfig
    m = layer(kda.KimiDeltaAttention)
    config = KimiLinearConfig(hidden_size=WIDTH, linear_attn_config={
        "head_dim": D, "num_heads": HEADS, "kda_layers": [1], "full_attn_layers": []},
        num_hidden_layers=1, rms_norm_eps=m.norm_eps)
    forget, norm = kimi.KimiLinearForgetGate(config).double(), kimi.KimiLinearRMSNormGated(D, eps=m.norm_eps)
    with torch.no_grad():
        forget.f_a_proj.weight.copy_(m.w_decay_down.weight)
        forget.f_b_proj.weight.copy_(m.w_decay_up.weight)
        forget.dt_bias.copy_(m.decay_bias)
        forget.A_log.copy_(m.decay_log_rate.view(1, 1, HEADS, 1))
        norm.weight.copy_(m.out_norm)
    x = inputs()
    assert (forget(x).double() - m.gate(x)).abs().max() < FP32
    y = torch.randn(B, HEADS, T, D, dtype=torch.float64)             # what the rule gave
    gate = m.w_gate_up(m.w_gate_down(x)).view(B, T, HEADS, D)
    want = norm(y.transpose(1, 2), gate).double().transpose(1, 2)
    assert (m.read(y, x) - want).abs().max() < FP32


# -- decoding, causality, the starting decay -----------------------------------------------

@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_a_changed_later_token_leaves_earlier_outputs_as_they_were(chunk):
    assert causality_leak(layer(kda.KimiDeltaAttention, linear_chunk=chunk), inputs()) < EXACT


def test_decoding_with_the_state_equals_the_whole_pass_and_the_state_does_not_grow():
    m = layer(kda.KimiDeltaAttention, linear_chunk=4)
    x = inputs()
    assert decode_error(m, x) < EXACT
    assert decode_error(m, x, pieces=(1,) * T) < EXACT
    short, long = decoded(m, x, (2, 1))[1], decoded(m, x)[1]
    assert short.nbytes() == long.nbytes() == B * HEADS * D * D * 8   # S: D x D per head
    assert short.k == long.k == [None]                        # nothing that grows


def test_the_channels_start_with_memories_of_different_lengths():
    """At x = 0, α spreads over each head's channels and the heads, as fla starts it:
    exp(A) from 1 to 16 and softplus(b_dt) from 0.001 to 0.1."""
    m = kda.KimiDeltaAttention(kda.ModelConfig(vocab_size=8, n_head=4, n_embd=64), 0)
    alpha = m.gate(torch.zeros(1, 1, 64)).exp()[0, 0]                 # (H, D)
    assert torch.all(alpha[:, 1:] < alpha[:, :-1])            # each head: channels differ
    assert torch.all(alpha[1:] < alpha[:-1])                  # and heads differ
    assert alpha[0, 0] > 0.998 and alpha[-1, -1] < 0.25


@pytest.mark.parametrize("chunk", [16, 64])
def test_the_memory_bound_counts_the_fading_the_layer_keeps_for_backward(chunk):
    """engine/budget.py counts 5 bytes an entry of `score_maps` T×T maps: for KDA that must
    not exceed the C × C × d_k tensors (the fading and the faded keys, fp32) the layer's
    backward keeps, and must not fall far below them (the default, a map a head, would)."""
    from model.mechanisms import MECHANISMS
    config = kda.ModelConfig(vocab_size=8, n_head=2, n_embd=32, block_size=32, linear_chunk=chunk)
    m = kda.KimiDeltaAttention(config, 0)
    C, H, Dh = min(chunk, 32), 2, 16
    kept = {}

    def pack(t):                        # each storage once, however many views of it are saved
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        whole(m, torch.randn(1, 32, 32, requires_grad=True))
    fading = sum(n for n in kept.values() if n >= H * C * C * Dh * 4)
    counted = 5 * MECHANISMS["kda"].score_maps(config) * 32 ** 2
    assert fading / 2 <= counted <= fading


def test_the_chunked_forms_gradients_equal_the_recurrent_forms():
    def grads(form):
        tensors = [t.clone().requires_grad_() for t in rule_inputs()]
        out, state = form(*tensors)
        (out.sin().sum() + state.cos().sum()).backward()
        return [t.grad for t in tensors]
    want = grads(lambda *t: kda.recurrent(*t, delta.empty_state(t[0])))
    got = grads(lambda *t: kda.chunked(*t, delta.empty_state(t[0]), 4))
    for w, g in zip(want, got):
        assert torch.isfinite(g).all() and (g - w).abs().max() < 1e-9


def test_kimi_linears_pattern_of_three_kda_layers_to_one_latent_layer_decodes_as_it_passes():
    """Kimi Linear's 3:1 hybrid with latent attention: three layers keep a state, the
    fourth its latents, and decoding token by token gives the whole pass's logits."""
    from model.gpt import GPT
    torch.manual_seed(0)
    model = GPT(kda.ModelConfig(vocab_size=16, n_layer=4, n_head=2, n_embd=32, block_size=32,
                                linear_chunk=8, mechanism="kda,kda,kda,mla")).double().eval()
    idx = torch.randint(0, 16, (1, 20), generator=torch.Generator().manual_seed(6))
    cache = model.new_cache(20)
    with torch.no_grad():
        steps = [model(idx[:, :5], cache=cache).logits]
        steps += [model(idx[:, t:t + 1], cache=cache).logits for t in range(5, 20)]
        assert (torch.cat(steps, 1) - model(idx).logits).abs().max() < 1e-9
    assert sorted(cache.states) == [0, 1, 2] and cache.k[3] is not None


# -- the slips each check is for -----------------------------------------------------------

FADE = "        state = log_alpha[:, :, t, :, None].exp() * state\n"
WRITE = "        state = state + k_t.unsqueeze(-1) * (b_t * (v_t - held)).unsqueeze(-2)\n"
A_LINE = "    A = (beta.unsqueeze(-1) * with_k).tril(-1)"
CARRY = "    return out, Gamma[:, :, -1, :, None] * state + (last * k).transpose(-2, -1) @ new\n"
SOURCE = (ROOT / "model" / "kda.py").read_text(encoding="utf-8")
STEP = SOURCE[SOURCE.index(FADE):SOURCE.index(WRITE) + len(WRITE)]     # fade, read, write
DECAY = "        return -rate * F.softplus(f.view(B, T, self.n_head, self.head_dim))\n"
# (what the slip is, the text as written, the text with the slip, the check that catches it)
PLANTED = [
    ("the decay applied after the delta update, not before", STEP,
     STEP.replace(FADE, "") + FADE, rule_error),
    ("a scalar decay per head, not one per channel",
     "log_alpha[:, :, t, :, None].exp()", "log_alpha[:, :, t, :1, None].exp()", rule_error),
    ("chunk: a scalar decay per head, not one per channel", "    gamma = log_alpha.cumsum(-2)",
     "    gamma = log_alpha[..., :1].cumsum(-2)", recurrent_error),
    ("the decay from one number per head (the channels' mean)", DECAY,
     DECAY.replace("self.head_dim))", "self.head_dim)).mean(-1, keepdim=True)"), layer_error),
    ("the decay on the value's channels, not the key's",
     "log_alpha[:, :, t, :, None].exp()", "log_alpha[:, :, t, None, :].exp()", rule_error),
    ("chunk: the state before the chunk faded on the value's channels", CARRY,
     CARRY.replace("Gamma[:, :, -1, :, None]", "Gamma[:, :, -1, None, :]"), recurrent_error),
    ("beta missing from the erase term", WRITE, WRITE.replace("(b_t * (v_t - held))",
                                                              "(b_t * v_t - held)"), rule_error),
    ("beta missing from the UT transform", A_LINE,
     "    A = with_k.tril(-1)", rule_error),
    ("chunk: the faded state before the chunk read unfaded in the erase",
     "W, U = T @ (Gamma * k), T @ v", "W, U = T @ k, T @ v", recurrent_error),
    ("chunk: the state handed on not faded", CARRY,
     CARRY.replace("Gamma[:, :, -1, :, None] * state", "state"), recurrent_error),
    ("chunk: the fading counted from one token late (off by one)",
     "    gamma = log_alpha.cumsum(-2)", "    gamma = log_alpha.cumsum(-2) - log_alpha",
     recurrent_error),
    ("chunk: a write left unfaded on its way to the next chunk", "(last * k).transpose",
     "k.transpose", recurrent_error),
    ("chunk: outputs read the writes of later tokens", ".tril().unsqueeze(-1)",
     ".unsqueeze(-1)", leak),
    ("exp(A) missing from the decay", "rate = self.decay_log_rate.exp()[:, None]",
     "rate = 1.0", layer_error),
    ("the output not RMS-normed", "normed = y * torch.rsqrt(", "normed = y + 0 * torch.rsqrt(",
     layer_error),
    ("the output gate missing", " * torch.sigmoid(at_least_fp32(gate)).transpose(1, 2)", "",
     layer_error),
]


@pytest.mark.parametrize("name,line,wrong,check", PLANTED, ids=[p[0] for p in PLANTED])
def test_each_planted_slip_is_caught_by_its_check(name, line, wrong, check, monkeypatch):
    assert check() < EXACT                                    # the module as written passes
    caught = check(planted("kda", line, wrong, monkeypatch))
    print(f"{name}: {caught:.3g}")
    assert not caught < 1e-6, f"{name}: the check moved only {caught}"   # NaN counts as caught
