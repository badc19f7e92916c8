"""The one model configuration. Variant fields hold registry names (strings), so a
config stays plain data that saves to JSON and loads back; the names are looked up
in the registries once, when the layers are built."""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from attnlab.errors import ConfigError, choices_hint


def opt(default, help: str, registry: str | None = None):
    """A config field with its one-line doc (shown by --help) and, for variant
    fields, the name of the registry that lists the valid choices."""
    return field(default=default, metadata={"help": help, "registry": registry})


@dataclass
class ModelConfig:
    vocab_size: int = opt(0, "vocabulary size; 0 = take it from the tokenizer")
    block_size: int = opt(256, "training context length T (tokens a query can see)")
    n_layer: int = opt(6, "number of Transformer blocks")
    n_head: int = opt(6, "attention heads per block; head size d_k = n_embd / n_head")
    n_kv_head: int = opt(0, "key/value heads (GQA/MQA); 0 = n_head, plain multi-head")
    n_embd: int = opt(384, "model width d_model")
    sliding_window: int = opt(0, "each query sees its W most recent tokens (itself "
                                 "included); 0 = every earlier token")
    n_global: int = opt(0, "with a window: the first N tokens stay visible to every "
                           "later token (global tokens / attention sinks)")
    attention: str = opt("sdpa", "attention backend", registry="attention")
    position: str = opt("rope", "position encoding", registry="position")
    norm: str = opt("layernorm", "normalisation layer", registry="norm")
    mlp: str = opt("gelu", "feed-forward block", registry="mlp")
    tie_embeddings: bool = opt(True, "share the token embedding with the output layer")
    bias: bool = opt(False, "bias in linear layers and LayerNorm")
    dropout: float = opt(0.0, "dropout probability (0 keeps SDPA on its fused path)")
    rope_theta: float = opt(10000.0, "RoPE base: pair i turns by position * theta^(-2i/d_k)")
    rope_scaling: str = opt("none", "stretch RoPE to a longer context", registry="rope_scaling")
    rope_factor: float = opt(1.0, "RoPE scaling factor s (new context / original context)")
    rope_original_context: int = opt(0, "context the model was trained at (YaRN); "
                                        "0 = block_size")

    def __post_init__(self):
        self.validate()

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    def validate(self) -> None:
        """Refuse impossible settings before any work, saying why."""
        for name in ("block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"model.{name} must be a positive integer, got {value!r}")
        for name in ("vocab_size", "n_kv_head", "sliding_window", "n_global",
                     "rope_original_context"):
            if getattr(self, name) < 0:
                raise ConfigError(f"model.{name} must not be negative, got {getattr(self, name)}")
        if self.sliding_window > self.block_size:
            raise ConfigError(f"model.sliding_window={self.sliding_window} is larger than the "
                              f"context model.block_size={self.block_size}; a window that wide "
                              "is plain causal attention: use 0, or a smaller window")
        if self.n_embd % self.n_head:
            raise ConfigError(
                f"model.n_embd={self.n_embd} is not divisible by model.n_head={self.n_head}: "
                "each head gets an equal slice d_k = n_embd / n_head")
        if self.head_dim % 2 and self.position == "rope":
            raise ConfigError(f"RoPE rotates pairs of dimensions, so the head size "
                              f"(n_embd/n_head = {self.head_dim}) must be even")
        if self.n_head % self.kv_heads:
            raise ConfigError(f"model.n_kv_head={self.n_kv_head} must divide "
                              f"model.n_head={self.n_head}: each key/value head serves "
                              "a whole group of query heads")
        if self.n_global and not self.sliding_window:
            raise ConfigError("model.n_global keeps the first tokens visible past a sliding "
                              "window; set model.sliding_window too (without a window every "
                              "token is visible anyway)")
        if self.attention == "banded" and not self.sliding_window:
            raise ConfigError("model.attention=banded computes only a sliding window's band; "
                              "set model.sliding_window (e.g. 256) or use sdpa")
        if self.attention == "flex" and self.dropout:
            raise ConfigError("model.attention=flex has no attention dropout; set "
                              "model.dropout=0 or use eager, sdpa or banded")
        if self.rope_scaling != "none" and self.position != "rope":
            raise ConfigError(f"model.rope_scaling={self.rope_scaling} needs model.position=rope")
        if not self.rope_factor >= 1.0:
            raise ConfigError(f"model.rope_factor must be at least 1, got {self.rope_factor}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout}")
        if not self.rope_theta > 0:
            raise ConfigError(f"model.rope_theta must be positive, got {self.rope_theta}")
        from model.registry import REGISTRIES  # late: the registries import this module
        for f in fields(self):
            registry = f.metadata.get("registry")
            if registry and getattr(self, f.name) not in REGISTRIES[registry]:
                raise ConfigError(f"unknown model.{f.name} {getattr(self, f.name)!r}"
                                  + choices_hint(getattr(self, f.name), REGISTRIES[registry]))
