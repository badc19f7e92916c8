"""Every registered mechanism (linear attention, DeltaNet, latent attention, ...) inside
the whole model, built through model.mechanism: the GPT trains, generating
with the model's own caches (the growing one and the static one) gives the tokens and
logits of the full forward pass, the caches hold what each entry says, a hybrid of three
linear layers to one softmax layer trains and decodes, and what a recurrent state cannot
do (a window, an encoder) is refused by the registry in one line."""
import pytest
import torch

from conftest import run_script, train_tiny
from model.config import ModelConfig, ModelError
from model.deltanet import DeltaNet, GatedDeltaNet
from model.decode import static_cache
from model.gpt import GPT
from model.latent_attention import LatentAttention
from model.linear_attention import LinearAttention
from model.mechanisms import MECHANISMS

# Tiny models spend their time in dispatch: a second thread only adds waiting for it.
pytestmark = pytest.mark.usefixtures("one_thread")

# Every registered mechanism, so one added tomorrow is tested here the day it lands.
CLASSES = {name: entry.layer for name, entry in MECHANISMS.items()}
RECURRENT = [name for name, entry in MECHANISMS.items() if entry.cache.per_token(ModelConfig()) == 0]
N_LAYER = 2


def gpt_with(mechanism: str, n_layer: int = N_LAYER, **settings) -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=16, n_layer=n_layer, n_head=2, n_embd=32, block_size=32,
                           linear_chunk=8, mechanism=mechanism, **settings))


@pytest.mark.parametrize("name", CLASSES)
def test_the_registry_builds_its_class_in_every_block(name):
    assert all(type(block.attn) is CLASSES[name] for block in gpt_with(name).blocks)


@pytest.mark.parametrize("name", CLASSES)
def test_its_layer_writes_through_w_o_and_starts_with_gpt2s_scaled_init(name):
    """A layer hands its output to the residual stream through w_o, an nn.Linear (the
    article's W_O): the model's init scales it by 1/√(2·n_layer) as GPT-2 does, and the
    lens ablates through it. A layer that names it otherwise starts at full scale and
    fails here."""
    model = gpt_with(name, n_layer=8)
    for block in model.blocks:
        assert isinstance(block.attn.w_o, torch.nn.Linear)
        std = block.attn.w_o.weight.std().item()
        assert abs(std - 0.02 / 16 ** 0.5) < 0.0015, (name, std)


