"""DeepSeek-V3 proven equal to transformers' own DeepseekV3 classes (model/latent_attention.py
with its query latent, model/moe.py's grouped, scaled sigmoid routing and the dense first
layers, engine/interop_deepseek.py): the new pieces against float64 formulas written from
the paper, then a tiny random DeepseekV3ForCausalLM imported through the bridge, and our
DeepSeek-V3 exported back, with the same logits; nothing downloaded.

Three of transformers' modules compute in float32 whatever the model's dtype:
DeepseekV3RMSNorm casts its input to float32, DeepseekV3RotaryEmbedding turns float32
frequencies by float32 positions, and DeepseekV3TopkRouter casts the tokens and its weight
to float32. So the whole model is compared twice: as transformers ships it, in float32 (to
float32's error), and in float64 with those three forwards replaced by the same formulas
without the casts (`in_float64`), to 1e-9. Its eager attention takes the softmax in float32
too, so the float64 comparisons run transformers' sdpa attention, which keeps the dtype."""
import copy
import json
from dataclasses import replace
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from common.errors import CheckpointError
from engine import interop_deepseek
from engine.interop import ARCHITECTURES, architecture_for, export, hf_tokenizer, load_hf_folder
from model import GPT, ModelConfig
from model.attention import Mask
from model.cache import KVCache
from model.config import ModelError
from model.latent_attention import QueryLatent
from model.layers import SwiGLU
from model.moe import MixtureOfExperts, group_limit

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
warnings.filterwarnings("ignore", module="transformers")
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as theirs  # noqa: E402

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from test_interop import CHARS  # noqa: E402

V = CHARS.vocab_size
LENGTH = 20


def hf_config(**over) -> "transformers.DeepseekV3Config":
    """The card at a test's size: a query latent, a latent of 32 and a rotary key of 8,
    one dense layer before two of experts, 8 routed experts in 4 groups of which a token
    may use 2, two shared experts, the routed weights scaled by 2.5."""
    c = dict(vocab_size=V, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
             n_shared_experts=2, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
             topk_group=2, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=24,
             qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=64,
             routed_scaling_factor=2.5, pad_token_id=0, bos_token_id=1, eos_token_id=1)
    c.update(over)
    return transformers.DeepseekV3Config(**c)


