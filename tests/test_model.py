"""The whole model (model/gpt.py): causality, loss at initialisation, learning, the
KV cache, and every registered variant."""
import itertools
import math

import pytest
import torch

from model import GPT, REGISTRIES, ModelConfig
from model.decode import decodes_with_rolling_cache
from model.attention import Mask


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=40, n_layer=2, n_head=4, n_embd=32, block_size=24)
    if kw.get("attention") == "banded" and not kw.get("sliding_window"):
        kw["sliding_window"] = 8                 # banded exists only for windows
    return ModelConfig(**{**base, **kw})


# flex compiles a kernel per shape (seconds each on a CPU): it is checked against the
# reference in test_attention.py and once end to end below, not in every matrix here.
BACKENDS = sorted(set(REGISTRIES["attention"]) - {"flex"})
BACKEND_X_POSITION = list(itertools.product(BACKENDS, sorted(REGISTRIES["position"])))


@pytest.mark.parametrize("attention,position", BACKEND_X_POSITION)
def test_every_backend_equals_eager_in_the_full_model(attention, position):
    torch.manual_seed(0)
    model = GPT(tiny(attention=attention, position=position))
    eager = GPT(tiny(attention="eager", position=position,
                     sliding_window=model.config.sliding_window))
    eager.load_state_dict(model.state_dict())
    x = torch.randint(0, 40, (3, 24))
    a, b = eager(x, x), model(x, x)
    assert torch.allclose(a.logits, b.logits, atol=1e-5)
    ga = torch.autograd.grad(a.loss, eager.wte.weight)[0]
    gb = torch.autograd.grad(b.loss, model.wte.weight)[0]
    assert torch.allclose(ga, gb, atol=1e-6)


def test_flex_model_matches_eager_and_decodes_with_a_cache():
    torch.manual_seed(0)
    kw = dict(position="alibi", sliding_window=6, n_global=2)
    flex, eager = GPT(tiny(attention="flex", **kw)).eval(), GPT(tiny(attention="eager", **kw)).eval()
    eager.load_state_dict(flex.state_dict())
    x = torch.randint(0, 40, (2, 24))
    with torch.no_grad():
        assert torch.allclose(flex(x).logits, eager(x).logits, atol=1e-5)
        cache = flex.new_cache(24)
        steps = [flex(x[:, :16], cache=cache).logits]
        steps += [flex(x[:, t:t + 1], cache=cache).logits for t in range(16, 24)]
    assert torch.allclose(torch.cat(steps, 1), eager(x).logits, atol=1e-5)


@pytest.mark.parametrize("attention,position", BACKEND_X_POSITION)
def test_changing_the_future_never_changes_the_past(attention, position):
    torch.manual_seed(0)
    model = GPT(tiny(attention=attention, position=position)).eval()
    x = torch.randint(0, 40, (2, 24))
    t = 10
    y = x.clone()
    y[:, t + 1:] = torch.randint(0, 40, (2, 24 - t - 1))
    a, b = model(x).logits, model(y).logits
    assert torch.equal(a[:, :t + 1], b[:, :t + 1])
    assert not torch.allclose(a[:, t + 1:], b[:, t + 1:])


def test_attention_weights_are_zero_above_the_diagonal_in_every_layer():
    model = GPT(tiny(attention="sdpa")).eval()      # weights come from eager on request
    out = model(torch.randint(0, 40, (1, 24)), return_attention=True)
    assert len(out.attentions) == 2
    upper = torch.triu(torch.ones(24, 24, dtype=torch.bool), 1)
    for w in out.attentions:
        assert w.shape == (1, 4, 24, 24)
        assert (w[..., upper] == 0).all()
        assert torch.allclose(w.sum(-1), torch.ones(1, 4, 24), atol=1e-5)


def test_loss_at_initialisation_is_about_ln_vocab():
    torch.manual_seed(0)
    model = GPT(tiny(vocab_size=500, n_embd=64))
    x = torch.randint(0, 500, (8, 24))
    y = torch.randint(0, 500, (8, 24))
    assert model(x, y).loss.item() == pytest.approx(math.log(500), abs=0.1)


