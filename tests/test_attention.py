"""The article's claims about scaled dot-product attention, checked on the code that
implements them (model/attention.py)."""
import math

import pytest
import torch

from model.attention import ATTENTION_BACKENDS, Mask, MultiHeadAttention, eager_attention, visible
from model.config import ModelConfig
from model.positions import PositionEncoding


def test_softmax_of_the_articles_scores():
    p = torch.softmax(torch.tensor([1.0, 2.0, 3.0]), dim=0)
    assert torch.allclose(p, torch.tensor([0.09, 0.24, 0.67]), atol=0.005)
    # The same scores eight times larger: the softmax saturates to nearly one-hot.
    p8 = torch.softmax(torch.tensor([8.0, 16.0, 24.0]), dim=0)
    assert torch.allclose(p8, torch.tensor([0.0, 0.0, 1.0]), atol=0.001)
    assert p8[2] > 0.999


def test_movie_night_blend_through_the_attention_function():
    # One query, three keys whose scores softmax to (0.5, 0.3, 0.2), values 9, 2 and 5:
    # the output is the weighted average 0.5*9 + 0.3*2 + 0.2*5 = 6.1.
    weights = torch.tensor([0.5, 0.3, 0.2])
    q = torch.ones(1, 1, 1, 1)                               # d_k = 1, so no scaling
    k = weights.log().view(1, 1, 3, 1)                       # q·k = log w
    v = torch.tensor([9.0, 2.0, 5.0]).view(1, 1, 3, 1)
    out, w = eager_attention(q, k, v, Mask(q_start=2, q_len=1, k_len=3), need_weights=True)
    assert torch.allclose(w.flatten(), weights, atol=1e-6)
    assert out.item() == pytest.approx(6.1, abs=1e-5)


def test_attention_rows_sum_to_one():
    q, k, v = torch.randn(3, 2, 3, 10, 8).unbind(0)
    _, w = eager_attention(q, k, v, Mask(0, 10, 10), need_weights=True)
    assert torch.allclose(w.sum(-1), torch.ones(2, 3, 10), atol=1e-6)


@pytest.mark.parametrize("d_k,expected", [(4, 2.0), (64, 8.0), (512, 22.6)])
def test_dot_products_grow_like_sqrt_dk_and_scaling_removes_it(d_k, expected):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(20000, d_k, generator=g)
    k = torch.randn(20000, d_k, generator=g)
    dots = (q * k).sum(-1)
    assert dots.abs().pow(2).mean().sqrt().item() == pytest.approx(expected, rel=0.05)
    assert (dots / math.sqrt(d_k)).std().item() == pytest.approx(1.0, rel=0.05)


def test_mask_rule_from_absolute_positions():
    m = visible(torch.arange(3), torch.arange(3))
    assert m.tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    # A 2-token chunk at positions 3-4 after a 3-token cache: every cached key visible,
    # and the chunk causal within itself (is_causal's top-left triangle would hide keys).
    chunk = Mask(q_start=3, q_len=2, k_len=5).dense
    assert chunk.tolist() == [[True, True, True, True, False], [True] * 5]


def _qkv(B=2, H=3, T=12, D=8, Tk=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    Tk = Tk or T
    return (torch.randn(B, H, T, D, generator=g), torch.randn(B, H, Tk, D, generator=g),
            torch.randn(B, H, Tk, D, generator=g))


MASKS = {  # (q_start, q_len, k_len, window)
    "square causal": (0, 12, 12, 0), "chunk after cache": (5, 7, 12, 0),
    "one token decode": (11, 1, 12, 0), "window 4": (0, 12, 12, 4),
    "window 4 chunk after cache": (5, 7, 12, 4), "window 4 decode": (11, 1, 12, 4),
}


def test_sliding_window_rule():
    m = visible(torch.arange(5), torch.arange(5), window=2).int()
    assert m.tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0],
                          [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]
    assert not Mask(q_start=11, q_len=1, k_len=12, window=4).sees_everything
    assert Mask(q_start=3, q_len=1, k_len=4, window=4).sees_everything


@pytest.mark.parametrize("backend", sorted(ATTENTION_BACKENDS))
@pytest.mark.parametrize("mask_name", sorted(MASKS))
def test_every_backend_equals_eager(backend, mask_name):
    q_start, q_len, k_len, window = MASKS[mask_name]
    q, k, v = _qkv(T=q_len, Tk=k_len)
    mask = Mask(q_start, q_len, k_len, window)
    if window:                           # check the eager path against the rule itself
        _, w = eager_attention(q, k, v, mask, need_weights=True)
        assert torch.equal(w[0, 0] > 0, mask.dense)
    q.requires_grad_(True)
    ref, _ = eager_attention(q, k, v, mask)
    out, _ = ATTENTION_BACKENDS[backend](q, k, v, mask)
    assert torch.allclose(out, ref, atol=1e-6)
    g_ref, = torch.autograd.grad(ref.sum(), q)
    g_out, = torch.autograd.grad(out.sum(), q)
    assert torch.allclose(g_out, g_ref, atol=1e-5)


def test_future_weights_are_exactly_zero():
    q, k, v = _qkv(T=16)
    _, w = eager_attention(q, k, v, Mask(0, 16, 16), need_weights=True)
    above = torch.triu(torch.ones(16, 16, dtype=torch.bool), diagonal=1)
    assert (w[..., above] == 0).all()
    assert (w[..., ~above] > 0).all()


def test_sdpa_refuses_to_return_weights():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="eager"):
        ATTENTION_BACKENDS["sdpa"](q, k, v, Mask(0, 12, 12), need_weights=True)


def test_without_positions_attention_is_permutation_equivariant():
    cfg = ModelConfig(vocab_size=10, n_layer=1, n_head=4, n_embd=32, position="none")
    attn = MultiHeadAttention(cfg, 0).eval()
    x = torch.randn(1, 9, 32)
    perm = torch.randperm(9)
    everything = Mask(q_start=9, q_len=9, k_len=9)    # no mask: every token sees every token
    out, _ = attn(x, PositionEncoding(cfg), everything)
    out_perm, _ = attn(x[:, perm], PositionEncoding(cfg), everything)
    assert torch.allclose(out_perm, out[:, perm], atol=1e-6)
    assert not torch.allclose(out_perm, out, atol=1e-3)   # the outputs did move


@pytest.mark.parametrize("n_kv_head", [1, 2, 4])
def test_grouped_query_attention_shapes_and_mha_identity(n_kv_head):
    cfg = ModelConfig(vocab_size=10, n_layer=1, n_head=4, n_kv_head=n_kv_head, n_embd=32)
    attn = MultiHeadAttention(cfg, 0)
    assert attn.w_qkv.out_features == (4 + 2 * n_kv_head) * 8
    out, _ = attn(torch.randn(2, 5, 32), PositionEncoding(cfg), Mask(0, 5, 5))
    assert out.shape == (2, 5, 32)
    if n_kv_head == 4:           # n_kv_head == n_head is plain multi-head attention
        plain = MultiHeadAttention(ModelConfig(vocab_size=10, n_layer=1, n_head=4, n_embd=32), 0)
        assert plain.w_qkv.weight.shape == attn.w_qkv.weight.shape
