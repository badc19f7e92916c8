"""Gemma 3's text model to and from the Hugging Face `transformers` format: an entry of
engine/interop.py's ARCHITECTURES, read with the same safetensors reader and no
transformers, no pickle, no remote code.

    gemma3_text   sandwich blocks of (1+w) RMSNorms, GeGLU (tanh),       Gemma3ForCausalLM
                  learned QK-norms, scores scaled by
                  1/√query_pre_attn_scalar, embeddings scaled by √width,
                  windowed layers with full ones among them (layer_types),
                  each kind with its RoPE base, tied embeddings

Each maps exactly onto this project's model with block=sandwich, norm=rmsnorm1p,
mlp=geglu, position=rope, qk_norm and qk_norm_weight, embed_scale, and
full_attention_every with sliding_window and rope_local_theta where the layers mix.
What it cannot hold is refused in one line naming the config.json field: a head size
other than width / heads, biases in attention, bidirectional attention, soft-capped
attention scores, scaled RoPE (the larger Gemma 3 checkpoints stretch their global
layers' RoPE by 8), and full layers placed other than every Nth.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from common.errors import CheckpointError
from engine.hf_files import MAX_POSITIONS, MAX_WIDTH, Field, count
from engine.interop import (_SIZES, ARCHITECTURES, Architecture, _common_refusals, _needs,
                            _refuse_unless, _split_qkv, _with_mlp_width)
from model import ModelConfig
from model.layers import MLPS

FULL, SLIDING = "full_attention", "sliding_attention"
# transformers' default when a config predates layer_types: every 6th layer full.
DEFAULT_PATTERN = 6


def layer_types(cfg: ModelConfig) -> list[str]:
    """Which layers see everything, in transformers' words (GPTWithVariants.sees_everything)."""
    every, window = cfg.full_attention_every, cfg.sliding_window
    return [FULL if not window or (every and (i + 1) % every == 0) else SLIDING
            for i in range(cfg.n_layer)]


def _blockers(cfg: ModelConfig) -> list[str]:
    # The parts every other architecture refuses and Gemma 3 has are left out of the
    # common refusals and checked here.
    own = replace(cfg, full_attention_every=0, qk_norm=False, qk_norm_weight=False,
                  score_scale=0.0, embed_scale=False, rope_local_theta=0.0, logit_softcap=0.0,
                  block="prenorm")
    out = _common_refusals(own) + _needs(cfg, position="rope", norm="rmsnorm1p", mlp="geglu",
                                         block="sandwich")
    if not (cfg.qk_norm and cfg.qk_norm_weight):
        out.append("needs model.qk_norm=true and model.qk_norm_weight=true (Gemma 3 learns a "
                   "norm for its queries and one for its keys)")
    if not cfg.embed_scale:
        out.append("needs model.embed_scale=true (Gemma scales its embeddings by √width)")
    if cfg.bias:
        out.append("model.bias=true (Gemma 3's MLP and norms have no biases)")
    if cfg.score_scale and abs(round(cfg.score_scale ** -2) ** -0.5 - cfg.score_scale) > 1e-12:
        out.append(f"model.score_scale={cfg.score_scale} (Gemma 3 writes the scale as "
                   "1/√query_pre_attn_scalar, a whole number)")
    return out


def _to_config(cfg: ModelConfig) -> dict:
    local = cfg.rope_local_theta or cfg.rope_theta
    return {"vocab_size": cfg.vocab_size, "hidden_size": cfg.n_embd,
            "intermediate_size": MLPS[cfg.mlp].width(cfg), "num_hidden_layers": cfg.n_layer,
            "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.kv_heads,
            "head_dim": cfg.head_dim, "hidden_activation": "gelu_pytorch_tanh",
            "max_position_embeddings": cfg.block_size, "rms_norm_eps": cfg.norm_eps,
            "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False,
            "attention_dropout": 0.0,
            "query_pre_attn_scalar": round(cfg.score_scale ** -2) if cfg.score_scale else cfg.head_dim,
            "sliding_window": cfg.sliding_window or None, "layer_types": layer_types(cfg),
            "rope_parameters": {FULL: {"rope_type": "default", "rope_theta": cfg.rope_theta},
                                SLIDING: {"rope_type": "default", "rope_theta": local}},
            "final_logit_softcapping": cfg.logit_softcap or None,
            "attn_logit_softcapping": None, "use_bidirectional_attention": False}


