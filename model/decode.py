"""Generation: one token at a time from a model, and the caches that make a step cheap.

The model (model/gpt.py) exposes what decoding needs: a forward pass that reads and
advances a cache, and `new_cache`. Everything else lives here: how earlier tokens are
kept (`DECODERS`: re-read in full, a growing cache, a preallocated static cache, or that
static step recorded as a CUDA graph), what happens when the context fills up, and
StreamingLLM's rolling cache (arXiv:2309.17453)."""
from __future__ import annotations

import weakref
from typing import Iterator

import torch
import torch.nn as nn

from model.cache import CapturedStep, KVCache, StaticKVCache
from model.config import ModelError
from model.mechanisms import MECHANISMS
from model.layers import layer_names
from model.sampling import sample_next

# How generate keeps earlier tokens: none, a growing cache, a static one, a CUDA graph.
DECODERS = ("full", "cache", "static", "graph")


def static_cache(model, max_len: int) -> StaticKVCache:
    """A preallocated cache for `model`, stepped by tensors alone."""
    return StaticKVCache(model.config.n_layer, max_len, model.kept_window(), model.config.n_global)


def stream_cache(model, window: int, sinks: int) -> KVCache:
    """A rolling cache of the first `sinks` tokens and the newest `window`, renumbered
    as it rolls (StreamingLLM, arXiv:2309.17453), for any model, windowed or not."""
    return KVCache(model.config.n_layer, window, window, sinks, shift=model.positions.shift)


def decodes_with_rolling_cache(model) -> bool:
    """A windowed model whose positions are relative (or absent) can decode for ever
    from a rolling cache; learned and sinusoidal positions are absolute, and a layer that
    sees the whole context (model.full_attention_every) needs every key."""
    return bool(model.kept_window()) and not model.positions.absolute


def generate(model, idx, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, generator: torch.Generator | None = None,
             use_cache: bool = True, on_step=None, decode: str = "cache",
             sinks: int | None = None, stream_window: int = 0,
             forced: torch.Tensor | None = None) -> Iterator[torch.Tensor]:
    """Yield (B, 1) new tokens one at a time, so a caller can print them as they come.

    `decode` says how earlier tokens are kept (DECODERS): re-read in `full` every
    step (also `use_cache=False`), in a growing `cache`, in a preallocated `static`
    cache stepped by tensors alone, or that step replayed as a CUDA `graph`. The three
    caches give the same logits up to rounding, so the same tokens for the same seed;
    `full` agrees with them within the context (past it, it slides the context one
    token at a time where a cache re-reads the newest half).

    A windowed model with relative positions decodes from a rolling cache with no
    limit. Otherwise the model sees at most block_size tokens: with a cache, when
    it fills up the oldest half of the context is dropped and the rest is re-read
    in one pass (positions restart at 0), so every token is still predicted from
    between block_size/2 and block_size tokens of context. `on_step(logits, token)`,
    if given, sees each step's last-position logits and the token drawn from them.

    `sinks` streams past the context from a rolling cache instead: the first `sinks`
    tokens and the newest `stream_window` (default (block_size - sinks) // 2, so
    renumbered positions stay inside the context) are kept, for ever (StreamingLLM,
    arXiv:2309.17453); sinks=0 keeps the window alone. It decodes from the growing
    cache whatever `decode` says. `forced` (B, N) tokens are fed instead of sampled
    (teacher forcing), so `on_step` sees the logits the model gives a known text."""
    model.check_generates()
    decode = decode_mode(model, decode, use_cache, sinks, idx.device)
    return _generate(model, idx, max_new_tokens, temperature, top_k, top_p, generator,
                     on_step, decode, sinks, stream_window, forced)


