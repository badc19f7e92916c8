"""The mixture-of-experts MLP (model/moe.py) against DeepSeek-V3's equations (arXiv:
2412.19437, section 2.1.2) in float64 NumPy and against transformers' own DeepseekV3MoE;
its balancing bias picks experts without weighting them, moves by the paper's rule once
per optimizer step, and resumes exactly."""
import json
import socket
import sys

import numpy as np
import pytest
import torch

from common.errors import ConfigError
from conftest import run_script
from engine import cli
from engine.inference import load_run
from engine.loop import train
from engine.run import setup_run
from model import GPT, ModelConfig
from model.moe import MixtureOfExperts, expert_loads, load_line


def moe_config(**overrides) -> ModelConfig:
    fields = dict(vocab_size=40, block_size=16, n_layer=2, n_head=2, n_embd=16, mlp="moe",
                  moe_experts=6, moe_shared=2, moe_top_k=2, moe_hidden=8)
    return ModelConfig(**(fields | overrides))


def layer(seed=0, **overrides) -> MixtureOfExperts:
    """One layer in float64 with weights large enough that the experts differ clearly,
    and a balancing bias of the size of the affinities' spread, so it changes picks."""
    torch.manual_seed(seed)
    m = MixtureOfExperts(moe_config(**overrides)).double()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.5)
        m.balance_bias.copy_(0.2 * torch.randn(m.n_routed))
    return m


# --- the paper's equations, in float64 NumPy -------------------------------------------

def paper_moe(u, centroids, fc, proj, bias, n_shared, k):
    """Eqs. 12-16 for tokens u (N, C): s_i = sigmoid(u·e_i); the k largest s_i + b_i are
    chosen; g_i = s_i / Σ_chosen s_j; out = Σ_shared FFN_i(u) + Σ_routed g_i FFN_i(u), with
    FFN_i(u) = W_down (silu(W_gate u) ⊙ W_up u). Every expert runs on every token here
    (the module runs each only on its tokens)."""
    def ffn(i):
        h = u @ fc[i].T
        gate, up = h[:, :h.shape[1] // 2], h[:, h.shape[1] // 2:]
        return (gate / (1 + np.exp(-gate)) * up) @ proj[i].T
    s = 1 / (1 + np.exp(-(u @ centroids.T)))                       # (N, E_routed)
    out = sum(ffn(i) for i in range(n_shared)) if n_shared else np.zeros_like(u)
    for t in range(u.shape[0]):
        chosen = np.argsort(-(s[t] + bias))[:k]
        g = s[t, chosen] / s[t, chosen].sum()
        for gi, i in zip(g, chosen):
            out[t] += gi * ffn(n_shared + i)[t]
    return out


def as_numpy(m: MixtureOfExperts):
    return (m.router.weight.detach().numpy(), m.fc.weight.detach().numpy(),
            m.proj.weight.detach().numpy(), m.balance_bias.double().numpy())


@pytest.mark.parametrize("shared,top_k", [(2, 2), (0, 1), (1, 3)])
def test_the_layer_is_the_papers_equations(shared, top_k):
    m = layer(moe_shared=shared, moe_top_k=top_k)
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    router, fc, proj, bias = as_numpy(m)
    expected = paper_moe(x.reshape(-1, 16).numpy(), router, fc, proj, bias, shared, top_k)
    np.testing.assert_allclose(m(x).detach().reshape(-1, 16).numpy(), expected, rtol=0, atol=1e-12)


def test_the_bias_changes_which_experts_are_picked_but_not_their_weights():
    m = layer()
    u = torch.randn(40, 16, dtype=torch.float64)
    scores = torch.sigmoid(m.router(u))
    with torch.no_grad():
        m.balance_bias.zero_()
    _, plain = m.route(u)
    with torch.no_grad():
        m.balance_bias[3] = 10.0                # expert 3 is then every token's pick
    weights, chosen = m.route(u)
    assert (chosen == 3).any(-1).all()
    assert not torch.equal(chosen.sort(-1).values, plain.sort(-1).values)
    picked = scores.gather(-1, chosen)          # the plain affinities of the chosen experts
    torch.testing.assert_close(weights, picked / picked.sum(-1, keepdim=True), rtol=0, atol=1e-15)


def test_the_gate_runs_in_float32_under_bf16_autocast():
    """The picks and weights do not follow bf16's rounding of the affinities."""
    m = layer().float()
    u = torch.randn(64, 16)
    weights, chosen = m.route(u)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        weights_bf16, chosen_bf16 = m.route(u)
    assert weights_bf16.dtype == torch.float32
    assert torch.equal(chosen, chosen_bf16) and torch.equal(weights, weights_bf16)


def test_the_bias_moves_by_the_papers_rule_once_per_step_from_the_steps_whole_load():
    """b_i += γ·sign(mean load - load_i), from the tokens of all the step's micro-batches;
    here 4 tokens of top-2 picks: loads 5/4, 1/4, 2/4 and 0 (mean 2/4)."""
    m = MixtureOfExperts(moe_config(moe_experts=4, moe_top_k=2, moe_bias_rate=0.01))
    m.picks = torch.tensor([3, 1, 0, 0])        # as if counted by a first micro-batch
    m.picks = m.picks + torch.tensor([2, 0, 2, 0])   # and a second
    m.after_step()
    assert m.balance_bias.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.01], abs=1e-9)
    assert m.load.tolist() == [1.25, 0.25, 0.5, 0.0]
    assert m.picks is None
    m.after_step()                              # no tokens since: nothing moves
    assert m.balance_bias.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.01], abs=1e-9)


