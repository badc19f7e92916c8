"""The one model configuration. Variant fields hold registry names (strings), so a
config stays plain data that saves to JSON and loads back; the names are looked up
in the registries once, when the layers are built, and checked there
(model/registry.py), where the facts about each variant live.

model/ imports torch and itself only, so this file lifts out with the rest of the
folder: its error type is its own, and its fields carry their help text in plain
dataclass metadata (the same keys as common/fields.py writes)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields


class ModelError(ValueError):
    """A model setting or input the model cannot work with, explained in its message.
    The scripts print it as one `error:` line, like the project's own errors."""


def _opt(default, help: str, registry: str | None = None, pattern: bool = False):
    # pattern: the value may be a comma-separated list of registry names, one per layer, cycled.
    return field(default=default, metadata={"help": help, "registry": registry, "pattern": pattern})


MOST_LAYERS = 512
MOST_EXPERTS = 512
DIVISORS_SHOWN = 12        # a refusal lists at most this many of a size's divisors


def divisors(n: int) -> list[int]:
    """The divisors of `n`, found in pairs (d, n / d) from d up to √n, at most 100,000
    tries, so an absurd size costs no time (past 10^10 some may be missed)."""
    tries = range(1, min(math.isqrt(n), 100_000) + 1)
    return sorted({x for d in tries if n % d == 0 for x in (d, n // d)})


def listed(values: list[int], near: int) -> str:
    """`values` for a refusal to list: all, or the DIVISORS_SHOWN nearest `near` by ratio."""
    if len(values) <= DIVISORS_SHOWN:
        return ", ".join(map(str, values))
    shown = sorted(sorted(values, key=lambda d: abs(math.log(d / near)))[:DIVISORS_SHOWN])
    return f"{', '.join(map(str, shown))} (the {DIVISORS_SHOWN} nearest {near})"


@dataclass
class ModelConfig:
    vocab_size: int = _opt(0, "vocabulary size; 0 = take it from the tokenizer")
    block_size: int = _opt(256, "training context length T (tokens a query can see)")
    n_layer: int = _opt(6, "number of Transformer blocks")
    n_head: int = _opt(6, "attention heads per block; head size d_k = n_embd / n_head")
    n_kv_head: int = _opt(0, "key/value heads (GQA/MQA); 0 = n_head, plain multi-head")
    n_embd: int = _opt(384, "model width d_model")
    sliding_window: int = _opt(0, "each query sees its W most recent tokens (itself "
                                  "included); 0 = every earlier token")
    n_global: int = _opt(0, "with a window: the first N tokens stay visible to every "
                            "later token (global tokens / attention sinks)")
    full_attention_every: int = _opt(0, "with a sliding window, every Nth layer sees the whole "
                                        "context instead (gpt-oss alternates: 2; Gemma 3 has "
                                        "five windowed layers to one global: 6); 0 = every "
                                        "layer windowed")
    causal: bool = _opt(True, "each token sees only itself and earlier tokens (a decoder, the "
                              "article's masked self-attention); false = every token sees the "
                              "whole sequence (an encoder, BERT's bidirectional self-attention)")
    mechanism: str = _opt("mha", "attention mechanism: mha is the article's multi-head attention "
                                 "(grouped-query/multi-query by model.n_kv_head); a comma-separated "
                                 "list is cycled over the layers (a hybrid)", registry="mechanism",
                          pattern=True)
    attention: str = _opt("auto", "attention backend (model/attention.py); auto = the one that "
                                   "pays on the machine: eager for bf16 on a CPU with native bf16, "
                                   "flex or banded for a long window, else sdpa", registry="attention")
    position: str = _opt("rope", "position encoding", registry="position")
    position_offset: int = _opt(0, "learned positions: position p reads table row p + offset "
                                   "(RoBERTa keeps its first two rows for padding: 2)")
    n_token_types: int = _opt(0, "token-type (segment) embeddings: BERT adds one of N learned "
                                 "vectors per token (sentence A or B); 0 = none")
    norm: str = _opt("layernorm", "normalisation layer", registry="norm")
    block: str = _opt("prenorm", "residual block: prenorm normalises each sublayer's input "
                                 "(GPT-2), postnorm each residual sum (BERT)", registry="block")
    mlp: str = _opt("gelu", "feed-forward block: gelu is GELU exactly, gelu_tanh its tanh "
                               "approximation as GPT-2 computed it", registry="mlp")
    mlp_hidden: int = _opt(0, "the MLP's hidden width; 0 = the variant's own rule (4 x n_embd, "
                              "SwiGLU 8/3 x n_embd rounded up to 32)")
    moe_experts: int = _opt(8, "model.mlp=moe: routed experts per layer, of which each token "
                               "uses model.moe_top_k")
    moe_shared: int = _opt(1, "model.mlp=moe: shared experts per layer, which every token uses")
    moe_top_k: int = _opt(2, "model.mlp=moe: routed experts each token is sent to, the k with "
                             "the highest affinity plus balancing bias")
    moe_router: str = _opt("sigmoid", "model.mlp=moe: how the router picks and weights experts: "
                                      "sigmoid affinities with a balancing bias (DeepSeek-V3), or "
                                      "softmax_topk, a softmax over the k largest logits of a "
                                      "router with a bias (gpt-oss)", registry="moe_router")
    moe_expert: str = _opt("swiglu", "model.mlp=moe: each expert's feed-forward: swiglu, or gpt_oss "
                                     "(clamped SwiGLU, (up + 1)·g·σ(1.702·g))", registry="moe_expert")
    moe_hidden: int = _opt(0, "model.mlp=moe: each expert's hidden width; 0 = SwiGLU's 8/3 x "
                              "n_embd shared out among the top_k + shared experts a token uses")
    moe_shared_gate: bool = _opt(False, "model.mlp=moe: the shared experts' output scaled by a "
                                        "sigmoid gate from the token, σ(u·w), one number a token "
                                        "(Qwen3-Next); false = added as it is")
    moe_bias_rate: float = _opt(1e-3, "model.mlp=moe: the balancing bias's step γ; after each "
                                      "optimizer step each routed expert's bias moves by γ "
                                      "towards an even load (DeepSeek-V3's 0.001); 0 = fixed")
    moe_routed_scale: float = _opt(1.0, "model.mlp=moe: the routed experts' weights multiplied "
                                        "by this after normalising (DeepSeek-V3's and Kimi "
                                        "Linear's routed_scaling_factor, 2.5 or so); 1 = as they are")
    moe_groups: int = _opt(1, "model.mlp=moe, sigmoid router: the routed experts split into this "
                              "many groups, of which each token may use model.moe_group_top "
                              "(DeepSeek-V3's node-limited routing: 8 groups, 4 used); 1 = "
                              "no groups")
    moe_group_top: int = _opt(1, "model.mlp=moe with model.moe_groups: the groups a token's "
                                 "experts may come from, those whose two best experts score "
                                 "highest")
    moe_dense_layers: int = _opt(0, "model.mlp=moe: the first N layers get a dense SwiGLU of "
                                    "width model.mlp_hidden instead of experts (DeepSeek-V3's "
                                    "first three)")
    tie_embeddings: bool = _opt(True, "share the token embedding with the output layer")
    readout: str = _opt("full", "output layer: a softmax over the whole vocabulary, or the "
                                "adaptive softmax for large vocabularies", registry="readout")
    readout_shortlist: int = _opt(0, "adaptive readout: how many of the most frequent tokens get "
                                     "the full-width softmax; 0 = as many as make up 95% of the "
                                     "training tokens (counted when a run starts)")
    zero_head: bool = _opt(False, "start an untied output layer at zero (modded-nanogpt): every "
                                  "logit 0, the loss exactly ln(vocab_size) at step 0")
    bias: bool = _opt(False, "bias in linear layers and LayerNorm")
    norm_eps: float = _opt(1e-5, "epsilon inside LayerNorm / RMSNorm (1e-5 as in GPT-2; "
                                 "imported models bring their own)")
    dropout: float = _opt(0.0, "dropout probability (0 keeps SDPA on its fused path)")
    qk_norm: bool = _opt(False, "normalise each head's queries and keys to unit RMS before "
                                "Q·Kᵀ (QK-norm): the scores stay bounded at any rate")
    qk_norm_weight: bool = _opt(False, "with model.qk_norm: queries and keys each get a learned "
                                       "norm over d_k, of model.norm's kind (Gemma 3's q_norm and "
                                       "k_norm); false = unit RMS alone")
    score_scale: float = _opt(0.0, "with model.qk_norm: what Q·Kᵀ is multiplied by; 0 = 1/√d_k, "
                                   "the article's (Gemma 3: 1/√query_pre_attn_scalar)")
    embed_scale: bool = _opt(False, "multiply the token embeddings by √n_embd before the first "
                                    "block (Gemma: its table, shared with the output layer, stays "
                                    "small while the stream starts near unit scale)")
    value_embeds: bool = _opt(False, "value embeddings (modded-nanogpt): each layer adds a learned "
                                     "vector per token to that token's value, V = x·W_V + E_V[token]")
    skip_connections: bool = _opt(False, "U-net skips: the output of block i, for i in the first "
                                         "half, is added with a learned weight to the input of "
                                         "block n_layer-1-i")
    token_mix: int = _opt(0, "before attention, add to each position a learned per-channel "
                             "weighting of it and the token_mix-1 positions before it (a causal "
                             "depthwise convolution, as Canon layers); 0 = off")
    logit_softcap: float = _opt(0.0, "squash output logits into (-c, c) by c·tanh(z/c); 0 = off")
    rope_theta: float = _opt(10000.0, "RoPE base: pair i turns by position * theta^(-2i/d_k)")
    rope_local_theta: float = _opt(0.0, "with model.full_attention_every: the RoPE base of the "
                                        "windowed layers, model.rope_theta staying the full ones'; "
                                        "0 = rope_theta for all (Gemma 3: 10,000 local, "
                                        "1,000,000 global)")
    rope_dims: int = _opt(0, "model.position=rope_partial: how many of each head's dimensions "
                             "RoPE turns (the first ones; the rest carry no position); 0 = a "
                             "quarter of the head, Qwen3-Next's partial_rotary_factor")
    rope_scaling: str = _opt("none", "stretch RoPE to a longer context", registry="rope_scaling")
    rope_factor: float = _opt(1.0, "RoPE scaling factor s (new context / original context)")
    rope_original_context: int = _opt(0, "context the model was trained at (YaRN); "
                                         "0 = block_size")
    linear_chunk: int = _opt(64, "linear attention and DeltaNet: tokens per chunk of the chunked "
                                 "parallel form (same outputs, less memory than T x T)")
    delta_conv: int = _opt(0, "delta-rule layers (deltanet, gated_deltanet, kda, ...): a causal "
                              "depthwise convolution of this many taps on q, k and v, then SiLU, "
                              "as the Qwen3-Next and Kimi Linear cards have (4); 0 = none")
    mla_kv_rank: int = _opt(0, "latent attention (MLA): width of the cached latent c_kv; "
                               "0 = 4 x head_dim (DeepSeek-V2's ratio)")
    mla_nope: bool = _opt(False, "latent attention (MLA) without positions: its shared key and "
                                 "query parts are left unturned (Kimi Linear, whose delta-rule "
                                 "layers bring order); false = turned by its own RoPE")
    mla_rope_dim: int = _opt(0, "latent attention (MLA): width of the shared rotary key k_rope; "
                                "0 = head_dim / 2 (DeepSeek-V2's ratio)")
    mla_q_rank: int = _opt(0, "latent attention (MLA): queries through a latent of this width, "
                              "down, RMSNorm, up (DeepSeek-V2/V3's q_lora_rank); 0 = "
                              "full-rank queries")
    sparse_top_k: int = _opt(0, "sparse attention (DSA): the keys each query attends to, chosen by "
                                "the lightning indexer; 0 = block_size / 4")
    indexer_heads: int = _opt(4, "sparse attention (DSA): the lightning indexer's heads")
    indexer_dim: int = _opt(0, "sparse attention (DSA): the width of each indexer query and key; "
                               "0 = head_dim (at least head_dim: that many turn by RoPE)")
    mtp_depth: int = _opt(0, "multi-token prediction (DeepSeek-V3): D modules after the stack, "
                             "module k predicting the token k+1 ahead through the shared "
                             "embedding and output layer; 0 = none (sample --decode mtp "
                             "drafts with the first)")
    mtp_weight: float = _opt(0.3, "multi-token prediction: λ, the weight of its loss beside the "
                                  "next-token loss (DeepSeek-V3: 0.3, then 0.1 late in training)")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    def validate(self) -> None:
        """Refuse impossible sizes before any work, saying why. Variant names and what
        each variant needs are checked by model.registry.check, which knows them."""
        self._validate_numbers()
        self._validate_experts()
        if self.token_mix > self.block_size:
            raise ModelError(f"model.token_mix={self.token_mix} mixes in more positions than the "
                             f"context model.block_size={self.block_size} holds; give at most "
                             f"{self.block_size}" + (" (4 is usual)" if self.block_size >= 4 else ""))
        if self.delta_conv > self.block_size:
            raise ModelError(f"model.delta_conv={self.delta_conv} convolves over more positions "
                             f"than the context model.block_size={self.block_size} holds; give "
                             f"at most {self.block_size} (4 is the cards')")
        if self.sliding_window > self.block_size:
            raise ModelError(f"model.sliding_window={self.sliding_window} is larger than the "
                             f"context model.block_size={self.block_size}; a window that wide "
                             "is plain causal attention: use 0, or a smaller window")
        if self.n_embd % self.n_head:
            raise ModelError(
                f"model.n_embd={self.n_embd} is not divisible by model.n_head={self.n_head}: "
                "each head gets an equal slice d_k = n_embd / n_head; give model.n_head one of "
                f"{listed(divisors(self.n_embd), self.n_head)}, or change model.n_embd")
        if self.n_head % self.kv_heads:
            raise ModelError(f"model.n_kv_head={self.n_kv_head} must divide "
                             f"model.n_head={self.n_head}: each key/value head serves "
                             "a whole group of query heads; give one of "
                             f"{listed(divisors(self.n_head), self.n_kv_head)} (or 0: one per "
                             "query head)")
        if self.sliding_window and not self.causal:
            raise ModelError("model.sliding_window limits how far back a query looks; with "
                             "model.causal=false every token sees the whole sequence: set one "
                             "or the other")
        if self.indexer_heads <= 0:
            raise ModelError(f"model.indexer_heads must be a positive integer, got "
                             f"{self.indexer_heads} (model.indexer_heads: the lightning indexer's "
                             "heads; 4 is the default)")
        if not self.rope_factor >= 1.0:
            raise ModelError(f"model.rope_factor must be at least 1, got {self.rope_factor}")
        if self.zero_head and self.tie_embeddings:
            raise ModelError("model.zero_head starts the output layer at zero, but it is tied to "
                             "the token embedding (which must not start at zero); set "
                             "model.tie_embeddings=false with it")
        if self.logit_softcap < 0:
            raise ModelError(f"model.logit_softcap must not be negative, got {self.logit_softcap}")
        if not 0.0 <= self.dropout < 1.0:
            raise ModelError(f"model.dropout must be in [0, 1), got {self.dropout}")
        if not 0 < self.norm_eps < 1:
            raise ModelError(f"model.norm_eps must be in (0, 1), got {self.norm_eps}")
        if not self.rope_theta > 0:
            raise ModelError(f"model.rope_theta must be positive, got {self.rope_theta}")

    def _validate_numbers(self) -> None:
        """Each field of the kind it says, the sizes positive and bounded, the counts not
        negative."""
        for f in fields(self):               # the Python API meets no command-line parser
            value = getattr(self, f.name)
            if f.type == "int" and (not isinstance(value, int) or isinstance(value, bool)):
                raise ModelError(f"model.{f.name} must be a whole number, got {value!r}")
            if f.type == "float" and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value)):
                raise ModelError(f"model.{f.name} must be a finite number, got {value!r}")
            if f.type == "bool" and not isinstance(value, bool):
                # bool("false") is True: a string here would switch the part on in silence.
                raise ModelError(f"model.{f.name} must be a bool (True or False), got {value!r}")
            if f.type == "str" and not isinstance(value, str):
                raise ModelError(f"model.{f.name} must be a name (a string), got {value!r}")
        for name in ("block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelError(f"model.{name} must be a positive integer, got {value!r}")
        if self.n_layer > MOST_LAYERS:
            # Every layer is a module built even to size the model: bounded before any is.
            raise ModelError(f"model.n_layer={self.n_layer:,} is more than {MOST_LAYERS} layers "
                             "(GPT-3 has 96); give a smaller model.n_layer")
        for f in fields(self):
            if f.name in ("vocab_size", "n_kv_head", "sliding_window", "n_global", "full_attention_every",
                          "rope_original_context", "readout_shortlist", "position_offset",
                          "n_token_types", "mlp_hidden", "token_mix", "mla_kv_rank", "delta_conv",
                          "rope_dims", "mla_rope_dim", "mla_q_rank", "sparse_top_k", "indexer_dim",
                          "mtp_depth",
                          "rope_local_theta", "score_scale") and getattr(self, f.name) < 0:
                raise ModelError(f"model.{f.name} must not be negative, got {getattr(self, f.name)} "
                                 f"(model.{f.name}: {f.metadata['help']})")

    def _validate_experts(self) -> None:
        """The mixture of experts' counts (model.mlp=moe): k of at least one routed expert."""
        for name in ("moe_shared", "moe_hidden", "moe_bias_rate", "moe_dense_layers"):
            if getattr(self, name) < 0:
                raise ModelError(f"model.{name} must not be negative, got {getattr(self, name)} "
                                 f"(model.{name}: {self.__dataclass_fields__[name].metadata['help']})")
        if self.moe_experts < 1:
            raise ModelError(f"model.moe_experts must be at least 1, got {self.moe_experts} "
                             "(the routed experts each token chooses from)")
        if self.moe_experts + self.moe_shared > MOST_EXPERTS:
            # A forward pass visits each expert in turn: bounded in time, not only in memory.
            raise ModelError(f"model.moe_experts={self.moe_experts} and model.moe_shared="
                             f"{self.moe_shared} make more than {MOST_EXPERTS} experts a layer "
                             "(DeepSeek-V3 has 257); give fewer")
        if not self.moe_routed_scale > 0:
            raise ModelError(f"model.moe_routed_scale must be positive, got {self.moe_routed_scale}")
        if self.moe_bias_rate > 1:
            raise ModelError(f"model.moe_bias_rate={self.moe_bias_rate} moves the balancing bias "
                             "by more than 1 a step, past the sigmoid's whole range; DeepSeek-V3 "
                             "uses 0.001")
        if self.moe_groups < 1 or self.moe_experts % self.moe_groups:
            raise ModelError(f"model.moe_groups={self.moe_groups} must be at least 1 and divide "
                             f"model.moe_experts={self.moe_experts}: the routed experts split "
                             "into equal groups")
        if self.moe_groups > 1 and self.moe_experts // self.moe_groups < 2:
            raise ModelError(f"model.moe_groups={self.moe_groups} leaves fewer than two experts a "
                             "group; a group scores by its two best: give fewer groups")
        if not 1 <= self.moe_group_top <= self.moe_groups:
            raise ModelError(f"model.moe_group_top={self.moe_group_top} must be between 1 and "
                             f"model.moe_groups={self.moe_groups}")
        per_group = self.moe_experts // self.moe_groups
        if self.moe_groups > 1 and self.moe_top_k > self.moe_group_top * per_group:
            raise ModelError(f"model.moe_top_k={self.moe_top_k} is more experts than "
                             f"model.moe_group_top={self.moe_group_top} groups of {per_group} hold")
        if not 1 <= self.moe_top_k <= self.moe_experts:
            raise ModelError(f"model.moe_top_k={self.moe_top_k} must be between 1 and "
                             f"model.moe_experts={self.moe_experts}: each token goes to that "
                             "many of the routed experts")
