"""Models to and from the Hugging Face `transformers` format.

A folder in that format holds config.json (with a `model_type`), the weights in
safetensors (one file, or shards named by model.safetensors.index.json) and
tokenizer.json. Each architecture below that says exactly what one of ours computes
is an entry of ARCHITECTURES: which of our variants it needs, how its config maps to
ours (and the schema its config.json must fit), and how each weight matrix maps
(transposed, split or fused). Reading a folder needs neither transformers nor pickle,
and treats the folder as untrusted (engine/hf_files.py: files confined to the folder,
bounded reads, config and tensors checked before anything is allocated); writing one
uses transformers' own config and tokenizer classes, so the folder is what
`from_pretrained` expects.

    gpt2      learned positions, LayerNorm, GELU (tanh), biases        GPT2LMHeadModel
    llama     RoPE, RMSNorm, SwiGLU, GQA/MQA, no window                LlamaForCausalLM
    mistral   the same with a sliding window, no biases                MistralForCausalLM
    gpt_neox  RoPE, LayerNorm, GELU (tanh), sequential residual         GPTNeoXForCausalLM
              (this project's default, biases zero where it has none)

and the BERT-family encoders (bert, roberta, distilbert) of engine/interop_bert.py, and
gpt-oss (learned sinks, alternating windows, experts) of engine/interop_gpt_oss.py,
Gemma 3's text model (gemma3_text) of engine/interop_gemma3.py, Qwen3-Next (Gated
DeltaNet among gated attention, experts) of engine/interop_qwen3_next.py, and Kimi Linear
(KDA among latent attention, experts) of engine/interop_kimi_linear.py.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Callable

import torch

from common.errors import AttnlabError, CheckpointError, TokenizerError
from common.files import inside, read_bounded, read_json, remove_stale, umask_mode
from data.tokenizer import Tokenizer, tokenizer_limit
from engine.checkpoint import (CKPT_DIR, load_weights, refuse_non_finite, refuse_too_large_model,
                               use_another)
from engine.hf_files import (CONFIG_LIMIT, FETCH_AGAIN, MAX_HEADS, MAX_LAYERS,
                             MAX_POSITIONS, MAX_VOCAB, MAX_WIDTH, Field,
                             WeightFiles, checked_config, count, read_folder_bytes,
                             read_folder_json)
from model import GPT, ModelConfig, ModelError
from model.layers import BLOCKS, MLPS, NORMS
from model.mechanisms import MECHANISMS, names_used
from model.positions import POSITION_ENCODINGS
from model.rope_scaling import ROPE_SCALINGS
from model.readout import READOUTS


class ExportError(AttnlabError):
    """A model no architecture of transformers computes exactly."""


def is_hf_folder(path: str | Path) -> bool:
    """A folder in transformers' format: a config.json that is not this project's (a
    run's and a checkpoint's config.json have a "model" section, and they sit beside
    checkpoints/ or state.json). An unreadable config.json counts too, so that reading
    the folder says what is wrong with it rather than that it holds no checkpoint."""
    path = Path(path)
    if (not os.path.lexists(path / "config.json") or os.path.lexists(path / "state.json")
            or (path / CKPT_DIR).is_dir()):
        return False
    config = read_json(path / "config.json", CONFIG_LIMIT)
    return config is None or "model_type" in config or not isinstance(config.get("model"), dict)


# -- the parts each architecture is made of ------------------------------------------

_PART_REGISTRIES = {"position": POSITION_ENCODINGS, "norm": NORMS, "mlp": MLPS, "block": BLOCKS}


def _needs(cfg: ModelConfig, **wanted) -> list[str]:
    """The fields of cfg whose variant (registry entry) is not one an architecture
    computes (a name, or a tuple of names), as 'model.field=now (needs X)'."""
    out = []
    for field, names in wanted.items():
        names = (names,) if isinstance(names, str) else names
        registry = _PART_REGISTRIES[field]
        if all(registry[getattr(cfg, field)] is not registry[n] for n in names):
            out.append(f"model.{field}={getattr(cfg, field)} (needs {' or '.join(names)})")
    return out


# GELU's two forms under transformers' names for them (ACT2FN): the exact one is "gelu",
# as here; GPT-2 wrote the tanh form "gelu_new", GPT-NeoX "gelu_pytorch_tanh"; both are read.
_HF_GELU = {"gelu": ("gelu",), "gelu_tanh": ("gelu_new", "gelu_pytorch_tanh")}
_GELUS = tuple(_HF_GELU)
_HF_GELU_NAMES = sum(_HF_GELU.values(), ())      # every name read as one of them


def _hf_gelu(cfg: ModelConfig, tanh_name: str) -> str:
    return "gelu" if MLPS[cfg.mlp] is MLPS["gelu"] else tanh_name


def _gelu_from_hf(act: str) -> str:
    return next(ours for ours, theirs in _HF_GELU.items() if act in theirs)


def _common_refusals(cfg: ModelConfig, decoder: bool = True) -> list[str]:
    out = []
    if any(n != "mha" for n in names_used(cfg)):
        # Every architecture here computes the article's multi-head attention; one that
        # computes another mechanism names it in its own blockers.
        out.append(f"model.mechanism={cfg.mechanism} (needs mha in every layer)")
    if cfg.full_attention_every:
        out.append(f"model.full_attention_every={cfg.full_attention_every} (full layers among "
                   "windowed ones: none of these architectures mixes them)")
    if cfg.n_global:
        out.append(f"model.n_global={cfg.n_global} (global tokens: no architecture has them)")
    if cfg.qk_norm:
        out.append("model.qk_norm=true (QK-norm: none of these architectures normalises q and k)")
    if cfg.logit_softcap:
        out.append(f"model.logit_softcap={cfg.logit_softcap} (no soft-capped logits there)")
    # Gemma 3's parts (engine/interop_gemma3.py, which leaves them out of these).
    if cfg.qk_norm_weight:
        out.append("model.qk_norm_weight=true (learned QK-norms: see gemma3_text)")
    if cfg.score_scale:
        out.append(f"model.score_scale={cfg.score_scale} (scores scaled other than by 1/√d_k: "
                   "see gemma3_text)")
    if cfg.embed_scale:
        out.append("model.embed_scale=true (embeddings scaled by √n_embd: see gemma3_text)")
    if cfg.rope_local_theta:
        out.append(f"model.rope_local_theta={cfg.rope_local_theta} (a second RoPE base: see "
                   "gemma3_text)")
    if BLOCKS[cfg.block].norms_outputs:
        out.append(f"model.block={cfg.block} (a norm on each sublayer's output: see gemma3_text)")
    if cfg.value_embeds:
        out.append("model.value_embeds=true (no value embeddings there)")
    if cfg.skip_connections:
        out.append("model.skip_connections=true (no skips across blocks there)")
    if cfg.token_mix:
        out.append(f"model.token_mix={cfg.token_mix} (no convolution over positions there)")
    if cfg.mtp_depth:
        out.append(f"model.mtp_depth={cfg.mtp_depth} (multi-token prediction modules: no "
                   "architecture here has them)")
    if not READOUTS[cfg.readout].plain:
        out.append(f"model.readout={cfg.readout} (every architecture there scores the whole "
                   "vocabulary with one linear layer: train with model.readout=full)")
    if ROPE_SCALINGS[cfg.rope_scaling].stretches:
        out.append(f"model.rope_scaling={cfg.rope_scaling} (export the model unstretched: "
                   "rope_scaling=none)")
    if not decoder:        # the BERT family (engine/interop_bert.py) checks an encoder's parts
        return out
    if not cfg.causal:
        out.append("model.causal=false (an encoder: see the BERT family)")
    if not BLOCKS[cfg.block].final_norm:
        out.append(f"model.block={cfg.block} (post-norm blocks: see the BERT family)")
    if cfg.n_token_types:
        out.append(f"model.n_token_types={cfg.n_token_types} (token types: see the BERT family)")
    if cfg.position_offset:
        out.append(f"model.position_offset={cfg.position_offset} (see RoBERTa)")
    return out


@dataclass(frozen=True)
class Architecture:
    model_type: str
    hf_class: str                                    # the transformers class that loads it
    blockers: Callable[[ModelConfig], list[str]]     # why cfg cannot be this architecture
    to_hf_config: Callable[[ModelConfig], dict]
    from_hf_config: Callable[[dict], ModelConfig]    # after config.json fits `schema`
    to_hf_weights: Callable[[dict, ModelConfig], dict]
    from_hf_weights: Callable[[Callable, ModelConfig], dict]
    schema: dict[str, Field] = field(default_factory=dict)   # every config value read
    base_prefix: str = ""          # transformers' base_model_prefix, with its dot
    head: tuple[str, ...] = ("lm_head.weight",)      # the output layer's names (export's first)
    ignored: tuple[str, ...] = ()  # buffers transformers skips on load (its regexes)
    char_vocab: bool = True        # a character tokenizer exports (the BERT family's does not)
    # An architecture that reads or writes its folder its own way (the BERT family picks
    # its head from the weights present and writes an encoder's tokenizer).
    load: Callable | None = None          # (folder, config dict, device, dtype) -> like load_hf_folder
    write: Callable | None = None         # (model, cfg, tokenizer, out) -> Architecture


def _split_qkv(w, cfg):
    H, Hkv, D = cfg.n_head, cfg.kv_heads, cfg.head_dim
    return w.split([H * D, Hkv * D, Hkv * D], dim=0)


def _neox_qkv(w, cfg):
    """Ours stacks all queries, then keys, then values; NeoX interleaves them per head."""
    H, D = cfg.n_head, cfg.head_dim
    return w.reshape(3, H, D, *w.shape[1:]).transpose(0, 1).reshape(w.shape)


def _from_neox_qkv(w, cfg):
    H, D = cfg.n_head, cfg.head_dim
    return w.reshape(H, 3, D, *w.shape[1:]).transpose(0, 1).reshape(w.shape)


def _with_mlp_width(cfg, width):
    """cfg with the MLP `width` a checkpoint brings: model.mlp_hidden stays 0 when the
    variant's own rule gives that width, so such an import reads as before."""
    if width is not None and width != MLPS[cfg.mlp].width(cfg):
        cfg.mlp_hidden = width
    return cfg


