"""Multi-token prediction (model/mtp.py, DeepSeek-V3 section 2.2) against a float64 NumPy
reference written from the paper's equations on the module's own weights, its targets
and loss, what it shares with the model, and self-speculative decoding with it
(model/decode.py, decode="mtp"): greedy gives plain greedy decoding's tokens, sampling
keeps plain sampling's distribution, the cache gives a rejected draft back."""
import math

import numpy as np
import pytest
import torch

from model import GPT, ModelConfig
from model.cache import KVCache
from model.config import ModelError
from model.decode import speculative_pick
from reference import attention, rms_norm, rope


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=40, n_layer=2, n_head=2, n_embd=16, block_size=16, mtp_depth=1)
    return ModelConfig(**{**base, **kw})


def built(seed=0, **kw):
    torch.manual_seed(seed)
    return GPT(tiny(**kw)).double()


def varied(**kw):
    """A model to decode from: a random one with a tied head repeats its last token for
    ever (each token's embedding scores itself highest), which hides any slip in the
    context; an untied head walks a cycle of several tokens."""
    return built(tie_embeddings=False, **kw).eval()


# -- the paper's equations in NumPy float64 ------------------------------------------------

def np_(t):
    return t.detach().double().numpy()


def layer_norm(x, gain):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * gain


def gelu(x):
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def block(x, b, n_head, theta):
    """A pre-norm Transformer block, x (T, C): x + W_O·attention(LN(x)), x + MLP(LN(x)),
    causal softmax attention with RoPE on each head's queries and keys."""
    T, C = x.shape
    D = C // n_head
    q, k, v = np.split(layer_norm(x, np_(b.norm_attn.weight)) @ np_(b.attn.w_qkv.weight).T, 3, axis=1)
    heads = []
    for h in range(n_head):
        part = slice(h * D, (h + 1) * D)
        out, _, _ = attention(rope(q[:, part], range(T), theta), rope(k[:, part], range(T), theta),
                              v[:, part], np.tril(np.ones((T, T), dtype=bool)))
        heads.append(out)
    x = x + np.concatenate(heads, axis=1) @ np_(b.attn.w_o.weight).T
    hidden = gelu(layer_norm(x, np_(b.norm_mlp.weight)) @ np_(b.mlp.fc.weight).T)
    return x + hidden @ np_(b.mlp.proj.weight).T


def mtp_depth(module, h_before, embedded, config):
    """h'_i = M_k [RMSNorm(h^{k-1}_i); RMSNorm(Emb(t_{i+k}))], then h^k = TRM_k(h')."""
    joined = np.concatenate([rms_norm(h_before, np_(module.norm_hidden.weight), config.norm_eps),
                             rms_norm(embedded, np_(module.norm_embed.weight), config.norm_eps)], axis=1)
    return block(joined @ np_(module.proj.weight).T, module.block, config.n_head, config.rope_theta)


def reference_loss(model, tokens, shift=0):
    """L_MTP = λ/D Σ_k L^k for one sequence `tokens` (T+1 ids: the window and its last
    target), L^k the mean cross-entropy of P^k_{i+k+1} = OutHead(h^k_i) against t_{i+k+1}
    (against t_{i+k+1+shift}, for a planted slip)."""
    c = model.config
    idx = torch.as_tensor(tokens[:-1])[None]
    with torch.no_grad():
        h = np_(model(idx).hidden[0])                   # h^0: what the main head reads
    E, T = np_(model.wte.weight), len(tokens) - 1
    losses = []
    for k in range(1, c.mtp_depth + 1):
        positions = range(T - k)                        # i = 0 .. T-k-1 have t_{i+k+1}
        h = mtp_depth(model.mtp.depths[k - 1], h[:len(positions)],
                      E[[tokens[i + k] for i in positions]], c)
        logits = layer_norm(h, np_(model.norm_f.weight)) @ E.T          # the shared OutHead
        top = logits.max(1, keepdims=True)
        logp = logits - top - np.log(np.exp(logits - top).sum(1, keepdims=True))
        scored = [(j, i + k + 1 + shift) for j, i in enumerate(positions) if 0 <= i + k + 1 + shift <= T]
        losses.append(-np.mean([logp[j, tokens[t]] for j, t in scored]))
    return c.mtp_weight / c.mtp_depth * sum(losses), h


