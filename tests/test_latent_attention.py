"""Multi-head latent attention (model/latent_attention.py; DeepSeek-V2, arXiv:2405.04434):
the layer against a float64 reference of the paper's eqs. 9-19 in both of its forms (keys
and values rebuilt from the latent, and W_UK, W_UV absorbed into the query and the output),
decoding from the cached latent against the whole pass, a decoding step that never
rebuilds the cache, causality, the cache's size per token, and, planted into a copy of the
module (or a subclass, for the cache's layout), the bugs each check is for."""
import numpy as np
import pytest
import torch

import model.latent_attention as latent
import reference
from mechanism_checks import (B, HEADS, T, TOLERANCE, WIDTH, causality_leak, config, decode_error,
                              decoded, inputs, layer, matrix, planted, whole)
from model.attention import Mask, MultiHeadAttention
from model.cache import KVCache
from model.positions import POSITION_ENCODINGS

# Tiny models spend their time in dispatch: a second thread only adds waiting for it.
pytestmark = pytest.mark.usefixtures("one_thread")

# A latent of 6 numbers and a rotary key of 4 a token, against MHA's 2·H·d_h = 32.
D, RANK, ROPE = WIDTH // HEADS, 6, 4
SIZES = {"mla_kv_rank": RANK, "mla_rope_dim": ROPE}
# Each form forced for every call of a layer; None leaves the layer's own choice (`absorbs`).
FORMS = {"absorbed": True, "up-projected": False}


def built(module=latent, cls=None, form=None, **kw):
    m = layer(cls or module.LatentAttention, **{**SIZES, **kw})
    if form is not None:
        m.absorbs = lambda q_len, k_len: FORMS[form]
    return m


def reference_error(module=latent, cls=None, form=None) -> float:
    m = built(module, cls, form)
    x = inputs()
    y = whole(m, x).detach().numpy()
    W = {"q": matrix(m.w_q), "dkv": matrix(m.w_dkv), "ukv": matrix(m.w_ukv), "kr": matrix(m.w_kr),
         "o": matrix(m.w_o), "kv_norm": m.kv_norm.weight.detach().numpy()}
    theta, eps = config().rope_theta, config().norm_eps
    ref = np.stack([reference.latent_attention(x[b].numpy(), W, HEADS, D, ROPE, theta, eps)
                    for b in range(B)])
    return float(np.abs(y - ref).max())


def decoding_error(module=latent, cls=None, form=None) -> float:
    """Decoding from the cache (a prefill, then one token, then chunks) against the whole pass."""
    return decode_error(built(module, cls, form), inputs())


def leak(module=latent, cls=None, form=None) -> float:
    return causality_leak(built(module, cls, form), inputs())


def cache_excess(module=latent, cls=None) -> float:
    """Bytes per token the cache holds beyond the latent and the one shared rotary key,
    (r + d_R) float64 numbers, measured on the tensors it keeps after decoding."""
    cache = decoded(layer(cls or module.LatentAttention, **SIZES), inputs())[1]
    assert cache.stored == cache.capacity == T               # every slot filled, none spare
    return float(cache.nbytes() / (B * T) - (RANK + ROPE) * 8)


@pytest.mark.parametrize("form", [*FORMS, None])
def test_the_layer_matches_the_float64_reference(form):
    assert reference_error(form=form) < TOLERANCE


@pytest.mark.parametrize("form", [*FORMS, None])
def test_decoding_from_the_latent_cache_equals_the_whole_pass(form):
    assert decoding_error(form=form) < TOLERANCE
    assert decode_error(built(form=form), inputs(), pieces=(1,) * T) < TOLERANCE


@pytest.mark.parametrize("form", [*FORMS, None])
def test_a_changed_later_token_leaves_earlier_outputs_as_they_were(form):
    assert leak(form=form) < TOLERANCE


def both_forms(m, x, pieces, need_weights=False):
    """The layer's outputs (and weights) over x in pieces through a cache, each piece
    computed in both forms from the same cache: (absorbed, up-projected) lists."""
    positions = POSITION_ENCODINGS["rope"](config())
    cache, start, outs = KVCache(1, x.shape[1]), 0, {True: [], False: []}
    for n in pieces:
        k_pos, k_first = cache.begin(n, x.device)
        mask = Mask(q_start=cache.length, q_len=n, k_pos=k_pos, k_first=k_first)
        for form in (True, False):
            m.absorbs = lambda q_len, k_len: form
            # The second write of a piece overwrites the first with the same rows.
            outs[form].append(m(x[:, start:start + n], positions, mask, cache, need_weights))
        cache.end(n)
        start += n
    return outs[True], outs[False]