def _zeros_if_absent(sd, name, size):
    return sd[name] if name in sd else torch.zeros(size)


# -- GPT-2 -----------------------------------------------------------------------------

def _gpt2_blockers(cfg):
    return _common_refusals(cfg) + _needs(cfg, position="learned", norm="layernorm", mlp=_GELUS) + (
        [f"model.n_kv_head={cfg.n_kv_head} (GPT-2 has one key/value head per query head)"]
        if cfg.kv_heads != cfg.n_head else []) + (
        [f"model.sliding_window={cfg.sliding_window} (GPT-2 has no window)"] if cfg.sliding_window else [])


def _gpt2_config(cfg):
    return {"vocab_size": cfg.vocab_size, "n_positions": cfg.block_size, "n_embd": cfg.n_embd,
            "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": MLPS[cfg.mlp].width(cfg),
            "activation_function": _hf_gelu(cfg, "gelu_new"), "layer_norm_epsilon": cfg.norm_eps,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            "tie_word_embeddings": cfg.tie_embeddings}


_ROPE = {
    "rope_parameters": Field(dict, null=True, fields={
        "rope_theta": Field(float, 1e-3, 1e12), "rope_type": Field(str),
        "partial_rotary_factor": Field(float, 0.0, 1.0)}),
    "rope_scaling": Field(dict, null=True, fields={"rope_type": Field(str), "type": Field(str)}),
    "rope_theta": Field(float, 1e-3, 1e12),
}
_SIZES = {"vocab_size": count(MAX_VOCAB), "max_position_embeddings": count(MAX_POSITIONS),
          "hidden_size": count(MAX_WIDTH), "num_hidden_layers": count(MAX_LAYERS),
          "num_attention_heads": count(MAX_HEADS)}