_THETA = Field(dict, null=True, fields={"rope_theta": Field(float, 1e-3, 1e12),
                                        "rope_type": Field(str)})
SCHEMA = {
    **_SIZES, "intermediate_size": count(16 * MAX_WIDTH),
    "num_key_value_heads": count(1 << 12, required=False, null=True),
    "head_dim": count(MAX_WIDTH, required=False, null=True), "hidden_activation": Field(str),
    "rms_norm_eps": Field(float, 0.0, 1.0), "tie_word_embeddings": Field(bool),
    "attention_bias": Field(bool), "query_pre_attn_scalar": Field(float, 1e-6, 1e12),
    "sliding_window": count(MAX_POSITIONS, required=False, null=True),
    "layer_types": Field(list, 1, 1 << 10, items=Field(str, choices=(FULL, SLIDING)), null=True),
    "sliding_window_pattern": count(1 << 10, required=False, null=True),
    "rope_parameters": Field(dict, null=True, fields={FULL: _THETA, SLIDING: _THETA}),
    "rope_scaling": Field(dict, null=True, fields={"rope_type": Field(str), "type": Field(str)}),
    "rope_theta": Field(float, 1e-3, 1e12), "rope_local_base_freq": Field(float, 1e-3, 1e12),
    "final_logit_softcapping": Field(float, 0.0, 1e6, null=True),
    "attn_logit_softcapping": Field(float, 0.0, 1e6, null=True),
    "use_bidirectional_attention": Field(bool, null=True),
}


def _thetas(c: dict) -> tuple[float, float]:
    """(full layers' RoPE base, windowed layers'), from transformers 5's rope_parameters
    per layer type or the older rope_theta and rope_local_base_freq."""
    params = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling") or {}
    kinds = [(params.get(t) or {}).get("rope_type", "default") for t in (FULL, SLIDING)]
    kinds.append(scaling.get("rope_type", scaling.get("type", "default")))
    for kind in kinds:
        if kind != "default":
            raise CheckpointError(f"rope scaling {kind!r} in config.json: attnlab imports "
                                  "unscaled RoPE only (set a scaling afterwards with "
                                  "model.rope_scaling)")
    full = (params.get(FULL) or {}).get("rope_theta", c.get("rope_theta", 1_000_000.0))
    local = (params.get(SLIDING) or {}).get("rope_theta", c.get("rope_local_base_freq", 10_000.0))
    return float(full), float(local)


def _pattern(types: list[str], n_layer: int) -> int | None:
    """N such that the full layers are N-1, 2N-1, ... (model.full_attention_every), 0 when
    every layer is alike, None when no N places them so."""
    if len(set(types)) == 1:
        return 0
    for every in range(2, n_layer + 1):
        if types == [FULL if (i + 1) % every == 0 else SLIDING for i in range(n_layer)]:
            return every
    return None