@pytest.mark.parametrize("depth", [1, 2])
def test_the_module_and_its_loss_equal_the_papers_equations(depth):
    model = built(mtp_depth=depth, mtp_weight=0.3).train()
    tokens = torch.randint(0, 40, (13,), generator=torch.Generator().manual_seed(1)).tolist()
    x, y = torch.tensor([tokens[:-1]]), torch.tensor([tokens[1:]])
    want, h_last = reference_loss(model, tokens)
    out = model(x, y)
    assert abs(model.mtp.aux_loss.item() - want) < 1e-9
    assert abs(model.mtp.loss.item() - want / 0.3) < 1e-9
    if depth == 1:                                      # the module's states themselves
        got, _ = model.mtp.depth(model, 0, out.hidden[:, :11], x[:, 1:])
        np.testing.assert_allclose(np_(got[0]), h_last, atol=1e-9, rtol=0)


def test_position_i_is_scored_on_the_token_two_ahead():
    """The reference scored one token nearer or further gives another loss: the match
    above pins t_{i+2}, and an off-by-one in the module's targets would miss it."""
    model = built().train()
    tokens = torch.randint(0, 40, (15,), generator=torch.Generator().manual_seed(6)).tolist()
    right = reference_loss(model, tokens)[0]
    model(torch.tensor([tokens[:-1]]), torch.tensor([tokens[1:]]))
    assert abs(model.mtp.aux_loss.item() - right) < 1e-9
    for slip in (-1, 1):
        assert abs(reference_loss(model, tokens, slip)[0] - right) > 1e-6


def test_the_logged_loss_is_the_next_token_loss_and_the_step_adds_lambda_times_mtp():
    from engine.objectives import auxiliary_loss
    model = built(mtp_weight=0.1).train()
    plain = GPT(tiny(mtp_depth=0)).double().train()
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")})
    x = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(2))
    y = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(3))
    y[0, 4] = -1                                           # an ignored target stays ignored
    out = model(x, y)
    assert torch.equal(out.loss, plain(x, y).loss)
    assert torch.equal(auxiliary_loss(model), model.mtp.aux_loss)
    assert torch.allclose(model.mtp.aux_loss, 0.1 * model.mtp.loss)
    # Evaluation and decoding take no MTP loss.
    model.eval()
    model(x, y)
    assert model.mtp.aux_loss is None and auxiliary_loss(model) == 0.0
    with torch.no_grad():
        model.train()(x, y)
    assert model.mtp.aux_loss is None


def test_embedding_and_head_are_the_models_own():
    model = built().train()
    mine = {p.data_ptr() for p in model.mtp.parameters()}
    assert model.wte.weight.data_ptr() not in mine and model.lm_head.weight.data_ptr() not in mine
    C, block = 16, model.mtp.depths[0].block
    assert sum(p.numel() for p in model.mtp.parameters()) == \
        2 * C + 2 * C * C + sum(p.numel() for p in block.parameters())
    x = torch.randint(0, 40, (1, 10))
    model(x, x.roll(-1, 1))
    model.mtp.aux_loss.backward()                      # the MTP loss alone reaches both
    assert model.wte.weight.grad.abs().sum() > 0
    assert model.norm_f.weight.grad.abs().sum() > 0
    untied = built(tie_embeddings=False).train()
    untied(x, x.roll(-1, 1))
    untied.mtp.aux_loss.backward()
    assert untied.lm_head.weight.grad.abs().sum() > 0 and untied.wte.weight.grad.abs().sum() > 0


def test_only_the_variants_model_builds_it():
    assert type(GPT(tiny(mtp_depth=0, vocab_size=40))).__name__ == "GPT"
    model = GPT(tiny())
    assert type(model).__name__ == "GPTWithVariants" and len(model.mtp.depths) == 1
    assert not hasattr(GPT(tiny(mtp_depth=0)), "mtp")


@pytest.mark.parametrize("fields, says", [
    ({"mtp_depth": -1}, "model.mtp_depth must not be negative"),
    ({"mtp_weight": -0.1}, "model.mtp_weight must not be negative"),
    ({"mtp_depth": 15}, "give at most 14"),
    ({"causal": False}, "leave model.mtp_depth=0 for an encoder"),
    ({"readout": "adaptive", "tie_embeddings": False, "readout_shortlist": 10},
     "scores a shortlist its own way"),
    ({"readout": "none", "tie_embeddings": False}, "has none"),
    ({"mtp_depth": 0, "mtp_weight": 0.1}, "model.mtp_depth=0 builds no module"),
])
def test_settings_it_cannot_work_with_are_refused_in_one_line(fields, says):
    with pytest.raises(ModelError, match=says) as err:
        GPT(tiny(**fields))
    assert "\n" not in str(err.value)


