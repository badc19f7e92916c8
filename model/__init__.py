"""A decoder-only Transformer built from the pieces of the attention article.

Read in this order: mask.py (the one mask rule), attention.py (the formula and its
backends, multi-head; precision.py says whether this CPU has native bf16), positions.py (none, sinusoidal, learned, RoPE, ALiBi),
layers.py (norms, MLP, the residual block), readout.py (the output layer, and the
adaptive softmax for large vocabularies), gpt.py (the whole model and its KV cache),
sampling.py (logits to tokens); registry.py lists every variant and checks a config.
The folder imports torch and itself only: copy it out and it runs."""
from model.config import ModelConfig, ModelError
from model.gpt import GPT, KVCache, Output
from model.registry import REGISTRIES

__all__ = ["GPT", "KVCache", "ModelConfig", "ModelError", "Output", "REGISTRIES"]
