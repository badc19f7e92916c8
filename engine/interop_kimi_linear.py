"""Kimi Linear (arXiv:2510.26692) to and from the Hugging Face `transformers` format: an
entry of engine/interop.py's ARCHITECTURES, read with the same safetensors reader and no
transformers, no pickle, no remote code.

    kimi_linear   Kimi Delta Attention layers (a short convolution on q,   KimiLinearForCausalLM
                  k, v; a decay per key channel; the output RMS-normed
                  and sigmoid-gated) among latent attention layers
                  without positions (DeepSeek's MLA, NoPE), RMSNorms,
                  DeepSeek-V3's experts (sigmoid affinities, a
                  correction bias, a routed scale) and shared experts

Ours: model.mechanism cycling kda and mla (layer_types), model.delta_conv, model.mla_nope,
model.norm=rmsnorm, model.mlp=moe with the sigmoid router and model.moe_routed_scale. The
files keep the checkpoint's own names (block_sparse_moe, experts' w1/w2/w3, a convolution
each for q, k and v), which transformers converts when it loads them; the latent layer's
kv_b_proj keeps each head's key rows then its value rows, ours all keys then all values.
Its latent RMSNorm has transformers' fixed ε of 10⁻⁶ where ours has model.norm_eps, so a
model with latent layers maps only with model.norm_eps=1e-6."""
from __future__ import annotations

from dataclasses import replace

import torch

from common.errors import CheckpointError
from engine.hf_files import MAX_HEADS, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB, MAX_WIDTH, Field, count
from engine.interop import ARCHITECTURES, Architecture, _common_refusals, _needs, _refuse_unless
from model import ModelConfig
from model.latent_attention import latent_sizes
from model.layers import MLPS, layer_names
from model.mechanisms import MECHANISMS, names_used
from model.moe import MOE_EXPERTS, MOE_ROUTERS, MixtureOfExperts

LINEAR, FULL = "linear_attention", "full_attention"
MECHANISM_OF = {LINEAR: "kda", FULL: "mla"}
_ROUTER, _EXPERT = "sigmoid", "swiglu"
LATENT_EPS = 1e-6          # KimiLinearRMSNorm's default, which its latent norm keeps


def _kind(name: str) -> str | None:
    return next((t for t, ours in MECHANISM_OF.items() if MECHANISMS[name] is MECHANISMS[ours]),
                None)


def layer_types(cfg: ModelConfig) -> list[str]:
    return [_kind(n) for n in layer_names(cfg)]


def _blockers(cfg: ModelConfig) -> list[str]:
    own = replace(cfg, mechanism="mha")
    out = _common_refusals(own) + _needs(cfg, position=("none", "rope"), norm="rmsnorm", mlp="moe")
    kinds = {_kind(n) for n in names_used(cfg)}
    if None in kinds:
        out.append(f"model.mechanism={cfg.mechanism} (needs kda or mla in every layer: Kimi "
                   "Linear's delta-rule and latent layers)")
    if LINEAR in kinds and not cfg.delta_conv:
        out.append("model.delta_conv=0 (Kimi Linear's KDA layers convolve q, k and v: needs 4)")
    if FULL in kinds:
        if not cfg.mla_nope:
            out.append("model.mla_nope=false (Kimi Linear's latent layers turn nothing: needs true)")
        if cfg.norm_eps != LATENT_EPS:
            out.append(f"model.norm_eps={cfg.norm_eps} (Kimi Linear's latent norm has ε 1e-6: "
                       "needs 1e-6)")
    if cfg.bias:
        out.append("model.bias=true (Kimi Linear's layers have no biases)")
    if MLPS[cfg.mlp] is MixtureOfExperts:
        if MOE_ROUTERS[cfg.moe_router] is not MOE_ROUTERS[_ROUTER]:
            out.append(f"model.moe_router={cfg.moe_router} (needs {_ROUTER})")
        if MOE_EXPERTS[cfg.moe_expert] is not MOE_EXPERTS[_EXPERT]:
            out.append(f"model.moe_expert={cfg.moe_expert} (needs {_EXPERT})")
        if not cfg.moe_shared:
            out.append("model.moe_shared=0 (Kimi Linear has shared experts: needs 1)")
        if cfg.moe_shared_gate:
            out.append("model.moe_shared_gate=true (Kimi Linear's shared experts are not gated)")
        if cfg.moe_groups > 1:
            out.append(f"model.moe_groups={cfg.moe_groups} (Kimi Linear's router picks among "
                       "every expert: needs 1)")
        if cfg.moe_dense_layers:
            out.append(f"model.moe_dense_layers={cfg.moe_dense_layers} (every Kimi Linear layer "
                       "here has experts: needs 0)")
    if cfg.mla_q_rank:
        out.append(f"model.mla_q_rank={cfg.mla_q_rank} (Kimi Linear's latent layers project "
                   "their queries at full rank: needs 0)")
    return out


