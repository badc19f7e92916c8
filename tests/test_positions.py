"""Position encodings (model/positions.py): what each one promises."""
import pytest
import torch

from model import GPT, ModelConfig
from model.positions import POSITION_ENCODINGS, PositionRangeError, RoPE


def _rope_score(rope, q, k, m, n):
    """q at position m against k at position n, after rotation."""
    qr = rope.rotate(q.view(1, 1, 1, -1), m)
    kr = rope.rotate(k.view(1, 1, 1, -1), n)
    return (qr * kr).sum().item()


def test_rope_score_depends_only_on_the_offset():
    rope = RoPE(ModelConfig(vocab_size=8, n_head=1, n_embd=16, block_size=64))
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(16, generator=g), torch.randn(16, generator=g)
    for offset in (0, 1, 5, 17):
        scores = [_rope_score(rope, q, k, n + offset, n) for n in (0, 3, 40, 200)]
        assert max(scores) - min(scores) < 1e-4, (offset, scores)
    # ... and it does depend on the offset.
    assert abs(_rope_score(rope, q, k, 5, 0) - _rope_score(rope, q, k, 6, 0)) > 1e-3


def test_rope_keeps_vector_length():
    rope = RoPE(ModelConfig(vocab_size=8, n_head=2, n_embd=32))
    q = torch.randn(1, 2, 10, 16)
    qr = rope.rotate(q, 7)
    assert torch.allclose(qr.norm(dim=-1), q.norm(dim=-1), atol=1e-5)