def decode_mode(model, decode: str, use_cache: bool, sinks: int | None, device) -> str:
    """The decode mode generate runs, after refusing what cannot run, saying why."""
    if decode not in DECODERS:
        raise ModelError(f"decode must be one of {', '.join(DECODERS)}, not {decode!r}")
    if not use_cache:
        decode = "full"
    if decode == "graph" and device.type != "cuda":
        raise ModelError("decode='graph' records a CUDA graph: it needs a CUDA device; "
                         "use 'static' or 'cache' elsewhere")
    if decode == "graph" and graph_refusal(model):
        raise ModelError(f"decode='graph' replays one recorded step, and {graph_refusal(model)}: "
                         "use 'static' or 'cache'")
    if sinks is not None:
        check_sinks(model.config, decode, sinks)
        decode = "cache"
    return decode


def graph_refusal(model) -> str | None:
    """Why the model's decoding step cannot be recorded as a CUDA graph, where one of its
    modules says so (its `graph_refusal`); None where it can."""
    return next((m.graph_refusal for m in model.modules() if getattr(m, "graph_refusal", None)), None)


def check_sinks(config, decode: str, sinks: int) -> None:
    """Why a streaming cache cannot run here, if it cannot."""
    window = config.block_size
    if decode == "full":
        raise ModelError("sinks keep keys in a rolling KV cache; use a cache to decode")
    names = layer_names(config)
    if not any(MECHANISMS[n].cache.per_token(config) for n in names):
        raise ModelError(f"sinks choose which keys a rolling cache keeps, and model."
                         f"mechanism={config.mechanism} keeps no keys: its fixed-size "
                         "state already reads past the context; sample without sinks")
    if config.rope_local_theta:
        raise ModelError("sinks renumber a rolling cache's keys by turning them with the model's "
                         "RoPE, and model.rope_local_theta turns the windowed layers' keys by "
                         "another base; sample without sinks")
    for name in names:
        if MECHANISMS[name].stream_refusal:
            raise ModelError(f"sinks renumber a rolling cache's keys, and model.mechanism="
                             f"{name} cannot be renumbered: {MECHANISMS[name].stream_refusal}")
    if not 0 <= sinks < window:
        raise ModelError(f"sinks must be between 0 and block_size-1 ({window - 1}), not {sinks}")


@torch.no_grad()
def _generate(model, idx, max_new_tokens, temperature, top_k, top_p, generator, on_step,
              decode, sinks, stream_window, forced):
    if forced is not None:
        max_new_tokens = forced.shape[1]
    window = model.config.block_size
    steps = CachedSteps(model, decode, idx.shape[0])
    if decode == "full":
        logits_of = _decode_full(model, idx[:, -window:])
    elif sinks is not None:
        logits_of = _decode_streaming(model, idx, steps, sinks, stream_window)
    elif decodes_with_rolling_cache(model):
        logits_of = _decode_rolling(idx, steps, model.new_cache(window))
    else:
        logits_of = _decode_reprefill(model, idx[:, -window:], steps)
    # Each mode below is a generator: it yields the logits for the next token and is
    # sent the token chosen from them.
    try:
        for i in range(max_new_tokens):
            logits = next(logits_of) if i == 0 else logits_of.send(token)
            logits = logits[:, -1].float()    # sampling maths in fp32 whatever the weights
            token = (forced[:, i:i + 1] if forced is not None else
                     sample_next(logits, temperature, top_k, top_p, generator))
            if on_step is not None:
                on_step(logits, token)
            yield token
    except GeneratorExit:                     # the caller stopped early: all is well
        steps.release()
        raise
    steps.release()                           # (not after an error: it may be the cache's)


def _decode_full(model, context):
    """No cache: every step re-reads the newest block_size tokens, sliding the context
    one token at a time past it."""
    window = model.config.block_size
    while True:
        token = yield model(context[:, -window:]).logits
        context = torch.cat([context, token], dim=1)[:, -window:]


