"""Qwen3-Next to and from the Hugging Face `transformers` format: an entry of
engine/interop.py's ARCHITECTURES, read with the same safetensors reader and no
transformers, no pickle, no remote code.

    qwen3_next   Gated DeltaNet layers (a short convolution on q, k, v;     Qwen3NextForCausalLM
                 Mamba2's decay; the output RMS-normed and SiLU-gated)
                 among gated softmax layers (the gate from q_proj, learned
                 (1+w) QK-norms, RoPE on a quarter of each head), (1+w)
                 RMSNorms, experts routed by a softmax's top k and a
                 shared expert behind a sigmoid gate

Ours: model.mechanism cycling gated_deltanet_norm and gated (layer_types), model.delta_conv,
model.position=rope_partial, model.norm=rmsnorm1p, model.qk_norm and model.qk_norm_weight,
model.mlp=moe with model.moe_router=softmax, model.moe_shared_gate. The mapping reorders
rows only: transformers keeps each linear layer's q, k, v and z rows head by head
(in_proj_qkvz), β's and the decay's rows head by head (in_proj_ba), and each head's query
followed by its gate (q_proj); ours keeps all queries, then all keys, then all values, and
the gates in a matrix of their own. Our moe_shared shared experts of width H are its one
shared expert of width moe_shared·H, cut into pieces.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from common.errors import CheckpointError
from engine.hf_files import MAX_HEADS, MAX_WIDTH, Field, count
from engine.interop import (_ROPE, _SIZES, ARCHITECTURES, Architecture, _common_refusals, _needs,
                            _refuse_unless)
from model import ModelConfig
from model.layers import MLPS, layer_names
from model.mechanisms import MECHANISMS, names_used
from model.moe import MOE_EXPERTS, MOE_ROUTERS, MixtureOfExperts

LINEAR, FULL = "linear_attention", "full_attention"
# Our mechanism for each of transformers' layer types.
MECHANISM_OF = {LINEAR: "gated_deltanet_norm", FULL: "gated"}
_ROUTER, _EXPERT = "softmax", "swiglu"


def _kind(name: str) -> str | None:
    """transformers' layer type for one of our mechanisms, None for one it has not."""
    return next((t for t, ours in MECHANISM_OF.items() if MECHANISMS[name] is MECHANISMS[ours]),
                None)


def _blockers(cfg: ModelConfig) -> list[str]:
    # The parts every other architecture refuses and Qwen3-Next has are checked here.
    own = replace(cfg, mechanism="mha", qk_norm=False, qk_norm_weight=False)
    out = _common_refusals(own) + _needs(cfg, position="rope_partial", norm="rmsnorm1p", mlp="moe")
    kinds = {_kind(n) for n in names_used(cfg)}
    if None in kinds:
        out.append(f"model.mechanism={cfg.mechanism} (needs gated_deltanet_norm or gated in "
                   "every layer: Qwen3-Next's linear and full layers)")
    if LINEAR in kinds and not cfg.delta_conv:
        out.append("model.delta_conv=0 (Qwen3-Next's linear layers convolve q, k and v: "
                   "needs 4)")
    if FULL in kinds and not (cfg.qk_norm and cfg.qk_norm_weight):
        out.append(f"model.qk_norm={str(cfg.qk_norm).lower()} (Qwen3-Next learns a norm for "
                   "its queries and one for its keys: needs model.qk_norm=true and "
                   "model.qk_norm_weight=true)")
    if cfg.bias:
        out.append("model.bias=true (Qwen3-Next's layers have no biases)")
    turned = cfg.rope_dims or cfg.head_dim // 4
    if int(cfg.head_dim * (turned / cfg.head_dim)) != turned:
        out.append(f"model.rope_dims={cfg.rope_dims} (transformers turns int(head_dim x "
                   "partial_rotary_factor) dimensions, which does not come back to it)")
    if MLPS[cfg.mlp] is MixtureOfExperts:
        if MOE_ROUTERS[cfg.moe_router] is not MOE_ROUTERS[_ROUTER]:
            out.append(f"model.moe_router={cfg.moe_router} (needs {_ROUTER})")
        if MOE_EXPERTS[cfg.moe_expert] is not MOE_EXPERTS[_EXPERT]:
            out.append(f"model.moe_expert={cfg.moe_expert} (needs {_EXPERT})")
        if not cfg.moe_shared:
            out.append("model.moe_shared=0 (Qwen3-Next has a shared expert: needs 1)")
        if not cfg.moe_shared_gate:
            out.append("model.moe_shared_gate=false (Qwen3-Next gates its shared expert: "
                       "needs true)")
    return out


