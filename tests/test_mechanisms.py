"""Attention mechanisms (model/mechanisms.py, model/differential.py): every registered
mechanism trains, decodes with its own cache exactly as the full pass computes, keeps
causality and states its facts truly; differential attention equals a float64 NumPy
reference written from its paper, and the plausible one-line slips fail that check; a
toy mechanism defined in this file alone trains, generates, is listed and is refused
where it should be, so a new mechanism is its class, its entry and its test."""
from dataclasses import fields, replace

import numpy as np
import pytest
import torch
import torch.nn as nn

from attnlab import capture
from common.errors import AttnlabError
from engine import config as run_config
from engine.interop import ExportError, architecture_for
from model import GPT, ModelConfig, ModelError, differential
from model.differential import DifferentialAttention
from model.attention import Mask
from model.mechanisms import MECHANISMS, Cache, Mechanism
from model.layers import layer_names
from model.positions import POSITION_ENCODINGS
from reference import differential_attention, mask_rule


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=40, n_layer=2, n_head=2, n_embd=32, block_size=24)
    return ModelConfig(**{**base, **kw})


MECHANISM_NAMES = sorted(MECHANISMS)


# -- differential attention against its paper ------------------------------------------

def _differential_case(layer_idx=2, n_kv_head=0, causal=True):
    torch.manual_seed(1)
    config = tiny(n_embd=32, n_head=2, n_kv_head=n_kv_head, position="none", causal=causal,
                  mechanism="differential")
    layer = DifferentialAttention(config, layer_idx).double()
    with torch.no_grad():                   # gains away from 1, so a missing gain shows
        layer.head_norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(1, 7, 32, dtype=torch.float64)
    mask = Mask(q_start=0, q_len=7, k_pos=torch.arange(7), causal=causal)
    return config, layer, x, mask


def _reference_of(config, layer, x, causal=True):
    visible = mask_rule(range(7), range(7)) if causal else np.ones((7, 7), dtype=bool)
    lambdas = [p.detach().numpy() for p in (layer.lambda_q1, layer.lambda_k1,
                                            layer.lambda_q2, layer.lambda_k2)]
    return differential_attention(x[0].numpy(), layer.w_qkv.weight.detach().numpy(),
                                  layer.w_o.weight.detach().numpy(), lambdas,
                                  layer.head_norm.weight.detach().numpy(), layer.layer_idx,
                                  config.n_head, config.kv_heads, visible, config.norm_eps)


def _agrees(layer, config, x, mask, causal=True) -> bool:
    positions = POSITION_ENCODINGS["none"](config)
    out, maps = layer(x, positions, mask, need_weights=True)
    want_out, want_maps = _reference_of(config, layer, x, causal)
    return (np.allclose(out[0].detach().numpy(), want_out, atol=1e-10)
            and np.allclose(maps[0].detach().numpy(), want_maps, atol=1e-12))


@pytest.mark.parametrize("n_kv_head,causal", [(0, True), (1, True), (0, False)])
def test_differential_attention_is_the_papers_formula(n_kv_head, causal):
    config, layer, x, mask = _differential_case(n_kv_head=n_kv_head, causal=causal)
    assert _agrees(layer, config, x, mask, causal)
    # The fused path (no weights asked for) gives the same output.
    positions = POSITION_ENCODINGS["none"](config)
    fused, _ = layer(x, positions, mask)
    torch.testing.assert_close(fused[0].detach().numpy(), _reference_of(config, layer, x, causal)[0],
                               atol=1e-10, rtol=0)


def test_lambda_init_follows_the_papers_schedule():
    # λ_init = 0.8 − 0.6·exp(−0.3·(l−1)) for layer l from 1: 0.2 at the first layer.
    assert differential.lambda_init(0) == pytest.approx(0.2)
    assert differential.lambda_init(3) == pytest.approx(0.8 - 0.6 * np.exp(-0.9))


def _planted_sign(monkeypatch):
    true_lam = DifferentialAttention.lam
    monkeypatch.setattr(DifferentialAttention, "lam", lambda self: -true_lam(self))


def _planted_no_subtraction(monkeypatch):
    monkeypatch.setattr(DifferentialAttention, "lam", lambda self: self.lambda_q1.sum() * 0)


