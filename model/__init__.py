"""A decoder-only Transformer built from the pieces of the attention article.

Building the default model and one forward pass read in four files, once the config has
been checked where it was read (as train.py does; GPT(config) checks a fresh one first,
in registry.py): gpt.py (the model: embeddings, the blocks, the output layer), layers.py
(the block: norms, the MLP, attention around a residual), attention.py (the mask rule,
the formula, its backends and multi-head attention) and positions.py (RoPE and the other
encodings); config.py holds the fields.
Around them: mechanisms.py (what a layer's attention computes, each entry with its facts:
differential.py, sigmoid_attention.py, gated_attention.py, sink_attention.py,
sparse_attention.py, linear_attention.py, deltanet.py, kda.py, latent_attention.py,
latent_sparse_attention.py), extras.py (parts a config adds), moe.py (a mixture of
experts), readout.py (other output layers), partial_rope.py (RoPE on part of each head),
rope_scaling.py (RoPE past its context), flex.py (FlexAttention), decode.py and cache.py
(generation and its caches), mtp.py (multi-token prediction), sampling.py (logits to
tokens), seq2seq.py (an encoder-decoder, through cross-attention), meta.py (building
without values); registry.py lists every variant and checks a config.
The folder imports torch and itself only: copy it out and it runs."""
from model.config import ModelConfig, ModelError
from model.gpt import GPT, KVCache, Output
from model.registry import REGISTRIES

__all__ = ["GPT", "KVCache", "ModelConfig", "ModelError", "Output", "REGISTRIES"]