def test_rope_forward_and_backward_match_a_float64_numpy_rotation():
    """RoPE's rotation and its hand-written backward against the formula in NumPy: pair
    (x[i], x[i + d/2]) at position p turns by p·θ^(-2i/d); the gradient of Σ w·out is w
    turned back by the same angle."""
    import numpy as np
    d, T, start = 16, 12, 5
    rope = RoPE(ModelConfig(vocab_size=8, n_head=2, n_embd=2 * d, block_size=64))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, T, d, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 2, T, d, generator=g, dtype=torch.float64)
    out = rope.rotate(x, start)
    (out * w).sum().backward()
    angle = (start + np.arange(T))[:, None] * 10000.0 ** (-np.arange(0, d, 2) / d)
    cos, sin = np.cos(angle), np.sin(angle)

    def turn(a, sign):
        a1, a2 = a[..., : d // 2], a[..., d // 2:]
        return np.concatenate([a1 * cos - sign * a2 * sin, a2 * cos + sign * a1 * sin], axis=-1)
    # The table is float32, hence the tolerance.
    np.testing.assert_allclose(out.detach().numpy(), turn(x.detach().numpy(), 1), atol=1e-6)
    np.testing.assert_allclose(x.grad.numpy(), turn(w.numpy(), -1), atol=1e-6)


def numpy_rope(x, positions, inv_freq):
    """The rotation in float64 NumPy: pair (x[i], x[i + d/2]) at position p turns by p·f_i."""
    import numpy as np
    angle = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq
    d = x.shape[-1]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([x1 * np.cos(angle) - x2 * np.sin(angle),
                           x2 * np.cos(angle) + x1 * np.sin(angle)], axis=-1)


@pytest.mark.parametrize("scaling", ["none", "ntk"])
@pytest.mark.parametrize("made", ["GPT(...).double()", "RoPE(...).double()",
                                  "float32, .double(), .float(), .double()"])
def test_a_float64_models_rope_turns_by_float64_angles(scaling, made):
    """A float64 model turns q and k by angles computed in float64, in its table (positions
    below block_size) and past it: within 1e-12 of NumPy, where tables built in float32
    and cast up miss by 1e-7 and more (the angle of position 1000 carries float32's error)."""
    import numpy as np
    d, block = 16, 1024
    config = ModelConfig(vocab_size=8, n_layer=1, n_head=2, n_embd=2 * d, block_size=block,
                         rope_scaling=scaling, rope_factor=4.0)
    if made.startswith("GPT"):
        rope = GPT(config).double().positions
    elif made.startswith("RoPE"):
        rope = RoPE(config).double()
    else:
        rope = RoPE(config).double().float().double()
    theta = 10000.0 * (4.0 ** (d / (d - 2)) if scaling == "ntk" else 1.0)
    inv_freq = theta ** (-np.arange(0, d, 2) / d)
    x = torch.randn(1, 2, 24, d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for start in (0, 997, block - 12, 50_000):              # in the table, across its end, past it
        expected = numpy_rope(x.numpy(), start + np.arange(24), inv_freq)
        assert np.abs(rope.rotate(x, start).numpy() - expected).max() < 1e-12, start
    assert rope.inv_freq.dtype == torch.float64


def test_a_float32_models_rope_turns_by_float32_angles():
    rope = RoPE(ModelConfig(vocab_size=8, n_head=2, n_embd=32, block_size=64))
    reference = 10000.0 ** (-torch.arange(0, 16, 2).float() / 16)
    assert rope.inv_freq.dtype == torch.float32
    assert torch.equal(rope.inv_freq, reference)
    angle = torch.arange(5, 69).float()[:, None] * reference
    cos2, sin2 = rope.turns_at(torch.arange(5, 69), torch.float32)
    assert torch.equal(cos2, torch.cat((angle.cos(), angle.cos()), dim=-1))
    assert torch.equal(sin2, torch.cat((-angle.sin(), angle.sin()), dim=-1))
    half = GPT(ModelConfig(vocab_size=8, n_layer=1, n_head=2, n_embd=32, block_size=64)
               ).to(torch.bfloat16).positions
    assert half.inv_freq.dtype == torch.bfloat16                       # a cast as before
    assert half.turns_at(torch.arange(3), torch.bfloat16)[0].dtype == torch.bfloat16


def test_learned_positions_refuse_sequences_past_their_table():
    model = GPT(ModelConfig(vocab_size=8, n_layer=1, n_head=2, n_embd=16, block_size=8,
                            position="learned"))
    model(torch.zeros(1, 8, dtype=torch.long))               # exactly the table: fine
    with pytest.raises(PositionRangeError, match="block_size"):
        model(torch.zeros(1, 9, dtype=torch.long))


@pytest.mark.parametrize("position", ["none", "sinusoidal", "rope"])
def test_other_encodings_run_past_the_training_context(position):
    model = GPT(ModelConfig(vocab_size=8, n_layer=1, n_head=2, n_embd=16, block_size=8,
                            position=position))
    out = model(torch.zeros(1, 40, dtype=torch.long)).logits
    assert out.shape == (1, 40, 8) and torch.isfinite(out).all()


def test_sinusoidal_values_match_the_formula():
    cfg = ModelConfig(vocab_size=8, n_head=1, n_embd=8, position="sinusoidal")
    pe = POSITION_ENCODINGS["sinusoidal"](cfg).embed(torch.zeros(1, 5, 8), 0)[0]
    pos, i = 3, 1                                            # dimensions 2 and 3
    angle = pos / 10000 ** (2 * i / 8)
    assert pe[pos, 2].item() == pytest.approx(torch.tensor(angle).sin().item(), abs=1e-6)
    assert pe[pos, 3].item() == pytest.approx(torch.tensor(angle).cos().item(), abs=1e-6)


def test_sinusoidal_scales_the_token_embeddings_by_sqrt_d_model_first():
    """x·√d + PE (section 3.4 of arXiv:1706.03762), written out in float64."""
    import numpy as np
    d, T, start = 16, 6, 3
    cfg = ModelConfig(vocab_size=8, n_head=2, n_embd=d, position="sinusoidal")
    x = torch.randn(2, T, d, generator=torch.Generator().manual_seed(0))
    out = POSITION_ENCODINGS["sinusoidal"](cfg).embed(x, start).double().numpy()
    pos = np.arange(start, start + T)[:, None]
    angle = pos / 10000 ** (np.arange(0, d, 2)[None, :] / d)
    pe = np.empty((T, d))
    pe[:, 0::2], pe[:, 1::2] = np.sin(angle), np.cos(angle)
    np.testing.assert_allclose(out, x.double().numpy() * np.sqrt(d) + pe, atol=1e-5, rtol=0)


@pytest.mark.parametrize("position", sorted(POSITION_ENCODINGS))
def test_encodings_distinguish_order_except_none(position):
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=8, n_layer=1, n_head=2, n_embd=16, block_size=8,
                            position=position)).eval()
    a = model(torch.tensor([[1, 2, 3, 4]])).logits[0, -1]
    b = model(torch.tensor([[2, 1, 3, 4]])).logits[0, -1]
    # With no positions the last token sees the same set of (token, value) pairs in a
    # one-layer model, so swapping earlier tokens changes nothing; every encoding does.
    if position == "none":
        assert torch.allclose(a, b, atol=1e-6)
    else:
        assert not torch.allclose(a, b, atol=1e-6)