def shaken(module: torch.nn.Module, scale: float = 0.1) -> torch.nn.Module:
    """Every weight moved away from its init (norms off 1) and every balancing bias off 0,
    so a mapping that drops or swaps one shows."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * scale)
        for name, b in module.named_buffers():
            if name.endswith(("e_score_correction_bias", "balance_bias")):
                b.normal_(0.0, 0.1)
    return module


def _rms_norm_float64(self, x):
    # DeepseekV3RMSNorm.forward without its cast to float32.
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _rotary_float64(self, x, position_ids):
    # DeepseekV3RotaryEmbedding.forward (default RoPE) with float64 frequencies and positions.
    dim = self.config.qk_rope_head_dim
    base = self.config.rope_parameters["rope_theta"]
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    emb = torch.cat([position_ids[..., None].to(torch.float64) * inv_freq] * 2, dim=-1)
    return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _router_float64(self, hidden_states):
    # DeepseekV3TopkRouter.forward, its formula unchanged, at the tokens' own precision.
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight.to(hidden_states.dtype))
    scores = router_logits.sigmoid()
    scores_for_choice = scores + self.e_score_correction_bias
    group_scores = (scores_for_choice.view(-1, self.num_group, self.num_experts // self.num_group)
                    .topk(2, dim=-1)[0].sum(dim=-1))
    group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = (group_mask.unsqueeze(-1)
                  .expand(-1, self.num_group, self.num_experts // self.num_group)
                  .reshape(-1, self.num_experts))
    scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), float("-inf"))
    topk_indices = torch.topk(scores_for_choice, k=self.top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_indices)
    if self.norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return router_logits, topk_weights * self.routed_scaling_factor, topk_indices


@pytest.fixture
def in_float64(monkeypatch):
    monkeypatch.setattr(theirs.DeepseekV3RMSNorm, "forward", _rms_norm_float64)
    monkeypatch.setattr(theirs.DeepseekV3RotaryEmbedding, "forward", _rotary_float64)
    monkeypatch.setattr(theirs.DeepseekV3TopkRouter, "forward", _router_float64)


def batch(T: int = LENGTH) -> torch.Tensor:
    return torch.randint(0, V, (3, T), generator=torch.Generator().manual_seed(2))


def our_config(**over) -> ModelConfig:
    """Ours as the card: what hf_config() reads as."""
    c = dict(vocab_size=V, block_size=64, n_layer=3, n_head=4, n_embd=64, mechanism="mla",
             mla_kv_rank=32, mla_rope_dim=8, mla_q_rank=24, norm="rmsnorm", norm_eps=1e-6,
             mlp="moe", mlp_hidden=96, moe_dense_layers=1, moe_experts=8, moe_shared=2,
             moe_top_k=2, moe_hidden=24, moe_groups=4, moe_group_top=2, moe_routed_scale=2.5,
             tie_embeddings=False)
    c.update(over)
    return ModelConfig(**c)


# -- the pieces, each against a float64 formula from the paper ----------------------------

def _grouped_route_by_hand(s, b, groups, keep, k, scale):
    """DeepSeek-V3's gate one token at a time: each group scored by the sum of its two best
    s_i + b_i, the `keep` best groups open, the k best s_i + b_i among their experts chosen,
    g_i = s_i / Σ chosen s_j, times the scale."""
    weights, chosen = [], []
    per = s.shape[1] // groups
    for s_u, c_u in zip(s.tolist(), (s + b).tolist()):
        group_score = [sum(sorted(c_u[g * per:(g + 1) * per])[-2:]) for g in range(groups)]
        open_groups = sorted(range(groups), key=lambda g: -group_score[g])[:keep]
        candidates = [i for i in range(len(c_u)) if i // per in open_groups]
        pick = sorted(candidates, key=lambda i: -c_u[i])[:k]
        total = sum(s_u[i] for i in pick)
        weights.append([scale * s_u[i] / total for i in pick])
        chosen.append(pick)
    return torch.tensor(weights, dtype=torch.float64), torch.tensor(chosen)


def test_grouped_scaled_routing_is_the_papers_gate_in_float64():
    cfg = our_config(n_layer=1, moe_dense_layers=0, mlp_hidden=0)
    torch.manual_seed(0)
    moe = MixtureOfExperts(cfg).double()
    with torch.no_grad():
        moe.router.weight.normal_(0.0, 0.5)
        moe.balance_bias.normal_(0.0, 0.3)
    u = torch.randn(50, 64, dtype=torch.float64)
    weights, chosen = moe.route(u)
    s = torch.sigmoid(u @ moe.router.weight.T)
    want_w, want_c = _grouped_route_by_hand(s, moe.balance_bias.double(), 4, 2, 2, 2.5)
    order, want_order = chosen.argsort(-1), want_c.argsort(-1)
    assert torch.equal(chosen.gather(-1, order), want_c.gather(-1, want_order))
    torch.testing.assert_close(weights.gather(-1, order), want_w.gather(-1, want_order),
                               atol=1e-12, rtol=0)
    # Every expert chosen lies in one of at most two groups.
    assert all(len(set((row // 2).tolist())) <= 2 for row in chosen)
    # The bias picks, the affinities weight: the weights sum to the scale.
    torch.testing.assert_close(weights.sum(-1), torch.full((50,), 2.5, dtype=torch.float64))


def test_group_limit_hides_every_expert_outside_the_best_groups():
    choice = torch.tensor([[0.9, 0.1, 0.5, 0.5, 0.8, 0.0]], dtype=torch.float64)
    # groups of two: sums 1.0, 1.0, 0.8; the best two groups stay open.
    hidden = group_limit(choice, 3, 2)
    assert hidden.tolist() == [[0.0, 0.0, 0.0, 0.0, float("-inf"), float("-inf")]]


def test_grouped_routing_is_transformers_router_in_float64(in_float64):
    config = hf_config()
    torch.manual_seed(0)
    router = theirs.DeepseekV3TopkRouter(config).double()
    moe = MixtureOfExperts(our_config(n_layer=1, moe_dense_layers=0, mlp_hidden=0)).double()
    with torch.no_grad():
        router.weight.normal_(0.0, 0.5)
        router.e_score_correction_bias.normal_(0.0, 0.3)
        moe.router.weight.copy_(router.weight)
        moe.balance_bias.copy_(router.e_score_correction_bias)
    u = torch.randn(50, 64, dtype=torch.float64)
    _, their_w, their_c = router(u)
    weights, chosen = moe.route(u)
    order, their_order = chosen.argsort(-1), their_c.argsort(-1)
    assert torch.equal(chosen.gather(-1, order), their_c.gather(-1, their_order))
    torch.testing.assert_close(weights.gather(-1, order), their_w.gather(-1, their_order),
                               atol=1e-12, rtol=0)


def test_the_first_layers_are_dense_and_the_rest_experts():
    model = GPT(our_config())
    kinds = [type(b.mlp) for b in model.blocks]
    assert kinds == [SwiGLU, MixtureOfExperts, MixtureOfExperts]
    assert model.blocks[0].mlp.hidden == 96 and model.blocks[1].mlp.hidden == 24


def test_the_query_latent_is_down_norm_up_in_float64():
    cfg = our_config(n_layer=1, moe_dense_layers=0, mlp_hidden=0)
    torch.manual_seed(0)
    layer = GPT(cfg).double().blocks[0].attn
    assert isinstance(layer.w_q, QueryLatent)
    x = torch.randn(2, 5, 64, dtype=torch.float64)
    c = x @ layer.w_q.w_dq.weight.T                                       # (B, T, r_q)
    c = c / (c.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * layer.w_q.q_norm.weight
    torch.testing.assert_close(layer.w_q(x), c @ layer.w_q.w_uq.weight.T, atol=1e-12, rtol=0)


@pytest.mark.parametrize("fields,named", [
    (dict(moe_groups=3), "divide"),
    (dict(moe_groups=8), "two experts a group"),
    (dict(moe_group_top=5), "between 1 and"),
    (dict(moe_groups=4, moe_group_top=1, moe_top_k=3), "more experts than"),
    (dict(moe_dense_layers=3), "none of the"),
    (dict(moe_router="softmax_topk", moe_bias_rate=0.0), "model.moe_router=sigmoid"),
    (dict(mechanism="mha"), "model.mla_q_rank=24"),
    (dict(mlp="swiglu", moe_dense_layers=0, mla_q_rank=0, moe_groups=1, moe_group_top=1,
          moe_routed_scale=1.0, moe_experts=8, moe_shared=1, moe_top_k=2, moe_hidden=0), None),
])
def test_a_field_that_cannot_apply_is_refused_in_one_line(fields, named):
    if named is None:      # the plain fields of a dense model are unchanged by the new ones
        GPT(our_config(**fields))
        return
    with pytest.raises(ModelError) as err:
        GPT(our_config(**fields))
    assert named in str(err.value) and "\n" not in str(err.value)


def test_the_new_fields_off_build_nothing_new():
    plain = GPT(our_config(mla_q_rank=0, moe_dense_layers=0, mlp_hidden=0, moe_groups=1,
                           moe_group_top=1, moe_routed_scale=1.0))
    names = {n for n, _ in plain.named_parameters()}
    assert not any("w_dq" in n or "q_norm" in n for n in names)
    assert all(isinstance(b.mlp, MixtureOfExperts) for b in plain.blocks)


# -- the whole card, imported and exported ----------------------------------------------

@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepseek_v3")
    torch.manual_seed(0)
    shaken(transformers.DeepseekV3ForCausalLM(hf_config()).eval()).save_pretrained(folder)
    hf_tokenizer(CHARS).save_pretrained(folder)
    return folder


def hf_model(folder, dtype=torch.float64):
    return transformers.DeepseekV3ForCausalLM.from_pretrained(
        folder, attn_implementation="sdpa", experts_implementation="eager", dtype=dtype).eval()


def test_the_bridge_reads_deepseek_v3_as_its_card(hf_folder):
    _, cfg, _ = load_hf_folder(hf_folder)
    assert cfg == our_config(moe_bias_rate=cfg.moe_bias_rate)


def test_an_imported_deepseek_v3_gives_transformers_logits_in_float64(hf_folder, in_float64):
    ours, _, _ = load_hf_folder(hf_folder, dtype=torch.float64)
    x = batch()
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, hf_model(hf_folder)(x).logits, atol=1e-9, rtol=0)


def test_an_imported_deepseek_v3_gives_transformers_logits_as_shipped_in_float32(hf_folder):
    ours, _, _ = load_hf_folder(hf_folder)
    x = batch()
    with torch.no_grad():
        theirs_logits = hf_model(hf_folder, torch.float32)(x).logits
        torch.testing.assert_close(ours(x).logits, theirs_logits, atol=2e-5, rtol=0)


def test_an_imported_deepseek_v3_decodes_from_its_cache_the_logits_of_its_full_pass(hf_folder):
    ours, _, _ = load_hf_folder(hf_folder, dtype=torch.float64)
    x = batch()
    with torch.no_grad():
        full = ours(x).logits
        cache = ours.new_cache(x.shape[1])
        steps = [ours(x[:, :3], cache=cache).logits]
        steps += [ours(x[:, t:t + 1], cache=cache).logits for t in range(3, x.shape[1])]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-9, rtol=0)


@pytest.mark.parametrize("over", [{}, dict(mla_q_rank=0, moe_groups=1, moe_group_top=1,
                                            moe_dense_layers=0, mlp_hidden=0, moe_shared=1,
                                            moe_routed_scale=1.0, tie_embeddings=True)],
                         ids=["the card", "full-rank queries, no groups, no dense layers"])
def test_our_deepseek_v3_exports_to_a_folder_transformers_loads_with_equal_logits(
        over, tmp_path, in_float64):
    cfg = our_config(**over)
    torch.manual_seed(0)
    ours = shaken(GPT(cfg)).double().eval()
    arch = export(ours, cfg, CHARS, tmp_path / "out")
    assert arch.hf_class == "DeepseekV3ForCausalLM"
    theirs_model, info = transformers.DeepseekV3ForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="sdpa", experts_implementation="eager",
        output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    theirs_model = theirs_model.double().eval()
    x = batch()
    with torch.no_grad():   # the export is written in float32: compare with our model rounded so
        rounded = GPT(cfg).double().eval()
        rounded.load_state_dict({k: v.float().double() for k, v in ours.state_dict().items()})
        torch.testing.assert_close(theirs_model(x).logits, rounded(x).logits, atol=1e-9, rtol=0)
    # ... and reads back as the same model.
    again, cfg_again, _ = load_hf_folder(tmp_path / "out", dtype=torch.float64)
    assert cfg_again == cfg.__class__(**{**cfg.__dict__, "moe_bias_rate": cfg_again.moe_bias_rate})
    with torch.no_grad():
        torch.testing.assert_close(again(x).logits, rounded(x).logits, atol=1e-12, rtol=0)


def test_the_mtp_module_is_left_out_of_an_export_and_said_so(tmp_path, in_float64):
    cfg = our_config(mtp_depth=1)
    torch.manual_seed(0)
    ours = shaken(GPT(cfg)).double().eval()
    export(ours, cfg, CHARS, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written.get("num_mtp_layers", written.get("num_nextn_predict_layers")) == 0
    theirs_model = hf_model(tmp_path / "out")
    x = batch()
    with torch.no_grad():
        rounded = GPT(cfg).double().eval()
        rounded.load_state_dict({k: v.float().double() for k, v in ours.state_dict().items()})
        torch.testing.assert_close(theirs_model(x).logits, rounded(x).logits, atol=1e-9, rtol=0)
    assert "multi-token prediction" in interop_deepseek.__doc__


# -- what cannot cross, in one line each ------------------------------------------------

@pytest.mark.parametrize("change,named", [
    (dict(norm_eps=1e-5), "model.norm_eps=1e-05"),
    (dict(bias=True), "model.bias=true"),
    (dict(moe_shared=0), "model.moe_shared=0"),
    (dict(mechanism="mha", mla_q_rank=0), "model.mechanism=mha"),
    (dict(moe_router="softmax_topk", moe_bias_rate=0.0, moe_groups=1, moe_group_top=1),
     "model.moe_router=softmax_topk"),
    (dict(norm="layernorm"), "model.norm=layernorm"),
])
def test_a_deepseek_v3_the_bridge_cannot_write_is_refused_one_reason_a_field(change, named):
    reasons = interop_deepseek._blockers(our_config(**change))
    assert len(reasons) == 1 and reasons[0].startswith(named) and "\n" not in reasons[0]
    assert interop_deepseek._blockers(our_config()) == []


@pytest.mark.parametrize("change,named", [
    (dict(rms_norm_eps=1e-5), "rms_norm_eps"),
    (dict(v_head_dim=8), "v_head_dim"),
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(rope_interleave=False), "rope_interleave"),
    (dict(norm_topk_prob=False), "norm_topk_prob"),
])
def test_a_deepseek_v3_the_bridge_cannot_compute_is_refused_in_one_line(change, named, tmp_path):
    transformers.DeepseekV3Config.save_pretrained(hf_config(**change), tmp_path)
    hf_tokenizer(CHARS).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError) as err:
        load_hf_folder(tmp_path)
    assert named in str(err.value) and "\n" not in str(err.value)


# -- planted slips: each must break the float64 equality ----------------------------------

SLIPS = {
    "rotary rows not reordered": lambda mp: (
        mp.setattr(interop_deepseek, "_halved", lambda R: torch.arange(R))),
    "keys and values read as halves, not head by head": lambda mp: mp.setitem(
        ARCHITECTURES, "deepseek_v3", replace(interop_deepseek.DEEPSEEK_V3, from_hf_weights=(
            _kv_as_halves(interop_deepseek.DEEPSEEK_V3.from_hf_weights)))),
    "groups ignored": lambda mp: mp.setattr(
        "model.moe.group_limit", lambda choice, groups, keep: torch.zeros_like(choice)),
    "no routed scale": lambda mp: mp.setattr(MixtureOfExperts, "route", _unscaled(MixtureOfExperts.route)),
}


def _kv_as_halves(real):
    def read(get, cfg):
        out = real(get, cfg)
        for i in range(cfg.n_layer):
            out[f"blocks.{i}.attn.w_ukv.weight"] = get(f"model.layers.{i}.self_attn.kv_b_proj.weight")
        return out
    return read


def _unscaled(real):
    def route(self, u):
        weights, chosen = real(self, u)
        return weights / self.routed_scale, chosen
    return route


@pytest.mark.parametrize("slip", SLIPS)
def test_a_planted_slip_breaks_the_equality(slip, hf_folder, in_float64, monkeypatch):
    SLIPS[slip](monkeypatch)
    ours, _, _ = load_hf_folder(hf_folder, dtype=torch.float64)
    x = batch()
    with torch.no_grad():
        gap = (ours(x).logits - hf_model(hf_folder)(x).logits).abs().max().item()
    assert gap > 1e-6, slip


def test_the_deepseek_v3_preset_is_a_model_transformers_deepseek_v3_computes():
    from engine import cli
    cfg = cli.build("deepseek-v3", []).model
    cfg.vocab_size = V
    assert architecture_for(cfg, CHARS) is interop_deepseek.DEEPSEEK_V3


# -- DeepSeek-V3.2: the lightning indexer on latent attention ------------------------------

from transformers.models.deepseek_v32 import modeling_deepseek_v32 as theirs32  # noqa: E402

from model.latent_sparse_attention import LatentSparseAttention  # noqa: E402

TOP_K = 6                 # of up to LENGTH = 20 visible keys: most queries choose


def hf32_config(**over) -> "transformers.DeepseekV32Config":
    """hf_config()'s card with an indexer of 8 heads of 16 choosing 6 keys a query. Eight
    heads, because its scores are sums of ReLUs and a key every head scores below zero
    scores exactly 0: with few heads such ties are common, and transformers' top-k breaks
    them its own way (ours picks the newest)."""
    c = {k: v for k, v in hf_config().to_dict().items()
         if k in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                  "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "n_shared_experts", "n_routed_experts", "num_experts_per_tok", "n_group",
                  "topk_group", "first_k_dense_replace", "kv_lora_rank", "q_lora_rank",
                  "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                  "max_position_embeddings", "routed_scaling_factor")}
    c.update(index_topk=TOP_K, index_n_heads=8, index_head_dim=16, pad_token_id=0,
             bos_token_id=1, eos_token_id=1, **over)
    return transformers.DeepseekV32Config(**c)


def our32_config(**over) -> ModelConfig:
    return our_config(**{"mechanism": "mla_sparse", "sparse_top_k": TOP_K, "indexer_heads": 8,
                         "indexer_dim": 16, **over})


def _indexer_float64(self, hidden_states, q_resid, position_embeddings, attention_mask,
                     position_ids, cache=None):
    # DeepseekV32Indexer.forward, its formula unchanged, at the input's precision (it casts
    # its products and its head weights to float32).
    B, S, _ = hidden_states.shape
    cos, sin = position_embeddings
    q = self.wq_b(q_resid).view(B, S, self.n_heads, self.head_dim)
    q_rot, q_pass = torch.split(q, [self.qk_rope_head_dim, self.head_dim - self.qk_rope_head_dim], -1)
    k = self.k_norm(self.wk(hidden_states)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [self.qk_rope_head_dim, self.head_dim - self.qk_rope_head_dim], -1)
    q_rot, k_rot = theirs32.apply_rotary_pos_emb(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q, k = torch.cat([q_rot, q_pass], -1), torch.cat([k_rot, k_pass], -1).squeeze(2)
    scores = F.relu(torch.matmul(q, k.transpose(-1, -2).unsqueeze(1)) * self.softmax_scale)
    weights = F.linear(hidden_states, self.weights_proj.weight.to(hidden_states.dtype)) * self.n_heads ** -0.5
    index = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
    index = index.masked_fill(~attention_mask, float("-inf"))
    return index.topk(min(self.index_topk, index.shape[-1]), dim=-1).indices.to(torch.int32)


@pytest.fixture
def v32_in_float64(monkeypatch):
    monkeypatch.setattr(theirs32.DeepseekV32RMSNorm, "forward", _rms_norm_float64)
    monkeypatch.setattr(theirs32.DeepseekV32RotaryEmbedding, "forward", _rotary_float64)
    monkeypatch.setattr(theirs32.DeepseekV32TopkRouter, "forward", _router_float64)
    monkeypatch.setattr(theirs32.DeepseekV32Indexer, "forward", _indexer_float64)


def _rope_by_hand(t, theta=10000.0):
    """RoPE on the last dimension, pair i = (i, i + R/2) turned by position · θ^(-2i/R)."""
    R, T = t.shape[-1], t.shape[-2]
    angle = torch.arange(T, dtype=torch.float64)[:, None] * theta ** (
        -torch.arange(0, R, 2, dtype=torch.float64) / R)
    a, b = t[..., :R // 2], t[..., R // 2:]
    return torch.cat([a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()], -1)


def _rms(t, g):
    return t / (t.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * g


def test_latent_sparse_attention_is_the_papers_formula_in_float64():
    """DSA on MLA written out (arXiv:2512.02556, eq. 1-2, on arXiv:2405.04434's MLA): every
    query's index scores, its k best visible keys (ties to the newest), and the softmax
    over those keys alone of MLA's rebuilt keys and values, scaled by 1/√(d_h + d_R)."""
    cfg = our32_config(n_layer=1, moe_dense_layers=0, mlp_hidden=0)
    torch.manual_seed(0)
    model = shaken(GPT(cfg).double(), 0.2).eval()
    layer = model.blocks[0].attn
    assert isinstance(layer, LatentSparseAttention)
    x = torch.randn(2, LENGTH, 64, dtype=torch.float64)
    captured = []
    layer.register_forward_hook(lambda m, args, out: captured.append(out[0]))
    model.blocks[0].norm_attn.register_forward_hook(lambda m, args, out: x.copy_(out))
    with torch.no_grad():
        model(batch()[:2])
    H, D, R, r = 4, 16, 8, 32
    W = {n: p for n, p in layer.named_parameters()}
    B, T = x.shape[:2]
    c_q = _rms(x @ W["w_q.w_dq.weight"].T, W["w_q.q_norm.weight"])
    q = (c_q @ W["w_q.w_uq.weight"].T).view(B, T, H, D + R).transpose(1, 2)
    q = torch.cat([q[..., :D], _rope_by_hand(q[..., D:])], -1)
    c_kv = _rms(x @ W["w_dkv.weight"].T, W["kv_norm.weight"])
    k_r = _rope_by_hand(x @ W["w_kr.weight"].T)
    k_c, v = (c_kv @ W["w_ukv.weight"].T).view(B, T, 2 * H, D).transpose(1, 2).split(H, 1)
    k = torch.cat([k_c, k_r[:, None].expand(B, H, T, R)], -1)
    q_i = (c_q @ W["w_iq.weight"].T).view(B, T, 8, 16).transpose(1, 2)
    q_i = torch.cat([_rope_by_hand(q_i[..., :R]), q_i[..., R:]], -1)
    k_i = F.layer_norm(x @ W["w_ik.weight"].T, (16,), W["ik_norm.weight"], W["ik_norm.bias"], 1e-6)
    k_i = torch.cat([_rope_by_hand(k_i[..., :R]), k_i[..., R:]], -1)
    w = x @ W["w_iw.weight"].T / 8 ** 0.5                                  # (B, T, H_I)
    index = torch.einsum("btj,bjts->bts", w, F.relu(q_i @ k_i[:, None].transpose(-2, -1) / 4))
    out = torch.zeros(B, H, T, D, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            ranked = sorted(range(t + 1), key=lambda s: (-index[b, t, s].item(), -s))[:TOP_K]
            scores = torch.einsum("hd,hnd->hn", q[b, :, t], k[b, :, ranked]) / (D + R) ** 0.5
            out[b, :, t] = torch.einsum("hn,hnd->hd", torch.softmax(scores, -1), v[b, :, ranked])
    want = out.transpose(1, 2).reshape(B, T, H * D) @ W["w_o.weight"].T
    torch.testing.assert_close(captured[-1], want, atol=1e-12, rtol=0)


def test_with_every_key_chosen_it_is_latent_attention():
    cfg = our32_config(n_layer=1, moe_dense_layers=0, mlp_hidden=0, sparse_top_k=64)
    torch.manual_seed(0)
    sparse = shaken(GPT(cfg).double(), 0.2).eval()
    dense = GPT(replace(cfg, mechanism="mla", sparse_top_k=0, indexer_heads=4,
                        indexer_dim=0)).double().eval()
    dense.load_state_dict(sparse.state_dict(), strict=False)
    x = batch()
    with torch.no_grad():
        torch.testing.assert_close(sparse(x).logits, dense(x).logits, atol=1e-12, rtol=0)


def test_the_indexer_learns_from_its_own_loss_alone():
    cfg = our32_config(n_layer=2, moe_dense_layers=1)
    torch.manual_seed(0)
    model = GPT(cfg)
    x = batch()
    model(x, x).loss.backward()
    layer = model.blocks[0].attn
    assert layer.w_iq.weight.grad is None or not layer.w_iq.weight.grad.any()
    model.zero_grad(set_to_none=True)
    model(x, x)
    layer.aux_loss.backward()
    assert layer.w_iq.weight.grad.any() and layer.w_ik.weight.grad.any()
    grad = layer.w_dkv.weight.grad               # detached: the main model is not moved by it
    assert grad is None or not grad.any()


def test_without_a_query_latent_the_indexer_reads_the_input_and_v32_refuses_it():
    cfg = our32_config(mla_q_rank=0)
    layer = GPT(cfg).blocks[0].attn
    assert layer.w_iq.in_features == cfg.n_embd
    reasons = interop_deepseek._v32_blockers(cfg)
    assert len(reasons) == 1 and reasons[0].startswith("model.mla_q_rank=0")
    # The export's line names that field as the first fix, before another mechanism.
    from engine.interop import ExportError
    with pytest.raises(ExportError, match=r"stopped by: model.mla_q_rank=0.*the card's values.*"
                                          r"or train with --model.mechanism=mha"):
        architecture_for(cfg, CHARS)


def test_mla_sparse_decodes_from_its_cache_the_logits_of_its_full_pass():
    torch.manual_seed(0)
    model = shaken(GPT(our32_config()).double()).eval()
    x = batch()
    with torch.no_grad():
        full = model(x).logits
        cache = model.new_cache(x.shape[1])
        steps = [model(x[:, :3], cache=cache).logits]
        steps += [model(x[:, t:t + 1], cache=cache).logits for t in range(3, x.shape[1])]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-9, rtol=0)


# -- a decoding step reads the k latents it chose ------------------------------------------

def v32_preset() -> ModelConfig:
    """The deepseek-v3.2 preset's model (4 heads of 32 over one latent, k = 32 of 128)."""
    from engine import cli
    return replace(cli.build("deepseek-v3.2", []).model, vocab_size=V)


def decoded(model, x, prefill: int) -> torch.Tensor:
    """x's logits: x[:, :prefill] in one pass into a cache, then one token a step."""
    cache = model.new_cache(x.shape[1])
    with torch.no_grad():
        steps = [model(x[:, :prefill], cache=cache).logits]
        steps += [model(x[:, t:t + 1], cache=cache).logits for t in range(prefill, x.shape[1])]
    return torch.cat(steps, 1)


@pytest.mark.parametrize("cfg", [our32_config(bias=True), replace(v32_preset(), n_layer=2)],
                         ids=["biased", "the preset's layers"])
def test_a_gathered_decoding_step_gives_the_masked_steps_and_the_full_pass_logits(cfg, monkeypatch):
    """Eight steps after a cache of 2k take the gathered, absorbed path and give what the
    masked, up-projected path and the whole pass give, to float64's rounding."""
    torch.manual_seed(0)
    model = shaken(GPT(cfg).double(), 0.05).eval()
    k = model.blocks[0].attn.top_k
    prefill = 2 * k
    x = batch(prefill + 8)[:2]
    with torch.no_grad():
        full = model(x).logits
    calls, gathered = [], LatentSparseAttention.gathered
    monkeypatch.setattr(LatentSparseAttention, "gathered",
                        lambda self, *a: calls.append(a[2].latent.shape[1]) or gathered(self, *a))
    steps = decoded(model, x, prefill)
    assert sorted(set(calls)) == list(range(prefill + 1, x.shape[1] + 1))   # every step gathered
    monkeypatch.setattr(LatentSparseAttention, "gathers", staticmethod(lambda *a: False))
    masked = decoded(model, x, prefill)
    assert len(calls) == model.config.n_layer * 8                  # no gather: the masked path
    torch.testing.assert_close(steps, masked, atol=1e-12, rtol=0)
    torch.testing.assert_close(steps, full, atol=1e-12, rtol=0)


def sparse_layer(**over) -> LatentSparseAttention:
    torch.manual_seed(0)
    cfg = our32_config(n_layer=1, **over)
    return shaken(LatentSparseAttention(cfg, 0).double(), 0.2).eval()


def layer_chunk(layer, cache, x, need_weights=False):
    """x (B, n, C) after what the cache holds, as GPT.forward drives a layer."""
    k_pos, k_first = cache.begin(x.shape[1], x.device)
    mask = Mask(q_start=cache.length, q_len=x.shape[1], k_pos=k_pos, k_first=k_first)
    with torch.no_grad():
        out = layer(x, None, mask, cache, need_weights)
    cache.end(x.shape[1])
    return out


def step_after(layer, x, poison: bool, need_weights=False):
    """Prefill x[:, :-1] into a cache, then decode x[:, -1:]; with `poison`, the latent and
    rotary key of every row the step does not choose is NaN first (the indexer keys, which
    the indexer reads for every row, are left whole)."""
    n = x.shape[1] - 1
    cache = KVCache(1, n + 1)
    layer_chunk(layer, cache, x[:, :n])
    if poison:
        seen, select = [], layer.select
        layer.select = lambda *a: seen.append(select(*a)) or seen[-1]
        layer_chunk(layer, copy.deepcopy(cache), x[:, n:])
        del layer.select
        chosen = seen[-1][:, 0, 0]                                   # (B, k)
        assert chosen.shape[-1] == TOP_K < n
        for b in range(x.shape[0]):
            unread = [s for s in range(n) if s not in chosen[b].tolist()]
            cache.k[0][b, :, unread, :layer.rank + layer.rope_dim] = float("nan")
    return layer_chunk(layer, cache, x[:, n:], need_weights)


def test_a_decoding_step_reads_only_the_k_latents_it_chose():
    """NaN in every latent and rotary key the indexer passed over changes nothing, weights
    included: the step never read them (the masked path's weight 0 times NaN is NaN)."""
    layer = sparse_layer(bias=True)
    x = torch.randn(3, 4 * TOP_K, 64, dtype=torch.float64)
    clean, clean_weights = step_after(layer, x, False, need_weights=True)
    poisoned, weights = step_after(layer, x, True, need_weights=True)
    assert torch.isfinite(poisoned).all() and torch.equal(clean, poisoned)
    assert torch.equal(clean_weights, weights)
    assert (weights > 0).sum(-1).eq(TOP_K).all()                  # the k chosen, 0 elsewhere


@pytest.mark.parametrize("old,new", [
    # the masked path at every step, as before the gather
    ("return q_len * k < k_len", "return False"),
    # every sequence of the batch reading the first one's rows
    ("rows = chosen[:, 0].reshape(", "rows = chosen[:1, 0].expand(B, -1, -1).reshape("),
])
def test_a_step_reading_rows_it_did_not_choose_is_caught(old, new, monkeypatch):
    from mechanism_checks import planted
    cls = planted("latent_sparse_attention", old, new, monkeypatch).LatentSparseAttention
    torch.manual_seed(0)
    layer = shaken(cls(our32_config(n_layer=1), 0).double(), 0.2).eval()
    out = step_after(layer, torch.randn(3, 4 * TOP_K, 64, dtype=torch.float64), True)[0]
    assert not torch.isfinite(out).all()


def test_where_the_indexers_scores_tie_at_zero_both_paths_choose_the_newest_keys(monkeypatch):
    """One indexer head with every weight w = -1: I = -ReLU(q^I·k^I/√d_I), exactly 0 for
    about half the keys, so a step's k are chosen among many tied at 0, newest first, by
    the masked path and the gathered one alike, and the decoded logits are the full pass's."""
    torch.manual_seed(0)
    model = shaken(GPT(our32_config(bias=True, indexer_heads=1)).double(), 0.05).eval()
    for block in model.blocks:
        block.attn.w_iw.weight.data.zero_()
        block.attn.w_iw.bias.data.fill_(-1.0)
    x = batch(4 * TOP_K)[:2]
    with torch.no_grad():
        full = model(x).logits
    picks, select = [], LatentSparseAttention.select
    monkeypatch.setattr(LatentSparseAttention, "select",
                        lambda self, index, *a: picks.append((index, select(self, index, *a)))
                        or picks[-1][1])
    steps = decoded(model, x, TOP_K + 1)
    torch.testing.assert_close(steps, full, atol=1e-12, rtol=0)
    tied_past_k = 0
    for index, chosen in picks[-model.config.n_layer * (x.shape[1] - TOP_K - 1):]:   # the steps
        row = index[:, -1]                                           # (B, Tk): one query each
        for b in range(row.shape[0]):
            want = sorted(range(row.shape[1]), key=lambda s: (-row[b, s].item(), -s))[:TOP_K]
            assert sorted(chosen[b, 0, -1].tolist()) == sorted(want)
            zeros = (row[b] == 0).nonzero().flatten().tolist()
            tied_past_k += len(zeros) > TOP_K and zeros[:TOP_K] != want   # not merely the oldest
    assert tied_past_k > 10
    monkeypatch.setattr(LatentSparseAttention, "gathers", staticmethod(lambda *a: False))
    torch.testing.assert_close(decoded(model, x, TOP_K + 1), steps, atol=1e-12, rtol=0)


@pytest.fixture(scope="module")
def hf32_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepseek_v32")
    torch.manual_seed(0)
    shaken(transformers.DeepseekV32ForCausalLM(hf32_config()).eval()).save_pretrained(folder)
    hf_tokenizer(CHARS).save_pretrained(folder)
    return folder


def hf32_model(folder, dtype=torch.float64):
    return transformers.DeepseekV32ForCausalLM.from_pretrained(
        folder, attn_implementation="sdpa", experts_implementation="eager", dtype=dtype).eval()


def test_the_bridge_reads_deepseek_v32_as_its_card(hf32_folder):
    _, cfg, _ = load_hf_folder(hf32_folder)
    assert cfg == our32_config(moe_bias_rate=cfg.moe_bias_rate)


def test_an_imported_deepseek_v32_gives_transformers_logits_in_float64(hf32_folder, v32_in_float64):
    ours, _, _ = load_hf_folder(hf32_folder, dtype=torch.float64)
    x = batch()
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, hf32_model(hf32_folder)(x).logits,
                                   atol=1e-9, rtol=0)


