"""Temperature, top-k and top-p (model/sampling.py)."""
import pytest
import torch

from model.sampling import next_token_distribution, sample_next

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])


def test_temperature_one_is_plain_softmax_and_rows_sum_to_one():
    p = next_token_distribution(LOGITS, 1.0)
    assert torch.allclose(p, torch.softmax(LOGITS, -1))
    assert p.sum().item() == pytest.approx(1.0)


def test_low_temperature_sharpens_high_flattens():
    sharp, flat = next_token_distribution(LOGITS, 0.5), next_token_distribution(LOGITS, 2.0)
    base = next_token_distribution(LOGITS, 1.0)
    assert sharp[0, 0] > base[0, 0] > flat[0, 0]


def test_top_k_keeps_k_tokens():
    p = next_token_distribution(LOGITS, 1.0, top_k=2)
    assert (p > 0).sum().item() == 2 and p[0, :2].sum().item() == pytest.approx(1.0)


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.softmax(LOGITS, -1)[0]                     # 0.53, 0.20, 0.12, 0.07, 0.03
    p = next_token_distribution(LOGITS, 1.0, top_p=0.7)
    kept = (p[0] > 0).sum().item()
    assert probs[:kept].sum() >= 0.7 and probs[:kept - 1].sum() < 0.7
    assert next_token_distribution(LOGITS, 1.0, top_p=0.01)[0, 0].item() == 1.0


def test_greedy_and_seeded_sampling():
    assert sample_next(LOGITS, temperature=0).item() == 0
    a = [sample_next(LOGITS, generator=torch.Generator().manual_seed(3)).item() for _ in range(3)]
    assert len(set(a)) == 1


def test_explainer_probabilities_sum_to_one_and_match_the_sampler():
    from engine.inference import StepExplainer
    from data.tokenizer import CharTokenizer
    from model import GPT, ModelConfig
    torch.manual_seed(0)
    tok = CharTokenizer("abcdefgh ")
    model = GPT(ModelConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_embd=16,
                            block_size=16)).eval()
    settings = dict(temperature=0.7, top_k=4, top_p=0.8)
    prompt = torch.tensor([[0, 1]])
    plain = [t.item() for t in model.generate(prompt, 12, generator=torch.Generator().manual_seed(5),
                                              **settings)]
    explainer = StepExplainer(tok, settings["temperature"], settings["top_k"], settings["top_p"])
    watched = [t.item() for t in model.generate(prompt, 12, generator=torch.Generator().manual_seed(5),
                                                on_step=explainer, **settings)]
    assert watched == plain                       # watching does not change what is drawn
    assert len(explainer.steps) == 12
    for step in explainer.steps:
        assert step["after"].sum().item() == pytest.approx(1.0, abs=1e-6)
        assert step["p_after"] > 0 and step["kept"] <= 4
        befores = [b for _, b, _ in step["candidates"]]
        assert befores == sorted(befores, reverse=True)
        assert "chosen" in explainer.render(step, 1)


# -- statistics: the sampler draws from the distribution it claims ---------------------
import numpy as np  # noqa: E402

WIDE = torch.tensor([3.0, 2.5, 1.0, 0.9, 0.2, -0.5, -1.0, -3.0])     # no ties
CHI2_DF7 = 29.9            # the 0.9999 quantile of chi-square with 7 degrees of freedom