_GPT2_SCHEMA = {
    "vocab_size": count(MAX_VOCAB), "n_positions": count(MAX_POSITIONS), "n_embd": count(MAX_WIDTH),
    "n_layer": count(MAX_LAYERS), "n_head": count(MAX_HEADS),
    "n_inner": count(4 * MAX_WIDTH, required=False, null=True),
    "activation_function": Field(str), "layer_norm_epsilon": Field(float, 0.0, 1.0),
    "tie_word_embeddings": Field(bool), "scale_attn_by_inverse_layer_idx": Field(bool),
    "reorder_and_upcast_attn": Field(bool), "scale_attn_weights": Field(bool),
}


def _gpt2_from_config(c):
    _refuse_unless(c, {"activation_function": _HF_GELU_NAMES,
                       "scale_attn_by_inverse_layer_idx": (False,),
                       "reorder_and_upcast_attn": (False,), "scale_attn_weights": (True,)})
    return _with_mlp_width(ModelConfig(vocab_size=c["vocab_size"], block_size=c["n_positions"], n_layer=c["n_layer"],
                       n_head=c["n_head"], n_embd=c["n_embd"], position="learned", norm="layernorm",
                       mlp=_gelu_from_hf(c.get("activation_function", "gelu_new")), bias=True,
                       norm_eps=c.get("layer_norm_epsilon", 1e-5),
                       tie_embeddings=c.get("tie_word_embeddings", True)), c.get("n_inner"))


def _gpt2_to_hf(sd, cfg):
    C, hidden = cfg.n_embd, MLPS[cfg.mlp].width(cfg)
    out = {"transformer.wte.weight": sd["wte.weight"],
           "transformer.wpe.weight": sd["positions.table.weight"],
           "transformer.ln_f.weight": sd["norm_f.weight"],
           "transformer.ln_f.bias": _zeros_if_absent(sd, "norm_f.bias", C)}
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        pairs = {"ln_1": ("norm_attn", None), "attn.c_attn": ("attn.w_qkv", 3 * C),
                 "attn.c_proj": ("attn.w_o", C), "ln_2": ("norm_mlp", None),
                 "mlp.c_fc": ("mlp.fc", hidden), "mlp.c_proj": ("mlp.proj", C)}
        for hf, (name, width) in pairs.items():
            w = sd[ours + name + ".weight"]
            out[theirs + hf + ".weight"] = w if width is None else w.t()   # Conv1D: (in, out)
            out[theirs + hf + ".bias"] = _zeros_if_absent(sd, ours + name + ".bias", width or C)
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    return out


def _gpt2_from_hf(get, cfg):
    out = {"wte.weight": get("transformer.wte.weight"),
           "positions.table.weight": get("transformer.wpe.weight"),
           "norm_f.weight": get("transformer.ln_f.weight"), "norm_f.bias": get("transformer.ln_f.bias")}
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        for hf, name, conv in [("ln_1", "norm_attn", False), ("attn.c_attn", "attn.w_qkv", True),
                               ("attn.c_proj", "attn.w_o", True), ("ln_2", "norm_mlp", False),
                               ("mlp.c_fc", "mlp.fc", True), ("mlp.c_proj", "mlp.proj", True)]:
            w = get(theirs + hf + ".weight")
            # GPT-2's Conv1D stores (in, out): its transpose is the (out, in) matrix as a view
            # of the mapped file, not a copy (a matmul reads either layout at the same speed).
            out[ours + name + ".weight"] = w.t() if conv else w
            out[ours + name + ".bias"] = get(theirs + hf + ".bias")
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = get("lm_head.weight")
    return out


# -- Llama and Mistral ---------------------------------------------------------------

def _llama_blockers(cfg, windowed: bool):
    out = _common_refusals(cfg) + _needs(cfg, position="rope", norm="rmsnorm", mlp="swiglu")
    if windowed and cfg.bias:
        out.append("model.bias=true (Mistral's layers have no biases)")
    if not windowed and cfg.sliding_window:
        out.append(f"model.sliding_window={cfg.sliding_window} (Llama has no window; "
                   "Mistral has one)")
    return out


def _llama_config(cfg, windowed: bool):
    c = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.n_embd, "num_hidden_layers": cfg.n_layer,
         "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.kv_heads,
         "head_dim": cfg.head_dim, "intermediate_size": MLPS[cfg.mlp].width(cfg),
         "hidden_act": "silu", "max_position_embeddings": cfg.block_size, "rms_norm_eps": cfg.norm_eps,
         "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
         "tie_word_embeddings": cfg.tie_embeddings, "attention_dropout": 0.0}
    if windowed:
        c["sliding_window"] = cfg.sliding_window
    else:
        c.update(attention_bias=cfg.bias, mlp_bias=cfg.bias)
    return c


