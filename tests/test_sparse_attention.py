"""DeepSeek sparse attention (model/sparse_attention.py, arXiv:2512.02556): the layer against
a float64 NumPy reference written from the paper (the lightning indexer's scores, each
query's top-k among the keys it may see, a softmax over those alone), dense multi-head
attention when k covers every key, decoding that reads k keys a step and equals the whole
pass, the indexer's KL loss against a NumPy count with its input cut from the main model's
graph, the loss reaching the training step, and transformers' own DeepseekV32Indexer."""
import copy
import math

import numpy as np
import pytest
import torch

from mechanism_checks import HEADS, T, WIDTH, causality_leak, config, decode_error, inputs, layer, planted
from model.attention import Mask, MultiHeadAttention
from model.cache import KVCache
from model.positions import POSITION_ENCODINGS
from model.sparse_attention import SparseAttention
from reference import mask_rule

D = WIDTH // HEADS
TOP_K = 4                                     # of up to T = 11 visible keys: a real choice


def sparse(cls=SparseAttention, **kw):
    return layer(cls, **{"mechanism": "sparse", "sparse_top_k": TOP_K, **kw}).eval()


def rope(x, start=0):
    """The model's RoPE written out: pair (i, i + d/2) of x (..., T, d) turns by p·10000^(-2i/d)."""
    d = x.shape[-1]
    angle = (start + np.arange(x.shape[-2]))[:, None] * 10000.0 ** (-np.arange(0, d, 2) / d)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([x1 * np.cos(angle) - x2 * np.sin(angle),
                           x2 * np.cos(angle) + x1 * np.sin(angle)], -1)


def weight(linear):
    return linear.weight.detach().numpy()


def index_reference(module, x, turn=True):
    """I_{t,s} = Σ_j w_{t,j}·ReLU(q^I_{t,j}·k^I_s), with DeepSeek's LayerNorm on the key,
    1/√d_I on the products, 1/√H_I on the weights, RoPE on the first d_k dimensions: (B, T, T)."""
    H_I, d_I = module.indexer_heads, module.indexer_dim
    q = (x @ weight(module.w_iq).T).reshape(*x.shape[:2], H_I, d_I).transpose(0, 2, 1, 3)
    k = x @ weight(module.w_ik).T
    k = (k - k.mean(-1, keepdims=True)) / np.sqrt(k.var(-1, keepdims=True) + module.ik_norm.eps)
    k = k * module.ik_norm.weight.detach().numpy()
    if turn:
        q = np.concatenate([rope(q[..., :D]), q[..., D:]], -1)
        k = np.concatenate([rope(k[..., :D]), k[..., D:]], -1)
    w = x @ weight(module.w_iw).T / math.sqrt(H_I)                  # (B, T, H_I)
    index = np.zeros((x.shape[0], x.shape[1], x.shape[1]))
    for b in range(x.shape[0]):
        for j in range(H_I):
            relu = np.maximum(q[b, j] @ k[b].T / math.sqrt(d_I), 0.0)
            index[b] += w[b, :, j:j + 1] * relu
    return index


def chosen_keys(index_row, visible_row, k):
    """The k highest-scored visible keys (ties to the newest); all visible ones if fewer."""
    keys = [s for s in range(len(index_row)) if visible_row[s]]
    return sorted(keys, key=lambda s: (-index_row[s], -s))[:k]


def reference(module, x, window=0, turn=True, k=TOP_K):
    """The layer's output (B, T, C), the chosen keys per query, and the main attention's
    weights there summed over heads (for the indexer's target)."""
    W = weight(module.w_qkv)
    H_kv = module.n_kv_head
    q, key, v = np.split(x @ W.T, [HEADS * D, (HEADS + H_kv) * D], axis=-1)
    index = index_reference(module, x, turn)
    visible = mask_rule(range(x.shape[1]), range(x.shape[1]), window)
    out = np.zeros((*x.shape[:2], HEADS * D))
    chosen, summed = [], []
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            S = chosen_keys(index[b, t], visible[t], k)
            chosen.append(S)
            total = np.zeros(len(S))
            for h in range(HEADS):
                g = h // (HEADS // H_kv)                            # its key/value head
                qh = q[b, :, h * D:(h + 1) * D]
                kh, vh = key[b, :, g * D:(g + 1) * D], v[b, :, g * D:(g + 1) * D]
                if turn:
                    qh, kh = rope(qh), rope(kh)
                s = np.array([qh[t] @ kh[j] for j in S]) / math.sqrt(D)
                p = np.exp(s - s.max())
                p /= p.sum()
                out[b, t, h * D:(h + 1) * D] = p @ vh[S]
                total += p
            summed.append(total)
    return out @ weight(module.w_o).T, index, chosen, summed


