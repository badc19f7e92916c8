"""BERT-family encoders to and from the Hugging Face `transformers` format: entries of
engine/interop.py's ARCHITECTURES, read with the same safetensors reader and no
transformers, no pickle, no remote code.

    bert        post-norm, learned positions, token types, exact GELU   BertModel /
                                                                        BertForMaskedLM
    roberta     BERT with positions offset past the padding rows        RobertaModel /
                (pad_token_id + 1) and its own head names               RobertaForMaskedLM
    distilbert  BERT without token types, LayerNorm eps fixed at 1e-12  DistilBertModel /
                                                                        DistilBertForMaskedLM

Each maps exactly onto this project's model with model.causal=false, block=postnorm,
position=learned, norm=layernorm, mlp=gelu, bias=true. A folder with a masked-LM
head (its weights present) gets readout=mlm, tied to the token embedding as there;
a folder without one (a sentence encoder such as all-MiniLM-L6-v2) loads with
readout=none: hidden states and attention, no token scores. BertModel's pooler (a
dense layer and tanh over [CLS], for sentence-level heads) is not part of the model
and is not read; an exported encoder has none, so transformers starts a fresh one
(its last_hidden_state and attentions are exact, its pooler_output is not).

RoBERTa counts positions from its padding token, so a padded position reads row 1 of
its table there and row offset + p here: the outputs at real tokens are equal, those
at the padding (which nothing attends to) are not.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from common.errors import CheckpointError, TokenizerError
from data.tokenizer import WordPieceTokenizer
from engine.interop import (ARCHITECTURES, BPE_FLAG, Architecture, ExportError, WeightFiles, _common_refusals,
                            _needs, _refuse_unless, _with_mlp_width,
                            refuse_ids_past_vocab)
from engine.hf_files import (FETCH_AGAIN, MAX_HEADS, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB,
                             MAX_WIDTH, TOKENIZER_LIMIT, Field, count, read_folder_bytes)
from engine.checkpoint import refuse_too_large_model
from model import GPT, ModelConfig, ModelError
from model.layers import BLOCKS, MLPS
from model.readout import READOUTS

# The one LayerNorm epsilon DistilBERT uses everywhere (it is not in its config).
DISTILBERT_EPS = 1e-12


@dataclass(frozen=True)
class Family:
    """Where one BERT-family checkpoint keeps each of the model's weights."""
    prefix: str                         # the base model's name inside the masked-LM class
    embeddings: dict                    # ours -> theirs, under the prefix
    layers: str                         # the per-layer name, with {i}
    qkv: tuple                          # query, key, value linear layers
    linears: dict                       # ours -> theirs, per layer (weight and bias)
    head: dict                          # ours -> theirs, the masked-LM head (no prefix)
    head_marker: str                    # a weight only a folder with the head has
    encoder_class: str
    mlm_class: str


_BERT_LAYER = {"attn.w_o": "attention.output.dense", "norm_attn": "attention.output.LayerNorm",
               "mlp.fc": "intermediate.dense", "mlp.proj": "output.dense",
               "norm_mlp": "output.LayerNorm"}
_BERT_EMBEDDINGS = {"wte.weight": "embeddings.word_embeddings.weight",
                    "positions.table.weight": "embeddings.position_embeddings.weight",
                    "token_types.table.weight": "embeddings.token_type_embeddings.weight",
                    "norm_emb.weight": "embeddings.LayerNorm.weight",
                    "norm_emb.bias": "embeddings.LayerNorm.bias"}
_QKV = ("attention.self.query", "attention.self.key", "attention.self.value")