def _rope_theta(c: dict) -> float:
    params = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling") or {}
    kind = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if kind != "default":
        raise CheckpointError(f"rope scaling {kind!r} in config.json: attnlab imports unscaled "
                              "RoPE only (set a scaling afterwards with model.rope_scaling)")
    if params.get("partial_rotary_factor", c.get("rotary_pct", 1.0)) != 1.0:
        raise CheckpointError("partial rotary embeddings: attnlab rotates every dimension")
    return float(params.get("rope_theta", c.get("rope_theta", c.get("rotary_emb_base", 10000.0))))


_LLAMA_SCHEMA = {
    **_SIZES, **_ROPE, "intermediate_size": count(16 * MAX_WIDTH),
    "num_key_value_heads": count(MAX_HEADS, required=False, null=True),
    "head_dim": count(MAX_WIDTH, required=False, null=True), "hidden_act": Field(str),
    "rms_norm_eps": Field(float, 0.0, 1.0), "tie_word_embeddings": Field(bool),
    "attention_bias": Field(bool), "mlp_bias": Field(bool),
    "sliding_window": count(MAX_POSITIONS, low=0, required=False, null=True),
}


def _llama_from_config(c):
    _refuse_unless(c, {"hidden_act": ("silu",)})
    H = c["num_attention_heads"]
    if c.get("head_dim") not in (None, c["hidden_size"] // H):
        raise CheckpointError(f"head_dim={c['head_dim']} is not hidden_size / heads: attnlab "
                              "splits the width equally between heads")
    bias = bool(c.get("attention_bias", False))
    if bias != bool(c.get("mlp_bias", False)):
        raise CheckpointError("attention_bias and mlp_bias differ: attnlab has one bias switch")
    cfg = ModelConfig(vocab_size=c["vocab_size"], block_size=c["max_position_embeddings"],
                      n_layer=c["num_hidden_layers"], n_head=H,
                      n_kv_head=c.get("num_key_value_heads") or H, n_embd=c["hidden_size"],
                      sliding_window=c.get("sliding_window") or 0, position="rope", norm="rmsnorm",
                      mlp="swiglu", bias=bias, norm_eps=c.get("rms_norm_eps", 1e-6),
                      rope_theta=_rope_theta(c), tie_embeddings=c.get("tie_word_embeddings", False))
    return _with_mlp_width(cfg, c["intermediate_size"])


_LLAMA_LINEARS = [("self_attn.o_proj", "attn.w_o"), ("mlp.down_proj", "mlp.proj")]


def _llama_to_hf(sd, cfg):
    out = {"model.embed_tokens.weight": sd["wte.weight"], "model.norm.weight": sd["norm_f.weight"]}
    hidden = MLPS[cfg.mlp].width(cfg)
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        out[theirs + "input_layernorm.weight"] = sd[ours + "norm_attn.weight"]
        out[theirs + "post_attention_layernorm.weight"] = sd[ours + "norm_mlp.weight"]
        for kind in ("weight", "bias") if cfg.bias else ("weight",):
            q, k, v = _split_qkv(sd[f"{ours}attn.w_qkv.{kind}"], cfg)
            gate, up = sd[f"{ours}mlp.fc.{kind}"].split(hidden, dim=0)
            named = {"self_attn.q_proj": q, "self_attn.k_proj": k, "self_attn.v_proj": v,
                     "mlp.gate_proj": gate, "mlp.up_proj": up}
            named.update({hf: sd[f"{ours}{name}.{kind}"] for hf, name in _LLAMA_LINEARS})
            out.update({f"{theirs}{hf}.{kind}": t for hf, t in named.items()})
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    return out


def _llama_from_hf(get, cfg):
    out = {"wte.weight": get("model.embed_tokens.weight"), "norm_f.weight": get("model.norm.weight")}
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        out[ours + "norm_attn.weight"] = get(theirs + "input_layernorm.weight")
        out[ours + "norm_mlp.weight"] = get(theirs + "post_attention_layernorm.weight")
        for kind in ("weight", "bias") if cfg.bias else ("weight",):
            out[f"{ours}attn.w_qkv.{kind}"] = torch.cat(
                [get(f"{theirs}self_attn.{p}_proj.{kind}") for p in "qkv"])
            out[f"{ours}mlp.fc.{kind}"] = torch.cat(
                [get(f"{theirs}mlp.{p}_proj.{kind}") for p in ("gate", "up")])
            out.update({f"{ours}{name}.{kind}": get(f"{theirs}{hf}.{kind}") for hf, name in _LLAMA_LINEARS})
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = get("lm_head.weight")
    return out


# -- GPT-NeoX (sequential residual) ----------------------------------------------------

def _neox_blockers(cfg):
    return _common_refusals(cfg) + _needs(cfg, position="rope", norm="layernorm", mlp=_GELUS) + (
        [f"model.n_kv_head={cfg.n_kv_head} (GPT-NeoX has one key/value head per query head)"]
        if cfg.kv_heads != cfg.n_head else []) + (
        [f"model.sliding_window={cfg.sliding_window} (GPT-NeoX has no window)"] if cfg.sliding_window else [])


def _neox_config(cfg):
    return {"vocab_size": cfg.vocab_size, "hidden_size": cfg.n_embd, "num_hidden_layers": cfg.n_layer,
            "num_attention_heads": cfg.n_head, "intermediate_size": MLPS[cfg.mlp].width(cfg),
            "hidden_act": _hf_gelu(cfg, "gelu_pytorch_tanh"), "max_position_embeddings": cfg.block_size,
            "layer_norm_eps": cfg.norm_eps, "use_parallel_residual": False,
            "attention_bias": cfg.bias, "tie_word_embeddings": cfg.tie_embeddings,
            "rope_parameters": {"rope_theta": cfg.rope_theta, "partial_rotary_factor": 1.0,
                                "rope_type": "default"},
            "attention_dropout": 0.0, "hidden_dropout": 0.0}


_NEOX_SCHEMA = {
    **_SIZES, **_ROPE, "intermediate_size": count(16 * MAX_WIDTH, required=False, null=True),
    "hidden_act": Field(str), "layer_norm_eps": Field(float, 0.0, 1.0),
    "use_parallel_residual": Field(bool), "attention_bias": Field(bool),
    "tie_word_embeddings": Field(bool), "rotary_pct": Field(float, 0.0, 1.0),
    "rotary_emb_base": Field(float, 1e-3, 1e12),
}


def _neox_from_config(c):
    _refuse_unless(c, {"hidden_act": _HF_GELU_NAMES,
                       "use_parallel_residual": (False,)})
    return _with_mlp_width(ModelConfig(vocab_size=c["vocab_size"], block_size=c["max_position_embeddings"],
                       n_layer=c["num_hidden_layers"], n_head=c["num_attention_heads"],
                       n_embd=c["hidden_size"], position="rope", norm="layernorm",
                       mlp=_gelu_from_hf(c.get("hidden_act", "gelu")),
                       bias=bool(c.get("attention_bias", True)), norm_eps=c.get("layer_norm_eps", 1e-5),
                       rope_theta=_rope_theta(c), tie_embeddings=c.get("tie_word_embeddings", False)),
        c.get("intermediate_size"))


# (NeoX name, ours, output width in n_embd (3: the fused QKV, reordered), whether NeoX always has a bias there: its
# norms and MLP do; its attention only with attention_bias)
_NEOX = [("input_layernorm", "norm_attn", 1, True), ("attention.query_key_value", "attn.w_qkv", 3, False),
         ("attention.dense", "attn.w_o", 1, False), ("post_attention_layernorm", "norm_mlp", 1, True),
         ("mlp.dense_h_to_4h", "mlp.fc", 4, True), ("mlp.dense_4h_to_h", "mlp.proj", 1, True)]


# NeoX's files call the output layer embed_out (transformers 5's module calls it lm_head
# and converts the name); a folder with either name is read.
_NEOX_HEAD = ("embed_out.weight", "lm_head.weight")


def _neox_to_hf(sd, cfg):
    C = cfg.n_embd
    out = {"gpt_neox.embed_in.weight": sd["wte.weight"],
           "gpt_neox.final_layer_norm.weight": sd["norm_f.weight"],
           "gpt_neox.final_layer_norm.bias": _zeros_if_absent(sd, "norm_f.bias", C)}
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"gpt_neox.layers.{i}."
        for hf, name, width, always in _NEOX:
            w = sd[ours + name + ".weight"]
            out[theirs + hf + ".weight"] = _neox_qkv(w, cfg) if width == 3 else w
            if always or cfg.bias:
                b = _zeros_if_absent(sd, ours + name + ".bias", w.shape[0])   # its output width
                out[theirs + hf + ".bias"] = _neox_qkv(b, cfg) if width == 3 else b
    if not cfg.tie_embeddings:
        out["embed_out.weight"] = sd["lm_head.weight"]      # NeoX's name for its output layer
    return out


def _neox_from_hf(get, cfg):
    out = {"wte.weight": get("gpt_neox.embed_in.weight"),
           "norm_f.weight": get("gpt_neox.final_layer_norm.weight")}
    extra_biases = {"norm_f.bias": get("gpt_neox.final_layer_norm.bias")}
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"gpt_neox.layers.{i}."
        for hf, name, width, always in _NEOX:
            w = get(theirs + hf + ".weight")
            out[ours + name + ".weight"] = _from_neox_qkv(w, cfg) if width == 3 else w
            if always or cfg.bias:
                b = get(theirs + hf + ".bias")
                target = out if cfg.bias else extra_biases
                target[ours + name + ".bias"] = _from_neox_qkv(b, cfg) if width == 3 else b
    if cfg.bias:
        out.update(extra_biases)
    elif any(b.any() for b in extra_biases.values()):
        raise CheckpointError("this GPT-NeoX has biases in its norms or MLP but none in its "
                              "attention; attnlab has one bias switch for all of them")
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = get(*_NEOX_HEAD)
    return out


def _refuse_unless(c: dict, allowed: dict) -> None:
    for key, values in allowed.items():
        if key in c and c[key] not in values:
            raise CheckpointError(f"{key}={c[key]!r}; attnlab computes "
                                  f"{' or '.join(map(repr, values))} only")


ARCHITECTURES = {
    "gpt2": Architecture("gpt2", "GPT2LMHeadModel", _gpt2_blockers, _gpt2_config,
                         _gpt2_from_config, _gpt2_to_hf, _gpt2_from_hf, _GPT2_SCHEMA,
                         "transformer.", ignored=(r"attn\.(masked_)?bias$", r"crossattention\.bias$")),
    "llama": Architecture("llama", "LlamaForCausalLM", lambda c: _llama_blockers(c, False),
                          lambda c: _llama_config(c, False), _llama_from_config, _llama_to_hf,
                          _llama_from_hf, _LLAMA_SCHEMA, "model.",
                          ignored=(r"rotary_emb\.inv_freq$",)),
    "mistral": Architecture("mistral", "MistralForCausalLM", lambda c: _llama_blockers(c, True),
                            lambda c: _llama_config(c, True), _llama_from_config, _llama_to_hf,
                            _llama_from_hf, _LLAMA_SCHEMA, "model.",
                            ignored=(r"rotary_emb\.inv_freq$",)),
    "gpt_neox": Architecture("gpt_neox", "GPTNeoXForCausalLM", _neox_blockers, _neox_config,
                             _neox_from_config, _neox_to_hf, _neox_from_hf, _NEOX_SCHEMA,
                             "gpt_neox.", head=_NEOX_HEAD,
                             ignored=(r"attention\.(masked_)?bias$", r"rotary_emb\.inv_freq$")),
}


def architecture_for(cfg: ModelConfig, tokenizer: Tokenizer | None = None) -> Architecture:
    """The architecture that computes exactly what cfg does, or ExportError naming, for
    the nearest one, the fields that stop it. A mechanism no architecture has is
    refused first, in its entry's own words (model/mechanisms.py), unless an architecture
    computes the model exactly (gpt-oss, engine/interop_gpt_oss.py, has learned sinks)."""
    reasons = {name: arch.blockers(cfg) for name, arch in ARCHITECTURES.items()}
    fits = [name for name, why in reasons.items() if not why]
    if fits:
        return ARCHITECTURES[fits[0]]
    # An architecture that has every mechanism used (gpt-oss's sinks, Qwen3-Next's layers)
    # but refuses another part: its reasons name the part, beside the mechanism's own words.
    takers = [name for name, why in reasons.items()
              if not any(w.startswith("model.mechanism=") for w in why)]
    stopped = "".join(f"; {ARCHITECTURES[name].hf_class} is stopped by: " + "; ".join(reasons[name])
                      for name in takers[:1])
    for name, mechanism in ((n, MECHANISMS[n]) for n in names_used(cfg)):
        if mechanism.export_refusal:
            # Where a card's class takes this mechanism, what stops it is the first fix;
            # multi-head attention, which always exports, is the other.
            remedy = ("; give those fields the card's values and train again, or train with "
                      "--model.mechanism=mha (the article's multi-head attention), which exports"
                      if stopped else
                      "; only a model trained with a mechanism transformers has exports: train "
                      "with --model.mechanism=mha (the article's multi-head attention; "
                      "--model.n_kv_head for GQA/MQA)")
            raise ExportError(f"cannot export model.mechanism={name}: {mechanism.export_refusal}"
                              f"{stopped}{remedy}")
    fewest = min(len(why) for why in reasons.values())
    nearest = [f"{name} ({ARCHITECTURES[name].hf_class}), stopped by: " + "; ".join(why)
               for name, why in reasons.items() if len(why) == fewest]
    raise ExportError("no transformers architecture computes this model exactly; nearest is "
                      + ", or ".join(nearest) + _remedy_line(cfg, tokenizer))


# What a run trains with for a vocabulary the BERT family's tokenizer.json can hold.
BPE_FLAG = "--data.tokenizer=bpe"
_BLOCKED_FIELD = re.compile(r"model\.(\w+)=")
_NEEDED = re.compile(r"\(needs (\w+(?: or \w+)*)\)")


def _remedy(cfg: ModelConfig, arch: Architecture) -> dict | None:
    """The model fields to train with, and their values, for `arch` to compute the model
    exactly, or None. Each blocked field takes the variant its blocker says it needs, or
    else its default (no window, a key/value head per query head, no token mix, ...); the
    result counts only if `arch` then has no blocker left."""
    defaults = {f.name: f.default for f in fields(ModelConfig)}
    fix, trial = {}, cfg
    for why in arch.blockers(cfg):
        blocked = _BLOCKED_FIELD.match(why)
        if blocked is None or blocked[1] not in defaults or blocked[1] in fix:
            return None
        name = blocked[1]
        needed = _NEEDED.search(why)
        for value in (needed[1].split(" or ") if needed else []) + [defaults[name]]:
            try:
                attempt = replace(trial, **{name: value})
                if not any(w.startswith(f"model.{name}=") for w in arch.blockers(attempt)):
                    fix[name], trial = value, attempt
                    break
            except (KeyError, ModelError):      # a name that is no variant of this field
                continue
        else:
            return None
    try:
        trial.validate()
    except ModelError:
        return None
    return fix if not arch.blockers(trial) else None


def _remedy_line(cfg: ModelConfig, tokenizer: Tokenizer | None = None) -> str:
    """'; to export as X, train with --model.a=b ...' for the architecture that asks the
    fewest of the run's own choices (fields away from their defaults) to be undone, then
    the fewest changes, then the fewest away from a default: a GQA run is pointed at
    Llama's norm and MLP rather than told to drop its key/value heads."""
    defaults = {f.name: f.default for f in fields(ModelConfig)}
    remedies = {name: _remedy(cfg, arch) for name, arch in ARCHITECTURES.items()}
    ranked = sorted((sum(getattr(cfg, f) != defaults[f] for f in fix), len(fix),
                     sum(v != defaults[f] for f, v in fix.items()), i, name)
                    for i, (name, fix) in enumerate(remedies.items()) if fix)
    if not ranked:
        return ""
    name = ranked[0][-1]
    flags = " ".join(f"--model.{f}={str(v).lower() if isinstance(v, bool) else v}"
                     for f, v in remedies[name].items())
    if tokenizer is not None and tokenizer.needs_every_symbol and not ARCHITECTURES[name].char_vocab:
        flags += " " + BPE_FLAG
    return f"; to export as {ARCHITECTURES[name].hf_class} ({name}), train with {flags}"


# -- reading a folder ------------------------------------------------------------------

@dataclass
class HFFolder:
    """A transformers folder whose config, tokenizer and tensor headers passed every
    check; no tensor has been read yet."""
    path: Path
    arch: Architecture
    cfg: ModelConfig
    tokenizer: Tokenizer
    files: WeightFiles
    tied_head: str | None        # an output layer stored although tied: must equal wte


def _config_and_architecture(folder: Path) -> tuple[dict, Architecture]:
    """config.json, read with a bound, and the architecture its model_type names."""
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a folder; give a transformers folder "
                              "(config.json, model.safetensors, tokenizer.json)")
    config = read_folder_json(folder, "config.json", CONFIG_LIMIT)
    model_type = config.get("model_type")
    arch = ARCHITECTURES.get(model_type) if isinstance(model_type, str) else None
    if arch is None:
        what = "names no model_type" if model_type is None else f"is a {str(model_type)[:40]!r} model"
        raise CheckpointError(f"{folder / 'config.json'} {what}; attnlab reads "
                              f"{', '.join(ARCHITECTURES)}")
    return config, arch