def gap(a, b) -> float:
    """The largest difference, NaN counted as infinite (a slip may leave a row no key)."""
    return float(np.nan_to_num(np.abs(a - b), nan=np.inf).max())


def forward(module, x, window=0, turn=True):
    positions = POSITION_ENCODINGS["rope" if turn else "none"](config()).double()
    return module(x, positions, Mask.over(0, x.shape[1], x.shape[1], window=window))[0]


@pytest.mark.parametrize("window,n_kv_head,indexer_dim,turn", [
    (0, 0, 0, True), (5, 0, 0, True), (0, 1, 0, True), (0, 0, 2 * D, True), (0, 0, 0, False)])
def test_the_layer_is_the_papers_formula(window, n_kv_head, indexer_dim, turn):
    module, x = sparse(n_kv_head=n_kv_head, indexer_dim=indexer_dim), inputs()
    with torch.no_grad():
        out = forward(module, x, window, turn).numpy()
    assert np.abs(out - reference(module, x.numpy(), window, turn)[0]).max() < 1e-12


def test_with_k_at_least_the_context_it_is_dense_multi_head_attention_exactly():
    module = sparse(sparse_top_k=T)
    plain = layer(MultiHeadAttention, attention="eager").eval()
    plain.load_state_dict(module.state_dict(), strict=False)
    x = inputs()
    with torch.no_grad():
        assert torch.equal(forward(module, x), forward(plain, x))
        assert not torch.equal(forward(sparse(), x), forward(plain, x))     # k = 4 chooses


@pytest.mark.parametrize("pieces", [(4, 1, 1, 3, 1, 1), (1,) * T])
@pytest.mark.parametrize("settings", [{}, {"n_kv_head": 1}, {"indexer_dim": 2 * D}])
def test_cached_decoding_equals_the_whole_pass(pieces, settings):
    assert decode_error(sparse(**settings), inputs(), pieces) < 1e-12


def test_no_earlier_output_moves_when_a_later_token_changes():
    assert causality_leak(sparse(), inputs()) == 0


def run_chunk(module, cache, x):
    """x (B, n, C) after what the cache holds, as GPT.forward drives a layer."""
    k_pos, k_first = cache.begin(x.shape[1], x.device)
    mask = Mask(q_start=cache.length, q_len=x.shape[1], k_pos=k_pos, k_first=k_first)
    with torch.no_grad():
        out = module(x, POSITION_ENCODINGS["rope"](config()).double(), mask, cache)[0]
    cache.end(x.shape[1])
    return out


def one_step_after(module, x, poison: bool):
    """Prefill x[:, :-1] into a cache, then decode x[:, -1:]; with `poison`, every main key
    and value the step does not choose is NaN first (the indexer keys are left whole)."""
    n = x.shape[1] - 1
    cache = KVCache(1, n + 1)
    run_chunk(module, cache, x[:, :n])
    if poison:
        seen, select = [], module.select
        module.select = lambda *a: seen.append(select(*a)) or seen[-1]
        run_chunk(module, copy.deepcopy(cache), x[:, n:])
        del module.select
        chosen = seen[-1][:, 0, 0]                                   # (B, k)
        assert chosen.shape[-1] == TOP_K < n
        main = module.n_kv_head * D
        for b in range(x.shape[0]):
            unread = [s for s in range(n) if s not in chosen[b].tolist()]
            cache.k[0][b, :, unread, :main] = float("nan")
            cache.v[0][b, :, unread] = float("nan")
    return run_chunk(module, cache, x[:, n:])


def test_a_decoding_step_reads_only_the_k_chosen_keys_and_values():
    """NaN in every key and value the indexer passed over changes nothing: the step never
    read them (a softmax over all keys with the rest at weight 0 would give NaN·0 = NaN)."""
    module, x = sparse(), inputs(length=T + 1)
    clean, poisoned = one_step_after(module, x, False), one_step_after(module, x, True)
    assert torch.isfinite(poisoned).all() and torch.equal(clean, poisoned)