def _from_config(c: dict) -> ModelConfig:
    _refuse_unless(c, {"hidden_activation": ("gelu_pytorch_tanh",), "attention_bias": (False,),
                       "use_bidirectional_attention": (False, None),
                       "attn_logit_softcapping": (None,)})
    H, width, n_layer = c["num_attention_heads"], c["hidden_size"], c["num_hidden_layers"]
    if c.get("head_dim") not in (None, width // H) or width % H:
        raise CheckpointError(f"head_dim={c.get('head_dim')} is not hidden_size / "
                              f"num_attention_heads ({width} / {H}): attnlab splits the width "
                              "equally between heads")
    types = c.get("layer_types") or [
        SLIDING if (i + 1) % (c.get("sliding_window_pattern") or DEFAULT_PATTERN) else FULL
        for i in range(n_layer)]
    if len(types) != n_layer:
        raise CheckpointError(f"layer_types lists {len(types)} layers, num_hidden_layers is "
                              f"{n_layer}: give one type a layer")
    every = _pattern(types, n_layer)
    if every is None:
        raise CheckpointError(f"layer_types={types} places the full layers other than every "
                              "Nth: attnlab makes layers N-1, 2N-1, ... full "
                              "(model.full_attention_every)")
    full, local = _thetas(c)
    windowed = SLIDING in types
    scalar = c.get("query_pre_attn_scalar", 256)
    cfg = ModelConfig(
        vocab_size=c["vocab_size"], block_size=c["max_position_embeddings"], n_layer=n_layer,
        n_head=H, n_kv_head=c.get("num_key_value_heads") or H, n_embd=width,
        sliding_window=(c.get("sliding_window") or 0) if windowed else 0,
        full_attention_every=every, position="rope", norm="rmsnorm1p", mlp="geglu",
        block="sandwich", bias=False, norm_eps=c.get("rms_norm_eps", 1e-6),
        qk_norm=True, qk_norm_weight=True, embed_scale=True,
        # 1/√d_k is the model's own scale: kept as 0, the default, when it is that.
        score_scale=0.0 if scalar == width // H else float(scalar) ** -0.5,
        # Every layer alike turns by its own kind's base alone.
        rope_theta=full if FULL in types else local,
        rope_local_theta=local if every and local != full else 0.0,
        logit_softcap=float(c.get("final_logit_softcapping") or 0.0),
        tie_embeddings=c.get("tie_word_embeddings", True))
    if windowed and not cfg.sliding_window:
        raise CheckpointError("layer_types has windowed layers and sliding_window is not set")
    return _with_mlp_width(cfg, c["intermediate_size"])


# (ours, theirs) per layer: weights copied as they are.
_LAYER = [("norm_attn", "input_layernorm"), ("norm_attn_out", "post_attention_layernorm"),
          ("norm_mlp", "pre_feedforward_layernorm"), ("norm_mlp_out", "post_feedforward_layernorm"),
          ("attn.w_o", "self_attn.o_proj"), ("attn.q_norm", "self_attn.q_norm"),
          ("attn.k_norm", "self_attn.k_norm"), ("mlp.proj", "mlp.down_proj")]


def _to_hf(sd: dict, cfg: ModelConfig) -> dict:
    out = {"model.embed_tokens.weight": sd["wte.weight"], "model.norm.weight": sd["norm_f.weight"]}
    hidden = MLPS[cfg.mlp].width(cfg)
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        for name, hf in _LAYER:
            out[f"{theirs}{hf}.weight"] = sd[f"{ours}{name}.weight"]
        q, k, v = _split_qkv(sd[f"{ours}attn.w_qkv.weight"], cfg)
        gate, up = sd[f"{ours}mlp.fc.weight"].split(hidden, dim=0)
        out.update({f"{theirs}self_attn.q_proj.weight": q, f"{theirs}self_attn.k_proj.weight": k,
                    f"{theirs}self_attn.v_proj.weight": v, f"{theirs}mlp.gate_proj.weight": gate,
                    f"{theirs}mlp.up_proj.weight": up})
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    return out


def _from_hf(get, cfg: ModelConfig) -> dict:
    out = {"wte.weight": get("model.embed_tokens.weight"), "norm_f.weight": get("model.norm.weight")}
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        for name, hf in _LAYER:
            out[f"{ours}{name}.weight"] = get(f"{theirs}{hf}.weight")
        out[f"{ours}attn.w_qkv.weight"] = torch.cat(
            [get(f"{theirs}self_attn.{p}_proj.weight") for p in "qkv"])
        out[f"{ours}mlp.fc.weight"] = torch.cat(
            [get(f"{theirs}mlp.{p}_proj.weight") for p in ("gate", "up")])
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = get("lm_head.weight")
    return out


GEMMA3 = Architecture("gemma3_text", "Gemma3ForCausalLM", _blockers, _to_config, _from_config,
                      _to_hf, _from_hf, SCHEMA, "model.",
                      ignored=(r"rotary_emb(_local)?\.inv_freq$",))   # a buffer older savers kept
ARCHITECTURES["gemma3_text"] = GEMMA3