def test_training_forwards_count_the_picks_and_evaluation_forwards_do_not():
    torch.manual_seed(0)
    model = GPT(moe_config())
    x = torch.randint(0, 40, (2, 16))
    model.eval()
    model(x, x)
    assert all(block.mlp.picks is None for block in model.blocks)
    model.train()
    for _ in range(2):                          # two micro-batches of one step
        model(x, x).loss.backward()
    for block in model.blocks:
        assert block.mlp.picks.sum().item() == 2 * x.numel() * 2     # micro-batches x tokens x top_k
        assert block.mlp.balance_bias.abs().sum().item() == 0       # forward moves no bias


def test_the_load_table_and_line_show_each_layer():
    torch.manual_seed(0)
    model = GPT(moe_config(moe_experts=4))
    assert load_line(GPT(moe_config(mlp="gelu", moe_experts=8, moe_shared=1, moe_top_k=2,
                                    moe_hidden=0))) is None
    model.blocks[0].mlp.picks = torch.tensor([4, 4, 0, 0])
    model.blocks[1].mlp.picks = torch.tensor([2, 2, 2, 2])
    for block in model.blocks:
        block.mlp.after_step()
    assert expert_loads(model) == {"blocks.0.mlp": [1.0, 1.0, 0.0, 0.0],
                                   "blocks.1.mlp": [0.5, 0.5, 0.5, 0.5]}
    assert load_line(model) == "moe load, busiest/mean by layer: 0 2.00, 1 1.00"


# --- transformers' DeepseekV3MoE --------------------------------------------------------

def deepseek(m: MixtureOfExperts):
    """transformers' DeepSeek-V3 MoE of the same sizes, plain top-k (one group of experts:
    n_group=1, topk_group=1) and no routed scaling (the paper's eq. 12 has none)."""
    hf = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    config = hf.DeepseekV3Config(hidden_size=m.router.in_features, moe_intermediate_size=m.hidden,
                                 n_shared_experts=m.n_shared, n_routed_experts=m.n_routed,
                                 num_experts_per_tok=m.top_k, n_group=1, topk_group=1,
                                 routed_scaling_factor=1.0, norm_topk_prob=True, hidden_act="silu")
    return hf.DeepseekV3MoE(config).double()


def copy_ours_to_theirs(m, theirs):
    """Our shared experts are one wide MLP of theirs, expert i its hidden units i·H .. (i+1)·H."""
    H, S = m.hidden, m.n_shared
    with torch.no_grad():
        theirs.gate.weight.copy_(m.router.weight)
        theirs.gate.e_score_correction_bias.copy_(m.balance_bias)
        theirs.experts.gate_up_proj.copy_(m.fc.weight[S:])
        theirs.experts.down_proj.copy_(m.proj.weight[S:])
        shared = theirs.shared_experts
        shared.gate_proj.weight.copy_(m.fc.weight[:S, :H].reshape(S * H, -1))
        shared.up_proj.weight.copy_(m.fc.weight[:S, H:].reshape(S * H, -1))
        shared.down_proj.weight.copy_(m.proj.weight[:S].permute(1, 0, 2).reshape(-1, S * H))