def reference(logits, temperature=1.0, top_k=0, top_p=1.0) -> np.ndarray:
    """softmax(logits / T), the k best kept, then the smallest set whose mass reaches
    p kept, renormalised: written from the papers in float64 (arXiv:1904.09751)."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_k:
        p[np.argsort(-p, kind="stable")[top_k:]] = 0
        p /= p.sum()
    if top_p < 1:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        keep = order[: int(np.searchsorted(cum, top_p - 1e-12)) + 1]
        q = np.zeros_like(p)
        q[keep] = p[keep]
        p = q / q.sum()
    return p


def draws(logits, n=20_000, **kw):
    g = torch.Generator().manual_seed(1234)
    return sample_next(logits.expand(n, -1), generator=g, **kw)[:, 0].numpy()


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7),
                                dict(temperature=1.5, top_k=3), dict(temperature=0.8, top_p=0.6),
                                dict(temperature=1.3, top_k=5, top_p=0.8)])
def test_draws_match_the_reference_distribution_by_chi_square(kw):
    expected = reference(WIDE, **kw)
    counts = np.bincount(draws(WIDE, **kw), minlength=len(WIDE))
    assert counts[expected == 0].sum() == 0                     # never outside the kept set
    kept = expected > 0
    e = expected[kept] * counts.sum()
    chi2 = ((counts[kept] - e) ** 2 / e).sum()
    assert chi2 < CHI2_DF7, (counts, e)
    torch.testing.assert_close(next_token_distribution(WIDE[None], **kw)[0].double(),
                               torch.from_numpy(expected), atol=1e-6, rtol=0)


@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.62, 0.9, 0.999, 1.0])
def test_top_p_keeps_the_smallest_set_reaching_p_at_every_p(top_p):
    p = next_token_distribution(WIDE[None], 1.0, top_p=top_p)[0]
    base = torch.softmax(WIDE, -1)
    kept = p > 0
    assert base[kept].sum() >= top_p - 1e-6                     # reaches p
    assert base[kept].sum() - base[kept].min() < top_p           # and is the smallest that does
    if top_p == 1.0:
        assert kept.all()


def test_top_k_keeps_every_token_tied_with_the_kth():
    """As transformers' TopKLogitsWarper does: a tie at the k-th value is not broken
    by position."""
    tied = torch.tensor([[3.0, 1.0, 1.0, 0.0]])
    assert (next_token_distribution(tied, 1.0, top_k=2) > 0).tolist() == [[True, True, True, False]]


def test_top_p_with_tied_probabilities_keeps_a_set_that_reaches_p():
    tied = torch.tensor([[1.0, 1.0, 1.0, 1.0]])                  # 0.25 each
    for top_p, n in [(0.25, 1), (0.3, 2), (0.5, 2), (0.75, 3), (1.0, 4)]:
        assert (next_token_distribution(tied, 1.0, top_p=top_p) > 0).sum().item() == n


def test_rows_of_a_batch_are_sampled_each_from_its_own_logits():
    batch = torch.stack([WIDE, WIDE.flip(0)])
    g = torch.Generator().manual_seed(7)
    rows = torch.cat([sample_next(batch, temperature=0.5, top_k=2, generator=g) for _ in range(2000)], 1)
    assert set(rows[0].tolist()) == {0, 1} and set(rows[1].tolist()) == {6, 7}
    assert 0.5 < (rows[0] == 0).float().mean() < 0.85             # ~0.73 under T = 0.5


@pytest.mark.parametrize("temperature", [1e-320, 1e-40])
def test_a_tiny_positive_temperature_is_nearly_greedy_not_nan(temperature):
    """logits / 1e-320 overflowed to inf and the softmax gave NaN (a traceback in sample.py,
    "internal error" on the page); shifting by the row's maximum first keeps it finite."""
    logits = torch.tensor([[1.0, 3.0, -2.0, 2.5], [0.0, 0.0, -1.0, -5.0]])
    probs = next_token_distribution(logits, temperature)
    assert not probs.isnan().any()
    assert torch.equal(probs[0], torch.tensor([0.0, 1.0, 0.0, 0.0]))
    assert torch.equal(probs[1], torch.tensor([0.5, 0.5, 0.0, 0.0]))     # a tie stays a tie
    assert sample_next(logits, temperature, generator=torch.Generator().manual_seed(0))[0].item() == 1


@pytest.mark.parametrize("top_p", [1e-300, 1e-46, 5e-324])
def test_a_top_p_below_float32s_range_keeps_the_likeliest_token(top_p):
    """top_p compared with float32 sums rounds 1e-300 to 0, which dropped every token:
    a softmax over -inf gave NaN and torch.multinomial a traceback."""
    probs = next_token_distribution(LOGITS, 1.0, top_p=top_p)
    assert torch.equal(probs, torch.tensor([[1.0, 0.0, 0.0, 0.0, 0.0]]))
    assert sample_next(LOGITS, 1.0, top_p=top_p).item() == 0


