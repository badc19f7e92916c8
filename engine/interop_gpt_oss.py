"""gpt-oss (OpenAI, arXiv:2508.10925) to and from the Hugging Face `transformers` format:
an entry of engine/interop.py's ARCHITECTURES, read with the same safetensors reader and
no transformers, no pickle, no remote code.

    gpt_oss   learned sinks in every layer, windowed and full layers     GptOssForCausalLM
              (layer_types), GQA, RoPE, RMSNorm, biases on q, k, v, o;
              experts routed by a softmax over the top k of a router
              with a bias, each a clamped SwiGLU with biases

Ours: model.mechanism=sinks, model.full_attention_every (or one kind of layer throughout),
model.mlp=moe with model.moe_router=softmax_topk, model.moe_expert=gpt_oss,
model.moe_shared=0, model.moe_bias_rate=0, model.bias=true. transformers keeps each
expert's gate and up columns interleaved (gate = [..., ::2], up = [..., 1::2]) in an
(in, out) matrix; ours are (out, in), gates first, then ups: the mapping reorders them.
Both rotate the two halves of each head (RoPE's rotate-half layout), so q and k need no
reordering; gpt-oss's YaRN (ramped over the pairs, not rounded) is model.rope_scaling=
yarn_by_pairs; and a window of W means, in both, that a query sees its W most recent tokens,
itself included.
"""
from __future__ import annotations

import torch

from common.errors import CheckpointError
from engine.hf_files import MAX_HEADS, MAX_POSITIONS, MAX_VOCAB, MAX_WIDTH, Field, count
from engine.interop import (_ROPE, _SIZES, ARCHITECTURES, Architecture, _common_refusals, _needs,
                            _rope_theta, _split_qkv)
from model import ModelConfig
from model.mechanisms import names_used
from model.moe import MOE_EXPERTS, MOE_ROUTERS, MixtureOfExperts
from model.layers import MLPS
from model.rope_scaling import ROPE_SCALINGS

_FULL, _SLIDING = "full_attention", "sliding_attention"
_ROUTER, _EXPERT = "softmax_topk", "gpt_oss"
# gpt-oss's YaRN: transformers' ramp over the pairs, between the pairs turning 32 times and
# once within the original context, its ends not rounded (truncate=false).
_YARN, _YARN_FIXED = "yarn_by_pairs", {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}


def _blockers(cfg: ModelConfig) -> list[str]:
    # Every other architecture refuses sinks and mixed layers; gpt-oss has both.
    out = [why for why in _common_refusals(cfg)
           if not why.startswith(("model.mechanism=", "model.full_attention_every=",
                                  "model.rope_scaling="))]
    scaling = ROPE_SCALINGS[cfg.rope_scaling]
    if scaling.stretches and scaling is not ROPE_SCALINGS[_YARN]:
        out.append(f"model.rope_scaling={cfg.rope_scaling} (needs {_YARN} or none)")
    if any(n != "sinks" for n in names_used(cfg)):
        out.append(f"model.mechanism={cfg.mechanism} (needs sinks in every layer)")
    out += _needs(cfg, position="rope", norm="rmsnorm", mlp="moe")
    if MLPS[cfg.mlp] is MixtureOfExperts:
        if MOE_ROUTERS[cfg.moe_router] is not MOE_ROUTERS[_ROUTER]:
            out.append(f"model.moe_router={cfg.moe_router} (needs {_ROUTER})")
        if MOE_EXPERTS[cfg.moe_expert] is not MOE_EXPERTS[_EXPERT]:
            out.append(f"model.moe_expert={cfg.moe_expert} (needs {_EXPERT})")
        if cfg.moe_shared:
            out.append(f"model.moe_shared={cfg.moe_shared} (gpt-oss has no shared experts)")
    if not cfg.bias:
        out.append("model.bias=false (gpt-oss's attention and experts have biases: "
                   "needs true)")
    return out


def layer_types(cfg: ModelConfig) -> list[str]:
    """transformers' layer_types for cfg: model/gpt.py's rule, layers N-1, 2N-1, ... full."""
    if not cfg.sliding_window:
        return [_FULL] * cfg.n_layer
    every = cfg.full_attention_every
    return [_FULL if every and (i + 1) % every == 0 else _SLIDING for i in range(cfg.n_layer)]


def _to_config(cfg: ModelConfig) -> dict:
    expert = MOE_EXPERTS[cfg.moe_expert]
    return {"vocab_size": cfg.vocab_size, "hidden_size": cfg.n_embd,
            "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
            "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
            "intermediate_size": MixtureOfExperts.width(cfg),
            "num_local_experts": cfg.moe_experts, "num_experts_per_tok": cfg.moe_top_k,
            "max_position_embeddings": cfg.block_size, "rms_norm_eps": cfg.norm_eps,
            "sliding_window": cfg.sliding_window or None, "layer_types": layer_types(cfg),
            "rope_parameters": _rope_parameters(cfg),
            "swiglu_alpha": expert.alpha, "swiglu_limit": expert.limit,
            "attention_bias": True, "attention_dropout": 0.0,
            "tie_word_embeddings": cfg.tie_embeddings, "router_aux_loss_coef": 0.0}