FAMILIES = {
    "bert": Family("bert.", _BERT_EMBEDDINGS, "encoder.layer.{i}.", _QKV, _BERT_LAYER,
                   {"head_transform.dense": "cls.predictions.transform.dense",
                    "head_transform.norm": "cls.predictions.transform.LayerNorm",
                    "lm_head.bias": "cls.predictions.bias",
                    "lm_head.weight": "cls.predictions.decoder.weight"},
                   "cls.predictions.transform.dense.weight", "BertModel", "BertForMaskedLM"),
    "roberta": Family("roberta.", _BERT_EMBEDDINGS, "encoder.layer.{i}.", _QKV, _BERT_LAYER,
                      {"head_transform.dense": "lm_head.dense",
                       "head_transform.norm": "lm_head.layer_norm",
                       "lm_head.bias": "lm_head.bias", "lm_head.weight": "lm_head.decoder.weight"},
                      "lm_head.dense.weight", "RobertaModel", "RobertaForMaskedLM"),
    "distilbert": Family(
        "distilbert.",
        {k: v for k, v in _BERT_EMBEDDINGS.items() if not k.startswith("token_types")},
        "transformer.layer.{i}.", ("attention.q_lin", "attention.k_lin", "attention.v_lin"),
        {"attn.w_o": "attention.out_lin", "norm_attn": "sa_layer_norm", "mlp.fc": "ffn.lin1",
         "mlp.proj": "ffn.lin2", "norm_mlp": "output_layer_norm"},
        {"head_transform.dense": "vocab_transform", "head_transform.norm": "vocab_layer_norm",
         "lm_head.bias": "vocab_projector.bias", "lm_head.weight": "vocab_projector.weight"},
        "vocab_transform.weight", "DistilBertModel", "DistilBertForMaskedLM"),
}


# -- configs ---------------------------------------------------------------------------

# Every config.json value a reader below uses, with its type and range: checked before
# any of them is used (engine/hf_files.checked_config), as for the decoders.
MAX_TOKEN_TYPES = 1 << 16
_BERT_SCHEMA = {
    "vocab_size": count(MAX_VOCAB), "hidden_size": count(MAX_WIDTH),
    "num_hidden_layers": count(MAX_LAYERS), "num_attention_heads": count(MAX_HEADS),
    "intermediate_size": count(4 * MAX_WIDTH, required=False, null=True),
    "hidden_act": Field(str), "max_position_embeddings": count(MAX_POSITIONS),
    "type_vocab_size": count(MAX_TOKEN_TYPES, low=0, required=False),
    "layer_norm_eps": Field(float, 0.0, 1.0), "position_embedding_type": Field(str),
    "is_decoder": Field(bool), "add_cross_attention": Field(bool),
    "tie_word_embeddings": Field(bool), "hidden_dropout_prob": Field(float, 0.0, 1.0),
    "attention_probs_dropout_prob": Field(float, 0.0, 1.0),
}
_ROBERTA_SCHEMA = {**_BERT_SCHEMA, "pad_token_id": count(MAX_POSITIONS, low=0, required=False)}
_DISTILBERT_SCHEMA = {
    "vocab_size": count(MAX_VOCAB), "dim": count(MAX_WIDTH), "n_layers": count(MAX_LAYERS),
    "n_heads": count(MAX_HEADS), "hidden_dim": count(4 * MAX_WIDTH, required=False, null=True),
    "activation": Field(str), "max_position_embeddings": count(MAX_POSITIONS),
    "sinusoidal_pos_embds": Field(bool), "tie_word_embeddings": Field(bool),
    "dropout": Field(float, 0.0, 1.0), "attention_dropout": Field(float, 0.0, 1.0),
}
# What a BERT-family file may hold that the model does not read: the position-id
# buffer, BertModel's pooler, the next-sentence head of BertForPreTraining, and the
# output bias stored a second time under the decoder's name.
_IGNORED = (r"(^|\.)embeddings\.(position_ids|token_type_ids)$", r"(^|\.)pooler\.",
            r"^cls\.seq_relationship\.", r"(^|\.)decoder\.bias$")

def _encoder(**kw) -> ModelConfig:
    """The variants every BERT-family model is made of, and its sizes."""
    return ModelConfig(causal=False, block="postnorm", position="learned", norm="layernorm",
                       mlp="gelu", bias=True, attention="auto", **kw)