@pytest.mark.parametrize("bias", [False, True], ids=["no bias", "biases"])
@pytest.mark.parametrize("sizes", [SIZES, {}], ids=["r < d_h", "the default r = 4·d_h"])
def test_the_absorbed_form_equals_the_up_projected_one(bias, sizes):
    """DeepSeek-V2 (section 2.1.2): (q_C·W_UKᵀ)·c_kvᵀ = q_C·k_Cᵀ and (w·c_kv)·W_UV = w·v, so
    folding the up-projections into the query and the output changes no number beyond
    float64's rounding, on a prefill, single tokens and a chunk after the cache (masked),
    and W_UK's bias, which the absorbed form leaves out, moves nothing either."""
    m = layer(latent.LatentAttention, bias=bias, **sizes)
    absorbed, up = both_forms(m, inputs(), (4, 1, 1, 3, 1, 1), need_weights=True)
    for (y_a, w_a), (y_u, w_u) in zip(absorbed, up):
        assert (y_a - y_u).abs().max() < 1e-12
        assert (w_a - w_u).abs().max() < 1e-12


def test_a_decoding_step_reads_the_latent_and_never_rebuilds_the_cache():
    """A step of one token (or a few) attends through W_UK and W_UV folded into the query
    and the output: the up-projection is never applied to the cached latents. A whole
    sequence, where rebuilding T keys costs less than T² latent-wide scores, is rebuilt."""
    m = layer(latent.LatentAttention)                    # the defaults: r = 4·d_h > d_h
    rebuilt = []
    m.w_ukv.register_forward_hook(lambda mod, args, out: rebuilt.append(args[0].shape[1]))
    x = inputs()
    decoded(m, x, pieces=(4,) + (1,) * (T - 4))             # a prefill, then single tokens
    assert rebuilt == [4]
    assert m.absorbs(1, 16384) and m.absorbs(4, 64) and not m.absorbs(64, 64)


