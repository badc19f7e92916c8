"""Today's model cards as presets (configs/gpt-oss.toml, deepseek-v3.toml, deepseek-v3.2.toml,
qwen3-next.toml, ...): each builds the card's layer pattern from the registries' pieces,
trains a step, and decodes from its cache the logits of the full pass, at a test's size."""
import pytest
import torch

from engine import cli
from engine.objectives import auxiliary_loss
from model import GPT
from model.decode import static_cache
from model.layers import layer_names

CARDS = {
    "gpt-oss": (["sinks"] * 4, {"full_attention_every": 2, "mlp": "moe"}),
    "deepseek-v3": (["mla"] * 4, {"mlp": "moe", "moe_shared": 1, "mtp_depth": 1}),
    "deepseek-v3.2": (["mla_sparse"] * 4, {"mlp": "moe"}),
    "qwen3-next": (["gated_deltanet_norm"] * 3 + ["gated"],
                   {"mlp": "moe", "moe_shared": 1, "delta_conv": 4, "position": "rope_partial",
                    "norm": "rmsnorm1p", "moe_router": "softmax", "moe_shared_gate": True}),
    "kimi-linear": (["kda"] * 3 + ["mla"], {"mlp": "moe", "moe_shared": 1, "delta_conv": 4,
                                            "mla_nope": True, "moe_routed_scale": 2.5}),
}


def card(name: str, **small):
    cfg = cli.build(name, [])
    cfg.model.vocab_size = 65
    for key, value in small.items():
        setattr(cfg.model, key, value)
    return cfg


@pytest.mark.parametrize("name", sorted(CARDS))
def test_each_card_is_its_pattern_of_pieces(name):
    layers, fields = CARDS[name]
    cfg = card(name)
    assert layer_names(cfg.model) == layers
    assert {k: getattr(cfg.model, k) for k in fields} == fields
    assert cfg.train.optimizer == "adamw"          # Muon takes no stacked experts


@pytest.mark.parametrize("name", sorted(CARDS))
def test_each_card_trains_and_decodes_from_its_cache(name):
    cfg = card(name, n_embd=32, n_head=2, n_kv_head=0 if name != "gpt-oss" else 1,
               block_size=24)
    if cfg.model.sliding_window:
        cfg.model.sliding_window = 6
    if cfg.model.sparse_top_k:
        cfg.model.sparse_top_k = 6
    torch.manual_seed(0)
    model = GPT(cfg.model)
    x = torch.randint(0, 65, (2, 24))
    loss = model(x, x).loss
    (loss + auxiliary_loss(model)).backward()      # the indexer learns from its own loss
    assert torch.isfinite(loss) and all(p.grad is not None for n, p in model.named_parameters()
                                        if p.requires_grad and "balance" not in n)
    model.eval()
    with torch.no_grad():
        full = model(x).logits
        cache = model.new_cache(24)
        steps = [model(x[:, :5], cache=cache).logits]
        steps += [model(x[:, t:t + 1], cache=cache).logits for t in range(5, 24)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=5e-5, rtol=0)