def test_an_imported_deepseek_v32_gives_transformers_logits_as_shipped_in_float32(hf32_folder):
    ours, _, _ = load_hf_folder(hf32_folder)
    x = batch()
    with torch.no_grad():
        theirs_logits = hf32_model(hf32_folder, torch.float32)(x).logits
        torch.testing.assert_close(ours(x).logits, theirs_logits, atol=2e-5, rtol=0)


def test_our_deepseek_v32_exports_to_a_folder_transformers_loads_with_equal_logits(
        tmp_path, v32_in_float64):
    cfg = our32_config()
    torch.manual_seed(0)
    ours = shaken(GPT(cfg)).double().eval()
    arch = export(ours, cfg, CHARS, tmp_path / "out")
    assert arch.hf_class == "DeepseekV32ForCausalLM"
    theirs_model, info = transformers.DeepseekV32ForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="sdpa", experts_implementation="eager",
        output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    theirs_model = theirs_model.double().eval()
    x = batch()
    with torch.no_grad():
        rounded = GPT(cfg).double().eval()
        rounded.load_state_dict({k: v.float().double() for k, v in ours.state_dict().items()})
        torch.testing.assert_close(theirs_model(x).logits, rounded(x).logits, atol=1e-9, rtol=0)


def test_a_planted_indexer_slip_breaks_the_v32_equality(hf32_folder, v32_in_float64, monkeypatch):
    # The indexer's queries read from the input, not the query latent: a plausible slip.
    monkeypatch.setattr(LatentSparseAttention, "turned",
                        lambda self, t, mask: t)          # no RoPE on the indexer
    ours, _, _ = load_hf_folder(hf32_folder, dtype=torch.float64)
    x = batch()
    with torch.no_grad():
        gap = (ours(x).logits - hf32_model(hf32_folder)(x).logits).abs().max().item()
    assert gap > 1e-6