@pytest.mark.parametrize("row, expected", [
    ([1.0, float("inf"), 0.0, float("nan")], [0.0, 1.0, 0.0, 0.0]),     # +inf wins, NaN scores nothing
    ([float("inf"), float("inf"), 0.0, 1.0], [0.5, 0.5, 0.0, 0.0]),
    ([float("nan")] * 4, [0.25] * 4),                                   # nothing finite: uniform
    ([float("-inf")] * 4, [0.25] * 4),
    ([3e38, -3e38, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]),                    # finite, but the gap overflows
])
@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=0.5, top_k=2),
                                      dict(temperature=2.0, top_p=0.9), dict(temperature=float("inf"))])
def test_logits_that_overflowed_still_give_a_distribution(row, expected, settings):
    """Weights scaled by 1e30 are finite but overflow in the forward pass: the logits come
    out inf or NaN, and the softmax handed torch.multinomial NaN (a traceback)."""
    logits = torch.tensor([row])
    probs = next_token_distribution(logits, **settings)
    assert torch.isfinite(probs).all() and probs.sum().item() == pytest.approx(1.0)
    if settings == dict(temperature=1.0):
        assert probs[0].tolist() == pytest.approx(expected)
    drawn = sample_next(logits.expand(50, -1), generator=torch.Generator().manual_seed(0), **settings)
    assert (probs[0][drawn[:, 0]] > 0).all()


@pytest.mark.parametrize("prompt,settings,words", [
    ((1, 0), {}, "at least one token"),
    ((2,), {}, "shape \\(batch, length\\)"),
    ((1, 3), {"temperature": -1.0}, "temperature must be 0"),
    ((1, 3), {"temperature": float("nan")}, "temperature must be 0"),
    ((1, 3), {"top_k": -1}, "top_k must be"),
    ((1, 3), {"top_p": 0.0}, "top_p must be more than 0"),
    ((1, 3), {"top_p": 1.5}, "top_p must be more than 0"),
    ((1, 3), {"max_new_tokens": -1}, "max_new_tokens must be"),
])
def test_generate_refuses_what_it_cannot_honour_in_one_line(prompt, settings, words):
    """The Python API meets no command-line parser: a negative temperature sampled greedily
    and an empty prompt failed with an IndexError deep in the first step."""
    from model import GPT, ModelConfig
    from model.config import ModelError
    model = GPT(ModelConfig(vocab_size=11, n_layer=1, n_head=2, n_embd=16, block_size=8)).eval()
    settings = {"max_new_tokens": 2, **settings}
    with pytest.raises(ModelError, match=words):
        model.generate(torch.zeros(prompt, dtype=torch.long), **settings)


def test_sample_py_says_when_the_prompt_is_longer_than_the_context(corpus, tmp_path):
    """The model reads at most block_size tokens: a longer prompt's start was dropped in
    silence. The run's context here is the tiny preset's 32 characters."""
    from conftest import run_script, train_tiny
    run = train_tiny(corpus, tmp_path, "long", "--train.max_iters=2", "--train.eval_interval=2",
                     "--train.eval_iters=1")
    prompt = "To be, or not to be, that is the question: whether 'tis nobler"   # a token a character
    proc = run_script("sample.py", "--run", run, "--max_new_tokens=2", "--device=cpu",
                      f"--prompt={prompt}", check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (f"warning: the prompt is {len(prompt)} tokens and the model reads its last 32; "
            f"the first {len(prompt) - 32} do not shape the text") in proc.stderr
    short = run_script("sample.py", "--run", run, "--max_new_tokens=2", "--device=cpu",
                       "--prompt=To be", check=False)
    assert short.returncode == 0 and "warning" not in short.stderr, short.stderr[-2000:]


def test_generation_reads_a_long_prompt_whole_only_where_a_rolling_cache_or_sinks_keep_it():
    """The warning about a cut prompt follows what _generate reads: a windowed model with
    relative positions (a rolling cache) and a streamed one read every token."""
    from model import GPT, ModelConfig
    from model.decode import prompt_read
    small = dict(vocab_size=11, n_layer=1, n_head=2, n_embd=16, block_size=8)
    plain = GPT(ModelConfig(**small))
    rolling = GPT(ModelConfig(**small, sliding_window=4))
    assert prompt_read(plain, 20, "cache", None) == prompt_read(rolling, 20, "full", None) == 8
    assert prompt_read(rolling, 20, "cache", None) == prompt_read(plain, 20, "cache", 2) == 20
    assert prompt_read(plain, 5, "cache", None) == 5