def test_alibi_slopes_are_the_papers_geometric_series():
    from model.positions import alibi_slopes
    assert alibi_slopes(8).tolist() == [2.0 ** -i for i in range(1, 9)]
    six = alibi_slopes(6).tolist()      # 4 from the power of two below, 2 interleaved from 8
    assert six[:4] == [2.0 ** (-2 * i) for i in range(1, 5)] and six[4:] == [2.0 ** -1, 2.0 ** -3]


def test_alibi_penalises_distance_linearly_and_never_the_token_itself():
    model = GPT(ModelConfig(vocab_size=8, n_layer=1, n_head=4, n_embd=16, position="alibi"))
    bias = model.positions.score_bias(torch.arange(6)[:, None], torch.arange(6)[None, :])
    assert bias.shape == (4, 6, 6) and (bias.diagonal(dim1=1, dim2=2) == 0).all()
    slopes = model.positions.slopes
    assert torch.allclose(bias[:, 5, 2], -3 * slopes)


def _rope(**kw):
    return RoPE(ModelConfig(vocab_size=8, n_head=1, n_embd=64, block_size=32, **kw))


def test_linear_scaling_is_position_interpolation():
    plain, linear = _rope(), _rope(rope_scaling="linear", rope_factor=4.0)
    x = torch.randn(1, 1, 1, 64)
    # Position 8 under 4x interpolation is turned exactly like position 2 unscaled.
    assert torch.allclose(linear.rotate(x, 8), plain.rotate(x, 2), atol=1e-6)


def test_ntk_scaling_raises_the_base_and_keeps_the_fastest_pair():
    plain, ntk = _rope(), _rope(rope_scaling="ntk", rope_factor=4.0)
    assert ntk.inv_freq[0] == plain.inv_freq[0] == 1.0       # local order untouched
    assert (ntk.inv_freq[1:] < plain.inv_freq[1:]).all()
    expected_last = (10000 * 4.0 ** (64 / 62)) ** (-62 / 64)
    assert ntk.inv_freq[-1].item() == pytest.approx(expected_last, rel=1e-5)


def test_yarn_keeps_fast_pairs_interpolates_slow_ones_and_sharpens():
    plain, yarn = _rope(), _rope(rope_scaling="yarn", rope_factor=4.0, rope_original_context=256)
    assert yarn.inv_freq[0] == plain.inv_freq[0]                         # many turns: kept
    assert yarn.inv_freq[-1].item() == pytest.approx(plain.inv_freq[-1].item() / 4, rel=1e-6)
    assert yarn.mscale == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)
    x = torch.randn(1, 1, 3, 64)
    assert torch.allclose(yarn.rotate(x, 0).norm(dim=-1), x.norm(dim=-1) * yarn.mscale, atol=1e-5)


@pytest.mark.parametrize("scaling", ["linear", "ntk", "yarn"])
def test_scaled_rope_models_run_at_four_times_the_context(scaling):
    model = GPT(ModelConfig(vocab_size=8, n_layer=1, n_head=2, n_embd=16, block_size=8,
                            rope_scaling=scaling, rope_factor=4.0))
    out = model(torch.zeros(1, 32, dtype=torch.long)).logits
    assert torch.isfinite(out).all()


def test_two_rope_tables_turning_in_one_pass_each_turn_by_their_own_frequencies():
    """A pass keeps its turning tensors in Mask.shared; a model with two tables (Gemma 3's
    local and global frequencies) must not read the other table's."""
    from model.attention import Mask
    local = RoPE(ModelConfig(vocab_size=8, n_head=2, n_embd=32, rope_theta=10_000.0))
    full = RoPE(ModelConfig(vocab_size=8, n_head=2, n_embd=32, rope_theta=1_000_000.0))
    x = torch.randn(1, 2, 5, 16, generator=torch.Generator().manual_seed(0))
    mask = Mask.over(0, 5, 5)
    local.rotate_in_pass(x, 0, mask.shared)
    assert torch.equal(full.rotate_in_pass(x, 0, mask.shared), full.rotate(x, 0))
