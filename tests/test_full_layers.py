"""Windowed layers with a few full ones among them (model.full_attention_every): gpt-oss
alternates a 128-token window with the whole context, Gemma 3 has five windowed layers to
one global. Which layers are full is checked against transformers' own configs for those
models; that a full layer reaches past the window and a windowed one does not, by how far
a change travels; and decoding from each cache, against the full forward pass."""
import pytest
import torch

from model import GPT, ModelConfig
from model.config import ModelError
from model.decode import decodes_with_rolling_cache, static_cache


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=40, n_layer=4, n_head=2, n_embd=32, block_size=24, sliding_window=3,
                full_attention_every=2)
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("n_layer,every,theirs", [(4, 2, "gpt-oss"), (12, 6, "gemma3")])
def test_the_full_layers_are_where_transformers_puts_them(n_layer, every, theirs):
    from transformers import Gemma3TextConfig, GptOssConfig
    config = (GptOssConfig(num_hidden_layers=n_layer) if theirs == "gpt-oss" else
              Gemma3TextConfig(num_hidden_layers=n_layer, sliding_window_pattern=every))
    model = GPT.skeleton(tiny(n_layer=n_layer, full_attention_every=every))
    ours = ["full_attention" if model.sees_everything(i) else "sliding_attention"
            for i in range(n_layer)]
    assert ours == config.layer_types


def reach(model, T: int = 12) -> int:
    """How far back a change to one token still moves the last position's logits."""
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 40, (1, T), generator=g)
    with torch.no_grad():
        last = model(x).logits[0, -1]
        for back in range(T - 1, 0, -1):
            y = x.clone()
            y[0, T - 1 - back] = (y[0, T - 1 - back] + 1) % 40
            if not torch.allclose(model(y).logits[0, -1], last, atol=1e-12, rtol=0):
                return back
    return 0


def test_a_full_layer_sees_the_whole_context_and_a_windowed_one_its_window():
    """Two layers with a window of 3: windowed, each reaches 2 tokens back, so the stack
    reaches 4; with the second layer full the last token hears the first (11 back)."""
    torch.manual_seed(0)
    windowed = GPT(tiny(n_layer=2, full_attention_every=0)).double().eval()
    torch.manual_seed(0)
    mixed = GPT(tiny(n_layer=2)).double().eval()
    assert reach(windowed) == 4
    assert reach(mixed) == 11
    # The first layer of the mixed model is still windowed: layer 1 alone (full) would
    # reach 11 from any input, so look at layer 0's output directly.
    x = torch.randint(0, 40, (1, 12))
    y = x.clone()
    y[0, 0] += 1
    outs = []
    for ids in (x, y):
        h = mixed.drop(mixed.wte(ids))
        mask = mixed.mask_for(12, ids.device, None, None)
        outs.append(mixed.blocks[0](h, mixed.positions, mask)[0])
    assert torch.equal(outs[0][0, 3:], outs[1][0, 3:]) and not torch.equal(outs[0][0, 0], outs[1][0, 0])


@pytest.mark.parametrize("position", ["rope", "learned", "alibi"])
def test_every_cache_decodes_as_the_full_forward_pass(position):
    torch.manual_seed(0)
    model = GPT(tiny(position=position)).eval()
    assert not decodes_with_rolling_cache(model)     # the full layers need every key
    x = torch.randint(0, 40, (2, 24))
    with torch.no_grad():
        full = model(x).logits
        cache = model.new_cache(24)
        steps = [model(x[:, :5], cache=cache).logits]
        steps += [model(x[:, t:t + 1], cache=cache).logits for t in range(5, 24)]
        prefill = model.new_cache(24)
        model(x[:, :5], cache=prefill)
        static = static_cache(model, 24)
        static.load(prefill)
        static_steps = [model(x[:, t:t + 1], cache=static).logits for t in range(5, 24)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=2e-5, rtol=0)
    torch.testing.assert_close(torch.cat(static_steps, 1), full[:, 5:], atol=2e-5, rtol=0)
    assert cache.window == 0 and static.capacity == 24


def test_generate_runs_past_the_window_with_full_layers():
    torch.manual_seed(0)
    model = GPT(tiny()).eval()
    g = torch.Generator().manual_seed(0)
    out = list(model.generate(torch.zeros(1, 1, dtype=torch.long), 30, generator=g))
    assert len(out) == 30


@pytest.mark.parametrize("fields,message", [
    (dict(sliding_window=0), "set model.sliding_window too"),
    (dict(full_attention_every=1), "leaves no windowed layer"),
    (dict(full_attention_every=5), "leaves no full layer"),
    (dict(full_attention_every=-2), "must not be negative"),
])
def test_impossible_patterns_are_refused_in_one_line(fields, message):
    with pytest.raises(ModelError, match=message):
        GPT(tiny(**fields))


def test_export_names_what_no_architecture_there_has():
    from engine.interop import _common_refusals
    assert any("full_attention_every=2" in r for r in _common_refusals(tiny()))


def test_the_machine_runs_one_dense_kernel_where_full_layers_sit_among_windowed_ones():
    """The band pays for a long context and a short window, but a full layer would hand it
    straight to sdpa: with full layers the machine names a kernel every layer runs."""
    from engine.machine import attention_backend
    long = dict(block_size=512, sliding_window=8)
    assert attention_backend(tiny(**long, full_attention_every=0), torch.device("cpu"),
                             torch.float32) == "banded"
    assert attention_backend(tiny(**long), torch.device("cpu"), torch.float32) == "sdpa"