@pytest.mark.usefixtures("one_thread")
def test_a_tiny_model_overfits_one_batch():
    torch.manual_seed(0)
    model = GPT(tiny())
    x = torch.randint(0, 40, (4, 24))
    y = torch.roll(x, -1, dims=1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(150):
        loss = model(x, y).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05


@pytest.mark.parametrize("attention,position", BACKEND_X_POSITION)
@pytest.mark.parametrize("n_kv_head,window", [(0, 0), (2, 0), (0, 5)])
def test_cached_decoding_equals_the_full_forward_pass(attention, position, n_kv_head, window):
    torch.manual_seed(0)
    model = GPT(tiny(attention=attention, position=position, n_kv_head=n_kv_head,
                     sliding_window=window)).eval()
    x = torch.randint(0, 40, (2, 24))
    full = model(x).logits
    cache = model.new_cache(24)
    pieces = [model(x[:, :7], cache=cache).logits, model(x[:, 7:12], cache=cache).logits]
    pieces += [model(x[:, t:t + 1], cache=cache).logits for t in range(12, 24)]
    assert cache.length == 24
    assert torch.allclose(torch.cat(pieces, 1), full, atol=1e-5)


def test_kv_cache_memory_shrinks_with_fewer_kv_heads():
    sizes = {}
    for n_kv in (4, 2, 1):
        model = GPT(tiny(n_kv_head=n_kv)).eval()
        cache = model.new_cache(24)
        model(torch.zeros(1, 24, dtype=torch.long), cache=cache)
        sizes[n_kv] = cache.nbytes()
    assert sizes[4] == 2 * sizes[2] == 4 * sizes[1]


@pytest.mark.parametrize("position", sorted(REGISTRIES["position"]))
def test_greedy_tokens_are_the_same_with_and_without_cache(position):
    torch.manual_seed(0)
    model = GPT(tiny(position=position, block_size=16)).eval()
    prompt = torch.randint(0, 40, (1, 5))
    # 30 new tokens run past block_size, through the cache's context shift.
    with_cache = torch.cat(list(model.generate(prompt, 30, temperature=0)), 1)
    no_cache = torch.cat(list(model.generate(prompt, 30, temperature=0, use_cache=False)), 1)
    first = 16 - 5        # up to the first shift the contexts are identical
    assert torch.equal(with_cache[:, :first], no_cache[:, :first])
    assert with_cache.shape == (1, 30)


def test_generation_within_the_context_matches_argmax_of_full_forward():
    torch.manual_seed(1)
    model = GPT(tiny()).eval()
    seq = torch.randint(0, 40, (1, 4))
    for token in model.generate(seq.clone(), 12, temperature=0):
        expected = model(seq).logits[:, -1].argmax(-1, keepdim=True)
        assert torch.equal(token, expected)
        seq = torch.cat([seq, token], 1)


@pytest.mark.parametrize("registry", ["norm", "mlp"])
def test_every_norm_and_mlp_variant_trains(registry):
    for name in REGISTRIES[registry]:
        torch.manual_seed(0)
        model = GPT(tiny(**{registry: name}))
        x = torch.randint(0, 40, (2, 24))
        loss = model(x, x).loss
        loss.backward()
        assert torch.isfinite(loss)
        assert all(p.grad is not None for p in model.parameters())


def test_mlp_activations_are_what_their_names_say():
    """Each activation against its formula in float64 NumPy: gelu is x·Φ(x) exactly (as
    torch and transformers name it), gelu_tanh GPT-2's tanh approximation of it; the two
    differ by up to about 5e-4, which the 1e-6 tolerance sees."""
    import math
    import numpy as np
    from model.layers import MLPS
    erf = np.vectorize(math.erf)
    formulas = {
        "gelu": lambda h: 0.5 * h * (1 + erf(h / math.sqrt(2))),
        "gelu_tanh": lambda h: 0.5 * h * (1 + np.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3))),
        "relu2": lambda h: np.maximum(h, 0) ** 2,
    }
    torch.manual_seed(0)
    x = torch.randn(2, 5, 32)
    for name, formula in formulas.items():
        mlp = MLPS[name](tiny())
        with torch.no_grad():
            hidden = mlp.fc(x).double().numpy()
            w, b = mlp.proj.weight.double().numpy(), mlp.proj.bias
            expected = formula(hidden) @ w.T + (0 if b is None else b.double().numpy())
            np.testing.assert_allclose(mlp(x).double().numpy(), expected, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_parameter_count_counts_tied_weights_once(tie, bias):
    model = GPT(tiny(tie_embeddings=tie, bias=bias))
    unique = {p.data_ptr(): p.numel() for p in model.parameters()}
    assert model.num_params() == sum(unique.values())
    assert (model.lm_head.weight is model.wte.weight) == tie
    assert model.flops_per_token() > 6 * model.num_params(non_embedding=True)
    # By hand: per block 4·C² attention + 8·C² MLP weights (+ 4 norm/bias vectors of C
    # with bias, 2 gains without), the final norm, and the output layer only if untied.
    c = model.config
    C, L, V, T = c.n_embd, c.n_layer, c.vocab_size, c.block_size
    vectors = (4 * C + 3 * C + C + 4 * C + C) if bias else 2 * C   # norms, then qkv, w_o, fc, proj biases
    blocks = L * (12 * C * C + vectors) + (2 * C if bias else C)
    assert model.num_params(non_embedding=True) == blocks + (0 if tie else V * C)
    # tied or not, the output layer's V·C multiply-adds are done for every token
    assert model.flops_per_token() == 6 * (blocks + V * C) + 12 * L * C * T


def test_dropout_is_active_in_training_only():
    model = GPT(tiny(dropout=0.5))
    x = torch.randint(0, 40, (2, 24))
    model.train()
    assert not torch.equal(model(x).logits, model(x).logits)
    model.eval()
    assert torch.equal(model(x).logits, model(x).logits)


@pytest.mark.parametrize("position", ["rope", "alibi", "none"])
def test_rolling_cache_stays_bounded_and_matches_the_full_pass_past_window_and_context(position):
    torch.manual_seed(0)
    model = GPT(tiny(position=position, sliding_window=6, n_global=2, block_size=16)).eval()
    x = torch.randint(0, 40, (1, 60))                       # past the window and 3.75x the context
    full = model(x).logits
    cache = model.new_cache(16)
    steps = [model(x[:, :5], cache=cache).logits]
    sizes = set()
    for t in range(5, 60):
        steps.append(model(x[:, t:t + 1], cache=cache).logits)
        sizes.add(cache.nbytes())
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5)
    assert len(sizes) == 1 and cache.capacity == 2 + 2 * 6       # n_global + 2W slots, always
    assert decodes_with_rolling_cache(model)


