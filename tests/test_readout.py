"""The output layer: the adaptive softmax for large vocabularies (model/readout.py), checked
against the formula of Grave et al. (2017) in float64 NumPy, and the run and the --budget
planner that set it up from the training data."""
import json
from collections import Counter

import numpy as np
import pytest
import torch

from engine import cli
from engine.budget import choose_readout
from model import GPT, ModelConfig, ModelError
from model.readout import frequency_rank, head_macs, shortlist_for
from conftest import run_script
from test_train import tiny_args


def adaptive_model(vocab=40, shortlist=7, seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=vocab, block_size=16, n_layer=2, n_head=2, n_embd=32,
                      tie_embeddings=False, readout="adaptive", readout_shortlist=shortlist)
    model = GPT(cfg).eval()
    counts = torch.randint(1, 1000, (vocab,), generator=torch.Generator().manual_seed(seed + 1))
    model.adaptive.set_frequencies(counts)
    return model, counts


def reference_log_probs(model, h: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """log P(token) for every token id, in float64, from the paper's two-level formula:
    the shortlist (the k most frequent tokens) and one 'rare token' entry share the
    head's softmax; a rare token's probability is that entry's times its own softmax
    over the tail, computed from the projection h·P."""
    sm = model.adaptive.softmax
    k = model.config.readout_shortlist
    w_head = sm.head.weight.detach().double().numpy()             # (k + 1, C)
    proj = sm.tail[0][0].weight.detach().double().numpy()        # (C/4, C)
    w_tail = sm.tail[0][1].weight.detach().double().numpy()      # (V - k, C/4)

    def log_softmax(z):
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    head = log_softmax(h @ w_head.T)
    tail = log_softmax((h @ proj.T) @ w_tail.T)
    by_frequency = np.concatenate([head[:, :k], head[:, k:k + 1] + tail], axis=1)
    order = sorted(range(len(counts)), key=lambda t: (-counts[t], t))   # most frequent first
    out = np.empty_like(by_frequency)
    out[:, order] = by_frequency
    return out


def final_hidden(model, x):
    seen = {}
    handle = model.norm_f.register_forward_hook(lambda m, a, o: seen.setdefault("h", o))
    with torch.no_grad():
        logits = model(x).logits
    handle.remove()
    return seen["h"].reshape(-1, model.config.n_embd).double().numpy(), logits


def test_adaptive_scores_and_loss_follow_the_formula_in_token_order():
    model, counts = adaptive_model()
    x = torch.randint(0, 40, (3, 16), generator=torch.Generator().manual_seed(2))
    y = torch.randint(0, 40, (3, 16), generator=torch.Generator().manual_seed(3))
    y[0, :5] = -1                                                # ignored positions
    h, logits = final_hidden(model, x)
    ref = reference_log_probs(model, h, counts.numpy())
    np.testing.assert_allclose(logits.reshape(-1, 40).double().numpy(), ref, atol=2e-5, rtol=0)
    assert np.allclose(np.exp(ref).sum(-1), 1.0)
    keep = (y != -1).flatten().numpy()
    expected = -ref[np.arange(len(ref))[keep], y.flatten().numpy()[keep]].mean()
    with torch.no_grad():
        assert model(x, y).loss.item() == pytest.approx(expected, abs=2e-5)
    # the same scores through the readout alone, as the logit lens reads a layer
    with torch.no_grad():
        alone = model.readout(torch.from_numpy(h).float().reshape(3, 16, -1))
    torch.testing.assert_close(alone, logits, atol=1e-6, rtol=0)


def test_adaptive_readout_trains_under_bf16_autocast_and_generates():
    model, _ = adaptive_model()
    model.train()
    x = torch.randint(0, 40, (2, 16))
    with torch.autocast("cpu", torch.bfloat16):
        loss = model(x, x).loss
    loss.backward()
    assert loss.dtype == torch.float32 and model.adaptive.softmax.head.weight.grad is not None
    with torch.no_grad():                            # bf16 matmuls, fp32 log-softmax: close
        assert loss.item() == pytest.approx(model(x, x).loss.item(), abs=0.02)
    model.eval()
    tokens = torch.cat(list(model.generate(x[:1, :4], 20, temperature=1.0)), dim=1)
    assert tokens.shape == (1, 20) and 0 <= tokens.min() and tokens.max() < 40


def test_the_shortlist_is_the_fewest_frequent_tokens_covering_95_percent():
    # sorted counts 50, 30, 10, 5, 5 reach 90 after three tokens and 95 after four
    assert shortlist_for(torch.tensor([5, 50, 5, 10, 30])) == 4
    assert shortlist_for(torch.tensor([5, 50, 5, 10, 30]), coverage=0.9) == 3
    assert shortlist_for(torch.tensor([0, 0, 7])) == 1
    assert frequency_rank(torch.tensor([5, 50, 5, 10, 30])).tolist() == [3, 0, 4, 2, 1]


@pytest.mark.parametrize("fields,message", [
    (dict(tie_embeddings=True), "cannot be tied"),
    (dict(zero_head=True), "leave them at their defaults"),
    (dict(readout_shortlist=40), "must be between 1 and"),
    (dict(readout="mixture"), "unknown model.readout"),
])
def test_impossible_adaptive_settings_are_refused(fields, message):
    base = dict(vocab_size=40, block_size=16, n_layer=1, n_head=2, n_embd=32,
                tie_embeddings=False, readout="adaptive", readout_shortlist=7)
    with pytest.raises(ModelError, match=message):
        GPT(ModelConfig(**{**base, **fields}))


def test_the_planner_picks_the_adaptive_readout_only_where_it_halves_the_work():
    zipf = torch.tensor([int(1e9 / (r + 1) ** 1.5) for r in range(3000)])   # steep, like Chinese characters
    cfg = cli.build("cpu", [])
    cfg.model.vocab_size = 3000
    said = []
    choose_readout(cfg.model, zipf, log=said.append)
    assert (cfg.model.readout, cfg.model.tie_embeddings) == ("adaptive", False)
    # attnlab.export refuses the adaptive readout: the line says how to keep a run exportable.
    assert said[0].endswith("so to export the run give --model.readout=full"), said
    assert cfg.model.readout_shortlist == shortlist_for(zipf) < 1500
    flat = torch.tensor([int(1e9 / (r + 1)) for r in range(3000)])   # 95% needs 1,953 of 3,000
    # An alphabet whose frequent letters are few (the bundled plays: 36 of 84 make 95%)
    # would halve its output layer too, but that layer is 1% of the model's work.
    letters = zipf[:84]
    assert head_macs(128, 84, shortlist_for(letters)) < 0.5 * head_macs(128, 84)
    for vocab, counts, fields in ((65, torch.randint(50, 100, (65,)), []),      # an alphabet
                                  (84, letters, []),
                                  (3000, flat, []),
                                  (3000, zipf, ["--model.logit_softcap=15"])):  # a full-layer setting
        cfg = cli.build("cpu", fields)
        cfg.model.vocab_size = vocab
        choose_readout(cfg.model, counts, log=lambda *a: None)
        assert cfg.model.readout == "full" and cfg.model.tie_embeddings


def test_a_run_ranks_the_vocabulary_by_its_training_text_and_keeps_it(corpus, tmp_path):
    run_script(*tiny_args(corpus, tmp_path, "ad", "--model.readout=adaptive",
                          "--model.tie_embeddings=false", "--train.max_iters=4",
                          "--train.eval_interval=2"))
    run_dir = tmp_path / "runs" / "ad"
    saved = json.loads((run_dir / "config.json").read_text())
    text = corpus.read_text()
    train_text = text[:int(len(text) * (1 - saved["data"]["val_fraction"]))]
    chars = sorted(set(text))
    counts = Counter(train_text)
    by_count = sorted(range(len(chars)), key=lambda i: (-counts[chars[i]], i))
    covered = np.cumsum([counts[chars[i]] for i in by_count])
    assert saved["model"]["readout_shortlist"] == int((covered < 0.95 * len(train_text)).sum()) + 1
    from engine.inference import load_run
    model, _, tokenizer, _ = load_run(run_dir, "latest")
    ids = [tokenizer.encode(chars[i])[0] for i in by_count]   # token ids, most frequent first
    assert model.adaptive.rank[ids].tolist() == list(range(len(chars)))
    # a resumed run keeps the ranking it was trained with, and its sample is text
    run_script("train.py", "--resume", run_dir, "--train.max_iters=6")
    resumed = load_run(run_dir, "latest")[0]
    assert torch.equal(resumed.adaptive.rank, model.adaptive.rank)
    sample = run_script("sample.py", "--run", run_dir, "--sample.max_new_tokens=30")
    assert len(sample.stdout.strip()) > 0


def test_the_logit_lens_reads_layers_through_the_adaptive_readout():
    from attnlab.lens import logit_lens
    model, _ = adaptive_model()
    x = torch.randint(0, 40, (1, 16), generator=torch.Generator().manual_seed(4))
    top, p_next = logit_lens(model, x)
    with torch.no_grad():
        probs = torch.softmax(model(x).logits[0, :-1], -1)
    # the last layer's reading is the model's own prediction
    torch.testing.assert_close(p_next[-1], probs.gather(-1, x[0, 1:, None])[:, 0], atol=1e-5, rtol=0)
    assert torch.equal(top[-1], model(x).logits[0].argmax(-1))
