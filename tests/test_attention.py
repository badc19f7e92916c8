"""The article's claims about scaled dot-product attention, checked on the code that
implements them (model/attention.py), and every backend against a float64 reference."""
import math
import warnings

import numpy as np
import pytest
import torch

from model.attention import ATTENTION_BACKENDS, MultiHeadAttention, eager_attention
from model.attention import Mask, visible
from model.config import ModelConfig
from model.positions import POSITION_ENCODINGS, PositionEncoding
from reference import attention as reference_attention, mask_rule


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
    out, w = eager_attention(q, k, v, Mask.over(2, 1, 3), need_weights=True)
    assert torch.allclose(w.flatten(), weights, atol=1e-6)
    assert out.item() == pytest.approx(6.1, abs=1e-5)


def test_attention_rows_sum_to_one():
    q, k, v = torch.randn(3, 2, 3, 10, 8).unbind(0)
    _, w = eager_attention(q, k, v, Mask.over(0, 10, 10), need_weights=True)
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
    chunk = Mask.over(3, 2, 5).dense
    assert chunk.tolist() == [[True, True, True, True, False], [True] * 5]


def test_sliding_window_and_global_tokens():
    m = visible(torch.arange(5), torch.arange(5), window=2).int()
    assert m.tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0],
                          [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]
    g = visible(torch.arange(5), torch.arange(5), window=2, n_global=1).int()
    assert g[:, 0].tolist() == [1, 1, 1, 1, 1] and g[4].tolist() == [1, 0, 0, 1, 1]
    assert not Mask.over(11, 1, 12, window=4).sees_everything
    assert Mask.over(3, 1, 4, window=4).sees_everything


def test_the_rule_agrees_with_the_reference_rule():
    for window, n_global in [(0, 0), (3, 0), (3, 2), (1, 0)]:
        ours = visible(torch.arange(4, 10), torch.arange(10), window, n_global).numpy()
        assert np.array_equal(ours, mask_rule(range(4, 10), range(10), window, n_global))


# (q_start, q_len, k_len, window, n_global): full sequences, a chunk after a cache, and
# decoding one token, with and without a window and global tokens.
MASKS = {
    "causal": (0, 20, 20, 0, 0), "causal chunk": (8, 12, 20, 0, 0), "causal decode": (19, 1, 20, 0, 0),
    "window": (0, 20, 20, 4, 0), "window chunk": (8, 12, 20, 4, 0), "window decode": (19, 1, 20, 4, 0),
    "window+global": (0, 20, 20, 4, 2), "window+global chunk": (8, 12, 20, 4, 2),
    "window+global decode": (19, 1, 20, 4, 2), "window 7, ragged blocks": (0, 20, 20, 7, 3),
}
# Backends with no backward on a CPU in torch (flex): their gradients are checked on a
# GPU by test_flex_gradients_match_the_reference_on_a_gpu.
CPU_FORWARD_ONLY = {n for n, b in ATTENTION_BACKENDS.items() if not b.trains_on_cpu}


def _inputs(mask_spec, position, seed=0):
    q_start, q_len, k_len, window, n_global = mask_spec
    g = torch.Generator().manual_seed(seed)
    B, H, D = 2, 4, 16
    cfg = ModelConfig(vocab_size=8, n_head=H, n_embd=H * D, block_size=32, position=position,
                      sliding_window=window, n_global=n_global)
    pos = POSITION_ENCODINGS[position](cfg).double()
    q = torch.randn(B, H, q_len, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, H, k_len, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, k_len, D, generator=g, dtype=torch.float64)
    q, k = pos.rotate(q, q_start), pos.rotate(k, 0)        # keys sit at positions 0..k_len-1
    mask = Mask.over(q_start, q_len, k_len, window=window, n_global=n_global,
                     bias_fn=pos.score_bias)
    return q, k, v, mask, POSITION_ENCODINGS[position](cfg).score_bias


