"""What a mechanism keeps per layer while decoding, when it is not softmax attention's
growing keys and values: linear attention's and DeltaNet's fixed-size state, latent
attention's compressed latent. Each mechanism's own state object says its size
(`bytes()`, `bytes_per_token()`); `LayerStates` holds one per layer and speaks the
protocol GPT.forward already speaks to a KVCache (`begin`, `end`, `length`), so a model
whose attention is one of these decodes token by token unchanged.

A layer reads its state with `cache.get(layer_idx)` (None before the first token) and
hands the next one back with `cache.put(layer_idx, state)`: the model, not the layer,
still advances the position (`end`)."""
from __future__ import annotations

import torch

from model.cache import KVCache
from model.config import ModelConfig, ModelError


def refuse_masks(config: ModelConfig, mechanism: str) -> None:
    """A recurrent state holds a sum over every earlier token, in order: it cannot leave
    the tokens outside a sliding window out, nor see the ones after it (an encoder)."""
    if config.sliding_window or not config.causal:
        raise ModelError(f"{mechanism} keeps one running state of every earlier token: it has "
                         "no sliding window and is causal; set model.sliding_window=0 and "
                         "model.causal=true with it")


class LayerStates:
    """One state object per layer and the position of the next token. A model with a
    sliding window (latent attention) hands its window on, so the mask hides what
    training hid; the latents themselves are all kept."""

    def __init__(self, n_layer: int, window: int = 0, n_global: int = 0):
        self.window, self.n_global = window, n_global
        self.states: list = [None] * n_layer
        self.length = 0                      # tokens seen: the position of the next one
        self.tails: dict[int, torch.Tensor] = {}    # TokenMix's rows, as in a KVCache

    def begin(self, T: int, device) -> tuple[torch.Tensor, int]:
        """The key positions the next T tokens see: every one so far (latent attention
        keeps them all; a recurrent state ignores them) and the smallest of them."""
        return torch.arange(self.length + T, device=device), 0

    def end(self, T: int) -> None:
        self.length += T

    def get(self, layer: int):
        return self.states[layer]

    def put(self, layer: int, state) -> None:
        self.states[layer] = state

    # TokenMix's rows before a chunk are kept exactly as a KVCache keeps them.
    recent = KVCache.recent

    def nbytes(self) -> int:
        return sum(s.bytes() for s in self.states if s is not None)