def test_the_encoder_decoder_refuses_it():
    from model.seq2seq import EncoderDecoder
    with pytest.raises(ModelError, match="model.mtp_depth=1"):
        EncoderDecoder(tiny())


def test_the_cli_refuses_a_negative_depth_in_one_error_line():
    from conftest import run_script
    proc = run_script("train.py", "--config", "tiny", "--model.mtp_depth=-1", check=False)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr


def test_the_memory_bound_counts_the_modules():
    from engine import cli
    from engine.budget import model_sizes, training_bytes
    plain, mtp = cli.build("tiny", []), cli.build("tiny", ["--model.mtp_depth=2"])
    assert model_sizes(mtp.model)[0] > model_sizes(plain.model)[0]
    m, b = plain.model, plain.train.batch_size
    extra = (training_bytes(mtp)[1] - 12 * training_bytes(mtp)[0]) \
        - (training_bytes(plain)[1] - 12 * training_bytes(plain)[0])
    # Two more blocks' activations and two more sets of logits a sequence.
    per_block = 34 * m.block_size * m.n_embd + 5 * m.n_head * m.block_size ** 2
    assert extra == b * 2 * (per_block + 4 * m.block_size * m.vocab_size)


# -- the cache gives a token back -----------------------------------------------------------

@pytest.mark.parametrize("window", [0, 4])
def test_a_truncated_cache_continues_as_though_the_token_never_came(window):
    model = built(mtp_depth=0, sliding_window=window).eval()
    x = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        cache = model.new_cache(16)
        model(x[:, :9], cache=cache)
        model(torch.tensor([[1, 2], [3, 4]]), cache=cache)     # a draft of two
        cache.truncate(2)
        got = torch.cat([model(x[:, 9:10], cache=cache).logits,
                         model(x[:, 10:12], cache=cache).logits], 1)
        assert cache.length == 12
        want = model(x).logits[:, 9:]
    torch.testing.assert_close(got, want, atol=1e-10, rtol=0)


def test_a_cache_with_a_state_or_too_little_refuses_to_forget():
    cache = KVCache(2, 8)
    with pytest.raises(ValueError, match="cannot forget 1 tokens of the 0"):
        cache.truncate(1)
    cache.keep(0, torch.zeros(1))
    with pytest.raises(ValueError, match="recurrent state"):
        cache.truncate(0)


# -- self-speculative decoding --------------------------------------------------------------

def greedy(model, prompt, n, decode, on_step=None):
    return torch.cat(list(model.generate(prompt, n, temperature=0, decode=decode, on_step=on_step)), 1)


def oracle(model, monkeypatch, truth, kept):
    """Make the module draft each row's next token of `truth` where kept(step) says (one
    bool, or one a row), and a wrong one elsewhere, so both branches run; `step` counts the tokens emitted so far
    (the returned on_step counts them)."""
    emitted = [0]
    real = type(model.mtp).depth

    def depth(self, m, k, h, tokens, cache=None):
        h, logits = real(self, m, k, h, tokens, cache)
        B, T, V = logits.shape
        i = emitted[0]
        right = truth[:, i] if i < truth.shape[1] else torch.zeros(B, dtype=torch.long)
        draft = torch.where(torch.as_tensor(kept(i)).expand(B), right, (right + 1) % V)
        return h, torch.nn.functional.one_hot(draft[:, None].expand(B, T), V).double()
    monkeypatch.setattr(type(model.mtp), "depth", depth)

    def count(logits, token):
        emitted[0] += 1
    return count