def test_the_cache_holds_the_latent_and_one_rotary_key_per_token():
    assert cache_excess() == 0
    # Against multi-head attention at the same width: 2·H·d_h numbers a token.
    mha_per_token = 2 * HEADS * D * 8
    assert (RANK + ROPE) * 8 < mha_per_token
    # The defaults: r = 4·d_h, d_R = d_h/2 (DeepSeek-V2's ratios), 4.5·d_h numbers a token
    # whatever the number of heads (MHA's 2·H·d_h: 64·d_h for V2's 32 heads of this sketch).
    assert decoded(layer(latent.LatentAttention), inputs())[1].nbytes() == B * T * (4 * D + D // 2) * 8


def test_the_weights_are_a_causal_softmax():
    m = layer(latent.LatentAttention, **SIZES)
    _, w = m(inputs(), None, Mask.over(0, T, T), need_weights=True)
    assert w.shape == (B, HEADS, T, T) and (w.triu(1) == 0).all()
    assert torch.allclose(w.sum(-1), torch.ones(B, HEADS, T, dtype=torch.float64))


def test_value_embeddings_are_refused_in_one_line():
    with pytest.raises(ValueError, match="value_embeds=false"):
        layer(latent.LatentAttention)(inputs(), None, Mask.over(0, T, T),
                                      value_embed=torch.zeros(B, T, WIDTH, dtype=torch.float64))


class CachesKeysAndValues(latent.LatentAttention):
    """The bug: the latent up-projected before it is cached, so every head's k_C and v are
    kept. The maths is right (decoding equals the whole pass); only the size shows it.
    (Such a cache has no latent to absorb into, so it always rebuilds.)"""

    def absorbs(self, q_len, k_len):
        return False

    def cache_entry(self, x, start, shared=None):
        return torch.cat([self.w_ukv(self.kv_norm(self.w_dkv(x))), self.rope(self.w_kr(x), start)], -1)

    def keys_values(self, state):
        B_, Tk, _ = state.latent.shape
        H = self.n_head
        kv, k_rope = state.latent.split([2 * H * self.head_dim, self.rope_dim], dim=-1)
        k_c, v = kv.reshape(B_, Tk, 2 * H, self.head_dim).transpose(1, 2).split(H, dim=1)
        k_rope = k_rope.unsqueeze(1).expand(B_, H, Tk, self.rope_dim)
        return torch.cat([k_c, k_rope], dim=-1), v


class CachesRopePerHead(latent.LatentAttention):
    """The bug: the shared rotary key cached once per head (H copies of one key)."""

    def absorbs(self, q_len, k_len):
        return False

    def cache_entry(self, x, start, shared=None):
        entry = super().cache_entry(x, start)
        return torch.cat([entry, entry[..., self.rank:].repeat(1, 1, self.n_head - 1)], -1)

    def keys_values(self, state):
        one_key = state.latent[..., :self.rank + self.rope_dim]
        return super().keys_values(latent.LatentState(one_key, self.rank))


@pytest.mark.parametrize("cls", [CachesKeysAndValues, CachesRopePerHead],
                         ids=["latent cached after up-projection", "rotary key cached per head"])
def test_a_cache_that_keeps_too_much_is_caught_by_its_size_alone(cls):
    assert decoding_error(cls=cls) < TOLERANCE and reference_error(cls=cls) < TOLERANCE
    assert cache_excess(cls=cls) > 0
    assert cache_excess() == 0


def forms_error(module=latent) -> float:
    """Largest difference between the two forms, with biases, from the same cache."""
    m = layer(module.LatentAttention, bias=True, **SIZES)
    absorbed, up = both_forms(m, inputs(), (4, 1, 1, 3, 1, 1))
    return max((a[0] - u[0]).abs().max().item() for a, u in zip(absorbed, up))


def weights_forms_error(module=latent) -> float:
    """forms_error with the weights asked for: the absorbed form's two products."""
    m = layer(module.LatentAttention, bias=True, **SIZES)
    absorbed, up = both_forms(m, inputs(), (4, 1, 1, 3, 1, 1), need_weights=True)
    return max(max((a[0] - u[0]).abs().max().item(), (a[1] - u[1]).abs().max().item())
               for a, u in zip(absorbed, up))


def in_form(check, form):
    def run(module=latent):
        return check(module, form=form)
    return run


ROPE_READ = "        k_rope = state.k_rope.unsqueeze(1)"
ROPE_MADE = "self.rope(self.w_kr(x), start, shared)], dim=-1)\n"
NORMED = "latent = self.kv_norm(self.w_dkv(x))"
# (what the bug is, the text as written, the text with the bug, the check that catches it)
PLANTED = [
    ("the shared key rotated again when read from the cache", ROPE_READ,
     "        k_rope = self.rope(state.k_rope, 0).unsqueeze(1)", in_form(reference_error, "up-projected")),
    ("the shared key never rotated", ROPE_MADE,
     "self.w_kr(x)], dim=-1)\n", reference_error),
    ("a new key rotated as if at position 0 (decoding only)", ROPE_MADE,
     "self.rope(self.w_kr(x), 0, None)], dim=-1)\n", decoding_error),
    ("the latent not normalised", NORMED, "latent = self.w_dkv(x)", reference_error),
    ("the queries' rotary part not rotated", "q_r = self.rope(q_r, mask.q_start, mask.shared)", "q_r = q_r",
     reference_error),
    ("no causal mask", "        return backend(q, k, v, mask, dropout_p, need_weights)",
     "        return backend(q, k, v, Mask.over(0, q.shape[2], k.shape[2], causal=False), "
     "dropout_p, need_weights)", in_form(leak, "up-projected")),
    ("no causal mask in the absorbed form", "        if not mask.sees_everything:          #",
     "        if False:          #", in_form(leak, "absorbed")),
    ("no causal mask on the absorbed form's weights",
     "        scores = mask.hide(scores, float(\"-inf\"))",
     "        scores = scores", weights_forms_error),
    ("the rule's rows in the wrong order for the heads' queries",
     "mask.dense.repeat(*([1] * (mask.dense.dim() - 2)), H, 1)",
     "mask.dense.repeat_interleave(H, dim=-2)", forms_error),
    ("the absorbed scores without the rotary part", "torch.cat([q_c @ w_uk, q_r], dim=-1)",
     "torch.cat([q_c @ w_uk, 0 * q_r], dim=-1)", in_form(reference_error, "absorbed")),
    ("the absorbed scores not scaled", " / math.sqrt(D + self.rope_dim)\n", "\n",
     in_form(reference_error, "absorbed")),
    ("W_UV's bias left out of the absorbed output",
     "            out = out + (b_v if dropped is None else dropped.sum(-1, keepdim=True) * b_v)",
     "            out = out", forms_error),
    ("W_UV's bias left out of the absorbed output with its weights",
     "            out = out + (b_v if dropped is None else dropped.sum(-1, keepdim=True) * b_v)",
     "            out = out + (b_v if dropped is None else 0)", weights_forms_error),
    ("the absorbed form chosen for a whole sequence",
     "        return q_len * k_len * (r - D) + q_len * r * D < k_len * r * D",
     "        return True", lambda module=latent: float(module.LatentAttention(config(), 0).absorbs(T, T))),
]


@pytest.mark.parametrize("name,line,wrong,check", PLANTED, ids=[p[0] for p in PLANTED])
def test_each_planted_bug_is_caught_by_its_check(name, line, wrong, check, monkeypatch):
    assert check() < TOLERANCE                                # the module as written passes
    caught = check(planted("latent_attention", line, wrong, monkeypatch))
    print(f"{name}: {caught:.3g}")
    assert not caught < 1e-6, f"{name}: the check moved only {caught}"   # NaN counts as caught


@pytest.mark.parametrize("n_embd,n_head,rope", [(36, 2, 8), (30, 3, 4), (64, 2, 16), (32, 2, 8)])
def test_the_default_rotary_width_is_even_for_every_head_size(n_embd, n_head, rope):
    """head_dim // 2 gave 9 for a head of 18, and the model was refused naming
    mla_rope_dim, a field the learner never set."""
    from model import GPT, ModelConfig
    config = ModelConfig(vocab_size=16, n_layer=1, n_head=n_head, n_embd=n_embd, block_size=8,
                         mechanism="mla")
    assert latent.latent_sizes(config)[1] == rope
    GPT(config)


@pytest.mark.parametrize("cache_kind", ["growing", "static"])
def test_a_float64_gpt_decodes_from_the_latent_as_its_full_forward(cache_kind):
    """The whole model with latent attention in every block, decoding one token at a time
    from its own cache (the absorbed form in every step after the prompt), gives the full
    forward pass's logits to float64's rounding; no step rebuilds the cached latents."""
    from model import GPT, ModelConfig
    from model.cache import StaticKVCache
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=16, n_layer=2, n_head=2, n_embd=32, block_size=32,
                            mechanism="mla")).double().eval()
    idx = torch.randint(0, 16, (2, 20), generator=torch.Generator().manual_seed(5))
    rebuilt = []
    for block in model.blocks:
        block.attn.w_ukv.register_forward_hook(lambda mod, args, out: rebuilt.append(args[0].shape[1]))
    with torch.no_grad():
        full = model(idx).logits
        rebuilt.clear()
        cache = model.new_cache(20)
        pieces = [model(idx[:, :6], cache=cache).logits]
        if cache_kind == "static":
            static = StaticKVCache(model.config.n_layer, 20)
            static.load(cache)
            cache = static
        pieces += [model(idx[:, t:t + 1], cache=cache).logits for t in range(6, 20)]
    assert (torch.cat(pieces, dim=1) - full).abs().max() < 1e-12
    assert rebuilt == [6, 6]                                 # the prompt's, in each layer only


def test_keys_and_values_start_as_large_as_multi_head_attentions():
    """At the model's initialisation (weights of std 0.02), multi-head attention's key of a
    unit-RMS input has an RMS of 0.02·√C. A latent key is the input through two such
    matrices, 0.02·√r times smaller again, unless the latent is normalised first (as
    DeepSeek-V2 does); without the norm a small model learned no recall in the steps
    that taught multi-head attention (docs/benchmarks.md)."""
    from model import GPT, ModelConfig
    torch.manual_seed(0)
    C = 64
    attn = GPT(ModelConfig(vocab_size=16, n_layer=2, n_head=4, n_embd=C, block_size=32,
                           mechanism="mla")).blocks[0].attn
    x = torch.randn(4, 32, C, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        k, v = attn.keys_values(latent.LatentState(attn.cache_entry(x, 0), attn.rank))
    mha = 0.02 * C ** 0.5
    for t in (k[..., :attn.head_dim], v):
        rms = t.pow(2).mean().sqrt().item()
        assert mha / 2 < rms < 2 * mha, (rms, mha)
