"""The one capture API (attnlab/capture.py): every cached activation checked against the
model's own computation done by hand, and the attention pattern of every variant against
the article's formula recomputed in float64 NumPy from the captured q, k and v."""
import math

import numpy as np
import pytest
import torch

from attnlab.capture import attention, attention_maps, names, run_with_cache
from conftest import small_model as model_for
from model import REGISTRIES




TOKENS = torch.randint(0, 30, (2, 12), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("attention_backend", sorted(REGISTRIES["attention"]))
@pytest.mark.parametrize("position", ["rope", "alibi", "learned"])
def test_the_last_residual_through_the_final_norm_and_head_is_the_logits(attention_backend, position):
    model = model_for(attention=attention_backend, position=position, n_kv_head=2)
    logits, cache = run_with_cache(model, TOKENS)
    assert set(cache) == set(names(model))
    with torch.no_grad():
        by_hand = model.lm_head(model.norm_f(cache["blocks.1.resid_post"]))
        torch.testing.assert_close(by_hand, logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(model(TOKENS).logits, logits, atol=1e-5, rtol=0)
    for layer in range(2):                       # the residual stream adds up, sublayer by sublayer
        p = f"blocks.{layer}."
        torch.testing.assert_close(cache[p + "resid_pre"] + cache[p + "attn_out"] + cache[p + "mlp_out"],
                                   cache[p + "resid_post"], atol=1e-6, rtol=0)
    torch.testing.assert_close(cache["blocks.0.resid_post"], cache["blocks.1.resid_pre"])
    w_o = model.blocks[1].attn.w_o
    with torch.no_grad():                        # the heads' outputs through W_O: the sublayer's
        torch.testing.assert_close(w_o(cache["blocks.1.z"].flatten(2)), cache["blocks.1.attn_out"])


# -- the pattern of every variant, from the formula --------------------------------------

def numpy_alibi(n_head: int, T: int) -> np.ndarray:
    """ALiBi's bias (arXiv:2108.12409) for a power-of-two head count: head h subtracts
    2^(-8(h+1)/H) times the distance to the key."""
    slopes = 2.0 ** (-8.0 * np.arange(1, n_head + 1) / n_head)
    distance = np.arange(T)[:, None] - np.arange(T)[None, :]
    return -slopes[:, None, None] * distance[None]


def numpy_visible(T: int, causal: bool, window: int, n_global: int, padding) -> np.ndarray:
    """(B, 1, T, T): a key is visible when it is not ahead (a decoder), inside the window
    or one of the first n_global, and not padding."""
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    ok = np.ones((T, T), bool)
    if causal:
        ok &= j <= i
    if window:
        ok &= ((i - j) < window) | (j < n_global)
    return ok[None, None] & ~padding[:, None, None, :]


def numpy_pattern(q, k, bias, visible) -> np.ndarray:
    """softmax(q·kᵀ/√d_k + bias, hidden keys at -inf), row by row, in float64."""
    scores = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1]) + bias
    scores = np.where(visible, scores, -np.inf)
    scores -= scores.max(-1, keepdims=True)
    e = np.exp(scores)
    return e / e.sum(-1, keepdims=True)


ENCODER = {"causal": False, "block": "postnorm", "position": "learned", "n_token_types": 2,
           "bias": True, "readout": "mlm"}