def _reference_case(mask_name, position):
    """Inputs for one cell, and the float64 reference's output and gradients for them."""
    q64, k64, v64, mask, bias_fn32 = _inputs(MASKS[mask_name], position)
    q_start, q_len, k_len, window, n_global = MASKS[mask_name]
    allowed = mask_rule(range(q_start, q_start + q_len), range(k_len), window, n_global)
    bias = None if mask.bias is None else mask.bias.numpy()
    ref, _, backward = reference_attention(q64.numpy(), k64.numpy(), v64.numpy(), allowed, bias)
    d_out = np.random.default_rng(1).standard_normal(ref.shape)
    return (q64, k64, v64), bias_fn32, ref, d_out, backward(d_out)


@pytest.mark.parametrize("position", sorted(POSITION_ENCODINGS))
@pytest.mark.parametrize("mask_name", sorted(MASKS))
@pytest.mark.parametrize("backend", sorted(ATTENTION_BACKENDS))
def test_every_backend_matches_the_float64_reference(backend, mask_name, position):
    (q64, k64, v64), bias_fn32, ref, d_out, ref_grads = _reference_case(mask_name, position)
    q_start, q_len, k_len, window, n_global = MASKS[mask_name]

    q, k, v = (t.float().requires_grad_(backend not in CPU_FORWARD_ONLY) for t in (q64, k64, v64))
    mask32 = Mask.over(q_start, q_len, k_len, window=window, n_global=n_global, bias_fn=bias_fn32)
    out, _ = ATTENTION_BACKENDS[backend](q, k, v, mask32)
    np.testing.assert_allclose(out.detach().numpy(), ref, atol=2e-5, rtol=1e-5)
    if backend in CPU_FORWARD_ONLY:
        return
    out.backward(torch.from_numpy(d_out).float())
    for name, t, expected in zip("qkv", (q, k, v), ref_grads):
        np.testing.assert_allclose(t.grad.numpy(), expected, atol=5e-5, rtol=1e-4, err_msg=name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex has a backward on GPUs only")
@pytest.mark.parametrize("position", sorted(POSITION_ENCODINGS))
@pytest.mark.parametrize("mask_name", ["causal", "window", "window+global", "window 7, ragged blocks"])
def test_flex_gradients_match_the_reference_on_a_gpu(mask_name, position):
    (q64, k64, v64), bias_fn32, ref, d_out, ref_grads = _reference_case(mask_name, position)
    q_start, q_len, k_len, window, n_global = MASKS[mask_name]
    q, k, v = (t.float().cuda().requires_grad_() for t in (q64, k64, v64))
    # The bias's tensors (ALiBi's slopes) on the GPU too, as a model's buffers are: the
    # compiled kernel cannot read a CPU tensor.
    cfg = ModelConfig(vocab_size=8, n_head=q.shape[1], n_embd=q.shape[1] * q.shape[-1],
                      block_size=32, position=position, sliding_window=window, n_global=n_global)
    bias_fn32 = POSITION_ENCODINGS[position](cfg).cuda().score_bias
    mask32 = Mask(q_start, q_len, torch.arange(k_len, device="cuda"), window=window,
                  n_global=n_global, bias_fn=bias_fn32)
    out, _ = ATTENTION_BACKENDS["flex"](q, k, v, mask32)
    np.testing.assert_allclose(out.detach().cpu().numpy(), ref, atol=2e-4, rtol=1e-3)
    out.backward(torch.from_numpy(d_out).float().cuda())
    for name, t, expected in zip("qkv", (q, k, v), ref_grads):
        np.testing.assert_allclose(t.grad.cpu().numpy(), expected, atol=5e-4, rtol=1e-3, err_msg=name)


def test_eager_weights_equal_the_reference_and_hide_exactly_the_masked_keys():
    q, k, v, mask, _ = _inputs(MASKS["window+global chunk"], "alibi")
    _, ref_p, _ = reference_attention(q.numpy(), k.numpy(), v.numpy(), mask.dense.numpy(),
                                      mask.bias.numpy())
    _, w = eager_attention(q, k, v, mask, need_weights=True)
    np.testing.assert_allclose(w.numpy(), ref_p, atol=1e-12)
    assert (w[..., ~mask.dense] == 0).all() and (w[..., mask.dense] > 0).all()


def test_future_weights_are_exactly_zero():
    q, k, v = torch.randn(3, 2, 3, 16, 8).unbind(0)
    _, w = eager_attention(q, k, v, Mask.over(0, 16, 16), need_weights=True)
    above = torch.triu(torch.ones(16, 16, dtype=torch.bool), diagonal=1)
    assert (w[..., above] == 0).all()
    assert (w[..., ~above] > 0).all()


@pytest.mark.parametrize("backend", sorted(set(ATTENTION_BACKENDS) - {"eager"}))
def test_fused_backends_refuse_to_return_weights(backend):
    q, k, v = torch.randn(3, 1, 2, 12, 8).unbind(0)
    with pytest.raises(ValueError, match="eager"):
        ATTENTION_BACKENDS[backend](q, k, v, Mask.over(0, 12, 12), need_weights=True)


def test_without_positions_attention_is_permutation_equivariant():
    cfg = ModelConfig(vocab_size=10, n_layer=1, n_head=4, n_embd=32, position="none")
    attn = MultiHeadAttention(cfg, 0).eval()
    x = torch.randn(1, 9, 32)
    perm = torch.randperm(9)
    everything = Mask(q_start=9, q_len=9, k_pos=torch.zeros(9, dtype=torch.long))  # no mask
    out, _ = attn(x, PositionEncoding(cfg), everything)
    out_perm, _ = attn(x[:, perm], PositionEncoding(cfg), everything)
    assert torch.allclose(out_perm, out[:, perm], atol=1e-6)
    assert not torch.allclose(out_perm, out, atol=1e-3)   # the outputs did move


@pytest.mark.parametrize("n_kv_head", [1, 2, 4])
def test_grouped_query_attention_shapes_and_mha_identity(n_kv_head):
    cfg = ModelConfig(vocab_size=10, n_layer=1, n_head=4, n_kv_head=n_kv_head, n_embd=32)
    attn = MultiHeadAttention(cfg, 0)
    assert attn.w_qkv.out_features == (4 + 2 * n_kv_head) * 8
    out, _ = attn(torch.randn(2, 5, 32), PositionEncoding(cfg), Mask.over(0, 5, 5))
    assert out.shape == (2, 5, 32)
    # n_kv_head == n_head is plain multi-head attention: the same layer, the same output.
    plain = MultiHeadAttention(ModelConfig(vocab_size=10, n_layer=1, n_head=4, n_embd=32), 0)
    if n_kv_head == 4:
        plain.load_state_dict(attn.state_dict())
        x = torch.randn(2, 5, 32)
        a, _ = attn(x, PositionEncoding(cfg), Mask.over(0, 5, 5))
        b, _ = plain(x, PositionEncoding(cfg), Mask.over(0, 5, 5))
        assert torch.equal(a, b)


def _rope_reference(x, theta):
    """RoPE from the paper in float64: pair (x[i], x[i + d/2]) of the vector at position
    p turns by the angle p * theta^(-2i/d)."""
    T, d = x.shape[-2], x.shape[-1]
    angle = np.arange(T)[:, None] * theta ** (-np.arange(0, d, 2) / d)[None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([x1 * np.cos(angle) - x2 * np.sin(angle),
                           x2 * np.cos(angle) + x1 * np.sin(angle)], axis=-1)


@pytest.mark.parametrize("n_kv_head", [1, 2, 4])
@pytest.mark.parametrize("position", ["none", "rope", "alibi"])
@pytest.mark.parametrize("backend", sorted(ATTENTION_BACKENDS))
def test_the_multi_head_layer_equals_an_independent_float64_reference(n_kv_head, position, backend):
    """The whole layer against NumPy: projections, positions applied by the reference's
    own code, each key/value head repeated for its group of query heads (GQA,
    arXiv:2305.13245), the article's attention, heads side by side, W_O."""
    import numpy as np
    from tests.reference import attention as ref_attention, mask_rule
    from model.positions import POSITION_ENCODINGS
    window = 6 if ATTENTION_BACKENDS[backend].needs_window else 0
    if not ATTENTION_BACKENDS[backend].trains_on_cpu and position == "alibi":
        pytest.skip("flex's score_mod path is compiled: checked on a GPU")
    H, C, T, theta = 4, 32, 12, 500.0
    cfg = ModelConfig(n_embd=C, n_head=H, n_kv_head=n_kv_head, block_size=T, position=position,
                      attention=backend, sliding_window=window, rope_theta=theta)
    # float64 except flex, which compiles float32 kernels only on a CPU; RoPE's angle
    # table is float32 by design (its rounding, ~1e-8, is far below a dropped rotation).
    dtype = torch.float64 if ATTENTION_BACKENDS[backend].trains_on_cpu else torch.float32
    atol = 2e-5 if dtype == torch.float32 else 1e-6 if position == "rope" else 1e-10
    torch.manual_seed(0)
    layer = MultiHeadAttention(cfg, 0).to(dtype)
    positions = POSITION_ENCODINGS[position](cfg)
    x = torch.randn(2, T, C, dtype=dtype)
    mask = Mask(q_start=0, q_len=T, k_pos=torch.arange(T), window=window,
                bias_fn=positions.score_bias)
    with torch.no_grad():
        out, _ = layer(x, positions, mask)

    D = C // H
    w_qkv, w_o = (w.detach().double().numpy() for w in (layer.w_qkv.weight, layer.w_o.weight))
    qkv = x.double().numpy() @ w_qkv.T                                    # (B, T, (H + 2·H_kv)·D)
    q = qkv[..., : H * D].reshape(2, T, H, D).transpose(0, 2, 1, 3)
    k = qkv[..., H * D:(H + n_kv_head) * D].reshape(2, T, n_kv_head, D).transpose(0, 2, 1, 3)
    v = qkv[..., (H + n_kv_head) * D:].reshape(2, T, n_kv_head, D).transpose(0, 2, 1, 3)
    if position == "rope":
        q, k = _rope_reference(q, theta), _rope_reference(k, theta)
    group = H // n_kv_head                                      # query heads per key/value head
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    bias = None
    if position == "alibi":                                     # slopes 2^(-8h/H), h = 1..H
        slopes = 2.0 ** (-8.0 * np.arange(1, H + 1) / H)
        distance = np.arange(T)[:, None] - np.arange(T)[None, :]
        bias = -slopes[:, None, None] * distance
    visible = mask_rule(np.arange(T), np.arange(T), window)
    heads, _, _ = ref_attention(q, k, v, visible, bias)
    expected = heads.transpose(0, 2, 1, 3).reshape(2, T, C) @ w_o.T
    np.testing.assert_allclose(out.double().numpy(), expected, atol=atol, rtol=0)


def test_flex_compiles_for_new_lengths_without_one_graph_per_length():
    """Prompts of six lengths: the flex kernel is not compiled six times (each ~3 s on
    a CPU, and past torch's recompile limit the slow unfused path)."""
    from torch._dynamo.utils import counters
    from model import flex
    flex._kernel.cache_clear()
    torch._dynamo.reset()
    counters.clear()
    for T in (64, 96, 128, 160, 200, 256):
        q = torch.randn(1, 2, T, 16)
        mask = Mask.over(0, T, T, window=32)
        out = flex.attend(q, q, q, mask)
        ref, _ = eager_attention(q, q, q, mask)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] <= 3


def _flex_cases():
    """Short lengths (on AVX2 CPUs torch's compiled kernel read memory it never wrote at
    8 and 24 with d_k = 8), plain causal and ALiBi with a window and global keys: two
    kernels to compile, seconds each."""
    from model.positions import alibi_slopes
    slopes = alibi_slopes(4)

    def alibi(q_pos, k_pos, head=None):
        distance = (q_pos - k_pos).float()
        return -(slopes[head] if head is not None else slopes.view(-1, 1, 1)) * distance
    yield 8, {}
    yield 24, dict(window=6, n_global=2, bias_fn=alibi)


def _numpy_flex_reference(q, k, v, mask):
    T = mask.q_len
    bias = None
    if mask.bias_fn is not None:
        bias = mask.bias_fn(torch.arange(T)[:, None], torch.arange(T)[None, :]).double().numpy()
    visible = mask_rule(np.arange(T), np.arange(T), mask.window, mask.n_global)
    out, _, _ = reference_attention(*(x.double().numpy() for x in (q, k, v)), visible, bias)
    return out


def test_flex_is_right_at_short_lengths_and_with_alibi_in_a_window():
    """Several inputs per case, each tensor allocated on its own, and before each call
    blocks of NaN handed back to the allocator: the faulty kernel read memory beside its
    inputs, so it was right or wrong for the same input depending on what lay there."""
    from model import flex
    for T, kw in _flex_cases():
        for seed in range(4):
            torch.manual_seed(seed)
            q, k, v = (torch.randn(2, 4, T, 8) for _ in range(3))
            mask = Mask.over(0, T, T, **kw)
            poison = [torch.full((n,), float("nan")) for n in (64, 256, 1024, 4096, 16384) * 4]
            del poison
            out = flex.attend(q, k, v, mask)
            np.testing.assert_allclose(out.double().numpy(), _numpy_flex_reference(q, k, v, mask),
                                       atol=1e-5, rtol=0, err_msg=f"T={T} {sorted(kw)}")


def _planted_case():
    """Inputs of the last flex case, for the tests that plant a kernel."""
    torch.manual_seed(0)
    T, kw = list(_flex_cases())[-1]
    q, k, v = torch.randn(3, 1, 4, T, 8).unbind(0)
    return q, k, v, Mask.over(0, T, T, **kw)


def _assert_dense_answer(out, q, k, v, mask):
    np.testing.assert_allclose(out.double().numpy(), _numpy_flex_reference(q, k, v, mask),
                               atol=1e-5, rtol=0)


def test_a_flex_kernel_that_disagrees_with_the_rule_is_never_used(monkeypatch):
    """A wrong compiled kernel (planted) is caught on the first call of its shape: the
    answer comes from the dense path, with one warning, and the kernel is not asked again."""
    from model import flex
    calls = []

    def wrong(q, k, v, mask):
        calls.append(q.shape)
        return torch.zeros_like(q)
    monkeypatch.setattr(flex, "_fused", wrong)
    monkeypatch.setattr(flex, "_verdicts", {})
    q, k, v, mask = _planted_case()
    with pytest.warns(RuntimeWarning, match="disagrees with the mask rule"):
        _assert_dense_answer(flex.attend(q, k, v, mask), q, k, v, mask)
    _assert_dense_answer(flex.attend(q, k, v, mask), q, k, v, mask)
    assert len(calls) == 1


def test_a_flex_kernel_that_does_not_compile_gives_the_dense_answer_once_warned(monkeypatch):
    """torch 2.11's CUDA lowering refused some score_mods outright (an InductorError at the
    first call): the call answers from the dense path with one warning naming why, and
    the kernel is not compiled again for that shape."""
    from model import flex
    calls = []

    def broken(q, k, v, mask):
        calls.append(q.shape)
        raise torch._inductor.exc.InductorError(RuntimeError("LoweringException: planted"), None)
    monkeypatch.setattr(flex, "_fused", broken)
    monkeypatch.setattr(flex, "_verdicts", {})
    q, k, v, mask = _planted_case()
    T = mask.q_len
    warned = []
    for _ in range(2):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            _assert_dense_answer(flex.attend(q, k, v, mask), q, k, v, mask)
        warned.append([str(w.message) for w in seen])
    assert len(warned[0]) == 1 and "did not compile (InductorError" in warned[0][0]
    assert warned[1] == [] and len(calls) == 1
    # Another length of the same kind: not compiled again, not warned again.
    q2, k2, v2 = torch.randn(3, 1, 4, T + 5, 8).unbind(0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        flex.attend(q2, k2, v2, Mask.over(0, T + 5, T + 5, window=mask.window,
                                          n_global=mask.n_global, bias_fn=mask.bias_fn))
    assert seen == [] and len(calls) == 1


def test_flex_takes_heads_its_kernel_refuses_to_the_dense_path(monkeypatch):
    """The CUDA kernel needs heads of 16 or more: narrower ones are answered densely, with
    one warning, without asking the kernel (which would fail to compile), also inside a
    compiled model; the rule itself reads the device and the width."""
    from model import flex
    wide, narrow = torch.empty(1, 2, 8, 16, device="meta"), torch.empty(1, 2, 8, 8, device="meta")
    assert flex.fits(wide) and flex.fits(narrow)                  # not on a GPU: any width
    cuda = type("CudaLike", (), {"is_cuda": True, "shape": narrow.shape})()
    assert not flex.fits(cuda)
    cuda.shape = wide.shape
    assert flex.fits(cuda)

    calls = []
    monkeypatch.setattr(flex, "fits", lambda q: False)
    monkeypatch.setattr(flex, "_fused", lambda *a: calls.append(1))
    monkeypatch.setattr(flex, "_verdicts", {})
    q, k, v, mask = _planted_case()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        outs = [flex.attend(q, k, v, mask), flex.attend(q, k, v, mask),
                torch.compile(flex.attend, fullgraph=True)(q, k, v, mask)]
    assert len([w for w in seen if "narrower than 16" in str(w.message)]) == 1 and calls == []
    for out in outs:
        _assert_dense_answer(out, q, k, v, mask)


def test_a_long_flex_block_mask_is_built_without_the_t_by_t_mask():
    """At T = 16,384 the whole boolean mask alone would be 256 MiB; building the block
    mask must stay far below that (measured in a process of its own)."""
    import subprocess
    import sys
    from conftest import ROOT
    code = ("import resource, sys; sys.path.insert(0, sys.argv[1]); from model import flex; from model.attention import rule; "
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; "
            "flex.block_mask(16384, 256, 0, 'cpu', rule); "
            "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)")
    proc = subprocess.run([sys.executable, "-c", code, str(ROOT)], capture_output=True, text=True,
                          timeout=300)
    grown_mib = float(proc.stdout.strip().splitlines()[-1])
    assert grown_mib < 128, proc.stderr[-500:]


def test_hide_sets_hidden_keys_and_leaves_a_mask_that_hides_none_alone():
    """Mask.hide, the one line a mechanism without the formula masks with: every key the
    rule hides gets the value, every visible one keeps its own, padding included; where
    nothing is hidden (one decoded token, no window), x itself comes back."""
    x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(0))
    pad = torch.tensor([[False] * 6, [True, False, False, False, False, False]])
    mask = Mask.over(0, 6, 6, window=3, key_padding=pad)
    hidden = mask.hide(x, 0.0)
    q, k = torch.arange(6)[:, None], torch.arange(6)[None, :]
    visible = ((k <= q) & (q - k < 3))[None, None] & ~pad[:, None, None, :]
    assert torch.equal(hidden, torch.where(visible, x, torch.zeros(())))
    row = x[..., :1, :]
    assert Mask.over(5, 1, 6).hide(row, float("-inf")) is row