def _to_config(cfg: ModelConfig) -> dict:
    H, D, width = cfg.n_head, cfg.head_dim, MixtureOfExperts.width(cfg)
    rank, rope_dim = latent_sizes(cfg)
    return {"vocab_size": cfg.vocab_size, "hidden_size": cfg.n_embd,
            "num_hidden_layers": cfg.n_layer, "num_attention_heads": H, "num_key_value_heads": H,
            "max_position_embeddings": cfg.block_size, "kv_lora_rank": rank, "q_lora_rank": None,
            "qk_rope_head_dim": rope_dim, "qk_nope_head_dim": D, "v_head_dim": D,
            "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
            # KimiLinearForCausalLM never ties its head to the embedding (it builds its own
            # lm_head), so a tied model is written with the shared matrix in both places.
            "tie_word_embeddings": False, "attention_bias": False,
            "attention_dropout": 0.0, "layer_types": layer_types(cfg),
            "mlp_layer_types": ["sparse"] * cfg.n_layer, "intermediate_size": width,
            "moe_intermediate_size": width, "num_local_experts": cfg.moe_experts,
            "num_experts_per_tok": cfg.moe_top_k, "n_shared_experts": cfg.moe_shared,
            "routed_scaling_factor": cfg.moe_routed_scale, "n_group": 1, "topk_group": 1,
            "norm_topk_prob": True, "pad_token_id": None,   # its default lies past a small vocabulary
            "linear_attn_config": {"head_dim": D, "num_heads": H,
                                   "short_conv_kernel_size": cfg.delta_conv or 4}}


def _named(c: dict, *names, default=None):
    """The first of transformers' names for one setting that config.json holds (a
    checkpoint's own names, or the ones transformers maps them to)."""
    return next((c[n] for n in names if c.get(n) is not None), default)


_WIDTH = count(MAX_WIDTH, required=False, null=True)
SCHEMA = {
    "vocab_size": count(MAX_VOCAB), "hidden_size": count(MAX_WIDTH),
    "num_hidden_layers": count(MAX_LAYERS), "num_attention_heads": count(MAX_HEADS),
    "num_key_value_heads": count(MAX_HEADS, required=False, null=True),
    "max_position_embeddings": count(MAX_POSITIONS, required=False),
    "model_max_length": count(MAX_POSITIONS, required=False),
    "kv_lora_rank": count(MAX_WIDTH), "q_lora_rank": _WIDTH, "qk_rope_head_dim": count(MAX_WIDTH),
    "qk_nope_head_dim": count(MAX_WIDTH), "v_head_dim": _WIDTH, "hidden_act": Field(str),
    "rms_norm_eps": Field(float, 0.0, 1.0), "tie_word_embeddings": Field(bool),
    "attention_bias": Field(bool),
    "layer_types": Field(list, 1, 1 << 10, items=Field(str, choices=(LINEAR, FULL)), null=True),
    "mlp_layer_types": Field(list, 1, 1 << 10, items=Field(str), null=True),
    "first_k_dense_replace": count(1 << 10, low=0, required=False),
    "moe_intermediate_size": count(16 * MAX_WIDTH), "intermediate_size": _WIDTH,
    "num_experts": _WIDTH, "num_local_experts": _WIDTH, "num_experts_per_token": _WIDTH,
    "num_experts_per_tok": _WIDTH, "num_shared_experts": count(1 << 10, low=0, required=False),
    "n_shared_experts": count(1 << 10, low=0, required=False),
    "routed_scaling_factor": Field(float, 1e-6, 1e6), "num_expert_group": _WIDTH, "n_group": _WIDTH,
    "topk_group": _WIDTH, "moe_renormalize": Field(bool), "norm_topk_prob": Field(bool),
    "linear_attn_config": Field(dict, null=True, fields={
        "head_dim": count(MAX_WIDTH), "num_heads": count(MAX_HEADS),
        "short_conv_kernel_size": count(1 << 10)}),
    "linear_head_dim": _WIDTH, "linear_num_heads": _WIDTH, "linear_conv_kernel_dim": _WIDTH,
}