def indexer_kl_reference(module, x, window=0, k=TOP_K):
    """D_KL(p_{t,S} ‖ softmax(I_{t,S})), p the heads' summed weights over S, L1-normalised;
    the mean over every query."""
    _, index, chosen, summed = reference(module, x, window, k=k)
    B, n = x.shape[:2]
    total = 0.0
    for row, (S, weights) in enumerate(zip(chosen, summed)):
        b, t = divmod(row, n)
        p = weights / weights.sum()
        scores = index[b, t, S]
        log_q = scores - scores.max() - np.log(np.exp(scores - scores.max()).sum())
        total += float((p * (np.log(p) - log_q)).sum())
    return total / (B * n)


@pytest.mark.parametrize("window,dense", [(0, False), (4, False), (0, True)])
def test_the_indexers_loss_is_the_kl_to_the_main_attention(window, dense):
    """Sparse training: S is the chosen set; the dense warm-up: S is every visible key."""
    module, x = sparse().train(), inputs()
    module.dense_warmup = dense
    forward(module, x, window)
    want = indexer_kl_reference(module, x.numpy(), window, k=T if dense else TOP_K)
    assert abs(module.aux_loss.item() - want) < 1e-12
    module.eval()
    forward(module, x)
    assert module.aux_loss is None                   # nothing to learn outside training


INDEXER = ("w_iq", "w_ik", "ik_norm", "w_iw")


def gradients(module, loss_of):
    module.zero_grad()
    x = inputs().requires_grad_()
    out = forward(module.train(), x)
    loss_of(out, module).backward()
    touched = {name.split(".")[0] for name, p in module.named_parameters()
               if p.grad is not None and bool((p.grad != 0).any())}       # NaN counts
    assert all(torch.isfinite(p.grad).all() for p in module.parameters() if p.grad is not None) \
        or module.__class__ is not SparseAttention
    return touched, x.grad is not None and bool((x.grad != 0).any())


def test_the_indexer_learns_from_its_loss_alone_and_the_model_from_the_lm_loss_alone():
    module = sparse()
    touched, into_input = gradients(module, lambda out, m: m.aux_loss)
    assert touched == set(INDEXER) and not into_input        # its input is detached
    touched, into_input = gradients(module, lambda out, m: out.square().sum())
    assert touched == {"w_qkv", "w_o"} and into_input         # the top-k choice passes none


@pytest.mark.parametrize("old, new", [
    ('masked_fill(~visible, float("-inf"))', 'masked_fill(~visible, 0.0)'),  # future keys chosen
    ('scores.masked_fill(~keep, float("-inf"))', 'scores.masked_fill(~mask.dense, float("-inf"))'),
    ("F.relu(dots / math.sqrt(self.indexer_dim))", "(dots / math.sqrt(self.indexer_dim))"),
    ("descending=True, stable=True).indices", "descending=False, stable=True).indices"),
    ("self.w_iw(x) * H_I ** -0.5", "self.w_iw(x) * 0 + H_I ** -0.5"),          # no w_{t,j}
])
def test_the_reference_catches_each_planted_slip(old, new, monkeypatch):
    cls = planted("sparse_attention", old, new, monkeypatch).SparseAttention
    module, x = sparse(cls), inputs()
    with torch.no_grad():
        out = forward(module, x).numpy()
    assert gap(out, reference(module, x.numpy())[0]) > 1e-3


def test_choosing_future_keys_is_a_causality_leak(monkeypatch):
    cls = planted("sparse_attention", 'masked_fill(~visible, float("-inf"))',
                  'masked_fill(~visible, 0.0)', monkeypatch).SparseAttention
    assert not causality_leak(sparse(cls), inputs()) < 1e-3       # NaN, or large


@pytest.mark.parametrize("old, new", [
    ("self.indexer_inputs(x.detach(), positions, mask)", "self.indexer_inputs(x, positions, mask)"),
    ("p = at_least_fp32(weights.detach()).sum(1)", "p = at_least_fp32(weights).sum(1)"),
])
def test_an_indexer_loss_that_reaches_the_main_model_is_caught(old, new, monkeypatch):
    cls = planted("sparse_attention", old, new, monkeypatch).SparseAttention
    touched, into_input = gradients(sparse(cls), lambda out, m: m.aux_loss)
    assert touched != set(INDEXER) or into_input