def in_file_terms(message: str, config: dict) -> str:
    """A refusal of the model a config.json describes names this project's fields
    (model.moe_top_k=9); beside each, the config.json key holding that value where exactly
    one does (num_experts_per_tok), so the reader knows which line of the file to fix."""
    def named(found: re.Match) -> str:
        keys = [k for k, v in config.items()
                if type(v) in (int, float, str) and str(v) == found.group(2)]
        return found.group(0) + (f" (config.json's {keys[0]})" if len(keys) == 1 else "")
    return re.sub(r"model\.(\w+)=([\w.+-]*\w)", named, message)


def open_hf_folder(folder: str | Path) -> HFFolder:
    """Check a transformers folder as untrusted input before anything is allocated:
    config.json against its architecture's schema and the memory free, tokenizer.json
    against the vocabulary, and the safetensors headers against the tensors the config
    needs. Any failure is one CheckpointError (or TokenizerError) naming the file."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a folder; give a transformers folder "
                              "(config.json, model.safetensors, tokenizer.json)")
    config_path = folder / "config.json"
    config, arch = _config_and_architecture(folder)
    checked_config(config, arch.schema, config_path)
    try:
        cfg = arch.from_hf_config(config)
        # The size of what the config describes, before anything is built: blocks,
        # embeddings (and an untied output layer), positions.
        refuse_too_large_model(cfg, config_path)
        expected = {name: tuple(t.shape)          # shapes only: no memory, no values
                    for name, t in arch.to_hf_weights(GPT.skeleton(cfg).state_dict(), cfg).items()}
    except (ModelError, CheckpointError) as err:
        said = str(err).removeprefix(f"{config_path}: ")
        if said.startswith(str(config_path)):              # already said whole, naming the file
            raise CheckpointError(in_file_terms(said, config)) from None
        # A value the model refuses is the file's to fix; a shape attnlab does not compute
        # (the bridge's own refusals) is not a broken file, and says so itself.
        refused_value = isinstance(err, ModelError) or isinstance(err.__cause__, ModelError)
        fix = "; fix that in the file, or write the folder anew with save_pretrained" \
            if refused_value else ""
        raise CheckpointError(f"{config_path}: {in_file_terms(said, config)}{fix}") from None
    tokenizer = _read_tokenizer(folder, cfg)
    files = WeightFiles(folder, arch.base_prefix)
    # A tied output layer is the token embedding; a folder may store it anyway.
    tied_head = files.find(*arch.head) if cfg.tie_embeddings else None
    wte_shape = (cfg.vocab_size, cfg.n_embd)
    files.check(expected, aliases={arch.head[0]: arch.head[1:]}, ignored=arch.ignored,
                allowed={tied_head: wte_shape} if tied_head else None, n_layer=cfg.n_layer)
    return HFFolder(folder, arch, cfg, tokenizer, files, tied_head)


def _read_tokenizer(folder: Path, cfg: ModelConfig) -> Tokenizer:
    path = folder / "tokenizer.json"
    if not os.path.lexists(path):
        raise CheckpointError(f"{folder} has no tokenizer.json (save the tokenizer with "
                              "save_pretrained into the same folder)")
    data = read_folder_bytes(folder, "tokenizer.json", tokenizer_limit(cfg.vocab_size))
    try:
        return checked_tokenizer(data, path, cfg)
    except TokenizerError as err:
        raise TokenizerError(f"{err}; {FETCH_AGAIN}") from None


def read_run_tokenizer(ckpt: Path, cfg: ModelConfig) -> Tokenizer:
    """The tokenizer.json of a run's checkpoint, read as a folder's is: confined to the
    checkpoint, bounded by the vocabulary config.json gives, and its ids checked against
    that vocabulary before it is built."""
    path = ckpt / "tokenizer.json"
    found = inside(ckpt, "tokenizer.json")
    try:
        if found is None:
            raise ValueError(f"leads outside {ckpt}")
        data = read_bounded(found, tokenizer_limit(cfg.vocab_size))
    except (OSError, ValueError) as err:
        if isinstance(err, FileNotFoundError) and not ckpt.exists():
            raise TokenizerError(f"checkpoint {ckpt} was removed while it was read (a run that is "
                                 "still training keeps only its newest checkpoints): run the "
                                 "command again") from None
        said = f": {err.strerror}" if getattr(err, "strerror", None) else f" {err}"
        raise TokenizerError(f"tokenizer file {path}{said}; "
                             f"the checkpoint is incomplete or edited: {use_another(ckpt)}") from None
    return checked_tokenizer(data, path, cfg)


def checked_tokenizer(data: bytes, path: Path, cfg: ModelConfig) -> Tokenizer:
    """A tokenizer from the bytes of its file, once the ids it lists are seen to fit
    config.json's vocab_size: building one of a million tokens costs gigabytes, only
    for it to be refused afterwards."""
    try:
        text = data.decode("utf-8")
        listed = _highest_listed_id(json.loads(text))
    except UnicodeDecodeError:
        raise TokenizerError(f"tokenizer file {path} is not UTF-8 text") from None
    except (ValueError, RecursionError):
        listed = None                       # Tokenizer.parse says what is wrong with it
    if listed is not None and listed >= cfg.vocab_size:
        _refuse_past_vocab(listed, cfg, path)
    tokenizer = Tokenizer.parse(text, path)
    refuse_ids_past_vocab(tokenizer, cfg, path)
    return tokenizer


def _highest_listed_id(data) -> int | None:
    """The largest id a transformers tokenizer.json lists (its model's vocab and its added
    tokens), read from the JSON alone; None for another form."""
    if not isinstance(data, dict):
        return None
    model, added = data.get("model"), data.get("added_tokens")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    ids = ([v for v in vocab.values() if type(v) is int] if isinstance(vocab, dict) else
           [len(vocab) - 1] if isinstance(vocab, list) else [])
    for token in added if isinstance(added, list) else ():
        if isinstance(token, dict) and type(token.get("id")) is int:
            ids.append(token["id"])
    return max(ids) if ids else None


def refuse_ids_past_vocab(tokenizer: Tokenizer, cfg: ModelConfig, path: Path) -> None:
    """A tokenizer whose ids reach past the embedding table would index out of range at
    the first such token: refused here, with the file named, before a model is built."""
    if tokenizer.highest_id >= cfg.vocab_size:
        _refuse_past_vocab(tokenizer.highest_id, cfg, path)


def _refuse_past_vocab(highest: int, cfg: ModelConfig, path: Path) -> None:
    raise TokenizerError(f"{path} has token ids up to {highest:,} but "
                         f"config.json's vocab_size is {cfg.vocab_size:,}: the model has no "
                         "row for the ids past it (the tokenizer is not this model's)")


def load_hf_folder(folder: str | Path, device="cpu", dtype=torch.float32):
    """(model in eval mode, its ModelConfig, its tokenizer) from a transformers folder,
    every file checked first (open_hf_folder; an architecture with a reader of its own,
    the BERT family, checks its folder there)."""
    folder = Path(folder)
    config, arch = _config_and_architecture(folder)
    if arch.load is not None:
        checked_config(config, arch.schema, folder / "config.json")
        return arch.load(folder, config, device, dtype)
    hf = open_hf_folder(folder)
    weights = hf.arch.from_hf_weights(hf.files.get, hf.cfg)
    if hf.tied_head and not torch.equal(hf.files.get(hf.tied_head).float(),
                                        weights["wte.weight"].float()):
        raise CheckpointError(f"{hf.files.source} holds an output layer {hf.tied_head} that "
                              "differs from the token embedding, but config.json ties them "
                              "(tie_word_embeddings): set it to false if they are separate")
    # The read tensors become the model's own: no random init to overwrite, no second copy.
    refuse_non_finite(weights, hf.path)
    model = GPT.unfilled(hf.cfg)
    load_weights(model, weights, hf.path, assign=True, finite_checked=True)
    return model.to(device=device, dtype=dtype).eval(), hf.cfg, hf.tokenizer


def weights_sha256(model: torch.nn.Module) -> str:
    """A hash of the weights' values (names and bytes in order): a run records its
    parent's, so a fine-tuned model says which weights it started from."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# -- writing a folder ------------------------------------------------------------------

