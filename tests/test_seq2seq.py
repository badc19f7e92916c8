"""Cross-attention and the encoder-decoder (model/attention.py CrossAttention,
model/seq2seq.py, attnlab/seq2seq.py): the article's third kind of attention against a
float64 reference with padded inputs, and the reversal demo it makes possible."""
import numpy as np
import pytest
import torch

from model import ModelConfig
from model.attention import ATTENTION_BACKENDS, CrossAttention
from tests.reference import attention as reference_attention


def padded_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 5, 32, generator=g, dtype=torch.float64)          # decoder states
    memory = torch.randn(3, 7, 32, generator=g, dtype=torch.float64)     # encoder output
    padding = torch.zeros(3, 7, dtype=torch.bool)
    padding[1, 4:] = True                                                # inputs of 7, 4 and 1
    padding[2, 1:] = True
    return x, memory, padding


@pytest.mark.parametrize("backend", sorted(ATTENTION_BACKENDS))
def test_cross_attention_equals_a_float64_reference_with_padded_inputs(backend):
    cfg = ModelConfig(n_embd=32, n_head=4, attention=backend,
                      sliding_window=4 if ATTENTION_BACKENDS[backend].needs_window else 0)
    torch.manual_seed(0)
    layer = CrossAttention(cfg).double()
    x, memory, padding = padded_inputs()
    with torch.no_grad():
        out, _ = layer(x, memory, padding)
    H, D = 4, 8
    w_q, w_kv, w_o = (w.weight.detach().numpy() for w in (layer.w_q, layer.w_kv, layer.w_o))
    q = (x.numpy() @ w_q.T).reshape(3, 5, H, D).transpose(0, 2, 1, 3)
    kv = (memory.numpy() @ w_kv.T).reshape(3, 7, 2 * H, D).transpose(0, 2, 1, 3)
    k, v = kv[:, :H], kv[:, H:]
    visible = ~padding.numpy()[:, None, None, :]                       # no causal mask
    heads, weights, _ = reference_attention(q, k, v, visible)
    expected = heads.transpose(0, 2, 1, 3).reshape(3, 5, 32) @ w_o.T
    np.testing.assert_allclose(out.numpy(), expected, atol=1e-10, rtol=0)


def test_padded_inputs_get_exactly_zero_weight_and_change_nothing():
    torch.manual_seed(0)
    layer = CrossAttention(ModelConfig(n_embd=32, n_head=4)).double()
    x, memory, padding = padded_inputs()
    with torch.no_grad():
        out, weights = layer(x, memory, padding, need_weights=True)
        assert (weights[1, :, :, 4:] == 0).all() and (weights[2, :, :, 1:] == 0).all()
        torch.testing.assert_close(weights.sum(-1), torch.ones(3, 4, 5, dtype=torch.float64))
        scrambled = memory.clone()
        scrambled[padding] = 99.0                                      # what the filler holds
        torch.testing.assert_close(layer(x, scrambled, padding)[0], out)
        alone, _ = layer(x[1:2], memory[1:2, :4])                      # the same input, unpadded
        torch.testing.assert_close(alone, out[1:2])


@pytest.mark.usefixtures("one_thread")
def test_the_reversal_demo_learns_to_reverse_held_out_strings():
    from attnlab.seq2seq import accuracy, batch, held_out, random_words, train
    # 300 steps reach 100% on these strings (200 reach 87%): a fixed count of updates,
    # so the result does not depend on how fast or busy the machine is.
    model = train(steps=300, log=lambda *a: None)
    test = random_words(300, torch.Generator().manual_seed(5), want_held_out=True)
    assert all(held_out(w) for w in test)
    train_words = random_words(300, torch.Generator().manual_seed(5), want_held_out=False)
    assert not any(held_out(w) for w in train_words)
    assert accuracy(model, test) >= 0.9
    src, pad, dec, _ = batch(["abcdef"])                               # the anti-diagonal
    maps = model(src, dec, src_padding=pad, return_attention=True).cross_attentions[-1][0].mean(0)
    assert [int(maps[i, :6].argmax()) for i in range(6)] == [5, 4, 3, 2, 1, 0]


@pytest.mark.parametrize("setting", [{"token_mix": 4}, {"value_embeds": True},
                                     {"skip_connections": True}, {"logit_softcap": 30.0},
                                     {"causal": False}, {"readout": "adaptive"}])
def test_decoder_only_options_are_refused_not_ignored(setting):
    """The encoder-decoder builds none of these; silently dropping one would make a
    learner believe it was trained with it."""
    from model.config import ModelError
    from model.seq2seq import EncoderDecoder
    # Said first: an adaptive readout would otherwise be asked for its shortlist.
    with pytest.raises(ModelError, match=f"does not build model.{next(iter(setting))}=.*an option"):
        EncoderDecoder(ModelConfig(vocab_size=29, block_size=11, n_layer=1, n_head=2,
                                   n_embd=16, position="learned", **setting))