def test_a_planted_gather_over_every_key_reads_the_keys_it_passed_over(monkeypatch):
    cls = planted("sparse_attention", "attend = self.gathered if T * chosen.shape[-1] < "
                  "k.shape[2] else self.masked", "attend = self.masked", monkeypatch).SparseAttention
    assert not torch.isfinite(one_step_after(sparse(cls), inputs(length=T + 1), True)).all()


def test_the_training_step_adds_each_layers_aux_loss():
    """engine.objectives.auxiliary_loss, which engine/loop.py adds to the loss it
    backpropagates: the indexer's KL from every sparse layer, and 0 for a model with none."""
    from engine.objectives import auxiliary_loss
    from model import GPT, ModelConfig
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=40, n_layer=3, n_head=2, n_embd=32, block_size=24,
                            mechanism="sparse,mha,sparse", sparse_top_k=4))
    idx = torch.randint(0, 40, (2, 16))
    model(idx, idx)
    layers = [model.blocks[0].attn, model.blocks[2].attn]
    assert auxiliary_loss(model) is not None
    assert torch.equal(auxiliary_loss(model), layers[0].aux_loss + layers[1].aux_loss)
    assert auxiliary_loss(GPT(ModelConfig(vocab_size=40, n_layer=1, n_head=2, n_embd=32))) == 0.0


def test_a_train_step_teaches_the_indexer(corpus, tmp_path):
    """Two steps of train.py's loop move the indexer's weights: only its KL reaches them."""
    from engine import cli
    from engine.loop import train
    from engine.run import setup_run
    cfg = cli.build("tiny", [f"--data.path={corpus}", f"--data.cache_dir={tmp_path / 'c'}",
                             f"--train.out_dir={tmp_path / 'r'}", "--train.max_iters=2",
                             "--model.mechanism=sparse", "--model.sparse_top_k=4"])
    run = setup_run(cfg, log=lambda *a, **k: None)
    before = run.model.blocks[0].attn.w_iq.weight.detach().clone()
    train(run)
    assert not torch.equal(before, run.model.blocks[0].attn.w_iq.weight.detach())


def test_the_dense_warm_up_trains_the_indexer_alone_then_sparse_training_goes_on(corpus, tmp_path):
    """train.indexer_warmup=2 of 3 steps: after two, only the indexers have moved and the
    layers still attend densely; the third trains the whole model, sparse."""
    from engine import cli
    from engine.loop import train
    from engine.run import setup_run
    def cfg(steps):
        return cli.build("tiny", [f"--data.path={corpus}", f"--data.cache_dir={tmp_path / 'c'}",
                                  f"--train.out_dir={tmp_path / 'r'}", "--train.run_name=warm",
                                  f"--train.max_iters={steps}", "--model.mechanism=sparse",
                                  "--train.indexer_warmup=2", "--train.eval_interval=100"])
    run = setup_run(cfg(2), log=lambda *a, **k: None)
    attn = run.model.blocks[0].attn
    before = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    train(run)
    moved = {n.split(".")[-2] for n, p in run.model.named_parameters() if not torch.equal(before[n], p)}
    assert moved == set(INDEXER) and attn.dense_warmup
    run = setup_run(cfg(3), run_dir=tmp_path / "r" / "warm", resume=True, log=lambda *a, **k: None)
    train(run)
    assert not run.model.blocks[0].attn.dense_warmup
    assert not torch.equal(before["blocks.0.attn.w_qkv.weight"], run.model.blocks[0].attn.w_qkv.weight)


@pytest.mark.parametrize("args, said", [
    (["--train.indexer_warmup=5"], "model.mechanism=mha has none: add --model.mechanism=sparse"),
    (["--model.mechanism=sparse", "--train.indexer_warmup=-1"], "must not be negative"),
])
def test_an_indexer_warm_up_without_an_indexer_is_one_line(args, said):
    from common.errors import ConfigError
    from engine import cli
    with pytest.raises(ConfigError, match=said) as err:
        cli.build("tiny", args)
    assert "\n" not in str(err.value)