def _pattern(types: list[str]) -> str:
    n = len(types)
    period = next(p for p in range(1, n + 1) if all(types[i] == types[i % p] for i in range(n)))
    return ",".join(MECHANISM_OF[t] for t in types[:period])


def _sizes(c: dict) -> tuple[int, int]:
    """(heads, head size), after checking every layer kind splits the width alike."""
    H, width = c["num_attention_heads"], c["hidden_size"]
    D = width // H
    linear = c.get("linear_attn_config") or {}
    wanted = {"qk_nope_head_dim": D, "v_head_dim": D,
              "linear_attn_config.head_dim": D, "linear_attn_config.num_heads": H,
              "num_key_value_heads": H}
    found = {"qk_nope_head_dim": c["qk_nope_head_dim"], "v_head_dim": _named(c, "v_head_dim", default=D),
             "linear_attn_config.head_dim": _named(linear, "head_dim", default=_named(c, "linear_head_dim", default=D)),
             "linear_attn_config.num_heads": _named(linear, "num_heads", default=_named(c, "linear_num_heads", default=H)),
             "num_key_value_heads": _named(c, "num_key_value_heads", default=H)}
    for key, want in wanted.items():
        if found[key] != want or width % H:
            raise CheckpointError(f"{key}={found[key]}: attnlab's layers split hidden_size "
                                  f"{width} equally between its {H} heads ({want})")
    return H, D


def _from_config(c: dict) -> ModelConfig:
    _refuse_unless(c, {"hidden_act": ("silu",), "attention_bias": (False,), "q_lora_rank": (None,),
                       "moe_renormalize": (True,), "norm_topk_prob": (True,)})
    H, D = _sizes(c)
    n_layer = c["num_hidden_layers"]
    types = c.get("layer_types") or []
    if len(types) != n_layer:
        raise CheckpointError(f"layer_types lists {len(types)} layers, num_hidden_layers is {n_layer}")
    kinds = c.get("mlp_layer_types") or []
    if kinds != ["sparse"] * n_layer:
        raise CheckpointError(f"mlp_layer_types={kinds[:6]}...: attnlab's model.mlp=moe puts "
                              "experts in every layer (no dense first layers)")
    groups, kept = _named(c, "num_expert_group", "n_group", default=1), _named(c, "topk_group", default=1)
    if kept != groups:
        raise CheckpointError(f"topk_group={kept} of num_expert_group={groups}: attnlab's router "
                              "picks among every expert, with no groups left out")
    if FULL in types and c.get("rms_norm_eps", 1e-5) != LATENT_EPS:
        raise CheckpointError(f"rms_norm_eps={c.get('rms_norm_eps', 1e-5)}: Kimi Linear's latent "
                              f"norm has ε {LATENT_EPS}, and attnlab one ε for every norm")
    linear = c.get("linear_attn_config") or {}
    return ModelConfig(
        vocab_size=c["vocab_size"],
        block_size=_named(c, "max_position_embeddings", "model_max_length", default=1 << 20),
        n_layer=n_layer, n_head=H, n_embd=c["hidden_size"], mechanism=_pattern(types),
        delta_conv=(_named(linear, "short_conv_kernel_size",
                           default=_named(c, "linear_conv_kernel_dim", default=4))
                    if LINEAR in types else 0),
        mla_nope=FULL in types,
        mla_kv_rank=c["kv_lora_rank"] if FULL in types else 0,
        mla_rope_dim=c["qk_rope_head_dim"] if FULL in types else 0,
        position="none", norm="rmsnorm", bias=False, norm_eps=c.get("rms_norm_eps", 1e-5),
        mlp="moe", moe_experts=_named(c, "num_experts", "num_local_experts"),
        moe_top_k=_named(c, "num_experts_per_token", "num_experts_per_tok"),
        moe_shared=_named(c, "num_shared_experts", "n_shared_experts", default=1),
        moe_hidden=c["moe_intermediate_size"], moe_router=_ROUTER, moe_expert=_EXPERT,
        moe_routed_scale=float(c.get("routed_scaling_factor", 1.0)), moe_bias_rate=0.0,
        tie_embeddings=c.get("tie_word_embeddings", False))