def _dropout(c: dict, hidden: str, attention: str) -> float:
    """The config's dropout, kept so an export says what the source said: attnlab has
    one model.dropout for both of the config's, so it is kept when they are equal (it
    changes nothing in eval mode)."""
    p = c.get(hidden, 0.0)
    return float(p) if c.get(attention, p) == p else 0.0


def _bert_from_config(c: dict, offset: int = 0) -> ModelConfig:
    _refuse_unless(c, {"hidden_act": ("gelu",), "position_embedding_type": ("absolute",),
                       "is_decoder": (False,), "add_cross_attention": (False,)})
    return _with_mlp_width(_encoder(vocab_size=c["vocab_size"], n_layer=c["num_hidden_layers"],
                    n_head=c["num_attention_heads"], n_embd=c["hidden_size"],
                    block_size=c["max_position_embeddings"] - offset, position_offset=offset,
                    n_token_types=c.get("type_vocab_size", 2), norm_eps=c.get("layer_norm_eps", 1e-12),
                    dropout=_dropout(c, "hidden_dropout_prob", "attention_probs_dropout_prob"),
                    tie_embeddings=c.get("tie_word_embeddings", True)), c.get("intermediate_size"))


def _roberta_from_config(c: dict) -> ModelConfig:
    # RoBERTa numbers positions from padding_idx + 1; the rows before are never a real
    # token's position.
    return _bert_from_config(c, offset=c.get("pad_token_id", 1) + 1)


def _distilbert_from_config(c: dict) -> ModelConfig:
    _refuse_unless(c, {"activation": ("gelu",), "sinusoidal_pos_embds": (False,)})
    return _with_mlp_width(_encoder(
        vocab_size=c["vocab_size"], n_layer=c["n_layers"], n_head=c["n_heads"], n_embd=c["dim"],
        block_size=c["max_position_embeddings"], norm_eps=DISTILBERT_EPS,
        dropout=_dropout(c, "dropout", "attention_dropout"),
        tie_embeddings=c.get("tie_word_embeddings", True)), c.get("hidden_dim"))


def _bert_to_config(cfg: ModelConfig) -> dict:
    return {"vocab_size": cfg.vocab_size, "hidden_size": cfg.n_embd,
            "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
            "intermediate_size": MLPS[cfg.mlp].width(cfg), "hidden_act": "gelu",
            "max_position_embeddings": cfg.block_size + cfg.position_offset,
            # No token types here: one all-zero type row, which adds nothing.
            "type_vocab_size": max(cfg.n_token_types, 1), "layer_norm_eps": cfg.norm_eps,
            "position_embedding_type": "absolute", "hidden_dropout_prob": cfg.dropout,
            "attention_probs_dropout_prob": cfg.dropout, "tie_word_embeddings": cfg.tie_embeddings}


def _roberta_to_config(cfg: ModelConfig) -> dict:
    return {**_bert_to_config(cfg), "pad_token_id": cfg.position_offset - 1}


def _distilbert_to_config(cfg: ModelConfig) -> dict:
    return {"vocab_size": cfg.vocab_size, "dim": cfg.n_embd, "n_layers": cfg.n_layer,
            "n_heads": cfg.n_head, "hidden_dim": MLPS[cfg.mlp].width(cfg), "activation": "gelu",
            "max_position_embeddings": cfg.block_size, "sinusoidal_pos_embds": False,
            "dropout": cfg.dropout, "attention_dropout": cfg.dropout, "tie_word_embeddings": cfg.tie_embeddings}