def _decode_reprefill(model, context, steps: CachedSteps):
    """A growing cache of at most block_size tokens: read the prompt once, then one
    token a step; when the cache is full, keep the newest half of the context and
    re-read it in one pass (positions restart at 0)."""
    window = model.config.block_size
    while True:
        logits = steps.prefill(context, model.new_cache(window))
        for _ in range(window - context.shape[1]):
            token = yield logits
            context = torch.cat([context, token], dim=1)
            logits = steps.step(token)
        token = yield logits
        context = torch.cat([context, token], dim=1)[:, -(window // 2 or 1):]


def _decode_rolling(context, steps: CachedSteps, cache: KVCache):
    """A cache that rolls (a windowed model with relative positions, or a stream):
    the prompt read once, then one token a step, for ever."""
    token = yield steps.prefill(context, cache)
    while True:
        token = yield steps.step(token)


def _decode_streaming(model, context, steps: CachedSteps, sinks: int, stream_window: int):
    """StreamingLLM (arXiv:2309.17453): a rolling cache of the first `sinks` tokens and
    the newest `stream_window` (by default (block_size - sinks) // 2, so renumbered
    positions stay inside the context), for any model."""
    window = stream_window or max(1, (model.config.block_size - sinks) // 2)
    return _decode_rolling(context, steps, stream_cache(model, window, sinks))


# A model's static cache and recorded step, kept for its next generate call: recording a
# step costs as much as decoding dozens of tokens. Weak keys, so a dropped model takes its
# graph with it; outside the module, so copying a model never copies a CUDA graph. What
# is kept holds batch x block_size keys and values a layer until then.
_KEPT_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _hooked(model: nn.Module) -> bool:
    """Whether Python runs at a forward (a tool's hooks): a recorded graph would skip it."""
    return bool(nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks
                or any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()))


class CachedSteps:
    """One token at a time after a prefill, as `decode` says: through the growing cache
    itself (`cache`), through a preallocated copy of it stepped by tensors alone
    (`static`), or that step replayed as a CUDA graph (`graph`). The static cache and the
    graph are made once and reloaded after every prefill, and kept for the model's next
    call while its weights stay where they are (same tensors, in place updates
    included) and no hook is set."""

    def __init__(self, model, decode: str, batch: int):
        self.model, self.decode, self.batch = model, decode, batch
        self.cache = self.static = self.graph = self.key = None

    def _key(self):
        if _hooked(self.model):
            return None
        tensors = [*self.model.parameters(), *self.model.buffers()]
        device = tensors[0].device.type if tensors else "cpu"
        # What decides the cache's dtype and kind of tensors beside the weights themselves.
        precision = (torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device),
                     torch.is_inference_mode_enabled())
        return (self.decode, self.batch, self.model.training, precision,
                tuple((t.data_ptr(), t.dtype, t.device) for t in tensors))

    def prefill(self, context: torch.Tensor, cache: KVCache) -> torch.Tensor:
        self.cache = cache
        logits = self.model(context, cache=cache).logits
        if self.decode != "cache":
            if self.static is None:
                # Taken out while in use, so a second call at the same time makes its own.
                self.key, kept = self._key(), _KEPT_STEPS.pop(self.model, None)
                if self.key is not None and kept is not None and kept[0] == self.key:
                    self.static, self.graph = kept[1], kept[2]
                else:
                    del kept                                # its memory goes before a new one
                    self.static = static_cache(self.model, self.model.config.block_size)
            self.static.load(cache)
            if self.decode == "graph" and self.graph is None:
                self.graph = CapturedStep(self.model, self.static, self.batch)
        return logits

    def release(self) -> None:
        """Keep the static cache and the recorded step for the model's next call."""
        if self.static is not None and self.key is not None:
            _KEPT_STEPS[self.model] = (self.key, self.static, self.graph)

    def step(self, token: torch.Tensor) -> torch.Tensor:
        if self.graph is not None:
            return self.graph(token).clone()      # the graph's output is overwritten next step
        return self.model(token, cache=self.static if self.static is not None else self.cache).logits
