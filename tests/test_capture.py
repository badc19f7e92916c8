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


# -- what the model-card pieces add, each from its paper's formula in float64 ----------

def layer_inputs(model, modules):
    """Run the model once over TOKENS and return what each module of `modules` was handed
    (its first argument), in float64 NumPy: the test's own hooks, apart from capture's."""
    got, handles = {}, []
    for name, module in modules.items():
        handles.append(module.register_forward_pre_hook(
            lambda m, args, name=name: got.__setitem__(name, args[0].detach().double().numpy())))
    try:
        with torch.no_grad():
            model(TOKENS)
    finally:
        for h in handles:
            h.remove()
    return got


def numpy_softmax_rows(scores) -> np.ndarray:
    scores = scores - scores.max(-1, keepdims=True)
    e = np.exp(scores)
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("window", [0, 5])
def test_the_sinks_share_is_its_logit_against_the_rows_scores(window):
    """gpt-oss's sink: exp(s_h) / (exp(s_h) + Σ_visible exp(q·k/√d_k)), from the captured
    q and k and the layer's own logit, in float64."""
    model = model_for(mechanism="sinks", n_kv_head=2, sliding_window=window)
    with torch.no_grad():
        for layer, block in enumerate(model.blocks):       # sinks that matter, one a head
            block.attn.sinks.copy_(torch.tensor([2.0, -1.0, 0.5, 0.0]) + layer)
    _, cache = run_with_cache(model, TOKENS)
    T, group = TOKENS.shape[1], 2
    visible = numpy_visible(T, True, window, 0, np.zeros((2, T), bool))
    for layer, block in enumerate(model.blocks):
        p = f"blocks.{layer}."
        q = cache[p + "q"].double().numpy()
        k = np.repeat(cache[p + "k"].double().numpy(), group, axis=1)
        scores = np.where(visible, q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1]), -np.inf)
        sink = block.attn.sinks.detach().double().numpy()[None, :, None]       # (1, H, 1)
        share = np.exp(sink) / (np.exp(sink) + np.exp(scores).sum(-1))
        np.testing.assert_allclose(cache[p + "sink"].double().numpy(), share, atol=1e-5, rtol=0)
        assert cache[p + "sink"].shape == (2, 4, T)


def test_the_gates_openness_is_the_mean_sigmoid_of_each_heads_channels():
    """Qwen3-Next's gate: σ(x·W_G + b) over each head's d_k channels of the layer input x,
    averaged per head, in float64."""
    model = model_for(mechanism="gated", bias=True)
    _, cache = run_with_cache(model, TOKENS)
    x = layer_inputs(model, {l: b.attn for l, b in enumerate(model.blocks)})
    for layer, block in enumerate(model.blocks):
        w, b = (t.detach().double().numpy() for t in (block.attn.w_gate.weight, block.attn.w_gate.bias))
        gate = 1 / (1 + np.exp(-(x[layer] @ w.T + b)))                        # (B, T, C)
        B, T, C = gate.shape
        expected = gate.reshape(B, T, 4, C // 4).mean(-1)                      # (B, T, H)
        np.testing.assert_allclose(cache[f"blocks.{layer}.gate"].double().numpy(), expected,
                                   atol=1e-6, rtol=0)
    # Asking for other activations only (the heads tool asks for the patterns) leaves the
    # gated layer's call as it is: the same patterns, the same logits.
    logits, only = run_with_cache(model, TOKENS, only=["blocks.0.pattern"])
    assert set(only) == {"blocks.0.pattern"}
    torch.testing.assert_close(only["blocks.0.pattern"], cache["blocks.0.pattern"], atol=0, rtol=0)


def numpy_layer_norm(x, weight, bias, eps) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight + (0.0 if bias is None else bias)


@pytest.mark.parametrize("window", [0, 7])
def test_the_indexers_chosen_keys_are_the_top_k_of_its_scores(window):
    """DeepSeek-V3.2's lightning indexer, I_{t,s} = Σ_j w_{t,j}·ReLU(q^I_{t,j}·k^I_s/√d_I)
    with w scaled by 1/√H_I and k^I through its LayerNorm, recomputed in float64 from the
    layer input; the chosen keys are each row's k highest among the visible; the layer's own
    weights fall on those keys only, and full_pattern is the softmax over every visible key.
    Ties, which ReLU's exact zeros make common, go to the newest key."""
    top_k = 4
    model = model_for(mechanism="sparse", position="none", sparse_top_k=top_k, indexer_heads=2,
                      sliding_window=window)
    _, cache = run_with_cache(model, TOKENS)
    x = layer_inputs(model, {l: b.attn for l, b in enumerate(model.blocks)})
    T = TOKENS.shape[1]
    visible = numpy_visible(T, True, window, 0, np.zeros((2, T), bool))[:, 0]     # (1, T, T)
    for layer, block in enumerate(model.blocks):
        a, p = block.attn, f"blocks.{layer}."
        d = {n: t.detach().double().numpy() for n, t in a.named_parameters()}
        B, H_I, d_I = x[layer].shape[0], a.indexer_heads, a.indexer_dim
        q_i = (x[layer] @ d["w_iq.weight"].T).reshape(B, T, H_I, d_I)
        k_i = numpy_layer_norm(x[layer] @ d["w_ik.weight"].T, d["ik_norm.weight"],
                               d.get("ik_norm.bias"), a.ik_norm.eps)             # (B, T, d_I)
        w = (x[layer] @ d["w_iw.weight"].T) / math.sqrt(H_I)                       # (B, T, H_I)
        dots = np.einsum("btjd,bsd->btjs", q_i, k_i) / math.sqrt(d_I)
        index = np.einsum("btj,btjs->bts", w, np.maximum(dots, 0))
        index = np.where(visible, index, -np.inf)
        np.testing.assert_allclose(cache[p + "index"].double().numpy(), index, atol=1e-5, rtol=0)
        expected = np.zeros(index.shape, bool)
        for b, t in np.ndindex(*index.shape[:2]):     # highest first; ties (ReLU's zeros) newest
            ranked = sorted(range(T), key=lambda s: (index[b, t, s], s), reverse=True)[:top_k]
            expected[b, t, ranked] = True
        expected &= visible
        assert np.array_equal(cache[p + "chosen"].numpy(), expected)
        assert (expected.sum(-1) == np.minimum(visible.sum(-1), top_k)).all()
        q = cache[p + "q"].double().numpy()
        k = cache[p + "k"].double().numpy()
        full = numpy_pattern(q, k, 0.0, visible[:, None])
        np.testing.assert_allclose(cache[p + "full_pattern"].double().numpy(), full, atol=1e-5, rtol=0)
        sparse = numpy_pattern(q, k, 0.0, (visible & expected)[:, None])
        np.testing.assert_allclose(cache[p + "pattern"].double().numpy(), sparse, atol=1e-5, rtol=0)


@pytest.mark.parametrize("router", ["sigmoid", "softmax_topk"])
def test_each_tokens_experts_are_the_routers_top_k_recomputed(router):
    """DeepSeek-V3's gate (sigmoid affinities; the balancing bias picks, the affinities
    weigh, normalised over the k) and gpt-oss's (the k largest logits, a softmax over them),
    from the MLP's input and the router's weights in float64; heaviest first."""
    model = model_for(mlp="moe", moe_experts=6, moe_top_k=2, moe_shared=1, moe_router=router,
                      moe_bias_rate=0.001 if router == "sigmoid" else 0.0)
    with torch.no_grad():
        for block in model.blocks:            # a bias that changes which experts win
            block.mlp.balance_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1, -0.4, 0.2]))
    _, cache = run_with_cache(model, TOKENS)
    u = layer_inputs(model, {l: b.mlp for l, b in enumerate(model.blocks)})
    for layer, block in enumerate(model.blocks):
        r = block.mlp.router
        logits = u[layer] @ r.weight.detach().double().numpy().T
        if r.bias is not None:
            logits = logits + r.bias.detach().double().numpy()
        if router == "sigmoid":
            s = 1 / (1 + np.exp(-logits))
            pick = np.argsort(-(s + block.mlp.balance_bias.double().numpy()), axis=-1)[..., :2]
            weights = np.take_along_axis(s, pick, -1)
            weights = weights / weights.sum(-1, keepdims=True)
        else:
            pick = np.argsort(-logits, axis=-1)[..., :2]
            weights = numpy_softmax_rows(np.take_along_axis(logits, pick, -1))
        order = np.argsort(-weights, axis=-1)
        experts = cache[f"blocks.{layer}.experts"].numpy()
        assert np.array_equal(experts, np.take_along_axis(pick, order, -1))
        np.testing.assert_allclose(cache[f"blocks.{layer}.expert_weights"].double().numpy(),
                                   np.take_along_axis(weights, order, -1), atol=1e-6, rtol=0)


