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