# (ours, theirs) per layer, copied as they are.
_COMMON = [("norm_attn.weight", "input_layernorm.weight"),
           ("norm_mlp.weight", "post_attention_layernorm.weight"),
           ("mlp.router.weight", "block_sparse_moe.gate.weight"),
           ("mlp.balance_bias", "block_sparse_moe.gate.e_score_correction_bias")]
_LINEAR = [("w_decay_down", "f_a_proj"), ("w_decay_up", "f_b_proj"), ("w_beta", "b_proj"),
           ("w_gate_down", "g_a_proj"), ("w_gate_up", "g_b_proj"), ("w_o", "o_proj")]
_LINEAR_PARAMS = [("decay_bias", "dt_bias"), ("out_norm", "o_norm.weight")]
_FULL = [("w_q.weight", "q_proj.weight"), ("kv_norm.weight", "kv_a_layernorm.weight"),
         ("w_o.weight", "o_proj.weight")]


def _to_hf(sd: dict, cfg: ModelConfig) -> dict:
    out = {"model.embed_tokens.weight": sd["wte.weight"], "model.norm.weight": sd["norm_f.weight"]}
    H, D, C, S = cfg.n_head, cfg.head_dim, cfg.n_embd, cfg.moe_shared
    rank = latent_sizes(cfg)[0]
    for i, kind in enumerate(layer_types(cfg)):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        out.update({theirs + hf: sd[ours + name] for name, hf in _COMMON})
        attn, hf_attn = f"{ours}attn.", f"{theirs}self_attn."
        if kind == LINEAR:
            for p, w, conv in zip("qkv", sd[attn + "w_qkv.weight"].chunk(3),
                                  sd[attn + "conv.weight"].chunk(3)):
                out[f"{hf_attn}{p}_proj.weight"], out[f"{hf_attn}{p}_conv1d.weight"] = w, conv
            out.update({f"{hf_attn}{hf}.weight": sd[f"{attn}{name}.weight"] for name, hf in _LINEAR})
            out.update({hf_attn + hf: sd[attn + name] for name, hf in _LINEAR_PARAMS})
            out[hf_attn + "A_log"] = sd[attn + "decay_log_rate"].view(1, 1, H, 1)
        else:
            out.update({hf_attn + hf: sd[attn + name] for name, hf in _FULL})
            out[hf_attn + "kv_a_proj_with_mqa.weight"] = torch.cat(
                (sd[attn + "w_dkv.weight"], sd[attn + "w_kr.weight"]))
            k, v = sd[attn + "w_ukv.weight"].view(2, H, D, rank).unbind(0)
            # Head by head: its key rows, then its value rows.
            out[hf_attn + "kv_b_proj.weight"] = torch.stack((k, v), 1).reshape(2 * C, rank)
        moe, fc, proj = f"{theirs}block_sparse_moe.", sd[ours + "mlp.fc.weight"], sd[ours + "mlp.proj.weight"]
        for e in range(cfg.moe_experts):
            gate, up = fc[S + e].chunk(2)
            out.update({f"{moe}experts.{e}.w1.weight": gate, f"{moe}experts.{e}.w3.weight": up,
                        f"{moe}experts.{e}.w2.weight": proj[S + e]})
        gates, ups = fc[:S].chunk(2, dim=1)
        out[moe + "shared_experts.gate_proj.weight"] = gates.reshape(-1, C)
        out[moe + "shared_experts.up_proj.weight"] = ups.reshape(-1, C)
        out[moe + "shared_experts.down_proj.weight"] = torch.cat(proj[:S].unbind(0), dim=1)
    out["lm_head.weight"] = sd["wte.weight" if cfg.tie_embeddings else "lm_head.weight"]
    return out