def test_a_bad_size_is_one_line_saying_what_to_give():
    from model import GPT, ModelConfig, ModelError
    base = dict(vocab_size=40, n_layer=1, n_head=2, n_embd=32, mechanism="sparse")
    for bad, said in ((dict(indexer_heads=0), "indexer_heads must be a positive integer"),
                      (dict(sparse_top_k=-1), "sparse_top_k must not be negative"),
                      (dict(indexer_dim=8), "indexer_dim=8 is below the head size")):
        with pytest.raises(ModelError, match=said) as err:
            GPT(ModelConfig(**base, **bad))
        assert "\n" not in str(err.value)


def test_the_indexer_equals_transformers_deepseek_v32_indexer(monkeypatch):
    """transformers' DeepseekV32Indexer, given this layer's weights, chooses the same keys
    from scores equal to float32's rounding: it computes them in float32 (`.float()`)
    whatever the model's dtype, so float64 agreement is not on offer."""
    from transformers import DeepseekV32Config
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer
    module, x = sparse(indexer_dim=2 * D), inputs()
    H_I, d_I = module.indexer_heads, module.indexer_dim
    hf_config = DeepseekV32Config(hidden_size=WIDTH, index_n_heads=H_I, index_head_dim=d_I,
                                  qk_rope_head_dim=D, q_lora_rank=WIDTH, index_topk=TOP_K)
    theirs = DeepseekV32Indexer(hf_config, 0).double()
    with torch.no_grad():
        theirs.wq_b.weight.copy_(module.w_iq.weight)
        theirs.wk.weight.copy_(module.w_ik.weight)
        theirs.weights_proj.weight.copy_(module.w_iw.weight)
        theirs.k_norm.weight.copy_(module.ik_norm.weight)
        theirs.k_norm.bias.zero_()
    theirs.k_norm.eps = module.ik_norm.eps
    angle = torch.arange(T, dtype=torch.float64)[:, None] * 10000.0 ** (
        -torch.arange(0, D, 2, dtype=torch.float64) / D)
    cos_sin = (torch.cat([angle, angle], -1).cos()[None].expand(2, T, D),
               torch.cat([angle, angle], -1).sin()[None].expand(2, T, D))
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None].expand(2, T, T)
    scores = []
    original = torch.Tensor.topk

    def seen_topk(self, *a, **kw):
        scores.append(self)
        return original(self, *a, **kw)
    monkeypatch.setattr(torch.Tensor, "topk", seen_topk)          # to read the scores it ranks
    chosen = theirs(x, x, cos_sin, causal, None)                     # (B, T, k)
    monkeypatch.undo()
    ours = torch.from_numpy(index_reference(module, x.numpy()))
    with torch.no_grad():
        positions = POSITION_ENCODINGS["rope"](config()).double()
        q_i, k_i, w = module.indexer_inputs(x, positions, Mask.over(0, T, T))
        index = module.index_scores(q_i, k_i, w)
    assert (index - ours).abs().max() < 1e-12                        # the layer, the paper
    theirs_scores = scores[0].double().masked_fill(~causal, 0.0)
    assert (theirs_scores - ours.masked_fill(~causal, 0.0)).abs().max() < 1e-5 * ours.abs().max()
    mine = module.select(index, Mask.over(0, T, T).dense[None, None], torch.arange(T))[:, 0]
    last = slice(TOP_K, None)                # rows with at least k visible keys: a real choice
    assert torch.equal(chosen[:, last].long().sort(-1).values, mine[:, last].sort(-1).values)


@pytest.mark.parametrize("fields,message", [
    (dict(sparse_top_k=4), "model.mechanism=mha has none"),
    (dict(indexer_heads=2), "model.mechanism=mha has none"),
    (dict(mechanism="sparse", sparse_top_k=100), "keeps more keys than the context"),
])
def test_the_indexers_fields_without_an_indexer_or_past_the_context_are_refused(fields, message):
    """A field that would change nothing is refused, not ignored."""
    from model import GPT, ModelConfig
    from model.config import ModelError
    with pytest.raises(ModelError, match=message):
        GPT(ModelConfig(vocab_size=40, n_layer=2, n_head=2, n_embd=32, block_size=32, **fields))