def _encoder_refusals(cfg: ModelConfig) -> list[str]:
    # What no architecture has, the readout aside (an encoder's is checked below).
    out = _common_refusals(replace(cfg, readout="full"), decoder=False) + _needs(
        cfg, position="learned", norm="layernorm", mlp="gelu")
    if cfg.causal:
        out.append("model.causal=true (BERT-family models see in both directions)")
    if BLOCKS[cfg.block] is not BLOCKS["postnorm"]:
        out.append(f"model.block={cfg.block} (BERT normalises after each residual sum: postnorm)")
    if not cfg.bias:
        out.append("model.bias=false (BERT's layers all have biases)")
    if cfg.kv_heads != cfg.n_head:
        out.append(f"model.n_kv_head={cfg.n_kv_head} (one key/value head per query head there)")
    if cfg.sliding_window:
        out.append(f"model.sliding_window={cfg.sliding_window} (no window there)")
    if READOUTS[cfg.readout] not in (READOUTS["mlm"], READOUTS["none"]):
        out.append(f"model.readout={cfg.readout} (a BERT-family model has the masked-LM head, "
                   "readout=mlm, or none)")
    return out


def _bert_blockers(cfg):
    return _encoder_refusals(cfg) + (
        [f"model.position_offset={cfg.position_offset} (BERT's positions start at row 0)"]
        if cfg.position_offset else [])


def _roberta_blockers(cfg):
    return _encoder_refusals(cfg) + (
        [] if cfg.position_offset >= 1 else
        ["model.position_offset=0 (RoBERTa's positions start past its padding row)"])


def _distilbert_blockers(cfg):
    out = _encoder_refusals(cfg)
    if cfg.n_token_types:
        out.append(f"model.n_token_types={cfg.n_token_types} (DistilBERT has no token types)")
    if cfg.position_offset:
        out.append(f"model.position_offset={cfg.position_offset} (positions start at row 0)")
    if cfg.norm_eps != DISTILBERT_EPS:
        out.append(f"model.norm_eps={cfg.norm_eps} (DistilBERT's LayerNorms use {DISTILBERT_EPS})")
    return out


# -- weights -----------------------------------------------------------------------------

def _has_head(cfg: ModelConfig) -> bool:
    return READOUTS[cfg.readout].scores_tokens


def _from_hf_weights(family: Family, get: Callable, cfg: ModelConfig) -> dict:
    p = family.prefix
    out = {ours: get(p + theirs) for ours, theirs in family.embeddings.items()
           if cfg.n_token_types or not ours.startswith("token_types")}
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", p + family.layers.format(i=i)
        for kind in ("weight", "bias"):
            out[f"{ours}attn.w_qkv.{kind}"] = torch.cat([get(f"{theirs}{n}.{kind}") for n in family.qkv])
            for name, hf in family.linears.items():
                out[f"{ours}{name}.{kind}"] = get(f"{theirs}{hf}.{kind}")
    if _has_head(cfg):
        h = family.head
        for part in ("head_transform.dense", "head_transform.norm"):
            for kind in ("weight", "bias"):
                out[f"{part}.{kind}"] = get(f"{h[part]}.{kind}")
        out["lm_head.bias"] = get(h["lm_head.bias"])
        if not cfg.tie_embeddings:
            out["lm_head.weight"] = get(h["lm_head.weight"])
    return out


def _to_hf_weights(family: Family, sd: dict, cfg: ModelConfig) -> dict:
    # The masked-LM class keeps the base model under its prefix; the base class has none.
    p = family.prefix if _has_head(cfg) else ""
    out = {}
    for ours, theirs in family.embeddings.items():
        if ours.startswith("token_types") and not cfg.n_token_types:
            out[p + theirs] = torch.zeros(1, cfg.n_embd)
        else:
            out[p + theirs] = sd[ours]
    H, D = cfg.n_head, cfg.head_dim
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", p + family.layers.format(i=i)
        for kind in ("weight", "bias"):
            for hf, t in zip(family.qkv, sd[f"{ours}attn.w_qkv.{kind}"].split(H * D, dim=0)):
                out[f"{theirs}{hf}.{kind}"] = t
            for name, hf in family.linears.items():
                out[f"{theirs}{hf}.{kind}"] = sd[f"{ours}{name}.{kind}"]
    if _has_head(cfg):
        h = family.head
        for part in ("head_transform.dense", "head_transform.norm"):
            for kind in ("weight", "bias"):
                out[f"{h[part]}.{kind}"] = sd[f"{part}.{kind}"]
        out[h["lm_head.bias"]] = sd["lm_head.bias"]
        if not cfg.tie_embeddings:
            out[h["lm_head.weight"]] = sd["lm_head.weight"]
    return out


