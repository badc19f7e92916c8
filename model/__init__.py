"""A decoder-only Transformer built from the pieces of the attention article.

Read in this order: attention.py (the formula, the mask, multi-head), positions.py
(none, sinusoidal, learned, RoPE), layers.py (norms, MLP, the residual block), gpt.py
(the whole model and its KV cache), sampling.py (logits to tokens)."""
from model.config import ModelConfig
from model.gpt import GPT, KVCache, Output
from model.registry import REGISTRIES

__all__ = ["GPT", "KVCache", "ModelConfig", "Output", "REGISTRIES"]