@pytest.mark.parametrize("window", [0, 6])
@pytest.mark.parametrize("prompt_len, n", [(1, 40), (5, 11), (16, 30), (20, 9)])
def test_greedy_self_speculation_gives_plain_greedy_tokens(window, prompt_len, n, monkeypatch):
    """Past the context too (block_size 16): a windowed model rolls its cache, another
    re-reads the newest half, and each token is the one plain decoding draws."""
    model = varied(sliding_window=window)
    prompt = torch.randint(0, 40, (1, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    want = greedy(model, prompt, n, "cache")
    assert torch.equal(greedy(model, prompt, n, "mtp"), want)     # the untrained drafts, mostly wrong
    count = oracle(model, monkeypatch, want, kept=lambda i: i % 3 != 1)
    assert torch.equal(greedy(model, prompt, n, "mtp", count), want)
    assert 0 < model.mtp.accepted < model.mtp.drafted


def test_drafts_that_are_always_right_halve_the_passes(monkeypatch):
    model = varied()
    prompt = torch.randint(0, 40, (2, 3), generator=torch.Generator().manual_seed(5))
    want = greedy(model, prompt, 12, "cache")
    count = oracle(model, monkeypatch, want, kept=lambda i: True)
    passes = []
    model.register_forward_hook(lambda *a: passes.append(1))
    steps = []
    got = torch.cat(list(model.generate(prompt, 12, temperature=0, decode="mtp",
                                        on_step=lambda l, t: (count(l, t), steps.append(l)))), 1)
    assert torch.equal(got, want)
    assert model.mtp.accepted == model.mtp.drafted
    assert len(passes) == 1 + 6                     # the prompt, then two tokens a pass
    assert len(steps) == 12 and steps[0].shape == (2, 40)


@pytest.mark.parametrize("window", [0, 6])
def test_each_draft_is_the_one_the_module_gives_the_whole_text(window, monkeypatch):
    """The module's own cache runs behind the main one: every draft made while decoding
    equals the module's prediction at that position from one pass over the finished text."""
    model = varied(sliding_window=window)
    prompt = torch.randint(0, 40, (1, 5), generator=torch.Generator().manual_seed(7))
    want = greedy(model, prompt, 10, "cache")
    real, drafts = type(model.mtp).depth, {}

    def depth(self, m, k, h, tokens, cache=None):
        h, logits = real(self, m, k, h, tokens, cache)
        drafts[cache.length - 1] = logits[0, -1]          # the position it drafts after
        return h, logits
    monkeypatch.setattr(type(model.mtp), "depth", depth)
    count = oracle(model, monkeypatch, want, kept=lambda i: i % 3 != 1)
    got = greedy(model, prompt, 10, "mtp", count)
    text = torch.cat([prompt, got], 1)
    with torch.no_grad():
        hidden = model(text).hidden
        _, whole = real(model.mtp, model, 0, hidden[:, :-1], text[:, 1:])
    assert len(drafts) >= 5
    for position, logits in drafts.items():
        torch.testing.assert_close(logits, whole[0, position], atol=1e-10, rtol=0)


def test_in_a_batch_a_draft_stands_only_where_it_stands_in_every_row(monkeypatch):
    model = varied()
    prompt = torch.randint(0, 40, (2, 3), generator=torch.Generator().manual_seed(8))
    want = greedy(model, prompt, 14, "cache")
    count = oracle(model, monkeypatch, want, kept=lambda i: torch.tensor([True, i % 2 == 0]))
    assert torch.equal(greedy(model, prompt, 14, "mtp", count), want)
    assert model.mtp.accepted > model.mtp.drafted // 2


def test_the_modules_blocks_start_as_the_stacks_do():
    """GPT-2's residual scaling (0.02/√(2·n_layer)) on the matrices that write into the
    stream, as the main blocks have it."""
    model = built(n_embd=64, n_head=4)
    for name in ("mlp.proj", "attn.w_o"):
        mine = model.mtp.depths[0].block.get_submodule(name).weight.std()
        theirs = model.blocks[-1].get_submodule(name).weight.std()
        assert abs(mine / theirs - 1) < 0.15 and mine < 0.014


def test_the_logits_each_step_shows_are_plain_decodings():
    model = varied()
    prompt = torch.randint(0, 40, (1, 4))
    seen = {"cache": [], "mtp": []}
    for decode in seen:
        greedy(model, prompt, 20, decode, on_step=lambda l, t, d=decode: seen[d].append(l))
    torch.testing.assert_close(torch.cat(seen["mtp"]), torch.cat(seen["cache"]), atol=1e-10, rtol=0)


def test_the_speculative_rule_keeps_the_target_distribution():
    """Leviathan et al.'s rule, drawn 200,000 times at once: the tokens follow p, not q,
    and the draft is kept with probability Σ min(p, q)."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    q = torch.tensor([0.1, 0.2, 0.3, 0.4])
    N = 200_000
    draft = torch.multinomial(q.expand(N, 4), 1, replacement=True, generator=g)
    token, kept = speculative_pick(p.expand(N, 4), q.expand(N, 4), draft, g)
    freq = torch.bincount(token[:, 0], minlength=4) / N
    assert (freq - p).abs().max() < 0.005                 # 4.5 standard errors at most
    assert abs(kept.float().mean() - torch.minimum(p, q).sum()) < 0.005


def test_sampling_with_drafts_follows_plain_samplings_distribution():
    """The first two tokens after a prompt in 20,000 rows at once (the second is the one
    the rule picks from the first draft): their joint frequencies against the model's own
    probabilities, computed exactly over the tiny vocabulary. The embedding is scaled up
    so that the main model and the module disagree: a draft kept without the rule fails."""
    model = built(vocab_size=6).eval()
    with torch.no_grad():
        model.wte.weight.mul_(40)
    N, prompt = 20_000, torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        first = torch.softmax(model(prompt).logits[0, -1], -1)
        both = torch.stack([first[a] * torch.softmax(model(torch.cat([prompt, torch.tensor([[a]])], 1))
                                                     .logits[0, -1], -1) for a in range(6)])
    g = torch.Generator().manual_seed(0)
    a, b = model.generate(prompt.expand(N, 3), 2, temperature=1.0, decode="mtp", generator=g)
    counts = torch.bincount(a[:, 0] * 6 + b[:, 0], minlength=36).double().view(6, 6)
    expected = N * both
    seen = expected > 5
    chi2 = float(((counts - expected) ** 2 / expected)[seen].sum())
    assert chi2 < 3 * int(seen.sum()) and counts[~seen].sum() < 3 * expected[~seen].sum() + 20
    assert 0 < model.mtp.accepted < model.mtp.drafted


@pytest.mark.parametrize("fields, kwargs, says", [
    ({"mtp_depth": 0}, {}, "has none"),
    ({}, {"sinks": 2}, "sinks stream from a rolling one"),
    ({}, {"forced": torch.zeros(1, 3, dtype=torch.long)}, "forced tokens are fed"),
    ({"mechanism": "deltanet"}, {}, "model.mechanism=deltanet folds every token"),
    ({"token_mix": 3}, {}, "model.token_mix keeps the newest rows"),
])
def test_what_cannot_give_a_draft_back_is_refused(fields, kwargs, says):
    model = built(**fields).eval()
    with pytest.raises(ModelError, match=says):
        next(iter(model.generate(torch.zeros(1, 2, dtype=torch.long), 3, decode="mtp", **kwargs)))


def test_muon_takes_the_modules_matrices():
    from engine.optim import is_hidden_matrix
    model = built()
    hidden = {n for n, p in model.named_parameters() if is_hidden_matrix(n, p)}
    assert {"mtp.depths.0.proj.weight", "mtp.depths.0.block.attn.w_qkv.weight"} <= hidden
    assert "wte.weight" not in hidden and "mtp.depths.0.norm_hidden.weight" not in hidden


def test_a_run_trains_it_logs_its_loss_apart_and_samples_with_it(corpus, tmp_path):
    import json
    from conftest import run_script, train_tiny
    run = train_tiny(corpus, tmp_path, "mtp", "--model.mtp_depth=1", "--train.max_iters=6")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert steps and all(r["mtp_loss"] > 0 and r["mtp_loss"] != r["loss"] for r in steps)
    proc = run_script("sample.py", "--run", run, "--decode", "mtp", "--temperature", "0",
                      "--max_new_tokens", "20")
    assert "drafts kept" in proc.stderr.splitlines()[-1]
    plain = train_tiny(corpus, tmp_path, "plain", "--train.max_iters=1")
    proc = run_script("sample.py", "--run", plain, "--decode", "mtp", check=False)
    said = [line for line in proc.stderr.strip().splitlines() if "Warning" not in line]
    assert proc.returncode != 0 and len(said) == 1 and said[0].startswith("error: decode='mtp'"), said


@pytest.mark.parametrize("tied", [True, False])
def test_the_flop_count_adds_the_modules_blocks_and_head_passes(tied):
    """For MFU: 6 a weight (the module's own), 6·V·C a depth for the shared output layer
    run again, and three times a block's attention (4·d·T forward, PaLM's count)."""
    plain, mtp = GPT(tiny(mtp_depth=0, tie_embeddings=tied)), GPT(tiny(mtp_depth=2, tie_embeddings=tied))
    own = sum(p.numel() for p in mtp.mtp.parameters())
    C, V, T = 16, 40, 16
    assert mtp.flops_per_token() - plain.flops_per_token() == 6 * own + 2 * (6 * V * C + 3 * 4 * C * T)


def test_export_to_transformers_refuses_the_modules_rather_than_dropping_them():
    from engine.interop import _common_refusals
    assert any("model.mtp_depth=1" in r for r in _common_refusals(tiny()))
    assert not any("mtp" in r for r in _common_refusals(tiny(mtp_depth=0)))