def export(model: GPT, cfg: ModelConfig, tokenizer: Tokenizer, out: str | Path,
           generation: dict | None = None) -> Architecture:
    """Write `out` as a transformers folder. Everything is checked before a file is
    written, and the folder appears whole (written beside it, then renamed)."""
    import transformers
    from safetensors.torch import save_file

    arch = architecture_for(cfg, tokenizer)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} exists and is not an empty folder; choose a new --out")
    if arch.write is not None:
        return arch.write(model, cfg, tokenizer, out)
    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    weights = {k: v.contiguous().clone() for k, v in arch.to_hf_weights(state, cfg).items()}
    remove_stale(out.parent, f".{out.name}.tmp-")      # left by an export that was killed
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        eot = tokenizer.eot_id
        hf_config = transformers.AutoConfig.for_model(
            arch.model_type, **arch.to_hf_config(cfg), bos_token_id=eot, eos_token_id=eot,
            architectures=[arch.hf_class], torch_dtype="float32")
        hf_config.save_pretrained(tmp)
        save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
        umask_mode(tmp / "model.safetensors")
        hf_tokenizer(tokenizer).save_pretrained(tmp)
        transformers.GenerationConfig(bos_token_id=eot, eos_token_id=eot,
                                      **(generation or {})).save_pretrained(tmp)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return arch


def hf_tokenizer(tokenizer: Tokenizer):
    """A transformers fast tokenizer that encodes and decodes exactly as ours does."""
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend
    from transformers import PreTrainedTokenizerFast
    if tokenizer.needs_every_symbol:             # characters: one token per character
        backend = Backend(models.WordLevel({c: i for i, c in enumerate(tokenizer.chars)}, unk_token=None))
        backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        backend.decoder = decoders.Fuse()
    else:
        backend = Backend.from_str(tokenizer.to_json())
    special = {}
    if tokenizer.eot_id is not None:
        eot = backend.id_to_token(tokenizer.eot_id)
        special = {"bos_token": eot, "eos_token": eot}
    return PreTrainedTokenizerFast(tokenizer_object=backend, **special)


def describe_parent(source: str | Path, model: torch.nn.Module) -> dict:
    return {"path": str(source), "weights_sha256": weights_sha256(model)}
