"""KV caches: the keys and values of earlier tokens, kept so that decoding a new token
computes only that token's query, key and value (the article's cost of attention at
generation time: one row of Q·Kᵀ per step instead of the whole triangle).

* `KVCache` grows as tokens come and hands each layer exactly the keys it has, so
  no step looks at an empty slot. It suits CPUs and any chunk length.
* `StaticKVCache` preallocates every buffer once and decodes one token per step with
  tensors only: the position of the step lives on the device, empty slots are hidden
  by the same mask rule as everything else. Nothing in a step depends on a Python
  value that changes between steps, so the step can be recorded once as a CUDA graph
  (`CapturedStep`) and replayed: one launch instead of ~100 small kernels per token,
  which is what bounds batch-1 decoding of a small model on a GPU.

What a layer keeps is its mechanism's (model/mechanisms.py, `Cache`): tensors that grow
with the text, written by `update` (keys and values; a latent has two of its own
shapes), or a fixed-size recurrent state, read by `state` and written by `keep`. Each
layer has its own buffers, so a hybrid's layers keep different things side by side.
"""
from __future__ import annotations

import torch

from model.attention import Mask


class KVCache:
    """Keys and values of the tokens seen so far, per layer, so that decoding a new
    token computes only its own query, key and value.

    The model, not a layer, does the bookkeeping: `begin(T)` before the layers says
    which key positions the next T tokens will attend to, each layer's `update` writes
    its keys and values, and `end(T)` advances. Without a window the buffer holds every
    token up to `max_len`. With a sliding window W it is a rolling buffer: it keeps the
    n_global first tokens and the newest W-1, which is all a future query can see, so
    its memory stays bounded by n_global + 2·W however long generation runs.

    Given `shift(k, delta)` (the position encoding's), it also renumbers what it keeps,
    as StreamingLLM does (arXiv:2309.17453): the newest tokens move down to follow the
    global ones (their keys turned back by the same offset), so positions stay below
    n_global + 2·W and a model streams far past its context without meeting a distance
    or a position it was never trained on. The first tokens kept then act as attention
    sinks: the place a head puts the weight it has nowhere else to put."""

    def __init__(self, n_layer: int, max_len: int, window: int = 0, n_global: int = 0,
                 shift=None):
        self.n_layer, self.window, self.n_global, self.shift = n_layer, window, n_global, shift
        self.capacity = n_global + 2 * window if window else max_len
        # Per layer, (B, H_kv, capacity, d_k) or whatever its mechanism writes; None until then.
        self.k: list[torch.Tensor | None] = [None] * n_layer
        self.v: list[torch.Tensor | None] = [None] * n_layer
        self.states: dict[int, torch.Tensor] = {}   # per layer, a recurrent state of fixed size
        self.positions = torch.empty(0, dtype=torch.long)   # absolute position of each slot
        self.stored = 0                      # filled slots
        self.length = 0                      # tokens seen: the position of the next one
        self.first = 0                       # the smallest position still stored
        self.tails: dict[int, torch.Tensor] = {}    # per layer, the rows a TokenMix saw last

    def state(self, layer: int) -> torch.Tensor | None:
        """This layer's recurrent state after the tokens seen so far (None before any)."""
        return self.states.get(layer)

    def keep(self, layer: int, state: torch.Tensor) -> None:
        """Store this layer's state after the current chunk."""
        self.states[layer] = state

    def recent(self, layer: int, h: torch.Tensor, n: int) -> torch.Tensor:
        """(B, n + T, C): this chunk's rows h after the n this layer's TokenMix saw before
        it (zeros before the first token, as in training); keeps the newest n for the
        next chunk. Rows, not positions: a renumbering cache leaves them as they are."""
        past = self.tails.get(layer)
        full = torch.cat((h.new_zeros(h.shape[0], n, h.shape[2]) if past is None else past, h), 1)
        self.tails[layer] = full[:, full.shape[1] - n:]
        return full

    def mask(self, T: int, device, **rule) -> Mask:
        """The Mask of a pass of T tokens after the cached ones: queries from the cache's
        length over the keys it holds, under the cache's own window (a streaming cache
        rolls over a model trained without one) and the model's `rule` (causal, ALiBi's
        bias, padding)."""
        k_pos, k_first = self.begin(T, device)
        # after begin: a renumbering cache moves its length
        return Mask(self.length, T, k_pos, k_first, self.window, self.n_global, **rule)

    def begin(self, T: int, device) -> tuple[torch.Tensor, int]:
        """Make room for T new tokens; return the key positions they will see and the
        smallest of them."""
        if self.positions.device != torch.device(device):
            self.positions = self.positions.to(device)
        if self.stored + T > self.capacity:
            if not self.window:
                raise ValueError(f"KV cache holds {self.capacity} tokens; "
                                 f"{self.stored + T} requested")
            self._compact()
            if self.stored + T > self.capacity:          # a long chunk: grow to fit it
                self._grow(self.stored + T)
        new = torch.arange(self.length, self.length + T, device=device)
        self.positions = torch.cat([self.positions[:self.stored], new])
        return self.positions, (self.first if self.stored else self.length)

    def _compact(self) -> None:
        """Keep the global tokens and the newest window-1: the only ones still visible."""
        g = min(self.n_global, self.stored)
        recent = min(self.window - 1, self.stored - g)
        keep = list(range(g)) + list(range(self.stored - recent, self.stored))
        idx = torch.tensor(keep, dtype=torch.long, device=self.positions.device)
        n = len(keep)
        for x in [*self.k, *self.v]:
            if x is not None:
                x[:, :, :n] = x[:, :, idx].clone()
        self.positions = self.positions[idx]
        self.stored = len(keep)
        self.first = 0 if g else self.length - recent
        if self.shift is not None and recent:
            delta = g - int(self.positions[g])       # the newest move down to follow the sinks
            for k in self.k:
                if k is not None:
                    k[:, :, g:self.stored] = self.shift(k[:, :, g:self.stored], delta)
            self.positions[g:] += delta
            self.length += delta
            self.first = int(self.positions[0])

    def _grow(self, capacity: int) -> None:
        def grown(x):
            extra = list(x.shape)
            extra[2] = capacity - self.capacity
            return torch.cat([x, x.new_zeros(extra)], dim=2)
        self.k = [None if x is None else grown(x) for x in self.k]
        self.v = [None if x is None else grown(x) for x in self.v]
        self.capacity = capacity

    def update(self, layer: int, k_new, v_new):
        """Store this chunk's keys/values (B, H_kv, T, ·); return every key/value the
        chunk attends to."""
        if self.k[layer] is None:        # each its own shape: a latent's two parts differ
            self.k[layer] = k_new.new_zeros(*k_new.shape[:2], self.capacity, k_new.shape[3])
            self.v[layer] = v_new.new_zeros(*v_new.shape[:2], self.capacity, v_new.shape[3])
        start, end = self.stored, self.stored + k_new.shape[2]
        self.k[layer][:, :, start:end] = k_new
        self.v[layer][:, :, start:end] = v_new
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def end(self, T: int) -> None:
        self.stored += T
        self.length += T

    def truncate(self, n: int) -> None:
        """Forget the newest n tokens, as though they had never come (a draft the model
        did not confirm, model/decode.py's "mtp"): their slots are written over by the
        next ones. A recurrent state or a token mix's rows fold each token in and cannot
        give one back, so a cache holding either refuses."""
        if self.states or self.tails:
            raise ValueError("this cache holds a recurrent state or a token mix's rows, which "
                             "cannot forget a token")
        if not 0 <= n <= self.stored:
            raise ValueError(f"cannot forget {n} tokens of the {self.stored} this cache holds")
        self.stored -= n
        self.length -= n
        self.positions = self.positions[:self.stored]

    def nbytes(self) -> int:
        return _nbytes([*self.k, *self.v, *self.states.values()])


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


