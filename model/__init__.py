"""A decoder-only Transformer built from the pieces of the attention article.

Read in this order: config.py (the one model configuration: sizes, and variants named
by strings), mask.py (the one mask rule), attention.py (the formula, its backends and
multi-head attention; flex.py is its FlexAttention path), mechanisms.py (what a
layer's attention computes: multi-head, or differential.py's difference of two maps,
each entry with its facts), positions.py (none,
sinusoidal, learned, RoPE, ALiBi), layers.py (norms, MLP, the residual block),
readout.py (the output layer, and the adaptive softmax for large vocabularies), gpt.py
(the whole model and generation from it), cache.py (the KV caches it decodes with),
sampling.py (logits to tokens), seq2seq.py (an encoder-decoder, through cross-attention);
registry.py lists every variant and checks a config.
The folder imports torch and itself only: copy it out and it runs."""
from model.config import ModelConfig, ModelError
from model.gpt import GPT, KVCache, Output
from model.registry import REGISTRIES

__all__ = ["GPT", "KVCache", "ModelConfig", "ModelError", "Output", "REGISTRIES"]
