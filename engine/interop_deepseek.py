"""DeepSeek-V3 (arXiv:2412.19437) to and from the Hugging Face `transformers` format: an
entry of engine/interop.py's ARCHITECTURES, read with the same safetensors reader and no
transformers, no pickle, no remote code.

    deepseek_v3   latent attention (MLA) in every layer, its queries      DeepseekV3ForCausalLM
                  full-rank or through a latent (q_lora_rank); RMSNorm;
                  the first layers dense SwiGLU (first_k_dense_replace),
                  the rest experts: sigmoid routing with the balancing
                  bias (e_score_correction_bias), grouped (n_group,
                  topk_group), scaled (routed_scaling_factor), shared
                  experts beside the routed ones

Ours: model.mechanism=mla (model.mla_kv_rank, mla_rope_dim, mla_q_rank), model.mlp=moe with
model.moe_router=sigmoid, moe_expert=swiglu, moe_dense_layers, moe_groups, moe_group_top,
moe_routed_scale, model.norm=rmsnorm, model.bias=false, model.norm_eps=1e-6. The mapping:

- transformers fuses W_DKV and W_KR in one `kv_a_proj_with_mqa` (latent rows, then the
  rotary key's); its `kv_b_proj` keeps each head's key rows then its value rows, head by
  head, where ours (`w_ukv`) has every head's key, then every head's value.
- DeepSeek lays each rotary pair out side by side (rope_interleave=true: pair i is
  dimensions 2i, 2i+1) and returns it rotate-half (pair i at i, i + d_R/2), the layout ours
  computes in throughout; so the rows of the rotary query and key are reordered, and the
  scores are the same.
- its shared experts are one SwiGLU of width n_shared·moe_intermediate_size; ours are
  n_shared experts of moe_intermediate_size: the sum of SwiGLUs side by side is one SwiGLU
  of their widths together, so they are concatenated (exported) or cut apart (imported).
- its latent norms (`kv_a_layernorm`, `q_a_layernorm`) have eps 1e-6 whatever rms_norm_eps
  says; ours have model.norm_eps, so it must be 1e-6 both ways.

transformers' DeepseekV3ForCausalLM has no multi-token prediction module (DeepSeek's own
checkpoint keeps it as an extra layer that class skips on load): an export leaves
model.mtp_depth's module out and writes num_mtp_layers=0; an import starts with none.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from common.errors import CheckpointError
from engine.hf_files import MAX_HEADS, MAX_WIDTH, Field, count
from engine.interop import (_ROPE, _SIZES, ARCHITECTURES, Architecture, _common_refusals,
                            _needs, _refuse_unless, _rope_theta)
from model import ModelConfig
from model.latent_attention import latent_sizes
from model.layers import MLPS, SwiGLU
from model.mechanisms import names_used
from model.moe import MOE_EXPERTS, MOE_ROUTERS, MixtureOfExperts
from model.sparse_attention import sparse_sizes

_ROUTER, _EXPERT = "sigmoid", "swiglu"
# transformers builds kv_a_layernorm and q_a_layernorm with DeepseekV3RMSNorm's default eps.
_LATENT_EPS = 1e-6


def _blockers(cfg: ModelConfig) -> list[str]:
    # Every other architecture refuses latent attention and the MTP module; DeepSeek-V3 has
    # the first, and its export leaves the second out (the docstring says why).
    out = [why for why in _common_refusals(cfg)
           if not why.startswith(("model.mechanism=", "model.mtp_depth="))]
    if any(n != "mla" for n in names_used(cfg)):
        out.append(f"model.mechanism={cfg.mechanism} (needs mla in every layer)")
    out += _needs(cfg, position=("rope", "none"), norm="rmsnorm", mlp="moe")
    if MLPS[cfg.mlp] is MixtureOfExperts:
        if MOE_ROUTERS[cfg.moe_router] is not MOE_ROUTERS[_ROUTER]:
            out.append(f"model.moe_router={cfg.moe_router} (needs {_ROUTER})")
        if MOE_EXPERTS[cfg.moe_expert] is not MOE_EXPERTS[_EXPERT]:
            out.append(f"model.moe_expert={cfg.moe_expert} (needs {_EXPERT})")
        if not cfg.moe_shared:
            out.append("model.moe_shared=0 (DeepSeek-V3 has shared experts: needs 1 or more)")
    if cfg.sliding_window:
        out.append(f"model.sliding_window={cfg.sliding_window} (DeepSeek-V3 sees every earlier "
                   "token: needs 0)")
    if cfg.bias:
        out.append("model.bias=true (DeepSeek-V3's latent attention and experts have no biases: "
                   "needs false)")
    if cfg.norm_eps != _LATENT_EPS:
        out.append(f"model.norm_eps={cfg.norm_eps} (DeepSeek-V3's latent norms use 1e-6 "
                   "whatever rms_norm_eps says: needs 1e-6)")
    return out


def _to_config(cfg: ModelConfig) -> dict:
    rank, rope_dim = latent_sizes(cfg)
    return {"vocab_size": cfg.vocab_size, "hidden_size": cfg.n_embd,
            "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
            "num_key_value_heads": cfg.n_head, "max_position_embeddings": cfg.block_size,
            "intermediate_size": SwiGLU.width(cfg),
            "moe_intermediate_size": MixtureOfExperts.width(cfg),
            "n_shared_experts": cfg.moe_shared, "n_routed_experts": cfg.moe_experts,
            "num_experts_per_tok": cfg.moe_top_k, "routed_scaling_factor": cfg.moe_routed_scale,
            "n_group": cfg.moe_groups, "topk_group": cfg.moe_group_top,
            "first_k_dense_replace": cfg.moe_dense_layers, "norm_topk_prob": True,
            "kv_lora_rank": rank, "q_lora_rank": cfg.mla_q_rank or None,
            "qk_rope_head_dim": rope_dim, "qk_nope_head_dim": cfg.head_dim,
            "v_head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
            "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
            "rope_interleave": True, "attention_bias": False, "attention_dropout": 0.0,
            "tie_word_embeddings": cfg.tie_embeddings, "num_mtp_layers": 0}


_SCHEMA = {
    **_SIZES, **_ROPE,
    "intermediate_size": count(16 * MAX_WIDTH), "moe_intermediate_size": count(16 * MAX_WIDTH),
    "num_key_value_heads": count(MAX_HEADS, required=False, null=True),
    "n_shared_experts": count(1 << 12), "n_routed_experts": count(1 << 12),
    "num_experts_per_tok": count(1 << 12), "routed_scaling_factor": Field(float, 0.0, 1e6),
    "n_group": count(1 << 12, required=False, null=True),
    "topk_group": count(1 << 12, required=False, null=True),
    "first_k_dense_replace": count(1 << 12, low=0, required=False, null=True),
    "norm_topk_prob": Field(bool), "kv_lora_rank": count(MAX_WIDTH),
    "q_lora_rank": count(MAX_WIDTH, required=False, null=True),
    "qk_rope_head_dim": count(MAX_WIDTH), "qk_nope_head_dim": count(MAX_WIDTH),
    "v_head_dim": count(MAX_WIDTH), "hidden_act": Field(str),
    "rms_norm_eps": Field(float, 0.0, 1.0), "rope_interleave": Field(bool),
    "attention_bias": Field(bool), "tie_word_embeddings": Field(bool),
}


def _from_config(c: dict) -> ModelConfig:
    _refuse_unless(c, {"hidden_act": ("silu",), "norm_topk_prob": (True,),
                       "attention_bias": (False,), "rope_interleave": (True,)})
    H, width = c["num_attention_heads"], c["hidden_size"]
    head = width // H
    if width % H or c["qk_nope_head_dim"] != head or c["v_head_dim"] != head:
        raise CheckpointError(f"qk_nope_head_dim={c['qk_nope_head_dim']}, v_head_dim="
                              f"{c['v_head_dim']}: attnlab's latent attention gives each head "
                              f"hidden_size / heads = {width / H:g} for both")
    if c.get("num_key_value_heads") not in (None, H):
        raise CheckpointError(f"num_key_value_heads={c['num_key_value_heads']}: latent attention "
                              "rebuilds a key and a value for every head (needs num_attention_heads)")
    if c.get("rms_norm_eps", _LATENT_EPS) != _LATENT_EPS:
        raise CheckpointError(f"rms_norm_eps={c['rms_norm_eps']}: DeepSeek-V3's latent norms use "
                              "1e-6 whatever it says, and attnlab's share model.norm_eps with the "
                              "rest (needs 1e-6)")
    if c["qk_rope_head_dim"] % 2:
        raise CheckpointError(f"qk_rope_head_dim={c['qk_rope_head_dim']} is odd: RoPE turns pairs")
    return ModelConfig(
        vocab_size=c["vocab_size"], block_size=c["max_position_embeddings"],
        n_layer=c["num_hidden_layers"], n_head=H, n_embd=width, mechanism="mla",
        mla_kv_rank=c["kv_lora_rank"], mla_rope_dim=c["qk_rope_head_dim"],
        mla_q_rank=c.get("q_lora_rank") or 0, position="rope", norm="rmsnorm", mlp="moe",
        mlp_hidden=c["intermediate_size"] if c.get("first_k_dense_replace") else 0,
        moe_dense_layers=c.get("first_k_dense_replace") or 0,
        moe_experts=c["n_routed_experts"], moe_shared=c["n_shared_experts"],
        moe_top_k=c["num_experts_per_tok"], moe_hidden=c["moe_intermediate_size"],
        moe_routed_scale=float(c["routed_scaling_factor"]), moe_groups=c.get("n_group") or 1,
        moe_group_top=c.get("topk_group") or 1, moe_router=_ROUTER, moe_expert=_EXPERT,
        bias=False, norm_eps=_LATENT_EPS, tie_embeddings=c.get("tie_word_embeddings", False),
        rope_theta=_rope_theta(c))


def _interleaved(rope_dim: int) -> torch.Tensor:
    """Row order taking ours (pair i at i, i + d_R/2) to DeepSeek's (pair i at 2i, 2i + 1)."""
    half = torch.arange(rope_dim // 2)
    return torch.stack((half, half + rope_dim // 2), dim=1).flatten()


def _halved(rope_dim: int) -> torch.Tensor:
    """Row order taking DeepSeek's pairs (2i, 2i + 1) to ours (i, i + d_R/2)."""
    return torch.cat((torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)))


def _query_rows(w: torch.Tensor, cfg: ModelConfig, order: torch.Tensor) -> torch.Tensor:
    """Each head's query rows [d_h plain; d_R rotary], the rotary ones put in `order`."""
    D, (_, R) = cfg.head_dim, latent_sizes(cfg)
    heads = w.view(cfg.n_head, D + R, -1)
    return torch.cat((heads[:, :D], heads[:, D:][:, order]), dim=1).reshape(w.shape)


def _query_names(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(ours, theirs) for the query's weights; the last is the one whose rows are per head."""
    if cfg.mla_q_rank:
        return [("attn.w_q.w_dq.weight", "self_attn.q_a_proj.weight"),
                ("attn.w_q.q_norm.weight", "self_attn.q_a_layernorm.weight"),
                ("attn.w_q.w_uq.weight", "self_attn.q_b_proj.weight")]
    return [("attn.w_q.weight", "self_attn.q_proj.weight")]


_ONE_TO_ONE = [("norm_attn.weight", "input_layernorm.weight"),
               ("norm_mlp.weight", "post_attention_layernorm.weight"),
               ("attn.kv_norm.weight", "self_attn.kv_a_layernorm.weight"),
               ("attn.w_o.weight", "self_attn.o_proj.weight")]


def _to_hf(sd: dict, cfg: ModelConfig) -> dict:
    out = {"model.embed_tokens.weight": sd["wte.weight"], "model.norm.weight": sd["norm_f.weight"]}
    H, D, (rank, R) = cfg.n_head, cfg.head_dim, latent_sizes(cfg)
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        out.update({theirs + b: sd[ours + a] for a, b in _ONE_TO_ONE})
        queries = _query_names(cfg)
        out.update({theirs + b: sd[ours + a] for a, b in queries[:-1]})
        out[theirs + queries[-1][1]] = _query_rows(sd[ours + queries[-1][0]], cfg, _interleaved(R))
        out[theirs + "self_attn.kv_a_proj_with_mqa.weight"] = torch.cat(
            (sd[ours + "attn.w_dkv.weight"], sd[ours + "attn.w_kr.weight"][_interleaved(R)]))
        key, value = sd[ours + "attn.w_ukv.weight"].view(2, H, D, rank)
        out[theirs + "self_attn.kv_b_proj.weight"] = torch.stack((key, value), 1).reshape(-1, rank)
        mlp, their_mlp = ours + "mlp.", theirs + "mlp."
        if i < cfg.moe_dense_layers:
            gate, up = sd[mlp + "fc.weight"].chunk(2)
            out.update({their_mlp + "gate_proj.weight": gate, their_mlp + "up_proj.weight": up,
                        their_mlp + "down_proj.weight": sd[mlp + "proj.weight"]})
            continue
        fc, proj, shared = sd[mlp + "fc.weight"], sd[mlp + "proj.weight"], cfg.moe_shared
        gates, ups = fc[:shared].chunk(2, dim=1)                  # (S, h, C) each
        out.update({
            their_mlp + "gate.weight": sd[mlp + "router.weight"],
            their_mlp + "gate.e_score_correction_bias": sd[mlp + "balance_bias"],
            # S experts of width h side by side: one SwiGLU of width S·h.
            their_mlp + "shared_experts.gate_proj.weight": gates.flatten(0, 1),
            their_mlp + "shared_experts.up_proj.weight": ups.flatten(0, 1),
            their_mlp + "shared_experts.down_proj.weight": torch.cat(list(proj[:shared]), dim=1)})
        for e in range(cfg.moe_experts):       # saved one matrix an expert, as DeepSeek's files are
            expert = f"{their_mlp}experts.{e}."
            out[expert + "gate_proj.weight"], out[expert + "up_proj.weight"] = fc[shared + e].chunk(2)
            out[expert + "down_proj.weight"] = proj[shared + e]
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    return out


def _from_hf(get, cfg: ModelConfig) -> dict:
    out = {"wte.weight": get("model.embed_tokens.weight"), "norm_f.weight": get("model.norm.weight")}
    H, D, (rank, R) = cfg.n_head, cfg.head_dim, latent_sizes(cfg)
    hidden, shared = MixtureOfExperts.width(cfg), cfg.moe_shared
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        out.update({ours + a: get(theirs + b) for a, b in _ONE_TO_ONE})
        queries = _query_names(cfg)
        out.update({ours + a: get(theirs + b) for a, b in queries[:-1]})
        out[ours + queries[-1][0]] = _query_rows(get(theirs + queries[-1][1]), cfg, _halved(R))
        latent, rope_key = get(theirs + "self_attn.kv_a_proj_with_mqa.weight").split([rank, R])
        out[ours + "attn.w_dkv.weight"], out[ours + "attn.w_kr.weight"] = latent, rope_key[_halved(R)]
        kv = get(theirs + "self_attn.kv_b_proj.weight").view(H, 2, D, rank)
        out[ours + "attn.w_ukv.weight"] = kv.transpose(0, 1).reshape(2 * H * D, rank)
        mlp, their_mlp = ours + "mlp.", theirs + "mlp."
        if i < cfg.moe_dense_layers:
            out[mlp + "fc.weight"] = torch.cat((get(their_mlp + "gate_proj.weight"),
                                                get(their_mlp + "up_proj.weight")))
            out[mlp + "proj.weight"] = get(their_mlp + "down_proj.weight")
            continue
        gates = get(their_mlp + "shared_experts.gate_proj.weight").view(shared, hidden, -1)
        ups = get(their_mlp + "shared_experts.up_proj.weight").view(shared, hidden, -1)
        down = get(their_mlp + "shared_experts.down_proj.weight")             # (C, S·h)
        experts = [f"{their_mlp}experts.{e}." for e in range(cfg.moe_experts)]
        routed_fc = torch.stack([torch.cat((get(e + "gate_proj.weight"), get(e + "up_proj.weight")))
                                 for e in experts])
        routed_proj = torch.stack([get(e + "down_proj.weight") for e in experts])
        out[mlp + "fc.weight"] = torch.cat((torch.cat((gates, ups), dim=1), routed_fc))
        out[mlp + "proj.weight"] = torch.cat((torch.stack(down.split(hidden, dim=1)), routed_proj))
        out[mlp + "router.weight"] = get(their_mlp + "gate.weight")
        out[mlp + "balance_bias"] = get(their_mlp + "gate.e_score_correction_bias").float()
        out[mlp + "load"] = torch.zeros(cfg.moe_experts)            # no load measured yet
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = get("lm_head.weight")
    return out


DEEPSEEK_V3 = Architecture("deepseek_v3", "DeepseekV3ForCausalLM", _blockers, _to_config,
                           _from_config, _to_hf, _from_hf, _SCHEMA, "model.",
                           ignored=(r"rotary_emb\.inv_freq$",))
ARCHITECTURES["deepseek_v3"] = DEEPSEEK_V3


# -- DeepSeek-V3.2: the same card with a lightning indexer in every latent attention layer --

_SPARSE = "mla_sparse"
_INDEXER = [("attn.w_iq.weight", "self_attn.indexer.wq_b.weight"),
            ("attn.w_ik.weight", "self_attn.indexer.wk.weight"),
            ("attn.ik_norm.weight", "self_attn.indexer.k_norm.weight"),
            ("attn.ik_norm.bias", "self_attn.indexer.k_norm.bias"),
            ("attn.w_iw.weight", "self_attn.indexer.weights_proj.weight")]


def _v32_blockers(cfg: ModelConfig) -> list[str]:
    out = [why for why in _blockers(cfg) if not why.startswith("model.mechanism=")]
    if any(n != _SPARSE for n in names_used(cfg)):
        out.append(f"model.mechanism={cfg.mechanism} (needs {_SPARSE} in every layer)")
    if not cfg.mla_q_rank:
        out.append("model.mla_q_rank=0 (DeepSeek-V3.2's indexer reads the query latent: needs "
                   "one, 1536 in the card)")
    return out


def _v32_to_config(cfg: ModelConfig) -> dict:
    top_k, heads, dim = sparse_sizes(cfg)
    out = {k: v for k, v in _to_config(cfg).items() if k not in ("rope_interleave", "num_mtp_layers")}
    layers = ["dense"] * cfg.moe_dense_layers + ["sparse"] * (cfg.n_layer - cfg.moe_dense_layers)
    return {**out, "mlp_layer_types": layers, "index_topk": top_k, "index_n_heads": heads,
            "index_head_dim": dim}


_V32_SCHEMA = {**{k: v for k, v in _SCHEMA.items() if k != "rope_interleave"},
               "index_topk": count(1 << 20), "index_n_heads": count(MAX_HEADS),
               "index_head_dim": count(MAX_WIDTH),
               "mlp_layer_types": Field(list, 1, 1 << 12, items=Field(str, choices=("dense", "sparse")))}


def _v32_from_config(c: dict) -> ModelConfig:
    if not c.get("q_lora_rank"):
        raise CheckpointError("q_lora_rank is not set: DeepSeek-V3.2's indexer reads the query latent")
    layers = c.get("mlp_layer_types")
    dense = layers.count("dense") if layers else c.get("first_k_dense_replace") or 0
    if layers and (len(layers) != c["num_hidden_layers"]
                   or layers != ["dense"] * dense + ["sparse"] * (len(layers) - dense)):
        raise CheckpointError(f"mlp_layer_types {layers[:8]}...: attnlab keeps the first layers "
                              "dense and the rest experts (model.moe_dense_layers)")
    cfg = _from_config({**c, "rope_interleave": True, "first_k_dense_replace": dense})
    return replace(cfg, mechanism=_SPARSE, sparse_top_k=min(c["index_topk"], cfg.block_size),
                   indexer_heads=c["index_n_heads"], indexer_dim=c["index_head_dim"])


def _v32_to_hf(sd: dict, cfg: ModelConfig) -> dict:
    out = _to_hf(sd, cfg)
    for i in range(cfg.n_layer):
        out.update({f"model.layers.{i}.{b}": sd[f"blocks.{i}.{a}"] for a, b in _INDEXER})
    return out


def _v32_from_hf(get, cfg: ModelConfig) -> dict:
    out = _from_hf(get, cfg)
    for i in range(cfg.n_layer):
        out.update({f"blocks.{i}.{a}": get(f"model.layers.{i}.{b}") for a, b in _INDEXER})
    return out


DEEPSEEK_V32 = Architecture("deepseek_v32", "DeepseekV32ForCausalLM", _v32_blockers, _v32_to_config,
                            _v32_from_config, _v32_to_hf, _v32_from_hf, _V32_SCHEMA, "model.",
                            ignored=(r"rotary_emb\.inv_freq$",))
ARCHITECTURES["deepseek_v32"] = DEEPSEEK_V32