def copy_theirs_to_ours(theirs, m):
    H, S = m.hidden, m.n_shared
    shared = theirs.shared_experts
    with torch.no_grad():
        m.router.weight.copy_(theirs.gate.weight)
        m.balance_bias.copy_(theirs.gate.e_score_correction_bias)
        m.fc.weight[S:] = theirs.experts.gate_up_proj
        m.proj.weight[S:] = theirs.experts.down_proj
        m.fc.weight[:S] = torch.cat([shared.gate_proj.weight.reshape(S, H, -1),
                                     shared.up_proj.weight.reshape(S, H, -1)], dim=1)
        m.proj.weight[:S] = shared.down_proj.weight.reshape(-1, S, H).permute(1, 0, 2)


def compare_with_deepseek(m, theirs):
    """transformers computes its gate in float32 whatever the model's dtype, so the picks
    are compared exactly and the gate weights to float32's precision; given the same gate,
    the experts and their weighted sum agree to 1e-12."""
    x = torch.randn(4, 6, m.router.in_features, dtype=torch.float64)
    u = x.reshape(-1, x.shape[-1])
    _, their_weights, their_chosen = theirs.gate(u)
    our_weights, our_chosen = m.route(u)
    order, their_order = our_chosen.argsort(-1), their_chosen.argsort(-1)
    assert torch.equal(our_chosen.gather(-1, order), their_chosen.gather(-1, their_order))
    torch.testing.assert_close(our_weights.gather(-1, order),
                               their_weights.double().gather(-1, their_order), rtol=0, atol=1e-6)
    torch.testing.assert_close(m(x), theirs(x), rtol=0, atol=1e-6)
    m.route = lambda u: (their_weights.double(), their_chosen)      # their gate, our experts
    torch.testing.assert_close(m(x), theirs(x), rtol=0, atol=1e-12)


def test_the_layer_equals_transformers_deepseek_v3_moe_with_our_weights():
    m = layer(seed=1)
    theirs = deepseek(m)
    copy_ours_to_theirs(m, theirs)
    compare_with_deepseek(m, theirs)


def test_the_layer_equals_transformers_deepseek_v3_moe_with_its_weights():
    m = layer(seed=2, moe_shared=1, moe_top_k=3)
    theirs = deepseek(m)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0.0, 0.5)
        theirs.gate.e_score_correction_bias.normal_(0.0, 0.2)
    copy_theirs_to_ours(theirs, m)
    compare_with_deepseek(m, theirs)


# --- in a training run ------------------------------------------------------------------

def _cfg(corpus, tmp_path, name, *extra):
    return cli.build("tiny", [f"--data.path={corpus}", f"--data.cache_dir={tmp_path / 'c'}",
                              f"--train.out_dir={tmp_path / 'r'}", f"--train.run_name={name}",
                              "--model.mlp=moe", "--model.moe_experts=4", "--model.moe_top_k=2",
                              "--model.moe_bias_rate=0.01", *extra])