def _planted_no_scale(monkeypatch):
    true_init = DifferentialAttention.__init__

    def unscaled(self, config, layer_idx):
        true_init(self, config, layer_idx)
        self.out_scale = 1.0
    monkeypatch.setattr(DifferentialAttention, "__init__", unscaled)


def _planted_one_query_half(monkeypatch):
    true_halves, calls = differential.halves, []

    def shared(x):                          # the queries (the first call) give half 1 twice
        calls.append(1)
        a, b = true_halves(x)
        return (a, a) if len(calls) % 2 else (a, b)
    monkeypatch.setattr(differential, "halves", shared)


def _planted_layer_from_1(monkeypatch):
    monkeypatch.setattr(differential, "lambda_init", lambda i: 0.8 - 0.6 * np.exp(-0.3 * (i + 1)))


@pytest.mark.parametrize("plant", [_planted_sign, _planted_no_subtraction, _planted_no_scale,
                                   _planted_one_query_half, _planted_layer_from_1])
def test_the_reference_check_catches_each_planted_slip(plant, monkeypatch):
    """The one-line slips a differential attention is likely to be written with: λ added
    instead of subtracted, the second map not subtracted at all, the (1 − λ_init) scale
    left out, both maps from one query half, λ_init's layer counted from 0 in the
    paper's l − 1."""
    plant(monkeypatch)
    config, layer, x, mask = _differential_case()
    assert not _agrees(layer, config, x, mask)


def test_the_difference_map_rows_sum_to_one_minus_lambda():
    """Each softmax row sums to 1, so a row of softmax₁ − λ·softmax₂ sums to 1 − λ:
    what `heads` draws is the difference map, negative where the second map wins."""
    torch.manual_seed(0)
    model = GPT(tiny(mechanism="differential", n_layer=3)).eval()
    _, maps = capture.attention(model, torch.randint(0, 40, (1, 12)))
    for block, m in zip(model.blocks, maps):
        lam = block.attn.lam().item()
        torch.testing.assert_close(m.sum(-1), torch.full_like(m.sum(-1), 1 - lam), atol=1e-5, rtol=0)
        assert torch.equal(m.triu(1), torch.zeros_like(m))       # nothing from the future


# -- every registered mechanism --------------------------------------------------------

@pytest.mark.parametrize("name", MECHANISM_NAMES)
@pytest.mark.parametrize("position,window,n_kv_head", [("rope", 0, 0), ("learned", 0, 1),
                                                       ("rope", 5, 0)])