def test_a_piece_is_read_only_where_a_layer_has_it_and_no_wrapper_is_left():
    """A hybrid of every piece names each layer's own; after capture, the modules hold no
    hook and no wrapped method, and the logits are the model's."""
    model = model_for(mechanism="sinks,gated,sparse", n_layer=3, mlp="moe", moe_experts=4,
                      moe_top_k=2, sparse_top_k=4)
    logits, cache = run_with_cache(model, TOKENS)
    assert [sorted(n.split(".")[2] for n in cache if n.startswith(f"blocks.{l}.") and
                   n.split(".")[2] in ("sink", "gate", "index", "chosen", "full_pattern"))
            for l in range(3)] == [["sink"], ["gate"], ["chosen", "full_pattern", "index"]]
    assert all(f"blocks.{l}.experts" in cache for l in range(3))
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert not any({"select", "masked", "route"} & set(vars(m)) for m in model.modules())
    torch.testing.assert_close(logits, model(TOKENS).logits, atol=1e-6, rtol=0)
    plain = model_for()
    assert not any(n.split(".")[-1] in ("sink", "gate", "chosen", "experts") for n in names(plain))


def test_latent_sparse_attention_shows_its_chosen_keys_against_its_full_attention():
    """DeepSeek-V3.2's indexer on latent attention (mla_sparse): the layer's weights fall on
    the chosen keys only, and there they are full attention's weights renormalised over the
    chosen: a full_pattern scaled otherwise than the layer (not by √(d_h + d_R)) fails."""
    model = model_for(mechanism="mla_sparse", sparse_top_k=3, indexer_heads=2)
    _, cache = run_with_cache(model, TOKENS)
    for layer in range(len(model.blocks)):
        p = f"blocks.{layer}."
        chosen, full, pattern = (cache[p + n].double() for n in ("chosen", "full_pattern", "pattern"))
        assert chosen.sum(-1).max() <= 3 and (pattern * ~chosen.bool()[:, None]).abs().max() == 0
        torch.testing.assert_close(full.sum(-1), torch.ones_like(full.sum(-1)), atol=1e-6, rtol=0)
        kept = full * chosen[:, None]
        torch.testing.assert_close(kept / kept.sum(-1, keepdim=True), pattern, atol=1e-5, rtol=0)