def _losses(run_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


def _biases(run_dir):
    model = load_run(run_dir, "latest")[0]
    return [block.mlp.balance_bias.tolist() for block in model.blocks]


def test_a_run_updates_the_bias_once_per_step_from_all_its_micro_batches(corpus, tmp_path, monkeypatch):
    seen = []
    original = MixtureOfExperts.after_step

    def spy(self, reduce=lambda c: c):
        seen.append(None if self.picks is None else int(self.picks.sum()))
        original(self, reduce)
    monkeypatch.setattr(MixtureOfExperts, "after_step", spy)
    cfg = _cfg(corpus, tmp_path, "accum", "--train.grad_accum=2", "--train.max_iters=3")
    train(setup_run(cfg, log=lambda *a, **k: None))
    tokens = cfg.train.grad_accum * cfg.train.batch_size * cfg.model.block_size
    assert seen == [tokens * cfg.model.moe_top_k] * (cfg.model.n_layer * 3)


def test_a_run_is_repeatable_and_resumes_with_the_same_bias_and_losses(corpus, tmp_path, capsys):
    quiet = dict(log=lambda *a, **k: None)
    train(setup_run(_cfg(corpus, tmp_path, "straight"), **quiet))
    assert "moe load, busiest/mean by layer: " in capsys.readouterr().out
    train(setup_run(_cfg(corpus, tmp_path, "again"), **quiet))
    first = setup_run(_cfg(corpus, tmp_path, "split"), **quiet)
    forward = first.train_forward

    def stop_after_ten(x, y):                 # as Ctrl-C would: save at step 10 and stop
        if first.progress.step == 9:
            first.stop_signal = "test"
        return forward(x, y)
    first.train_forward = stop_after_ten
    assert train(first)["interrupted"]
    assert any(any(b) for b in _biases(tmp_path / "r" / "split"))     # the bias moved, and was saved
    train(setup_run(_cfg(corpus, tmp_path, "split"), run_dir=tmp_path / "r" / "split", resume=True, **quiet))
    runs = [tmp_path / "r" / name for name in ("straight", "again", "split")]
    assert _losses(runs[0]) == _losses(runs[1]) == _losses(runs[2])
    assert _biases(runs[0]) == _biases(runs[1]) == _biases(runs[2])


# --- the fields ------------------------------------------------------------------------

@pytest.mark.parametrize("options,words", [
    (["--model.mlp=moe", "--model.moe_experts=0"], "model.moe_experts must be at least 1"),
    (["--model.mlp=moe", "--model.moe_top_k=9"], "model.moe_top_k=9 must be between 1 and"),
    (["--model.mlp=moe", "--model.moe_top_k=0"], "model.moe_top_k=0 must be between 1 and"),
    (["--model.mlp=moe", "--model.moe_shared=-1"], "model.moe_shared must not be negative"),
    (["--model.mlp=moe", "--model.moe_hidden=-4"], "model.moe_hidden must not be negative"),
    (["--model.mlp=moe", "--model.moe_bias_rate=-0.1"], "model.moe_bias_rate must not be negative"),
    (["--model.moe_experts=16"], "model.mlp=gelu has none: set model.mlp=moe"),
    (["--model.mlp=swiglu", "--model.moe_bias_rate=0"], "model.mlp=swiglu has none"),
    (["--model.mlp=moe", "--model.mlp_hidden=64"], "take model.moe_hidden"),
    (["--model.mlp=moe", "--train.optimizer=muon"], "use train.optimizer=adamw with it"),
])
def test_a_field_that_cannot_be_honoured_is_refused_in_one_line(options, words):
    with pytest.raises(ConfigError) as err:
        cli.build("tiny", options)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_the_memory_bound_counts_every_expert():
    from engine.budget import model_sizes
    for experts in (4, 16):
        cfg = moe_config(moe_experts=experts)
        assert model_sizes(cfg)[0] == sum(p.numel() for p in GPT(cfg).parameters())
    assert model_sizes(moe_config(moe_experts=16))[0] > model_sizes(moe_config(moe_experts=4))[0]


def test_model_flops_count_only_the_experts_a_token_uses():
    """More routed experts at the same top_k add weights but no work a token, except the
    router's scores against each expert: 6 FLOPs (forward and backward) per router weight."""
    few, many = (GPT(moe_config(moe_experts=n)) for n in (4, 16))
    n_embd, n_layer = few.config.n_embd, few.config.n_layer
    assert many.num_params() > few.num_params() + 12 * 3 * n_embd * 8 * n_layer
    assert many.flops_per_token() - few.flops_per_token() == 6 * 12 * n_embd * n_layer


def test_the_recall_tasks_own_loop_moves_the_bias_too():
    """attnlab/mqar_task.py steps its own optimizer; it calls the same hook as train.py."""
    from attnlab.mqar_task import MQARTask, train as train_mqar
    fields = dict(n_layer=1, n_head=2, n_embd=16, mlp="moe", moe_experts=4, moe_top_k=1)
    model = train_mqar(MQARTask(vocab_size=16, pairs=2), fields, length=16, steps=3, batch=4,
                       log=lambda *a: None)
    assert model.blocks[0].mlp.balance_bias.abs().sum() > 0


@pytest.mark.skipif(sys.platform == "win32", reason="gloo over TCP on localhost")
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_processes_count_every_token_as_one_process_does(corpus, tmp_path, parallel):
    """Under torchrun each process routes its own micro-batches; the load is summed over
    them before the bias moves, so two processes end with one process's bias exactly."""
    def options(name):
        return ["--config", "tiny", f"--data.path={corpus}", f"--data.cache_dir={tmp_path / 'c'}",
                f"--train.out_dir={tmp_path / 'r'}", f"--train.run_name={name}",
                "--train.grad_accum=2", "--train.max_iters=6", "--train.eval_interval=6",
                "--model.mlp=moe", "--model.moe_bias_rate=0.01"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_script("train.py", *options("one"))
    run_script("-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(port), "train.py", *options("two"),
               f"--train.parallel={parallel}", timeout=300)
    one, two = _biases(tmp_path / "r" / "one"), _biases(tmp_path / "r" / "two")
    assert any(any(b) for b in one) and one == two


# --- the tool --------------------------------------------------------------------------

def test_the_routing_view_reads_what_forward_routed(corpus, tmp_path, capsys):
    from attnlab import experts
    run = setup_run(_cfg(corpus, tmp_path, "view", "--train.max_iters=4"), log=lambda *a, **k: None)
    train(run)
    model, _, tokenizer, _ = load_run(run.run_dir, "latest")
    text = "To be, or not to be"
    tokens, routes = experts.routing(model, tokenizer, text)
    assert list(routes) == ["blocks.0.mlp", "blocks.1.mlp"] and len(tokens) == len(tokenizer.encode(text))
    model.train()                               # forward counts its picks in training mode
    model(torch.tensor([tokenizer.encode(text)]))
    for name, (weights, chosen) in routes.items():
        layer = model.get_submodule(name)
        assert torch.equal(torch.bincount(chosen.flatten(), minlength=layer.n_routed), layer.picks)
        assert (weights[:, :-1] >= weights[:, 1:]).all()                 # heaviest first
        torch.testing.assert_close(weights.sum(-1), torch.ones(len(tokens)))
    capsys.readouterr()
    assert experts.main(["--run", str(run.run_dir), "--checkpoint", "latest", "--text", text]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("blocks.0.mlp: expert") and out[1].split()[0] == "share"
    assert sum(map(float, out[1].split()[1:])) == pytest.approx(2.0)      # top-2: each token twice
    assert sum(line.startswith(f"{t:>4} ") for t in range(len(tokens)) for line in out) == len(tokens)


def test_the_routing_view_refuses_a_model_without_experts():
    from attnlab import experts
    from common.errors import AttnlabError
    with pytest.raises(AttnlabError, match="no mixture of experts .model.mlp=gelu."):
        experts.routing(GPT(moe_config(mlp="gelu", moe_experts=8, moe_shared=1, moe_hidden=0)), None, "x")


# --- decoding ---------------------------------------------------------------------------

def test_decoding_from_each_cache_gives_the_full_forwards_tokens():
    torch.manual_seed(0)
    model = GPT(moe_config()).eval()
    prompt = torch.randint(0, 40, (1, 5))
    runs = {decode: torch.cat(list(model.generate(prompt.clone(), 8, temperature=0, decode=decode)), 1)
            for decode in ("full", "cache", "static")}
    assert torch.equal(runs["full"], runs["cache"]) and torch.equal(runs["full"], runs["static"])


def test_a_cuda_graph_is_refused_and_auto_steps_the_static_cache_on_cuda():
    """A recorded graph replays fixed shapes; the experts' share of tokens varies by step."""
    from engine.inference import pick_decode
    from model import ModelError
    from model.decode import decode_mode
    model, plain = GPT(moe_config()), GPT(moe_config(mlp="gelu", moe_experts=8, moe_shared=1,
                                                     moe_hidden=0))
    cuda = torch.device("cuda")                 # a name only: nothing runs on it
    assert pick_decode("auto", cuda, model) == "static" and pick_decode("auto", cuda, plain) == "graph"
    assert pick_decode("auto", "cpu", model) == "cache"
    with pytest.raises(ConfigError, match="sample.decode=graph replays one recorded step, and a mixture"):
        pick_decode("graph", cuda, model)
    with pytest.raises(ModelError, match="decode='graph' replays one recorded step"):
        decode_mode(model, "graph", True, None, cuda)
    assert decode_mode(plain, "graph", True, None, cuda) == "graph"


@pytest.mark.parametrize("fields,message", [
    (dict(moe_experts=100_000, moe_top_k=2), "more than 512 experts"),
    (dict(moe_experts=8, moe_top_k=2, moe_shared=100_000), "more than 512 experts"),
    (dict(moe_experts=8, moe_top_k=2, moe_bias_rate=1e10), "more than 1 a step"),
])
def test_expert_counts_are_bounded_in_time_as_well_as_memory(fields, message):
    """Each expert is a turn of the forward pass's loop: a count the memory allows can
    still take minutes a step, so the count is refused before anything is built."""
    from model.config import ModelError
    with pytest.raises(ModelError, match=message):
        GPT(ModelConfig(vocab_size=40, n_layer=1, n_head=2, n_embd=32, block_size=16, mlp="moe",
                        **fields))