def learns_a_repeated_text(model: GPT) -> list[float]:
    g = torch.Generator().manual_seed(1)
    text = torch.randint(0, 16, (8,), generator=g).repeat(4)[:25]   # eight tokens, repeated
    x, y = text[None, :-1], text[None, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(20):
        loss = model(x, y).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", CLASSES)
def test_a_gpt_built_with_it_learns_a_repeated_text(name):
    losses = learns_a_repeated_text(gpt_with(name))
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("name", CLASSES)
def test_decoding_with_the_models_cache_equals_the_full_forward(name):
    model = gpt_with(name).double().eval()
    idx = torch.randint(0, 16, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(idx).logits
        cache = model.new_cache(20)
        pieces = [model(idx[:, :7], cache=cache).logits]             # a prompt, then a token
        pieces += [model(idx[:, t:t + 1], cache=cache).logits for t in range(7, 20)]
    assert (torch.cat(pieces, dim=1) - full).abs().max() < 1e-9
    assert cache.length == 20


def generated(model: GPT, prompt, n: int, **kw):
    seen = []
    tokens = list(model.generate(prompt, n, temperature=0.0,
                                 on_step=lambda logits, token: seen.append(logits), **kw))
    return torch.cat(tokens, dim=1), torch.stack(seen)


@pytest.mark.parametrize("name", [*CLASSES, "linear,linear,linear,mha"])
@pytest.mark.parametrize("decode", ["cache", "static"])
def test_generate_with_each_cache_gives_the_full_passes_tokens(name, decode):
    """40 new tokens after 6 pass block_size = 32: the cache is refilled from the newest
    half once, and the recurrent state starts again with it, as the full pass's does."""
    model = gpt_with(name, n_layer=4).double().eval()
    prompt = torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(3))
    cached, cached_logits = generated(model, prompt, 40, decode=decode)
    full, full_logits = generated(model, prompt, 40, use_cache=False)
    assert torch.equal(cached[:, :26], full[:, :26])
    # generate hands on_step fp32 logits whatever the model's dtype: fp32's rounding.
    assert (cached_logits[:26] - full_logits[:26]).abs().max() < 1e-6


@pytest.mark.parametrize("name", CLASSES)
def test_both_caches_hold_what_the_entry_says(name):
    """Bytes after 4 and after 12 tokens: the same for a recurrent state, the capacity's
    slots of (r + d_R) numbers for MLA; the static cache after a load holds the same."""
    model = gpt_with(name).eval()
    facts, c = MECHANISMS[name].cache, model.config
    for length in (4, 12):
        cache = model.new_cache(16)
        with torch.no_grad():
            model(torch.zeros(1, length, dtype=torch.long), cache=cache)
        static = static_cache(model, 16)
        static.load(cache)
        want = 4 * N_LAYER * (16 * facts.per_token(c) + facts.fixed(c))      # fp32
        assert cache.nbytes() == static.nbytes() == want
    if name not in PAPER_COUNTS:         # the entry's own Cache is no check on itself
        pytest.fail(f"no paper's count for mechanism {name!r}: add {name!r}: (numbers per "
                    "token, fixed numbers) of one layer at 2 heads of d_k = 16 to PAPER_COUNTS "
                    "in tests/test_mechanisms_in_a_gpt.py, counted from its paper")
    assert (facts.per_token(c), facts.fixed(c)) == PAPER_COUNTS[name]


# Each paper's count for one layer of gpt_with's model (2 heads of d_k = 16), written out
# apart from the entries' Cache functions; a new entry's belongs here too.
D = 16
PAPER_COUNTS = {"linear": (0, 2 * (D ** 2 + D)), "deltanet": (0, 2 * D ** 2),
                "gated_deltanet": (0, 2 * D ** 2), "mla": (4 * D + D // 2, 0),
                "gated_deltanet_norm": (0, 2 * D ** 2),   # its paper's whole layer: the same state
                "kda": (0, 2 * D ** 2),           # Kimi Linear: one d_k x d_v state a head
                "mha": (2 * 2 * D, 0), "differential": (2 * 2 * D, 0),
                "sigmoid": (2 * 2 * D, 0),     # the keys and values it scores, as mha's
                "gated": (2 * 2 * D, 0), "sinks": (2 * 2 * D, 0),   # a sink is no token
                "sparse": (2 * 2 * D + D, 0),    # DSA: mha's, and one indexer key of d_I = d_k
                "mla_sparse": (4 * D + D // 2 + D, 0)}   # DeepSeek-V3.2: mla's, and the indexer key


def test_a_mechanism_without_a_paper_count_is_told_what_to_add(monkeypatch):
    """A new entry met a bare KeyError here."""
    monkeypatch.setitem(MECHANISMS, "relu_attention", MECHANISMS["mha"])
    with pytest.raises(pytest.fail.Exception, match="add 'relu_attention': .* to PAPER_COUNTS"):
        test_both_caches_hold_what_the_entry_says("relu_attention")


def test_a_hybrid_of_three_linear_layers_to_one_softmax_layer_trains_and_decodes():
    model = gpt_with("linear,linear,linear,mha", n_layer=4)
    assert [type(b.attn).__name__ for b in model.blocks] == ["LinearAttention"] * 3 + [
        "MultiHeadAttention"]
    losses = learns_a_repeated_text(model)
    assert losses[-1] < 0.5 * losses[0], losses
    model = model.double().eval()
    idx = torch.randint(0, 16, (1, 20), generator=torch.Generator().manual_seed(6))
    cache = model.new_cache(20)
    with torch.no_grad():
        steps = [model(idx[:, :5], cache=cache).logits]
        steps += [model(idx[:, t:t + 1], cache=cache).logits for t in range(5, 20)]
        assert (torch.cat(steps, 1) - model(idx).logits).abs().max() < 1e-9
    # Three layers keep a state, the softmax layer its keys and values.
    assert sorted(cache.states) == [0, 1, 2] and [k is None for k in cache.k] == [True] * 3 + [False]


@pytest.mark.parametrize("name", CLASSES)
def test_it_runs_in_bf16_close_to_fp32(name):
    """Under bf16 autocast and with bf16 weights (a CPU trains in either): the recurrent
    states are summed in fp32 (torch has no bf16 triangular solve on a CPU, and bf16's
    8-bit mantissa would round a long sum away), and the output is near fp32's."""
    model = gpt_with(name).eval()
    idx = torch.randint(0, 16, (2, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = model(idx).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = model(idx).logits.float()
        bf16 = model.to(torch.bfloat16)(idx).logits.float()
    for got in (autocast, bf16):
        assert (got - want).abs().max() < 0.05 * want.abs().max()


@pytest.mark.parametrize("name", [*RECURRENT, "mha,linear"])
@pytest.mark.parametrize("setting", [{"sliding_window": 4}, {"sliding_window": 4, "n_global": 1},
                                     {"causal": False}],
                         ids=["window", "global", "encoder"])
def test_a_recurrent_state_refuses_a_window_and_an_encoder_in_one_line(name, setting):
    with pytest.raises(ValueError, match=r"reads every earlier token, causally, and no mask") as err:
        gpt_with(name, **setting)
    assert "\n" not in str(err.value)


def test_latent_attention_decodes_a_windowed_model_as_it_trained():
    # The rolling cache keeps the latents still in reach; the mask hides what training hid.
    model = gpt_with("mla", sliding_window=4, n_global=1).double().eval()
    idx = torch.randint(0, 16, (2, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(idx).logits
        cache = model.new_cache(20)
        pieces = [model(idx[:, :7], cache=cache).logits]
        pieces += [model(idx[:, t:t + 1], cache=cache).logits for t in range(7, 20)]
    assert (torch.cat(pieces, dim=1) - full).abs().max() < 1e-9
    assert cache.capacity == 1 + 2 * 4                        # bounded, not 20


def test_streaming_refuses_latent_attention_in_one_line_and_keeps_a_recurrent_state():
    """Sinks turn kept keys back by the model's RoPE: an MLA cache holds latents (no
    position) and keys of its own small RoPE, so it is refused; a recurrent layer keeps
    no keys, and its state streams as it is beside a softmax layer's rolling cache. A
    model of recurrent layers alone has no keys for sinks to choose: refused, not ignored."""
    prompt = torch.randint(0, 16, (1, 4), generator=torch.Generator().manual_seed(7))
    with pytest.raises(ModelError, match="model.mechanism=mla cannot be renumbered") as err:
        list(gpt_with("linear,mla").eval().generate(prompt, 3, sinks=2))
    assert "\n" not in str(err.value)
    with pytest.raises(ModelError, match="mechanism=linear,deltanet keeps no keys") as err:
        list(gpt_with("linear,deltanet").eval().generate(prompt, 3, sinks=2))
    assert "\n" not in str(err.value)
    assert len(list(gpt_with("linear,mha").eval().generate(prompt, 40, top_k=1, sinks=2))) == 40


def test_a_deltanet_run_trains_samples_and_says_why_it_cannot_be_drawn_or_exported(corpus, tmp_path):
    run = train_tiny(corpus, tmp_path, "dn", "--model.mechanism=deltanet", "--train.max_iters=50")
    sampled = run_script("sample.py", "--run", run, "--sample.max_new_tokens=20")
    assert sampled.stdout.strip()
    for tool, *args in (("attnlab.heads", "grid", "--text", "To be, or not"),
                        ("attnlab.export", "--out", tmp_path / "hf")):
        refused = run_script("-m", tool, *args, "--run", run, check=False)
        said = refused.stderr.strip().splitlines()[-1]
        assert refused.returncode == 2 and said.startswith("error: ") and "deltanet" in said
        assert "no attention weights to draw" in said or "no transformers architecture" in said
    assert not (tmp_path / "hf").exists()


def test_latent_attention_with_value_embeddings_is_refused_when_built_in_one_line():
    with pytest.raises(ValueError, match="model.mechanism=mla rebuilds its values") as err:
        gpt_with("mha,mla", value_embeds=True)
    assert "\n" not in str(err.value)
    gpt_with("linear,mha", value_embeds=True)               # a recurrent layer adds them


def test_the_recurrent_flops_stop_growing_with_the_context_and_mlas_grow_like_attentions():
    """Each entry's forward FLOPs per token at 1k and 16k of context: a chunk and a state
    for linear attention and DeltaNet, every earlier token for softmax and MLA."""
    config = gpt_with("mha").config
    flops = {n: [MECHANISMS[n].flops(config, T) for T in (1024, 16384)] for n in [*CLASSES, "mha"]}
    for name in RECURRENT:
        assert flops[name][0] == flops[name][1] < flops["mha"][0]
    assert flops["mha"][1] == 16 * flops["mha"][0] and flops["mla"][1] == 16 * flops["mla"][0]
    assert flops["mla"][0] > flops["mha"][0]                 # q and k are d_h + d_R long