# -- reading and writing folders ---------------------------------------------------------

def _load(family_name: str, arch: Architecture):
    family = FAMILIES[family_name]

    def load(folder: Path, config: dict, device="cpu", dtype=torch.float32):
        """(model in eval mode, its ModelConfig, its tokenizer) from a BERT-family folder;
        the head is read when its weights are there."""
        cfg = _checked_config(arch, config, folder / "config.json")
        files = WeightFiles(folder, family.prefix)
        cfg = replace(cfg, readout="mlm" if files.find(family.head_marker) else "none")
        if not READOUTS[cfg.readout].scores_tokens:
            cfg = replace(cfg, tie_embeddings=False)
        tied = _check_weight_headers(family, files, cfg)
        tokenizer = _read_tokenizer(folder, cfg)
        weights = _from_hf_weights(family, files.get, cfg)
        if tied and files.find(tied) and not torch.equal(files.get(tied).float(),
                                                         weights["wte.weight"].float()):
            raise CheckpointError(f"{files.source} holds an output layer {tied} that differs "
                                  "from the token embedding, but config.json ties them "
                                  "(tie_word_embeddings): set it to false if they are separate")
        from engine.checkpoint import load_weights, refuse_non_finite
        refuse_non_finite(weights, folder)
        # No random init (drawing 30k x 384 normal numbers to overwrite them costs more
        # than reading the file): the read tensors become the model's own.
        model = GPT.unfilled(cfg)
        load_weights(model, weights, folder, assign=True, finite_checked=True)
        return model.to(device=device, dtype=dtype).eval(), cfg, tokenizer
    return load


def _checked_config(arch: Architecture, config: dict, config_path: Path) -> ModelConfig:
    """The ModelConfig that config.json describes, refused (naming the file) when it is
    broken or larger than this machine's memory, before anything is read or built."""
    try:
        cfg = arch.from_hf_config(config)
    except (KeyError, TypeError, ValueError, ModelError, CheckpointError) as err:
        raise CheckpointError(f"{config_path}: {err}") from None
    # The size the config describes, counted on the model built on the meta device
    # (every size and variant checked, no memory), refused before anything is read or
    # built; its message names the file.
    try:
        refuse_too_large_model(cfg, config_path)
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{config_path}: {err}") from None
    return cfg


def _check_weight_headers(family: Family, files: WeightFiles, cfg: ModelConfig) -> str | None:
    """Refuses weight files whose headers do not match `cfg`; returns the name of the
    output layer that config.json ties to the embedding (None when untied or headless)."""
    # Names, shapes and dtypes from the headers, before a tensor is read (an integer or
    # quantised weight is refused, not cast): everything
    # the config needs, nothing else but the buffers transformers skips too, and a
    # tied output layer stored anyway (checked equal to the embedding below).
    expected = {name: tuple(t.shape)
                for name, t in _to_hf_weights(family, GPT.skeleton(cfg).state_dict(), cfg).items()}
    p = family.prefix
    aliases = {n: (n[len(p):],) if n.startswith(p) else (p + n,) for n in expected}
    tied = family.head["lm_head.weight"] if _has_head(cfg) and cfg.tie_embeddings else None
    files.check(expected, aliases=aliases, ignored=_IGNORED,
                allowed={tied: (cfg.vocab_size, cfg.n_embd)} if tied else None,
                n_layer=cfg.n_layer)
    return tied