def layer_types(cfg: ModelConfig) -> list[str]:
    return [_kind(n) for n in layer_names(cfg)]


def _to_config(cfg: ModelConfig) -> dict:
    H, D, width = cfg.n_head, cfg.head_dim, MixtureOfExperts.width(cfg)
    return {"vocab_size": cfg.vocab_size, "hidden_size": cfg.n_embd,
            "num_hidden_layers": cfg.n_layer, "num_attention_heads": H,
            "num_key_value_heads": cfg.kv_heads, "head_dim": D, "hidden_act": "silu",
            "max_position_embeddings": cfg.block_size, "rms_norm_eps": cfg.norm_eps,
            "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False,
            "attention_dropout": 0.0, "layer_types": layer_types(cfg),
            "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default",
                                "partial_rotary_factor": (cfg.rope_dims or D // 4) / D},
            "linear_conv_kernel_dim": cfg.delta_conv or 4, "linear_key_head_dim": D,
            "linear_value_head_dim": D, "linear_num_key_heads": H, "linear_num_value_heads": H,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "intermediate_size": width,
            "moe_intermediate_size": width, "shared_expert_intermediate_size": width * cfg.moe_shared,
            "num_experts": cfg.moe_experts, "num_experts_per_tok": cfg.moe_top_k,
            "norm_topk_prob": True, "router_aux_loss_coef": 0.0}


SCHEMA = {
    **_SIZES, **_ROPE, "num_key_value_heads": count(MAX_HEADS, required=False, null=True),
    "head_dim": count(MAX_WIDTH, required=False, null=True), "hidden_act": Field(str),
    "rms_norm_eps": Field(float, 0.0, 1.0), "tie_word_embeddings": Field(bool),
    "attention_bias": Field(bool),
    "layer_types": Field(list, 1, 1 << 10, items=Field(str, choices=(LINEAR, FULL))),
    "linear_conv_kernel_dim": count(1 << 10, required=False), "linear_key_head_dim": count(MAX_WIDTH),
    "linear_value_head_dim": count(MAX_WIDTH), "linear_num_key_heads": count(MAX_HEADS),
    "linear_num_value_heads": count(MAX_HEADS), "decoder_sparse_step": count(1 << 10, required=False),
    "mlp_only_layers": Field(list, 0, 1 << 10, items=count(1 << 10, low=0)),
    "intermediate_size": count(16 * MAX_WIDTH, required=False),
    "moe_intermediate_size": count(16 * MAX_WIDTH),
    "shared_expert_intermediate_size": count(16 * MAX_WIDTH, low=0, required=False),
    "num_experts": count(1 << 12), "num_experts_per_tok": count(1 << 12),
    "norm_topk_prob": Field(bool),
}


def _pattern(types: list[str]) -> str:
    """The shortest list of our mechanisms that, cycled, gives transformers' layer_types."""
    n = len(types)
    period = next(p for p in range(1, n + 1)
                  if all(types[i] == types[i % p] for i in range(n)))
    return ",".join(MECHANISM_OF[t] for t in types[:period])


def _rotary_dims(c: dict, head_dim: int) -> int:
    params = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling") or {}
    kind = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if kind != "default":
        raise CheckpointError(f"rope scaling {kind!r} in config.json: attnlab imports Qwen3-Next "
                              "with unscaled RoPE only")
    turned = int(head_dim * params.get("partial_rotary_factor", 0.25))
    if turned % 2 or not turned:
        raise CheckpointError(f"rope_parameters.partial_rotary_factor turns {turned} of each "
                              "head's dimensions: attnlab turns them in pairs, at least one")
    return 0 if turned == head_dim // 4 else turned


def _from_config(c: dict) -> ModelConfig:
    _refuse_unless(c, {"hidden_act": ("silu",), "attention_bias": (False,),
                       "norm_topk_prob": (True,), "decoder_sparse_step": (1,),
                       "mlp_only_layers": ([],)})
    H, width, n_layer = c["num_attention_heads"], c["hidden_size"], c["num_hidden_layers"]
    D = width // H
    if c.get("head_dim") not in (None, D) or width % H:
        raise CheckpointError(f"head_dim={c.get('head_dim')} is not hidden_size / "
                              f"num_attention_heads ({width} / {H}): attnlab splits the width "
                              "equally between heads")
    for key, want in (("linear_num_key_heads", H), ("linear_num_value_heads", H),
                      ("linear_key_head_dim", D), ("linear_value_head_dim", D)):
        if c.get(key) != want:
            raise CheckpointError(f"{key}={c.get(key)}: attnlab's linear layers have the "
                                  f"attention's heads and head size ({want})")
    types = c.get("layer_types")
    if types is None or len(types) != n_layer:
        raise CheckpointError(f"layer_types lists {len(types or [])} layers, num_hidden_layers "
                              f"is {n_layer}")
    hidden, shared = c["moe_intermediate_size"], c.get("shared_expert_intermediate_size", 0)
    if not shared or shared % hidden:
        raise CheckpointError(f"shared_expert_intermediate_size={shared} is not a whole number "
                              f"of experts of moe_intermediate_size={hidden}: attnlab's shared "
                              "experts are as wide as its routed ones")
    full = FULL in types
    return ModelConfig(
        vocab_size=c["vocab_size"], block_size=c["max_position_embeddings"], n_layer=n_layer,
        # Key/value heads are the full layers' alone: none such, none to share.
        n_head=H, n_kv_head=(c.get("num_key_value_heads") or H) if full else 0, n_embd=width,
        mechanism=_pattern(types), delta_conv=c.get("linear_conv_kernel_dim", 4) if LINEAR in types else 0,
        position="rope_partial", rope_dims=_rotary_dims(c, D),
        rope_theta=float((c.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        norm="rmsnorm1p", bias=False, norm_eps=c.get("rms_norm_eps", 1e-6),
        qk_norm=full, qk_norm_weight=full, mlp="moe", moe_experts=c["num_experts"],
        moe_top_k=c["num_experts_per_tok"], moe_shared=shared // hidden, moe_hidden=hidden,
        moe_router=_ROUTER, moe_expert=_EXPERT, moe_shared_gate=True, moe_bias_rate=0.0,
        tie_embeddings=c.get("tie_word_embeddings", False))


# (ours, theirs) per layer, copied as they are.
_NORMS = [("norm_attn.weight", "input_layernorm.weight"),
          ("norm_mlp.weight", "post_attention_layernorm.weight"),
          ("mlp.router.weight", "mlp.gate.weight"),
          ("mlp.shared_gate.weight", "mlp.shared_expert_gate.weight")]
_LINEAR = [("w_o.weight", "out_proj.weight"), ("conv.weight", "conv1d.weight"),
           ("decay_log_rate", "A_log"), ("decay_bias", "dt_bias"), ("out_norm", "norm.weight")]
_FULL = [("w_o.weight", "o_proj.weight"), ("q_norm.weight", "q_norm.weight"),
         ("k_norm.weight", "k_norm.weight")]


def _to_hf(sd: dict, cfg: ModelConfig) -> dict:
    out = {"model.embed_tokens.weight": sd["wte.weight"], "model.norm.weight": sd["norm_f.weight"]}
    H, D, C, S = cfg.n_head, cfg.head_dim, cfg.n_embd, cfg.moe_shared
    for i, kind in enumerate(layer_types(cfg)):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        out.update({theirs + hf: sd[ours + name] for name, hf in _NORMS})
        attn = f"{ours}attn."
        if kind == LINEAR:
            q, k, v = sd[attn + "w_qkv.weight"].view(3, H, D, C).unbind(0)
            z = sd[attn + "w_z.weight"].view(H, D, C)
            # Head by head: its q, k, v and z rows; then its β row and its decay row.
            out[f"{theirs}linear_attn.in_proj_qkvz.weight"] = torch.stack((q, k, v, z), 1).reshape(4 * C, C)
            out[f"{theirs}linear_attn.in_proj_ba.weight"] = torch.stack(
                (sd[attn + "w_beta.weight"], sd[attn + "w_alpha.weight"]), 1).reshape(2 * H, C)
            out.update({f"{theirs}linear_attn.{hf}": sd[attn + name] for name, hf in _LINEAR})
        else:
            q, k, v = sd[attn + "w_qkv.weight"].split([C, cfg.kv_heads * D, cfg.kv_heads * D])
            gate = sd[attn + "w_gate.weight"]
            out[f"{theirs}self_attn.q_proj.weight"] = torch.stack(
                (q.view(H, D, C), gate.view(H, D, C)), 1).reshape(2 * C, C)
            out[f"{theirs}self_attn.k_proj.weight"] = k
            out[f"{theirs}self_attn.v_proj.weight"] = v
            out.update({f"{theirs}self_attn.{hf}": sd[attn + name] for name, hf in _FULL})
        fc, proj = sd[ours + "mlp.fc.weight"], sd[ours + "mlp.proj.weight"]
        for e in range(cfg.moe_experts):      # the files keep each routed expert apart
            gate, up = fc[S + e].chunk(2)
            out.update({f"{theirs}mlp.experts.{e}.gate_proj.weight": gate,
                        f"{theirs}mlp.experts.{e}.up_proj.weight": up,
                        f"{theirs}mlp.experts.{e}.down_proj.weight": proj[S + e]})
        # The shared experts side by side: one expert S times as wide.
        gates, ups = fc[:S].chunk(2, dim=1)
        out[theirs + "mlp.shared_expert.gate_proj.weight"] = gates.reshape(-1, C)
        out[theirs + "mlp.shared_expert.up_proj.weight"] = ups.reshape(-1, C)
        out[theirs + "mlp.shared_expert.down_proj.weight"] = torch.cat(proj[:S].unbind(0), dim=1)
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    return out


def _from_hf(get, cfg: ModelConfig) -> dict:
    out = {"wte.weight": get("model.embed_tokens.weight"), "norm_f.weight": get("model.norm.weight")}
    H, D, C, S = cfg.n_head, cfg.head_dim, cfg.n_embd, cfg.moe_shared
    for i, kind in enumerate(layer_types(cfg)):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        out.update({ours + name: get(theirs + hf) for name, hf in _NORMS})
        attn = f"{ours}attn."
        if kind == LINEAR:
            q, k, v, z = get(f"{theirs}linear_attn.in_proj_qkvz.weight").view(H, 4, D, C).unbind(1)
            out[attn + "w_qkv.weight"] = torch.cat([t.reshape(C, C) for t in (q, k, v)])
            out[attn + "w_z.weight"] = z.reshape(C, C)
            beta, alpha = get(f"{theirs}linear_attn.in_proj_ba.weight").view(H, 2, C).unbind(1)
            out[attn + "w_beta.weight"], out[attn + "w_alpha.weight"] = beta, alpha
            out.update({attn + name: get(f"{theirs}linear_attn.{hf}") for name, hf in _LINEAR})
        else:
            q, gate = get(f"{theirs}self_attn.q_proj.weight").view(H, 2, D, C).unbind(1)
            out[attn + "w_qkv.weight"] = torch.cat(
                [q.reshape(C, C)] + [get(f"{theirs}self_attn.{p}_proj.weight") for p in "kv"])
            out[attn + "w_gate.weight"] = gate.reshape(C, C)
            out.update({attn + name: get(f"{theirs}self_attn.{hf}") for name, hf in _FULL})
        gates = get(theirs + "mlp.shared_expert.gate_proj.weight").view(S, -1, C)
        ups = get(theirs + "mlp.shared_expert.up_proj.weight").view(S, -1, C)
        downs = get(theirs + "mlp.shared_expert.down_proj.weight").view(C, S, -1).transpose(0, 1)
        routed = [f"{theirs}mlp.experts.{e}." for e in range(cfg.moe_experts)]
        out[ours + "mlp.fc.weight"] = torch.cat((torch.cat((gates, ups), dim=1), torch.stack(
            [torch.cat((get(r + "gate_proj.weight"), get(r + "up_proj.weight"))) for r in routed])))
        out[ours + "mlp.proj.weight"] = torch.cat(
            (downs, torch.stack([get(r + "down_proj.weight") for r in routed])))
        # No balancing bias (the router picks by its softmax alone) and no load measured yet.
        out[ours + "mlp.balance_bias"] = torch.zeros(cfg.moe_experts)
        out[ours + "mlp.load"] = torch.zeros(cfg.moe_experts)
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = get("lm_head.weight")
    return out


QWEN3_NEXT = Architecture("qwen3_next", "Qwen3NextForCausalLM", _blockers, _to_config,
                          _from_config, _to_hf, _from_hf, SCHEMA, "model.",
                          ignored=(r"rotary_emb\.inv_freq$", r"^mtp\."))
ARCHITECTURES["qwen3_next"] = QWEN3_NEXT
