"""Multi-head latent attention (model/latent_attention.py; DeepSeek-V2, arXiv:2405.04434):
the layer against a float64 reference of the paper's eqs. 9-19, decoding from the cached
latent against the whole pass, causality, the cache's size per token, and, planted into a
copy of the module (or a subclass, for the cache's layout), the bugs each check is for."""
import numpy as np
import pytest
import torch

import model.latent_attention as latent
import reference
from mechanism_checks import (B, HEADS, T, TOLERANCE, WIDTH, causality_leak, config, decode_error,
                              decoded, inputs, layer, matrix, planted, whole)
from model.attention import MultiHeadAttention
from model.attention import Mask

# Tiny models spend their time in dispatch: a second thread only adds waiting for it.
pytestmark = pytest.mark.usefixtures("one_thread")

# A latent of 6 numbers and a rotary key of 4 a token, against MHA's 2·H·d_h = 32.
D, RANK, ROPE = WIDTH // HEADS, 6, 4
SIZES = {"mla_kv_rank": RANK, "mla_rope_dim": ROPE}


def reference_error(module=latent, cls=None) -> float:
    m = layer(cls or module.LatentAttention, **SIZES)
    x = inputs()
    y = whole(m, x).detach().numpy()
    W = {"q": matrix(m.w_q), "dkv": matrix(m.w_dkv), "ukv": matrix(m.w_ukv), "kr": matrix(m.w_kr),
         "o": matrix(m.w_o)}
    theta = config().rope_theta
    ref = np.stack([reference.latent_attention(x[b].numpy(), W, HEADS, D, ROPE, theta)
                    for b in range(B)])
    return float(np.abs(y - ref).max())


def decoding_error(module=latent, cls=None) -> float:
    """Decoding from the cache (a prefill, then one token, then chunks) against the whole pass."""
    return decode_error(layer(cls or module.LatentAttention, **SIZES), inputs())


def leak(module=latent, cls=None) -> float:
    return causality_leak(layer(cls or module.LatentAttention, **SIZES), inputs())


def cache_excess(module=latent, cls=None) -> float:
    """Bytes per token the cache holds beyond the latent and the one shared rotary key,
    (r + d_R) float64 numbers, measured on the tensors it keeps after decoding."""
    cache = decoded(layer(cls or module.LatentAttention, **SIZES), inputs())[1]
    assert cache.stored == cache.capacity == T               # every slot filled, none spare
    return float(cache.nbytes() / (B * T) - (RANK + ROPE) * 8)


def test_the_layer_matches_the_float64_reference():
    assert reference_error() < TOLERANCE


def test_decoding_from_the_latent_cache_equals_the_whole_pass():
    assert decoding_error() < TOLERANCE
    m = layer(latent.LatentAttention, **SIZES)
    assert decode_error(m, inputs(), pieces=(1,) * T) < TOLERANCE


def test_a_changed_later_token_leaves_earlier_outputs_as_they_were():
    assert leak() < TOLERANCE


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
    kept. The maths is right (decoding equals the whole pass); only the size shows it."""

    def cache_entry(self, x, start):
        return self.w_ukv(self.w_dkv(x)), self.rope(self.w_kr(x), start)

    def keys_values(self, state):
        B_, Tk, _ = state.c_kv.shape
        H = self.n_head
        k_c, v = state.c_kv.view(B_, Tk, 2 * H, self.head_dim).transpose(1, 2).split(H, dim=1)
        k_rope = state.k_rope.unsqueeze(1).expand(B_, H, Tk, self.rope_dim)
        return torch.cat([k_c, k_rope], dim=-1), v


class CachesRopePerHead(latent.LatentAttention):
    """The bug: the shared rotary key cached once per head (H copies of one key)."""

    def cache_entry(self, x, start):
        c_kv, k_rope = super().cache_entry(x, start)
        return c_kv, k_rope.repeat(1, 1, self.n_head)

    def keys_values(self, state):
        one_key = state.k_rope[..., :self.rope_dim]
        return super().keys_values(latent.LatentState(state.c_kv, one_key))


@pytest.mark.parametrize("cls", [CachesKeysAndValues, CachesRopePerHead],
                         ids=["latent cached after up-projection", "rotary key cached per head"])
def test_a_cache_that_keeps_too_much_is_caught_by_its_size_alone(cls):
    assert decoding_error(cls=cls) < TOLERANCE and reference_error(cls=cls) < TOLERANCE
    assert cache_excess(cls=cls) > 0
    assert cache_excess() == 0


ROPE_READ = "        k_rope = state.k_rope.unsqueeze(1)"
ROPE_MADE = "        return self.w_dkv(x), self.rope(self.w_kr(x), start)\n"
# (what the bug is, the text as written, the text with the bug, the check that catches it)
PLANTED = [
    ("the shared key rotated again when read from the cache", ROPE_READ,
     "        k_rope = self.rope(state.k_rope, 0).unsqueeze(1)", reference_error),
    ("the shared key never rotated", ROPE_MADE,
     "        return self.w_dkv(x), self.w_kr(x)\n", reference_error),
    ("a new key rotated as if at position 0 (decoding only)", ROPE_MADE,
     "        return self.w_dkv(x), self.rope(self.w_kr(x), 0)\n", decoding_error),
    ("the queries' rotary part not rotated", "torch.cat([q_c, self.rope(q_r, mask.q_start)], dim=-1)",
     "torch.cat([q_c, q_r], dim=-1)", reference_error),
    ("no causal mask", "        y, weights = backend(q, k, v, mask, dropout_p, need_weights)",
     "        y, weights = backend(q, k, v, Mask.over(0, T, k.shape[2], causal=False), dropout_p, need_weights)",
     leak),
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