# The position stored in an empty slot: ahead of every query, so the causal rule
# (a key may not be ahead of its query) hides it without a separate "filled" mask.
EMPTY = 2 ** 40


class StaticKVCache:
    """Fixed buffers of `capacity` slots per layer, one token written per step.

    Slot of position p: p itself without a window (capacity max_len); with a window W
    the first n_global positions keep their own slots and the rest share a ring of W
    slots, p -> n_global + (p - n_global) mod W. A query at q sees keys q-W+1..q, W
    consecutive positions and so W different slots; the slot it writes held q-W, the
    one key that just left its window. `slot_pos` holds each slot's position (EMPTY if
    none) and the mask is the rule applied to it, so order in memory never matters.

    Filled from a prefill by `load(cache)` (a KVCache after a whole-prompt forward
    pass), then advanced by the model one token at a time: `begin(1)` writes this
    step's position into its slot, each layer's `update` writes its key and value
    there, `end(1)` moves `length`, a device tensor, on by one. Every write is in place,
    so a recorded CUDA graph keeps pointing at the right memory after a new `load`."""

    def __init__(self, n_layer: int, max_len: int, window: int = 0, n_global: int = 0):
        self.n_layer, self.window, self.n_global = n_layer, window, n_global
        self.capacity = n_global + window if window else max_len
        self.k: list[torch.Tensor | None] = [None] * n_layer    # per layer (B, H_kv, capacity, d_k)
        self.v: list[torch.Tensor | None] = [None] * n_layer
        self.states: dict[int, torch.Tensor] = {}               # per layer, KVCache.state's
        self.slot_pos: torch.Tensor | None = None   # (capacity,) position held by each slot
        self.length: torch.Tensor | None = None     # (1,) the position of the next token
        self._slot: torch.Tensor | None = None
        self.tails: torch.Tensor | None = None      # (n_layer, B, n, C): KVCache.recent's rows

    def slot_of(self, pos: torch.Tensor) -> torch.Tensor:
        if not self.window:
            return pos
        G = self.n_global
        return torch.where(pos < G, pos, G + (pos - G) % self.window)

    def load(self, cache: KVCache) -> None:
        """Take over a prefilled KVCache's keys and values: those a later query can
        still see, each in its slot."""
        n = cache.stored
        pos = cache.positions[:n]
        if self.window:      # the newest W-1 and the global ones; older keys are out of reach
            keep = (pos > cache.length - self.window) | (pos < self.n_global)
        else:
            # A full context is fine: the next step re-reads half of it before writing.
            if cache.length > self.capacity:
                raise ValueError(f"static KV cache holds {self.capacity} tokens; "
                                 f"{cache.length} given")
            keep = torch.ones_like(pos, dtype=torch.bool)
        pos, slots = pos[keep], self.slot_of(pos[keep])
        if self.slot_pos is None:
            device = cache.positions.device
            self.slot_pos = torch.full((self.capacity,), EMPTY, dtype=torch.long, device=device)
            self.length = torch.zeros(1, dtype=torch.long, device=device)
        for layer in range(self.n_layer):
            for mine, theirs in ((self.k, cache.k), (self.v, cache.v)):
                if theirs[layer] is None:
                    continue
                x = theirs[layer][:, :, :n][:, :, keep]
                if mine[layer] is None:
                    mine[layer] = x.new_zeros(*x.shape[:2], self.capacity, x.shape[3])
                elif x.shape[0] != mine[layer].shape[0]:
                    raise ValueError(f"static KV cache was built for batch {mine[layer].shape[0]}, "
                                     f"not {x.shape[0]}")
                mine[layer][:, :, slots] = x
        self.slot_pos.fill_(EMPTY)
        self.slot_pos[slots] = pos
        self.length.fill_(cache.length)
        for layer, state in cache.states.items():     # in place, for a recorded graph
            if layer in self.states:
                self.keep(layer, state)
            else:
                self.states[layer] = state.clone()
        if cache.tails:                           # in place too, for a recorded graph
            tails = torch.stack([cache.tails[i] for i in range(self.n_layer)])
            if self.tails is None:
                self.tails = tails.clone()
            else:
                self.tails.copy_(tails)

    mask = KVCache.mask

    def begin(self, T: int, device) -> tuple[torch.Tensor, int]:
        if T != 1:
            raise ValueError("a static KV cache takes one token per step; prefill a KVCache "
                             "and load() it")
        self._slot = self.slot_of(self.length)
        self.slot_pos.index_copy_(0, self._slot, self.length)
        return self.slot_pos, 0

    def update(self, layer: int, k_new, v_new):
        self.k[layer].index_copy_(2, self._slot, k_new)
        self.v[layer].index_copy_(2, self._slot, v_new)
        return self.k[layer], self.v[layer]

    def state(self, layer: int) -> torch.Tensor | None:
        return self.states.get(layer)

    def keep(self, layer: int, state: torch.Tensor) -> None:
        """Written in place: a recorded graph reads and writes the same memory each step."""
        self.states[layer].copy_(state)

    def recent(self, layer: int, h: torch.Tensor, n: int) -> torch.Tensor:
        """As KVCache.recent, for the one row of a step: fixed shapes, written in place."""
        full = torch.cat((self.tails[layer], h), 1)
        self.tails[layer].copy_(full[:, full.shape[1] - n:])
        return full

    def end(self, T: int) -> None:
        self.length.add_(T)

    def nbytes(self) -> int:
        return _nbytes([*self.k, *self.v, *self.states.values()])

    def snapshot(self) -> tuple:
        return (self.slot_pos.clone(), self.length.clone(),
                None if self.tails is None else self.tails.clone(),
                {layer: s.clone() for layer, s in self.states.items()})

    def restore(self, saved) -> None:
        self.slot_pos.copy_(saved[0])
        self.length.copy_(saved[1])
        if saved[2] is not None:
            self.tails.copy_(saved[2])
        for layer, s in saved[3].items():
            self.states[layer].copy_(s)


class CapturedStep:
    """One decode step of `model` over a loaded StaticKVCache, recorded as a CUDA graph.

    Calling it copies the new tokens into the graph's input, replays every kernel of
    the step in one launch and returns the graph's logits tensor (overwritten by the
    next call). Recording follows torch's recipe: a few warm-up runs on a side stream
    (their writes to the cache are undone; the slot they wrote is the one the next
    real step overwrites before anything reads it), then one run under capture."""

    def __init__(self, model, cache: StaticKVCache, batch: int, warmup: int = 2):
        device = cache.slot_pos.device
        self.token = torch.zeros(batch, 1, dtype=torch.long, device=device)
        saved = cache.snapshot()
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                model(self.token, cache=cache)
                cache.restore(saved)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = model(self.token, cache=cache).logits
        # Recording runs nothing, but keep the cache exactly as it was loaded.
        cache.restore(saved)

    def __call__(self, token: torch.Tensor) -> torch.Tensor:
        self.token.copy_(token)
        self.graph.replay()
        return self.logits