# Every variant that changes what q, k, v or the mask are, each from its registry: the
# captured q, k and v must be what the softmax and the weighted sum used.
VARIANTS = (
    [(f"attention={a}", {"attention": a}, False) for a in sorted(REGISTRIES["attention"])]
    + [(f"position={p}", {"position": p}, False) for p in sorted(REGISTRIES["position"])]
    + [(f"rope_scaling={s}", {"position": "rope", "rope_scaling": s, "rope_factor": 2.0,
                              "rope_original_context": 8}, False)
       for s in sorted(REGISTRIES["rope_scaling"])]
    + [("qk_norm", {"qk_norm": True}, False), ("value_embeds", {"value_embeds": True}, False),
       ("gqa", {"n_kv_head": 2}, False), ("mqa", {"n_kv_head": 1}, False),
       ("window+global", {"sliding_window": 4, "n_global": 1}, False),
       ("window+global banded", {"attention": "banded", "sliding_window": 4, "n_global": 2}, False),
       ("window alibi", {"position": "alibi", "sliding_window": 5}, False),
       ("encoder", ENCODER, False), ("encoder padded", ENCODER, True)]
    + [(f"encoder position={p}", {**ENCODER, "position": p}, False)
       for p in sorted(REGISTRIES["position"])
       if not REGISTRIES["position"][p].biases_scores and p != ENCODER["position"]])


@pytest.mark.parametrize("overrides,padded", [v[1:] for v in VARIANTS], ids=[v[0] for v in VARIANTS])
def test_the_captured_pattern_is_the_formula_on_the_captured_q_k_and_v(overrides, padded):
    from model.positions import POSITION_ENCODINGS
    model = model_for(vocab_size=32, **overrides)
    c = model.config
    ids = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(1))
    padding = np.zeros((2, 12), bool)
    inputs = {}
    if padded:                                   # the second text is 9 tokens and 3 of filler
        padding[1, 9:] = True
        inputs["attention_mask"] = torch.tensor(~padding, dtype=torch.long)
    _, patterns = run_with_cache(model, ids, only=[f"blocks.{l}.pattern" for l in range(c.n_layer)],
                                 **inputs)
    # Without a pattern asked for, the model runs its own backend: z is that backend's.
    _, own = run_with_cache(model, ids, only=[f"blocks.{l}.{n}" for l in range(c.n_layer)
                                               for n in ("q", "k", "v", "z")], **inputs)
    T, group = ids.shape[1], c.n_head // c.kv_heads
    bias = numpy_alibi(c.n_head, T) if POSITION_ENCODINGS[c.position].biases_scores else 0.0
    visible = numpy_visible(T, c.causal, c.sliding_window, c.n_global, padding)
    for layer in range(c.n_layer):
        p = f"blocks.{layer}."
        q = own[p + "q"].double().numpy()                                   # (B, H, T, D)
        k = np.repeat(own[p + "k"].double().numpy(), group, axis=1)         # each kv head serves
        v = np.repeat(own[p + "v"].double().numpy(), group, axis=1)         # `group` query heads
        pattern = patterns[p + "pattern"].double().numpy()
        np.testing.assert_allclose(pattern, numpy_pattern(q, k, bias, visible), atol=1e-5, rtol=0)
        z = own[p + "z"].double().numpy()                                    # (B, T, H, D)
        np.testing.assert_allclose(np.swapaxes(pattern @ v, 1, 2), z, atol=1e-5, rtol=0)


def test_attention_and_attention_maps_are_the_cached_patterns():
    from data.tokenizer import CharTokenizer
    tok = CharTokenizer("abcdefgh ")
    model = model_for(vocab_size=tok.vocab_size)
    ids = torch.tensor([tok.encode("abc defg")])
    _, cache = run_with_cache(model, ids)
    logits, maps = attention(model, ids)
    tokens, per_text = attention_maps(model, tok, "abc defg")
    assert tokens == list("abc defg") and len(maps) == len(per_text) == 2
    for layer in range(2):
        assert torch.equal(maps[layer], cache[f"blocks.{layer}.pattern"])
        assert torch.equal(per_text[layer], cache[f"blocks.{layer}.pattern"][0])
    torch.testing.assert_close(logits, model(ids).logits, atol=1e-5, rtol=0)


def test_an_unknown_name_is_refused_and_no_hook_is_left():
    from common.errors import AttnlabError
    model = model_for()
    with pytest.raises(AttnlabError, match="no activation named 'blocks.9.q'"):
        run_with_cache(model, TOKENS, only=["blocks.9.q"])
    run_with_cache(model, TOKENS)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