def test_cached_decoding_equals_the_full_forward_pass(name, position, window, n_kv_head):
    if window and not MECHANISMS[name].follows_mask:
        pytest.skip(f"{name} has no window")
    if n_kv_head and not MECHANISMS[name].takes_kv_heads:
        pytest.skip(f"{name} has no key and value heads to share")
    torch.manual_seed(0)
    model = GPT(tiny(mechanism=name, position=position, sliding_window=window,
                     n_kv_head=n_kv_head)).eval()
    x = torch.randint(0, 40, (2, 24))
    full = model(x).logits
    cache = model.new_cache(24)
    pieces = [model(x[:, :7], cache=cache).logits, model(x[:, 7:12], cache=cache).logits]
    pieces += [model(x[:, t:t + 1], cache=cache).logits for t in range(12, 24)]
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", MECHANISM_NAMES)
@pytest.mark.parametrize("decode", ["cache", "static"])
def test_generation_with_each_cache_is_greedy_argmax_of_the_full_pass(name, decode):
    torch.manual_seed(0)
    model = GPT(tiny(mechanism=name)).eval()
    prompt = torch.randint(0, 40, (1, 5))
    tokens = torch.cat(list(model.generate(prompt, 10, top_k=1, decode=decode)), 1)
    context = prompt
    for t in range(10):
        context = torch.cat([context, model(context).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(tokens, context[:, 5:])


@pytest.mark.parametrize("name", MECHANISM_NAMES)
def test_changing_the_future_never_changes_the_past(name):
    torch.manual_seed(0)
    model = GPT(tiny(mechanism=name)).eval()
    x = torch.randint(0, 40, (1, 16))
    y = x.clone()
    y[:, 9:] = torch.randint(0, 40, (1, 7))
    torch.testing.assert_close(model(x).logits[:, :9], model(y).logits[:, :9], atol=0, rtol=0)


@pytest.mark.parametrize("name", MECHANISM_NAMES)
def test_a_tiny_model_learns_one_batch(name):
    torch.manual_seed(0)
    model = GPT(tiny(mechanism=name))
    x = torch.randint(0, 40, (4, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(30):
        loss = model(x[:, :-1], x[:, 1:]).loss
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.6 * first


@pytest.mark.parametrize("name", MECHANISM_NAMES)
def test_the_cache_holds_what_its_entry_says(name):
    """Cache.per_token and Cache.fixed are what a cache of N tokens holds, in numbers."""
    model = GPT(tiny(mechanism=name)).eval()
    cache = model.new_cache(24)
    model(torch.zeros(1, 10, dtype=torch.long), cache=cache)
    facts = MECHANISMS[name].cache
    numbers = model.config.n_layer * (24 * facts.per_token(model.config) + facts.fixed(model.config))
    assert cache.nbytes() == 4 * numbers                      # fp32


@pytest.mark.parametrize("name", MECHANISM_NAMES)
def test_export_refuses_in_one_line_what_no_architecture_computes(name):
    reason = MECHANISMS[name].export_refusal
    if reason is None:
        assert architecture_for(tiny(mechanism=name, vocab_size=0)) is not None
        return
    with pytest.raises(ExportError) as err:
        architecture_for(tiny(mechanism=name))
    assert reason in str(err.value) and "\n" not in str(err.value)
    assert "train with --model.mechanism=mha" in str(err.value)


# -- each entry's facts against what its layer does ------------------------------------
# A contributor's layer can ignore RoPE, ALiBi or n_kv_head, or return no weights while
# its entry says it has them, and every test above still passes; these compare each fact
# with the layer.

def _logits(name, seed=0, **kw):
    torch.manual_seed(seed)
    return GPT(tiny(mechanism=name, **kw)).eval()(torch.arange(12)[None] % 40).logits


@pytest.mark.parametrize("name", MECHANISM_NAMES)
def test_the_models_rope_turns_the_layer_exactly_when_its_entry_says(name):
    # RoPE and "none" hold no parameters, so one seed builds the same weights for both.
    turned = not torch.equal(_logits(name, position="rope"), _logits(name, position="none"))
    assert turned == MECHANISMS[name].takes_rotary


@pytest.mark.parametrize("name", MECHANISM_NAMES)
def test_alibi_biases_the_layer_exactly_when_its_entry_says_it_takes_it(name):
    if not MECHANISMS[name].takes_score_bias:
        with pytest.raises(ModelError, match="no place for model.position=alibi"):
            GPT(tiny(mechanism=name, position="alibi"))
        return
    assert not torch.equal(_logits(name, position="alibi"), _logits(name, position="none"))


@pytest.mark.parametrize("name", MECHANISM_NAMES)
def test_shared_key_and_value_heads_shrink_the_layer_exactly_when_its_entry_says(name):
    if not MECHANISMS[name].takes_kv_heads:
        with pytest.raises(ModelError, match="no key and value heads to share"):
            GPT(tiny(mechanism=name, n_kv_head=1))
        return
    sizes = [sum(p.numel() for p in GPT(tiny(mechanism=name, n_kv_head=n)).blocks[0].attn.parameters())
             for n in (0, 1)]
    assert sizes[1] < sizes[0]


@pytest.mark.parametrize("name", MECHANISM_NAMES)
def test_a_layer_returns_weights_exactly_when_its_entry_says_it_has_them(name):
    torch.manual_seed(0)
    model = GPT(tiny(mechanism=name)).eval()
    config, attn = model.config, model.blocks[0].attn
    x = torch.randn(1, 7, config.n_embd)
    try:                             # a layer without weights returns None or says why
        _, weights = attn(x, model.positions, Mask(q_start=0, q_len=7, k_pos=torch.arange(7)),
                          need_weights=True)
    except ModelError:
        weights = None
    assert (weights is not None) == (MECHANISMS[name].no_weights is None)
    if weights is not None:          # one map per head, nothing on a later key
        assert weights.shape == (1, config.n_head, 7, 7)
        assert torch.all(weights.triu(1) == 0)
        # Rows that are distributions exactly when the entry says (heads' entropy, colour bar)
        rows_sum_to_one = torch.allclose(weights.sum(-1), torch.ones(()), atol=1e-5)
        assert (rows_sum_to_one and bool((weights >= 0).all())) == MECHANISMS[name].weights_sum_to_one


def _layer_out(entry, seed=0, n_kv_head=0, window=0, alibi=False, value_embed=False,
               qk_norm=False):
    """One layer of `entry` alone, built past the registry (which trusts the facts), on
    7 tokens: its output with one input of the layer's changed."""
    config = tiny(position="none", n_kv_head=n_kv_head, qk_norm=qk_norm)
    torch.manual_seed(seed)
    layer = entry.layer(config, 0).double().eval()
    x = torch.randn(1, 7, config.n_embd, dtype=torch.float64)
    ve = torch.randn(1, 7, config.kv_heads * config.head_dim, dtype=torch.float64)
    bias = POSITION_ENCODINGS["alibi"](config).score_bias if alibi else None
    mask = Mask(q_start=0, q_len=7, k_pos=torch.arange(7), window=window, bias_fn=bias)
    try:                               # a layer may refuse what it has no place for
        with torch.no_grad():
            out, _ = layer(x, POSITION_ENCODINGS["none"](config), mask,
                           value_embed=ve if value_embed else None)
    except ModelError:
        return None
    return out, sum(p.numel() for p in layer.parameters())


def fact_mismatches(entry) -> list[str]:
    """The facts of `entry` its layer contradicts: each says whether an input changes
    what the layer computes, and here that input is changed and the output compared."""
    plain = _layer_out(entry)
    changed = {
        "takes_value_embed": _layer_out(entry, value_embed=True),
        "takes_score_bias": _layer_out(entry, alibi=True),
        "follows_mask": _layer_out(entry, window=2),
        "takes_qk_norm": _layer_out(entry, qk_norm=True),
    }
    found = [fact for fact, out in changed.items()
             if (out is not None and not torch.equal(out[0], plain[0])) != getattr(entry, fact)]
    shared = _layer_out(entry, n_kv_head=1)          # 1 key/value head for tiny's 2
    if (shared is not None and shared[1] != plain[1]) != entry.takes_kv_heads:
        found.append("takes_kv_heads")
    return found


@pytest.mark.parametrize("name", MECHANISM_NAMES)
def test_each_does_or_does_not_take_fact_is_what_the_layer_does(name):
    """The registry refuses a setting by the fact alone, so a false fact passed every
    other test: here the layer itself is asked."""
    assert fact_mismatches(MECHANISMS[name]) == []


def test_a_layer_that_ignores_what_its_entry_says_it_takes_is_caught():
    assert fact_mismatches(TOY) == []
    liar = replace(TOY, takes_value_embed=True, takes_kv_heads=True, takes_qk_norm=True)
    assert fact_mismatches(liar) == ["takes_value_embed", "takes_qk_norm", "takes_kv_heads"]
    assert fact_mismatches(replace(MECHANISMS["mha"], takes_score_bias=False,
                                   follows_mask=False)) == ["takes_score_bias", "follows_mask"]


@pytest.mark.parametrize("name", MECHANISM_NAMES)
def test_a_layer_takes_the_machines_kernel_exactly_when_its_entry_says(name):
    """The device line names the kernel only for layers that run it (engine.machine)."""
    attn = GPT(tiny(mechanism=name)).blocks[0].attn
    assert callable(getattr(attn, "kernel", None)) == MECHANISMS[name].uses_kernel


def test_the_summary_line_says_the_settings_that_change_what_mha_attends_to():
    """A GQA or windowed run said only "mha mechanism", as if it were plain attention."""
    from engine.state import mechanism_words
    assert mechanism_words(tiny(n_head=4, n_kv_head=2)) == \
        "mha mechanism (2 key/value heads for 4 query heads)"
    assert mechanism_words(tiny(n_kv_head=1, sliding_window=16, n_global=2)) == \
        "mha mechanism (1 key/value head for 2 query heads; a window of 16, plus 2 global tokens)"
    assert mechanism_words(tiny(n_kv_head=2)) == mechanism_words(tiny()) == "mha mechanism"


def test_the_summary_line_says_an_attention_only_model_has_no_mlp():
    """With model.mlp=none only the parameter count told a learner the MLPs were gone."""
    from types import SimpleNamespace
    from engine.state import Run
    for mlp, said in (("none", True), ("gelu", False)):
        cfg = run_config.RunConfig()
        cfg.model = tiny(mlp=mlp)
        line = Run.summary(SimpleNamespace(cfg=cfg, model=GPT(cfg.model), kernel="sdpa"))
        assert ("no MLP (attention only)" in line) == said, line


@pytest.mark.parametrize("name", MECHANISM_NAMES)
def test_the_summary_line_says_when_a_rotary_position_turns_nothing(name):
    """linear and deltanet runs said "rope positions" while their layers turn nothing by
    it; the words follow the entry's takes_rotary, which a test above holds to the layer."""
    from engine.state import position_words
    own_way = not MECHANISMS[name].takes_rotary
    assert ("own way" in position_words(tiny(mechanism=name))) == own_way
    assert position_words(tiny(mechanism=name, position="learned")) == "learned positions"
    assert position_words(tiny(mechanism=name, position="none")) == "no positions (model.position=none)"
    mixed = position_words(tiny(mechanism=f"{name},mha", n_layer=2))
    assert (f"not in the {name} layers" in mixed) == (own_way and name != "mha")


@pytest.mark.parametrize("bad", [dict(head_multiple=0), dict(no_weights=""),
                                 dict(export_refusal="two\nlines"), dict(flops=0),
                                 dict(cache=("keys", 2))])
def test_an_entry_with_an_unusable_fact_is_refused_when_it_is_written(bad):
    """head_multiple=0 ended train, heads and export in ZeroDivisionError; an empty reason
    printed "error: ...: " with nothing after it."""
    with pytest.raises(TypeError, match="Mechanism"):
        Mechanism(**{"layer": MECHANISMS["mha"].layer, "cache": MECHANISMS["mha"].cache, **bad})


def test_a_cache_whose_sizes_are_numbers_not_functions_is_refused_when_written():
    with pytest.raises(TypeError, match="per_token must be a function of the config"):
        Cache("keys and values", 0)


def test_a_hybrid_pattern_cycles_over_the_layers():
    config = tiny(n_layer=5, mechanism="differential, mha")
    assert layer_names(config) == ["differential", "mha", "differential", "mha", "differential"]
    model = GPT(config)
    assert [type(b.attn) for b in model.blocks][:2] == [DifferentialAttention,
                                                       MECHANISMS["mha"].layer]
    with pytest.raises(ModelError, match=r"unknown model.mechanism 'diferential'.*did you mean 'differential'"):
        GPT(tiny(mechanism="mha,diferential"))


def test_a_pattern_longer_than_the_model_is_refused_not_cut():
    """Cycling a short pattern is the rule; a long one would drop its last names unseen."""
    GPT(tiny(n_layer=2, mechanism="linear,mha"))
    with pytest.raises(ModelError, match="names 3 layers and the model has model.n_layer=2"):
        GPT(tiny(n_layer=2, mechanism="linear,mha,mha"))


@pytest.mark.parametrize("pattern", ["linear,", "linear,,mha", ",mha"])
def test_an_empty_entry_in_a_pattern_is_named_as_such(pattern):
    """It was answered as an unknown mechanism '' with the list of valid ones."""
    with pytest.raises(ModelError, match="has an empty entry"):
        GPT(tiny(n_layer=3, mechanism=pattern))


def test_names_of_mha_settings_point_to_the_setting_and_name_no_mechanism():
    """The frontier's rows gqa, mqa, window and hybrid are settings of mha or patterns:
    typed as a mechanism, each is answered with the option that gives it."""
    from attnlab.frontier import MECHANISMS as ROWS
    from model.mechanisms import NOT_MECHANISMS
    assert not set(NOT_MECHANISMS) & set(MECHANISMS)
    assert set(ROWS) - set(MECHANISMS) <= set(NOT_MECHANISMS)
    for name, option in (("gqa", "--model.n_kv_head=K"), ("mqa", "--model.n_kv_head=1"),
                         ("window", "--model.sliding_window=W"), ("hybrid", "linear,mha")):
        with pytest.raises(ModelError, match=f"mechanism={name} is not a mechanism.*{option}"):
            GPT(tiny(mechanism=f"mha,{name}"))


def test_global_tokens_with_a_recurrent_mechanism_are_refused_for_the_mechanism():
    """Asking for a window before n_global would send the learner to a second refusal."""
    with pytest.raises(ModelError, match="mechanism=linear reads every earlier token"):
        GPT(tiny(mechanism="linear", n_global=2))
    with pytest.raises(ModelError, match="set model.sliding_window too"):
        GPT(tiny(n_global=2))


def test_the_flops_count_reads_each_layers_entry(monkeypatch):
    """PaLM's 12·d·T per layer for plain attention (4·d·T forward, three times for the
    backward too), taken from each layer's entry: in a hybrid, from each its own."""
    config = tiny(n_layer=3, mechanism="mha,differential")
    counted = GPT.skeleton(config).flops_per_token()
    monkeypatch.setitem(MECHANISMS, "mha", replace(MECHANISMS["mha"], flops=lambda c, T: 0))
    d, T = config.n_embd, config.block_size
    assert counted - GPT.skeleton(config).flops_per_token() == 2 * 12 * d * T


# Differential attention hands a backend four maps of one width (Q₁K₁ᵀ and Q₂K₂ᵀ, each
# against both halves of V), so it computes twice the paper's count, which its fact keeps.
COMPUTED_OVER_FACT = {"differential": 2.0}


@pytest.mark.parametrize("T", [64, 256])
@pytest.mark.parametrize("name", MECHANISM_NAMES)
def test_each_entrys_flops_agree_with_a_count_of_the_layers_own_multiplies(name, T):
    """torch's FlopCounterMode counts every matmul of a forward pass through the written
    formula (eager); the layer's nn.Linear weights (2·in·out a token) are the model's
    6N, not the entry's. What is left must be the entry's flops within 20%: catches a fact
    of 0, a factor of 2 lost, or T where a chunk belongs (linear at T=256 is 5x off)."""
    from torch.utils.flop_counter import FlopCounterMode
    config = tiny(n_head=4, n_embd=64, block_size=T, linear_chunk=32, mechanism=name,
                  attention="eager" if MECHANISMS[name].uses_kernel else "auto")
    model = GPT(config).eval()
    attn = model.blocks[0].attn
    weights = sum(2 * T * m.in_features * m.out_features for m in attn.modules()
                  if isinstance(m, nn.Linear))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        attn(torch.randn(1, T, config.n_embd), model.positions,
             Mask(q_start=0, q_len=T, k_pos=torch.arange(T)))
    counted = (counter.get_total_flops() - weights) / T
    expected = MECHANISMS[name].flops(config, T) * COMPUTED_OVER_FACT.get(name, 1.0)
    assert counted == pytest.approx(expected, rel=0.2)


def test_differential_needs_whole_pairs_per_half():
    with pytest.raises(ModelError, match="multiple of 4"):
        GPT(tiny(mechanism="differential", n_embd=36, n_head=6))      # d_k = 6
    with pytest.raises(ModelError, match="score bias"):
        GPT(tiny(mechanism="differential", position="alibi"))


# -- a new mechanism is its class, its entry and its test ------------------------------

class RunningMean(nn.Module):
    """A toy mechanism: each position reads the mean of every value up to itself, kept
    while decoding as a running sum and count, a state of fixed size."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.w_v = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.w_o = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(self, x, positions, mask, cache=None, need_weights=False, value_embed=None):
        B, T, C = x.shape
        v = self.w_v(x)
        past = None if cache is None else cache.state(self.layer_idx)       # (B, C + 1)
        past = v.new_zeros(B, C + 1) if past is None else past
        sums = past[:, None, :C] + v.cumsum(1)                               # (B, T, C)
        counts = past[:, None, C:] + torch.arange(1, T + 1, dtype=v.dtype)[:, None]   # (B, T, 1)
        if cache is not None:
            cache.keep(self.layer_idx, torch.cat([sums[:, -1], counts[:, -1]], -1))
        return self.w_o(sums / counts), None


TOY = Mechanism(RunningMean, Cache("a running sum and count", lambda c: 0, lambda c: c.n_embd + 1),
                no_weights="every earlier token weighs the same; there is no map to draw",
                export_refusal="a running mean is no transformers layer",
                follows_mask=False, takes_score_bias=False, takes_value_embed=False, takes_qk_norm=False,
                takes_kv_heads=False, takes_rotary=False, uses_kernel=False)


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(MECHANISMS, "running_mean", TOY)
    return "running_mean"


def test_a_mechanism_defined_in_a_test_trains_and_generates_with_its_cache(toy):
    torch.manual_seed(0)
    model = GPT(tiny(mechanism=toy))
    x = torch.randint(0, 40, (2, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(5):
        loss = model(x[:, :-1], x[:, 1:]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    model.eval()
    full = model(x).logits
    cache = model.new_cache(24)
    steps = [model(x[:, :5], cache=cache).logits] + [model(x[:, t:t + 1], cache=cache).logits
                                                      for t in range(5, 16)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=0)
    assert cache.nbytes() == 4 * model.config.n_layer * 2 * (model.config.n_embd + 1)
    tokens = list(model.generate(x[:, :3], 6, top_k=1, decode="static"))
    assert len(tokens) == 6


def test_a_mechanism_defined_in_a_test_is_listed_and_refused_where_it_should_be(toy):
    from train import parser
    model_field = next(f for f in fields(ModelConfig) if f.name == "mechanism")
    assert toy in run_config.choices_of(model_field)
    assert toy in " ".join(parser().format_help().split())
    with pytest.raises(ExportError, match="a running mean is no transformers layer"):
        architecture_for(tiny(mechanism=toy))
    model = GPT(tiny(mechanism=toy, n_layer=2))
    with pytest.raises(AttnlabError, match="no map to draw"):
        capture.attention(model, torch.zeros(1, 4, dtype=torch.long))
    assert not any(n.endswith((".pattern", ".q")) for n in capture.names(model))
    with pytest.raises(ModelError, match="sliding_window"):
        GPT(tiny(mechanism=toy, sliding_window=4))


# -- what the registry refuses as the entries are read ----------------------------------

def test_an_entry_written_over_after_the_dict_was_built_is_checked_when_read(monkeypatch):
    """MECHANISMS["mha"] = a bare class skipped the check Mechanism makes when written,
    and the model failed later with an AttributeError."""
    monkeypatch.setitem(MECHANISMS, "mha", MECHANISMS["mha"].layer)
    with pytest.raises(ModelError, match=r"MECHANISMS\['mha'\] is type, not a Mechanism"):
        GPT(tiny())


def test_the_exercises_name_is_refused_to_any_other_entry(monkeypatch):
    """A mechanism registered as "yours" was taken for the learner's exercise code."""
    from attnlab.exercises import plug
    from attnlab.exercises.learner import ExerciseError
    monkeypatch.setitem(MECHANISMS, "yours", TOY)
    with pytest.raises(ModelError, match="kept for the exercises' code"):
        GPT(tiny(mechanism="yours"))
    with pytest.raises(ExerciseError, match="registered by other code"):
        plug.install()


@pytest.mark.parametrize("pattern", ["linear", "deltanet,mla"])
def test_a_backend_named_for_mechanisms_that_run_no_kernel_is_refused(pattern):
    with pytest.raises(ModelError, match=f"model.attention=eager .* model.mechanism={pattern}"):
        GPT(tiny(attention="eager", mechanism=pattern))
    GPT(tiny(attention="eager", mechanism="linear,mha"))      # mha's layers run it


def test_every_fact_of_an_entry_and_of_its_cache_is_documented_where_the_others_are():
    """docs/architecture.md named neither uses_kernel nor Cache's arguments."""
    from pathlib import Path
    page = (Path(__file__).parents[1] / "docs/architecture.md").read_text()
    for f in fields(Mechanism):
        assert f"`{f.name}=" in page or f"`{f.name}`" in page, f.name
    assert "Cache(what, per_token, fixed)" in page and "keys_and_values" in page
    for f in fields(Cache):
        assert f"`{f.name}" in page, f.name


def test_differential_halves_turn_at_the_even_and_the_odd_frequencies_of_the_models_rope():
    """What model/differential.py's halves says: turned once by the model's RoPE at d_k, half
    1 turns at RoPE(d_k/2)'s frequencies (the model's even ones), half 2 at the odd ones
    between them; the paper's code gives both halves the even ones."""
    from model.differential import halves
    config = tiny(n_embd=32, n_head=2)                       # d_k = 16: 8 pairs, 4 per half
    rope = POSITION_ENCODINGS["rope"](config)
    D, T = 16, 6
    x = torch.zeros(1, 1, T, D, dtype=torch.float64)
    x[..., : D // 2] = 1.0                                   # every pair starts at angle 0
    turned = rope.rotate(x, 0)
    for half, expected in zip(halves(turned), (rope.inv_freq[0::2], rope.inv_freq[1::2])):
        first, second = half[..., : D // 4], half[..., D // 4:]
        angle = torch.atan2(second, first)[0, 0]                 # (T, D/4): pair j at position p
        assert torch.allclose(angle[1], expected.double(), atol=1e-6)