def test_the_deepseek_v32_preset_is_a_model_transformers_deepseek_v32_computes():
    from engine import cli
    cfg = cli.build("deepseek-v3.2", []).model
    cfg.vocab_size = V
    assert architecture_for(cfg, CHARS) is interop_deepseek.DEEPSEEK_V32


def test_a_refused_config_json_names_the_files_key_beside_ours(tmp_path):
    """A value the model refuses is named as this project's field and as config.json's
    key that holds it, so the reader knows which line of the file to fix."""
    transformers.DeepseekV3Config.save_pretrained(hf_config(num_experts_per_tok=9), tmp_path)
    hf_tokenizer(CHARS).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError) as err:
        load_hf_folder(tmp_path)
    said = str(err.value)
    assert "model.moe_top_k=9 (config.json's num_experts_per_tok)" in said, said
    assert said.count(str(tmp_path / "config.json")) == 1 and "save_pretrained" in said


def test_in_file_terms_names_a_key_only_where_one_holds_the_value():
    from engine.interop import in_file_terms
    config = {"num_experts_per_tok": 9, "n_group": 3, "num_hidden_layers": 3, "eps": 1e-06}
    assert (in_file_terms("model.moe_top_k=9 is too many; model.moe_groups=3 too", config)
            == "model.moe_top_k=9 (config.json's num_experts_per_tok) is too many; "
               "model.moe_groups=3 too")                     # 3: two keys hold it, none named
    assert in_file_terms("model.norm_eps=1e-06, more", config) == (
        "model.norm_eps=1e-06 (config.json's eps), more")