def _read_tokenizer(folder: Path, cfg: ModelConfig) -> WordPieceTokenizer:
    """The folder's tokenizer.json, refused when it is not UTF-8, not a WordPiece
    tokenizer, or holds ids past the model's vocabulary."""
    data = read_folder_bytes(folder, "tokenizer.json", TOKENIZER_LIMIT)
    try:
        tokenizer = WordPieceTokenizer.from_json(data.decode("utf-8", errors="strict"),
                                                 folder / "tokenizer.json")
    except UnicodeDecodeError:
        raise CheckpointError(f"{folder}/tokenizer.json is not UTF-8 text; {FETCH_AGAIN}") from None
    except TokenizerError as err:
        raise CheckpointError(f"{err}; {FETCH_AGAIN}") from None
    try:
        refuse_ids_past_vocab(tokenizer, cfg, folder / "tokenizer.json")
    except TokenizerError as err:
        raise CheckpointError(str(err)) from None
    return tokenizer


# Special tokens under the names the BERT family gives them, for transformers' tokenizer.
_SPECIAL = {"cls_token": ("[CLS]", "<s>"), "sep_token": ("[SEP]", "</s>"),
            "pad_token": ("[PAD]", "<pad>"), "mask_token": ("[MASK]", "<mask>"),
            "unk_token": ("[UNK]", "<unk>")}


def _hf_tokenizer(tokenizer, max_length: int):
    from tokenizers import Tokenizer as Backend
    from transformers import PreTrainedTokenizerFast
    backend = Backend.from_str(tokenizer.to_json())
    special = {role: next(n for n in names if backend.token_to_id(n) is not None)
               for role, names in _SPECIAL.items()
               if any(backend.token_to_id(n) is not None for n in names)}
    # The longest input the model reads, as the source's tokenizer_config.json says it.
    return PreTrainedTokenizerFast(tokenizer_object=backend, model_max_length=max_length, **special)


def _write(family_name: str, arch: Architecture):
    family = FAMILIES[family_name]

    def write(model: GPT, cfg: ModelConfig, tokenizer, out: Path) -> Architecture:
        """`out` as the family's base class (no head) or masked-LM class, written beside
        it and renamed, so the folder appears whole."""
        import transformers
        from safetensors.torch import save_file
        if tokenizer.needs_every_symbol:
            raise ExportError("a BERT-family folder needs a tokenizer.json transformers reads "
                              "for an encoder (WordPiece or BPE), not a character vocabulary: "
                              f"train with {BPE_FLAG}")
        state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
        weights = {k: v.contiguous().clone() for k, v in _to_hf_weights(family, state, cfg).items()}
        hf_class = family.mlm_class if _has_head(cfg) else family.encoder_class
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            transformers.AutoConfig.for_model(
                arch.model_type, **arch.to_hf_config(cfg), architectures=[hf_class],
                torch_dtype="float32").save_pretrained(tmp)
            save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
            _hf_tokenizer(tokenizer, cfg.block_size).save_pretrained(tmp)
            if out.exists():
                out.rmdir()
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return replace(arch, hf_class=hf_class)
    return write


def _architecture(name: str, blockers, to_config, from_config, schema) -> Architecture:
    family = FAMILIES[name]
    arch = Architecture(name, family.encoder_class, blockers, to_config, from_config,
                        lambda sd, cfg: _to_hf_weights(family, sd, cfg),
                        lambda get, cfg: _from_hf_weights(family, get, cfg), schema,
                        base_prefix=family.prefix)
    return replace(arch, load=_load(name, arch), write=_write(name, arch), char_vocab=False)


# In the order export tries them: the first that computes a model exactly is written,
# so an encoder without token types is a DistilBERT when its epsilon is DistilBERT's.
ENCODERS = {
    "roberta": _architecture("roberta", _roberta_blockers, _roberta_to_config, _roberta_from_config,
                             _ROBERTA_SCHEMA),
    "distilbert": _architecture("distilbert", _distilbert_blockers, _distilbert_to_config,
                                _distilbert_from_config, _DISTILBERT_SCHEMA),
    "bert": _architecture("bert", _bert_blockers, _bert_to_config, _bert_from_config, _BERT_SCHEMA),
}
ARCHITECTURES.update(ENCODERS)