def _from_hf(get, cfg: ModelConfig) -> dict:
    out = {"wte.weight": get("model.embed_tokens.weight"), "norm_f.weight": get("model.norm.weight")}
    H, D, C, S = cfg.n_head, cfg.head_dim, cfg.n_embd, cfg.moe_shared
    rank = latent_sizes(cfg)[0]
    for i, kind in enumerate(layer_types(cfg)):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        out.update({ours + name: get(theirs + hf) for name, hf in _COMMON})
        attn, hf_attn = f"{ours}attn.", f"{theirs}self_attn."
        if kind == LINEAR:
            out[attn + "w_qkv.weight"] = torch.cat([get(f"{hf_attn}{p}_proj.weight") for p in "qkv"])
            out[attn + "conv.weight"] = torch.cat([get(f"{hf_attn}{p}_conv1d.weight") for p in "qkv"])
            out.update({f"{attn}{name}.weight": get(f"{hf_attn}{hf}.weight") for name, hf in _LINEAR})
            out.update({attn + name: get(hf_attn + hf) for name, hf in _LINEAR_PARAMS})
            out[attn + "decay_log_rate"] = get(hf_attn + "A_log").reshape(H)
        else:
            out.update({attn + name: get(hf_attn + hf) for name, hf in _FULL})
            out[attn + "w_dkv.weight"], out[attn + "w_kr.weight"] = get(
                hf_attn + "kv_a_proj_with_mqa.weight").split([rank, latent_sizes(cfg)[1]])
            k, v = get(hf_attn + "kv_b_proj.weight").view(H, 2, D, rank).unbind(1)
            out[attn + "w_ukv.weight"] = torch.cat((k.reshape(C, rank), v.reshape(C, rank)))
        moe = f"{theirs}block_sparse_moe."
        gates = get(moe + "shared_experts.gate_proj.weight").view(S, -1, C)
        ups = get(moe + "shared_experts.up_proj.weight").view(S, -1, C)
        downs = get(moe + "shared_experts.down_proj.weight").view(C, S, -1).transpose(0, 1)
        routed = [f"{moe}experts.{e}." for e in range(cfg.moe_experts)]
        out[ours + "mlp.fc.weight"] = torch.cat((torch.cat((gates, ups), dim=1), torch.stack(
            [torch.cat((get(r + "w1.weight"), get(r + "w3.weight"))) for r in routed])))
        out[ours + "mlp.proj.weight"] = torch.cat(
            (downs, torch.stack([get(r + "w2.weight") for r in routed])))
        out[ours + "mlp.load"] = torch.zeros(cfg.moe_experts)      # no load measured yet
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = get("lm_head.weight")
    return out


KIMI_LINEAR = Architecture("kimi_linear", "KimiLinearForCausalLM", _blockers, _to_config,
                           _from_config, _to_hf, _from_hf, SCHEMA, "model.",
                           ignored=(r"rotary_emb\.inv_freq$",))   # buffers older files kept
ARCHITECTURES["kimi_linear"] = KIMI_LINEAR