def test_rolling_generation_runs_far_past_the_context_with_bounded_memory():
    model = GPT(tiny(position="rope", sliding_window=4, block_size=8)).eval()
    tokens = list(model.generate(torch.zeros(1, 3, dtype=torch.long), 100, temperature=0))
    assert len(tokens) == 100


def test_learned_positions_generate_past_the_context_by_shifting():
    model = GPT(tiny(position="learned", block_size=8)).eval()
    assert not decodes_with_rolling_cache(model)
    assert len(list(model.generate(torch.zeros(1, 3, dtype=torch.long), 50))) == 50


@pytest.mark.parametrize("position", list(REGISTRIES["position"]))
def test_bfloat16_weights_sample_like_float32(position):
    """sample.py's bf16 weights: the logits of the fp32 model within a tolerance taken
    from bf16 itself (4 unit roundoffs of the largest logit), which is far below what
    dropping the positions or changing the mask does to the same weights."""
    import dataclasses
    cfg = tiny(position=position)
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    with torch.no_grad():                         # weights large enough for order to matter
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8)
    half = GPT(cfg).eval()
    half.load_state_dict(model.state_dict())
    half = half.to(torch.bfloat16)
    x = torch.randint(0, 40, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full_logits, half_logits = model(x).logits, half(x).logits
        windowed = GPT(dataclasses.replace(cfg, sliding_window=4)).eval()
        windowed.load_state_dict(model.state_dict())
        window_change = (windowed(x).logits - full_logits).abs().max()
        unordered = GPT(dataclasses.replace(cfg, position="none")).eval()
        unordered.load_state_dict(model.state_dict(), strict=False)
        position_change = (unordered(x).logits - full_logits).abs().max()
    assert half_logits.dtype == torch.bfloat16
    tolerance = 4 * (torch.finfo(torch.bfloat16).eps / 2) * full_logits.abs().max()
    assert (half_logits.float() - full_logits).abs().max() < tolerance
    assert window_change > 4 * tolerance                      # a lost mask would show
    if position != "none":
        assert position_change > 4 * tolerance                # so would lost positions
    steps = []
    tokens = list(half.generate(x[:1], 6, temperature=0, on_step=lambda logits, t: steps.append(logits)))
    assert len(tokens) == 6 and all(s.dtype == torch.float32 for s in steps)


@pytest.mark.parametrize("position", ["learned", "sinusoidal"])
def test_windowed_absolute_positions_generate_past_the_context_by_the_documented_rule(position):
    """Absolute positions cannot roll: when the cache is full the newest half of the
    context is re-read from position 0. At every step the cached path's logits must be
    those of a full, uncached forward pass over exactly that context."""
    torch.manual_seed(0)
    model = GPT(tiny(position=position, block_size=8, sliding_window=4)).eval()
    W, prompt, seen = 8, [1, 2, 3], []
    g = torch.Generator().manual_seed(0)
    out = [int(t) for t in model.generate(torch.tensor([prompt]), 30, temperature=1.0, generator=g,
                                          on_step=lambda logits, t: seen.append(logits[0]))]
    kept = prompt[-W:]
    with torch.no_grad():
        for step in range(30):
            expected = model(torch.tensor([kept])).logits[0, -1]
            torch.testing.assert_close(seen[step], expected, atol=1e-5, rtol=0)
            history = prompt + out[:step + 1]
            kept = history[-(W // 2):] if len(kept) >= W else kept + [out[step]]
    assert len(set(out)) > 5                              # sampled: the contexts differ


def test_qk_norm_is_rms_normalised_queries_and_keys_in_the_articles_formula():
    """One attention layer with qk_norm against NumPy float64: each head's q and k
    divided by their root mean square (over that head's d_k), then the formula."""
    import numpy as np
    from model.attention import MultiHeadAttention
    from model.attention import Mask
    from model.positions import POSITION_ENCODINGS
    from reference import attention as reference, mask_rule
    cfg = tiny(position="none", qk_norm=True)
    torch.manual_seed(0)
    layer = MultiHeadAttention(cfg, 0).eval()
    with torch.no_grad():
        layer.w_qkv.weight.mul_(5)                    # large q and k: the norm must matter
    x = torch.randn(2, 10, 32)
    out, _ = layer(x, POSITION_ENCODINGS["none"](cfg), Mask.over(0, 10, 10))
    W = layer.w_qkv.weight.detach().double().numpy()
    H, D = 4, 8
    qkv = (x.double().numpy() @ W.T).reshape(2, 10, 3 * H, D).transpose(0, 2, 1, 3)
    q, k, v = qkv[:, :H], qkv[:, H:2 * H], qkv[:, 2 * H:]
    rms = lambda a: a / np.sqrt((a ** 2).mean(-1, keepdims=True) + torch.finfo(torch.float32).eps)
    y, _, _ = reference(rms(q), rms(k), v, mask_rule(range(10), range(10)))
    y = y.transpose(0, 2, 1, 3).reshape(2, 10, 32) @ layer.w_o.weight.detach().double().numpy().T
    np.testing.assert_allclose(out.detach().numpy(), y, atol=1e-5)
    plain = MultiHeadAttention(tiny(position="none"), 0).eval()
    plain.load_state_dict(layer.state_dict())
    without, _ = plain(x, POSITION_ENCODINGS["none"](cfg), Mask.over(0, 10, 10))
    assert (without - out).abs().max() > 1e-2             # the norm changed something


def test_logit_softcap_is_c_tanh_of_the_plain_logits():
    import numpy as np
    torch.manual_seed(0)
    capped = GPT(tiny(logit_softcap=3.0)).eval()
    plain = GPT(tiny()).eval()
    plain.load_state_dict(capped.state_dict())
    with torch.no_grad():
        for p in capped.parameters():
            p.mul_(4)                                 # logits well past the cap
        plain.load_state_dict(capped.state_dict())
        x = torch.randint(0, 40, (2, 24))
        z, out = plain(x).logits.double().numpy(), capped(x).logits
    assert np.abs(z).max() > 6                        # the cap has work to do
    np.testing.assert_allclose(out.numpy(), 3.0 * np.tanh(z / 3.0), atol=1e-5)
    assert out.abs().max() < 3.0


def test_value_embeddings_add_each_tokens_vector_to_its_value_in_the_articles_formula():
    """One attention layer with a value embedding against NumPy float64: V = x·W_V + E
    (E the rows of the tokens), then softmax(Q·Kᵀ/√d_k)·V and W_O."""
    import numpy as np
    from model.attention import MultiHeadAttention
    from model.attention import Mask
    from model.positions import POSITION_ENCODINGS
    from reference import attention as reference, mask_rule
    cfg = tiny(position="none", n_kv_head=2)
    torch.manual_seed(0)
    layer = MultiHeadAttention(cfg, 0).eval()
    x, ve = torch.randn(2, 10, 32), torch.randn(2, 10, 16)     # 2 kv heads x d_k 8
    out, _ = layer(x, POSITION_ENCODINGS["none"](cfg), Mask.over(0, 10, 10), value_embed=ve)
    W = layer.w_qkv.weight.detach().double().numpy()
    H, H_kv, D = 4, 2, 8
    qkv = (x.double().numpy() @ W.T).reshape(2, 10, H + 2 * H_kv, D).transpose(0, 2, 1, 3)
    q, k, v = qkv[:, :H], qkv[:, H:H + H_kv], qkv[:, H + H_kv:]
    v = v + ve.double().numpy().reshape(2, 10, H_kv, D).transpose(0, 2, 1, 3)
    k, v = k.repeat(2, axis=1), v.repeat(2, axis=1)            # each kv head serves 2 queries
    y, _, _ = reference(q, k, v, mask_rule(range(10), range(10)))
    y = y.transpose(0, 2, 1, 3).reshape(2, 10, 32) @ layer.w_o.weight.detach().double().numpy().T
    np.testing.assert_allclose(out.detach().numpy(), y, atol=1e-5)


def unet_forward(model, idx):
    """The model's logits written out from the definitions, in float64: block i reads
    value-embedding table i at the tokens; block L-1-i gets the output of block i (i in
    the first half, L//2 of them) times skip weight i added to its input."""
    model = model.double()
    c, L = model.config, model.config.n_layer
    x = model.wte(idx)
    outputs = []
    mask = Mask.over(0, idx.shape[1], idx.shape[1])
    for i, block in enumerate(model.blocks):
        mirror = L - 1 - i
        if c.skip_connections and mirror < L // 2:
            x = x + model.skip_weights[mirror] * outputs[mirror]
        ve = model.value_embeds[i].weight[idx] if c.value_embeds else None
        x, _ = block(x, model.positions, mask, None, False, ve)
        outputs.append(x)
    return model.lm_head(model.norm_f(x))


@pytest.mark.parametrize("n_layer", [3, 4, 5])
@pytest.mark.parametrize("fields", [dict(value_embeds=True), dict(skip_connections=True),
                                    dict(value_embeds=True, skip_connections=True)])
def test_value_embeddings_and_unet_skips_are_wired_as_defined(n_layer, fields):
    torch.manual_seed(0)
    model = GPT(tiny(position="none", n_layer=n_layer, **fields)).eval()
    with torch.no_grad():
        if "skip_connections" in fields:
            model.skip_weights.copy_(torch.tensor([0.7, -1.3])[:n_layer // 2])   # each its own
        if "value_embeds" in fields:
            for table in model.value_embeds:
                table.weight.mul_(20)                       # large enough to matter
    x = torch.randint(0, 40, (2, 24))
    got = model(x).logits.double()
    with torch.no_grad():
        expected = unet_forward(model, x)
        plain = GPT(tiny(position="none", n_layer=n_layer)).double().eval()
        plain.load_state_dict(model.state_dict(), strict=False)
        assert (plain(x).logits - expected).abs().max() > 1e-2     # the extras matter
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_value_embeddings_and_skips_decode_like_the_full_pass():
    """Cached and static decoding read the value embeddings of the tokens they step."""
    torch.manual_seed(0)
    model = GPT(tiny(n_layer=3, value_embeds=True, skip_connections=True, n_kv_head=2)).eval()
    with torch.no_grad():
        for table in model.value_embeds:
            table.weight.mul_(20)
    prompt = torch.randint(0, 40, (2, 5))
    runs = {}
    for decode in ("full", "cache", "static"):
        g = torch.Generator().manual_seed(1)
        runs[decode] = torch.cat(list(model.generate(prompt, 15, generator=g, decode=decode)), 1)
    assert torch.equal(runs["cache"], runs["full"]) and torch.equal(runs["static"], runs["full"])


def test_value_embeddings_and_skip_weights_go_to_adamw_not_muon():
    from engine.optim import configure_optimizer
    from engine.config import TrainConfig
    model = GPT(tiny(value_embeds=True, skip_connections=True, n_layer=4))
    opt = configure_optimizer(model, TrainConfig(optimizer="muon"), torch.device("cpu"))
    muon = {id(p) for g in opt.named["muon"].param_groups for p in g["params"]}
    extras = [*model.value_embeds.parameters(), model.skip_weights]
    assert not muon & {id(p) for p in extras}
    no_decay = {id(p) for g in opt.named["adamw"].param_groups if g["weight_decay"] == 0
                for p in g["params"]}
    assert id(model.skip_weights) in no_decay
    assert model.num_params(non_embedding=True) == GPT(tiny(n_layer=4)).num_params(True) + 2


def test_token_mix_adds_the_weighted_rows_before_each_position_as_defined():
    """Against the definition in float64 NumPy: out[t] = h[t] + sum_j w[j] * h[t - j],
    zero where t - j < 0. A shift the wrong way reads the future; one off reads the
    wrong neighbour; a dropped w[0] leaves the row itself unweighted."""
    import numpy as np
    from model.extras import TokenMix
    torch.manual_seed(0)
    mix = TokenMix(tiny(token_mix=3), 0)
    with torch.no_grad():
        mix.taps.normal_()
    h = torch.randn(2, 7, 32, dtype=torch.float64)
    got = mix.double()(h).detach().numpy()
    w, x = mix.taps.detach().numpy().reshape(3, 32), h.numpy()
    expected = np.zeros_like(x)
    for t in range(7):
        expected[:, t] = x[:, t]
        for j in range(3):
            if t - j >= 0:
                expected[:, t] += w[j] * x[:, t - j]
    np.testing.assert_allclose(got, expected, atol=1e-12)


def test_a_new_model_with_token_mix_is_the_plain_model_and_its_taps_go_to_adamw():
    """Zero taps at the start (the plain model's logits to the bit), then trained as a
    norm's gains are: AdamW without weight decay, not Muon's orthogonalised step."""
    from engine.optim import configure_optimizer
    from engine.config import TrainConfig
    torch.manual_seed(0)
    mixed = GPT(tiny(token_mix=4, n_layer=3)).eval()
    torch.manual_seed(0)
    plain = GPT(tiny(n_layer=3)).eval()
    x = torch.randint(0, 40, (2, 16))
    with torch.no_grad():
        assert torch.equal(mixed(x).logits, plain(x).logits)
    opt = configure_optimizer(mixed, TrainConfig(optimizer="muon"), torch.device("cpu"))
    taps = {id(b.mix.taps) for b in mixed.blocks}
    muon = {id(p) for g in opt.named["muon"].param_groups for p in g["params"]}
    no_decay = {id(p) for g in opt.named["adamw"].param_groups if g["weight_decay"] == 0
                for p in g["params"]}
    assert not taps & muon and taps <= no_decay
    loss = mixed.train()(x, x).loss
    loss.backward()
    assert all(b.mix.taps.grad.abs().sum() > 0 for b in mixed.blocks)   # it can learn
    with pytest.raises(Exception, match="model.token_mix must not be negative"):
        tiny(token_mix=-1).validate()
    with pytest.raises(Exception, match="model.token_mix=25 mixes in more positions than the context"):
        tiny(token_mix=25).validate()
    tiny(token_mix=24).validate()


def test_a_zero_head_starts_every_logit_at_zero_and_learns_from_there():
    """model.zero_head: the untied output layer starts at 0, so the loss at step 0 is
    exactly ln(vocab) and the blocks get no gradient through the head until it moves."""
    from model.config import ModelError
    torch.manual_seed(0)
    model = GPT(tiny(tie_embeddings=False, zero_head=True))
    x = torch.randint(0, 40, (2, 24))
    out = model(x, x)
    assert torch.count_nonzero(model.lm_head.weight) == 0 and torch.count_nonzero(model.wte.weight) > 0
    assert out.loss.item() == pytest.approx(math.log(40), abs=1e-6)
    out.loss.backward()
    assert model.lm_head.weight.grad.abs().max() > 0
    assert model.blocks[0].attn.w_qkv.weight.grad.abs().max() == 0
    with pytest.raises(ModelError, match="tie_embeddings=false"):
        GPT(tiny(zero_head=True))


# Loss and logits on a fixed seed, recorded from GPT.forward as it was before its switches
# (skips, value embeddings, readout kind, soft cap) became modules chosen at construction.
BEFORE_MODULES = [
    (dict(), 4.08773946762085, 14.490638841867622),
    (dict(value_embeds=True, skip_connections=True, n_layer=4, n_kv_head=1), 4.145086765289307,
     17.2663408368752),
    (dict(logit_softcap=5.0, tie_embeddings=False), 4.10518217086792, 3.7863971340702847),
    (dict(readout="adaptive", readout_shortlist=20, tie_embeddings=False), 5.565338611602783,
     -10521.946892499924),
    (dict(readout="mlm"), 4.091649055480957, 9.665229066693428),
]


@pytest.mark.parametrize("fields,loss,logit_sum", BEFORE_MODULES)
def test_the_forward_pass_computes_what_it_did_before_its_switches_became_modules(fields, loss, logit_sum):
    torch.manual_seed(0)
    fields = dict(fields)
    config = ModelConfig(vocab_size=60, n_layer=fields.pop("n_layer", 3), n_head=2, n_embd=32,
                         block_size=16, **fields)
    model = GPT(config)
    x, y = torch.randint(0, 60, (2, 16)), torch.randint(0, 60, (2, 16))
    assert model(x, y).loss.item() == pytest.approx(loss, rel=1e-5)
    assert model(x).logits.double().sum().item() == pytest.approx(logit_sum, rel=1e-4, abs=1e-3)


@pytest.mark.parametrize("field,value", [("vocab_size", 1.5), ("n_kv_head", 1.0), ("sliding_window", 2.5),
                                         ("n_layer", True), ("dropout", "0.1"),
                                         ("logit_softcap", float("nan")), ("rope_theta", float("inf")),
                                         ("causal", "false"), ("tie_embeddings", 1), ("mechanism", 3)])
def test_the_python_api_refuses_a_value_of_the_wrong_kind_in_one_line(field, value):
    """A config made in Python meets no command-line parser: a float where a count belongs
    gave a torch traceback from nn.Embedding, nan or inf ran to a nan loss, and the string
    "false" switched causal attention on (bool("false") is True)."""
    from model.config import ModelError
    with pytest.raises(ModelError, match=f"model.{field} must be a"):
        GPT(ModelConfig(**{"vocab_size": 5, field: value}))
