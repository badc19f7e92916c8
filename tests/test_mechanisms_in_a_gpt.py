"""Linear attention, DeltaNet and latent attention inside the whole model, before the
mechanism registry wires them in: each built by every block in place of the registry's choice (the
way a registry entry will build it), the GPT trains, and generating with the mechanism's
per-layer state (model/states.py) gives the logits and tokens of the full forward pass."""
import pytest
import torch

import model.layers as layers
from model.config import ModelConfig
from model.deltanet import DeltaNet, GatedDeltaNet
from model.gpt import GPT
from model.latent_attention import LatentAttention
from model.linear_attention import LinearAttention
from model.states import LayerStates

# Tiny models spend their time in dispatch: a second thread only adds waiting for it.
pytestmark = pytest.mark.usefixtures("one_thread")

MECHANISMS = {"linear": LinearAttention, "deltanet": DeltaNet, "gated_deltanet": GatedDeltaNet,
              "mla": LatentAttention}
N_LAYER = 2


def gpt_with(attention, monkeypatch, **settings) -> GPT:
    monkeypatch.setattr(layers, "build_layer", attention)
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=16, n_layer=N_LAYER, n_head=2, n_embd=32, block_size=32,
                            linear_chunk=8, **settings))
    assert all(isinstance(block.attn, attention) for block in model.blocks)
    return model


@pytest.mark.parametrize("name", MECHANISMS)
def test_a_gpt_built_with_it_learns_a_repeated_text(name, monkeypatch):
    model = gpt_with(MECHANISMS[name], monkeypatch)
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
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("name", MECHANISMS)
def test_decoding_with_its_state_equals_the_full_forward(name, monkeypatch):
    model = gpt_with(MECHANISMS[name], monkeypatch).double().eval()
    idx = torch.randint(0, 16, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(idx).logits
        cache = LayerStates(N_LAYER)
        pieces = [model(idx[:, :7], cache=cache).logits]             # a prompt, then a token
        pieces += [model(idx[:, t:t + 1], cache=cache).logits for t in range(7, 20)]
    assert (torch.cat(pieces, dim=1) - full).abs().max() < 1e-9
    assert cache.length == 20


@pytest.mark.parametrize("name", MECHANISMS)
def test_generate_with_its_state_gives_the_full_passes_tokens(name, monkeypatch):
    model = gpt_with(MECHANISMS[name], monkeypatch).double().eval()
    monkeypatch.setattr(model, "new_cache", lambda max_len: LayerStates(N_LAYER))
    prompt = torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(3))

    def run(**kw):
        seen = []
        tokens = list(model.generate(prompt, 20, temperature=0.0,
                                     on_step=lambda logits, token: seen.append(logits), **kw))
        return torch.cat(tokens, dim=1), torch.stack(seen)
    cached, cached_logits = run(decode="cache")
    full, full_logits = run(use_cache=False)
    assert torch.equal(cached, full)
    assert (cached_logits - full_logits).abs().max() < 1e-9


def test_the_state_a_gpt_keeps_is_fixed_for_the_recurrent_and_per_token_for_mla(monkeypatch):
    sizes = {}
    for name, attention in MECHANISMS.items():
        model = gpt_with(attention, monkeypatch).eval()
        kept = []
        for length in (4, 12):
            cache = LayerStates(N_LAYER)
            with torch.no_grad():
                model(torch.zeros(1, length, dtype=torch.long), cache=cache)
            kept.append(cache.nbytes())
        sizes[name] = kept
    head_dim = 16
    # Recurrent states: the same after 12 tokens as after 4 (fp32, per layer per head).
    assert sizes["linear"] == [N_LAYER * 2 * (head_dim ** 2 + head_dim) * 4] * 2
    assert sizes["deltanet"] == sizes["gated_deltanet"] == [N_LAYER * 2 * head_dim ** 2 * 4] * 2
    # MLA: (4·d_h + d_h/2) fp32 numbers per token and layer, against MHA's 2·H·d_h.
    assert sizes["mla"] == [N_LAYER * n * (4 * head_dim + head_dim // 2) * 4 for n in (4, 12)]


@pytest.mark.parametrize("name", MECHANISMS)
def test_it_runs_in_bf16_close_to_fp32(name, monkeypatch):
    """Under bf16 autocast and with bf16 weights (a CPU trains in either): the recurrent
    states are summed in fp32 (torch has no bf16 triangular solve on a CPU, and bf16's
    8-bit mantissa would round a long sum away), and the output is near fp32's."""
    model = gpt_with(MECHANISMS[name], monkeypatch).eval()
    idx = torch.randint(0, 16, (2, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = model(idx).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = model(idx).logits.float()
        bf16 = model.to(torch.bfloat16)(idx).logits.float()
    for got in (autocast, bf16):
        assert (got - want).abs().max() < 0.05 * want.abs().max()


@pytest.mark.parametrize("name", ["linear", "deltanet", "gated_deltanet"])
@pytest.mark.parametrize("setting", [{"sliding_window": 4}, {"causal": False}],
                         ids=["window", "encoder"])
def test_a_recurrent_state_refuses_a_window_and_an_encoder_in_one_line(name, setting, monkeypatch):
    with pytest.raises(ValueError, match="sliding_window=0 and model.causal=true"):
        gpt_with(MECHANISMS[name], monkeypatch, **setting)


def test_latent_attention_decodes_a_windowed_model_as_it_trained(monkeypatch):
    # The cache keeps every latent; its window makes the mask hide what training hid.
    model = gpt_with(LatentAttention, monkeypatch, sliding_window=4, n_global=1).double().eval()
    idx = torch.randint(0, 16, (2, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(idx).logits
        cache = LayerStates(N_LAYER, window=4, n_global=1)
        pieces = [model(idx[:, :7], cache=cache).logits]
        pieces += [model(idx[:, t:t + 1], cache=cache).logits for t in range(7, 20)]
    assert (torch.cat(pieces, dim=1) - full).abs().max() < 1e-9