def _rope_parameters(cfg: ModelConfig) -> dict:
    if not ROPE_SCALINGS[cfg.rope_scaling].stretches:
        return {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    return {"rope_theta": cfg.rope_theta, "rope_type": "yarn", "factor": cfg.rope_factor,
            "original_max_position_embeddings": cfg.rope_original_context or cfg.block_size,
            **_YARN_FIXED}


def _rope_fields(c: dict) -> dict:
    """The model's RoPE fields for config.json's rope_parameters: plain, or gpt-oss's YaRN."""
    params = c.get("rope_parameters") or {}
    if params.get("rope_type") != "yarn":
        return {"rope_theta": _rope_theta(c)}
    for key, ours in _YARN_FIXED.items():
        if params.get(key, True if key == "truncate" else ours) != ours:
            raise CheckpointError(f"rope_parameters.{key}={params.get(key, True)}; attnlab's "
                                  f"{_YARN} computes {key}={ours} only")
    for key in ("attention_factor", "mscale", "mscale_all_dim", "partial_rotary_factor"):
        if params.get(key) is not None:
            raise CheckpointError(f"rope_parameters.{key}={params[key]}: attnlab's {_YARN} takes "
                                  "its temperature from the factor alone, and rotates every dimension")
    for key in ("factor", "original_max_position_embeddings"):
        if params.get(key) is None:
            raise CheckpointError(f"rope_parameters.{key} is missing: YaRN needs it")
    return {"rope_theta": float(params.get("rope_theta", 10000.0)), "rope_scaling": _YARN,
            "rope_factor": float(params["factor"]),
            "rope_original_context": params["original_max_position_embeddings"]}


_SCHEMA = {
    **_SIZES, **_ROPE,
    "rope_parameters": Field(dict, null=True, fields={
        **_ROPE["rope_parameters"].fields, "factor": Field(float, 1.0, 1e6),
        "original_max_position_embeddings": count(MAX_POSITIONS, required=False),
        "beta_fast": Field(float, 0.0, 1e6), "beta_slow": Field(float, 0.0, 1e6),
        "truncate": Field(bool), "attention_factor": Field(float, 0.0, 1e6, null=True)}), "intermediate_size": count(16 * 2 ** 16),
    "num_key_value_heads": count(1 << 16, required=False, null=True),
    "head_dim": count(1 << 16, required=False, null=True),
    "num_local_experts": count(1 << 12), "num_experts_per_tok": count(1 << 12),
    "rms_norm_eps": Field(float, 0.0, 1.0), "tie_word_embeddings": Field(bool),
    "attention_bias": Field(bool), "swiglu_alpha": Field(float), "swiglu_limit": Field(float),
    "sliding_window": count(MAX_POSITIONS, low=0, required=False, null=True),
    "layer_types": Field(list, 1, 1 << 12, items=Field(str, choices=(_FULL, _SLIDING))),
    "vocab_size": count(MAX_VOCAB),
}


def _window_pattern(c: dict) -> tuple[int, int]:
    """(model.sliding_window, model.full_attention_every) for config.json's layer_types."""
    types = c["layer_types"]
    if len(types) != c["num_hidden_layers"]:
        raise CheckpointError(f"layer_types lists {len(types)} layers, num_hidden_layers is "
                              f"{c['num_hidden_layers']}")
    if _SLIDING not in types:
        return 0, 0
    if not c.get("sliding_window"):
        raise CheckpointError("layer_types has sliding layers but sliding_window is not set")
    every = types.index(_FULL) + 1 if _FULL in types else 0
    if types != [_FULL if every and (i + 1) % every == 0 else _SLIDING for i in range(len(types))]:
        raise CheckpointError(f"layer_types {types[:8]}...: attnlab makes every Nth layer full "
                              "(model.full_attention_every), the rest windowed")
    return c["sliding_window"], every


def _from_config(c: dict) -> ModelConfig:
    expert = MOE_EXPERTS[_EXPERT]
    for key, ours in (("swiglu_alpha", expert.alpha), ("swiglu_limit", expert.limit)):
        if c.get(key, ours) != ours:
            raise CheckpointError(f"{key}={c[key]}; attnlab's gpt_oss experts compute {ours} only")
    if not c.get("attention_bias", True):
        raise CheckpointError("attention_bias=false: gpt-oss's experts keep their biases, and "
                              "attnlab has one bias switch (model.bias) for both")
    H = c["num_attention_heads"]
    if c.get("head_dim") not in (None, c["hidden_size"] // H) or c["hidden_size"] % H:
        raise CheckpointError(f"head_dim={c.get('head_dim')} is not hidden_size / heads: attnlab "
                              "splits the width equally between heads")
    window, every = _window_pattern(c)
    return ModelConfig(
        vocab_size=c["vocab_size"], block_size=c["max_position_embeddings"],
        n_layer=c["num_hidden_layers"], n_head=H, n_kv_head=c.get("num_key_value_heads") or H,
        n_embd=c["hidden_size"], mechanism="sinks", sliding_window=window,
        full_attention_every=every, position="rope", norm="rmsnorm", mlp="moe",
        moe_experts=c["num_local_experts"], moe_top_k=c["num_experts_per_tok"], moe_shared=0,
        moe_hidden=c["intermediate_size"], moe_bias_rate=0.0, moe_router=_ROUTER,
        moe_expert=_EXPERT, bias=True, norm_eps=c.get("rms_norm_eps", 1e-5),
        tie_embeddings=c.get("tie_word_embeddings", False), **_rope_fields(c))


def _interleave(gate_then_up: torch.Tensor) -> torch.Tensor:
    """(E, 2H, ...) gates then ups -> (E, 2H, ...) gate, up, gate, up, ..."""
    gate, up = gate_then_up.chunk(2, dim=1)
    return torch.stack((gate, up), dim=2).flatten(1, 2)


def _deinterleave(interleaved: torch.Tensor) -> torch.Tensor:
    return torch.cat((interleaved[:, 0::2], interleaved[:, 1::2]), dim=1)


def _to_hf(sd: dict, cfg: ModelConfig) -> dict:
    out = {"model.embed_tokens.weight": sd["wte.weight"], "model.norm.weight": sd["norm_f.weight"]}
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        out[theirs + "input_layernorm.weight"] = sd[ours + "norm_attn.weight"]
        out[theirs + "post_attention_layernorm.weight"] = sd[ours + "norm_mlp.weight"]
        out[theirs + "self_attn.sinks"] = sd[ours + "attn.sinks"]
        for kind in ("weight", "bias"):
            q, k, v = _split_qkv(sd[f"{ours}attn.w_qkv.{kind}"], cfg)
            out.update({f"{theirs}self_attn.{p}_proj.{kind}": t for p, t in zip("qkv", (q, k, v))})
            out[f"{theirs}self_attn.o_proj.{kind}"] = sd[f"{ours}attn.w_o.{kind}"]
            out[f"{theirs}mlp.router.{kind}"] = sd[f"{ours}mlp.router.{kind}"]
        # Theirs multiplies x @ W, (E, in, out); ours is (E, out, in).
        out[theirs + "mlp.experts.gate_up_proj"] = _interleave(sd[ours + "mlp.fc.weight"]).transpose(1, 2)
        out[theirs + "mlp.experts.gate_up_proj_bias"] = _interleave(sd[ours + "mlp.fc.bias"])
        out[theirs + "mlp.experts.down_proj"] = sd[ours + "mlp.proj.weight"].transpose(1, 2)
        out[theirs + "mlp.experts.down_proj_bias"] = sd[ours + "mlp.proj.bias"]
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    return out


def _from_hf(get, cfg: ModelConfig) -> dict:
    out = {"wte.weight": get("model.embed_tokens.weight"), "norm_f.weight": get("model.norm.weight")}
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        out[ours + "norm_attn.weight"] = get(theirs + "input_layernorm.weight")
        out[ours + "norm_mlp.weight"] = get(theirs + "post_attention_layernorm.weight")
        out[ours + "attn.sinks"] = get(theirs + "self_attn.sinks")
        for kind in ("weight", "bias"):
            out[f"{ours}attn.w_qkv.{kind}"] = torch.cat(
                [get(f"{theirs}self_attn.{p}_proj.{kind}") for p in "qkv"])
            out[f"{ours}attn.w_o.{kind}"] = get(f"{theirs}self_attn.o_proj.{kind}")
            out[f"{ours}mlp.router.{kind}"] = get(f"{theirs}mlp.router.{kind}")
        out[ours + "mlp.fc.weight"] = _deinterleave(get(theirs + "mlp.experts.gate_up_proj").transpose(1, 2))
        out[ours + "mlp.fc.bias"] = _deinterleave(get(theirs + "mlp.experts.gate_up_proj_bias"))
        out[ours + "mlp.proj.weight"] = get(theirs + "mlp.experts.down_proj").transpose(1, 2)
        out[ours + "mlp.proj.bias"] = get(theirs + "mlp.experts.down_proj_bias")
        # No balancing bias (the router's own bias is a weight) and no load measured yet.
        out[ours + "mlp.balance_bias"] = torch.zeros(cfg.moe_experts)
        out[ours + "mlp.load"] = torch.zeros(cfg.moe_experts)
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = get("lm_head.weight")
    return out


GPT_OSS = Architecture("gpt_oss", "GptOssForCausalLM", _blockers, _to_config, _from_config,
                       _to_hf, _from_hf, _SCHEMA, "model.", ignored=(r"rotary_emb\.inv_freq$",))
ARCHITECTURES["gpt_oss"] = GPT_OSS
