"""The decoder-only Transformer: embeddings, a stack of blocks, and the output layer
that scores every vocabulary entry as the next token, and generation from it (the KV
caches it decodes with are in model/cache.py)."""
from __future__ import annotations

import weakref
from typing import Iterator, NamedTuple

import torch
import torch.nn as nn

from model.cache import CapturedStep, KVCache, StaticKVCache
from model.registry import check as check_config
from model.config import ModelConfig, ModelError
from model.layers import BLOCKS, NORMS, NoSkips, UNetSkips, token_types, value_embeddings
from model.mask import Mask
from model.mechanisms import layer_names, mechanisms_of
from model.positions import POSITION_ENCODINGS
from model.readout import (READOUTS, AdaptiveReadout, MaskedLMTransform, NoOutputLayer, SoftCap,
                           head_macs)
from model.sampling import sample_next
from torch.overrides import TorchFunctionMode


# How generate keeps earlier tokens: none, a growing cache, a static one, a CUDA graph.
DECODERS = ("full", "cache", "static", "graph")


class Output(NamedTuple):
    logits: torch.Tensor | None              # (B, T, vocab_size); None without an output layer
    loss: torch.Tensor | None                # mean cross-entropy when targets are given
    attentions: list | None                  # per layer (B, H, T, T_keys) when asked for
    hidden: torch.Tensor | None = None       # (B, T, C) the last hidden states, normalised


# What torch.nn's initialisers do: random draws, and (skipped only on the meta device,
# where tensors hold no values) constant fills. A mode sees nn.init's functions
# themselves, and a tensor's own methods.
_DRAWS = {nn.init.normal_, nn.init.uniform_, nn.init.trunc_normal_, nn.init.kaiming_uniform_,
          nn.init.kaiming_normal_, nn.init.xavier_uniform_, nn.init.xavier_normal_,
          nn.init.orthogonal_, torch.Tensor.normal_, torch.Tensor.uniform_}
_FILLS = _DRAWS | {nn.init.zeros_, nn.init.ones_, nn.init.constant_, torch.Tensor.fill_,
                   torch.Tensor.zero_}


class _Unfilled(TorchFunctionMode):
    """Build modules without their initial values: weights that are about to be replaced
    by a checkpoint's are left as allocated (never written, so the pages are never
    touched), and on the meta device nothing runs at all. On meta, torch routes normal_
    through its Python reference, whose first call imports torch._dynamo: seconds and
    ~70 MB for a model that has no values anyway."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")      # nn.init passes it by name
        if isinstance(target, torch.Tensor) and (func in _DRAWS or (func in _FILLS and target.is_meta)):
            return target
        return func(*args, **kwargs)


class GPT(nn.Module):
    @classmethod
    def skeleton(cls, config: ModelConfig) -> "GPT":
        """The model's modules, names and shapes on the meta device: no memory, no values
        and no initialiser run (for sizes, and to check a checkpoint against)."""
        with torch.device("meta"), _Unfilled():
            return cls(config)

    @classmethod
    def unfilled(cls, config: ModelConfig, device="cpu") -> "GPT":
        """The model with its weights allocated but not initialised (the random draws are
        skipped, so their memory is not touched) and every buffer computed: for weights
        that load_state_dict(..., assign=True) is about to replace."""
        with torch.device(device), _Unfilled():
            return cls(config)

    def __init__(self, config: ModelConfig):
        super().__init__()
        check_config(config)
        if config.vocab_size <= 0:
            raise ModelError("model.vocab_size must be set (it comes from the tokenizer)")
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)    # token -> vector
        self.token_types = token_types(config)                       # BERT's segments, or none
        self.positions = POSITION_ENCODINGS[config.position](config)
        block = BLOCKS[config.block]
        # Post-norm blocks (BERT) normalise the embeddings and leave no final norm to do.
        self.norm_emb = NORMS[config.norm](config) if block.norms_embeddings else nn.Identity()
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(block(config, i) for i in range(config.n_layer))
        # Which layers have attention weights to return (their entries' no_weights): a
        # hybrid's mha layers give theirs, its DeltaNet layers give None, not an error.
        self.has_weights = [m.no_weights is None for m in mechanisms_of(config)]
        # The switches of the forward pass, chosen here as modules (or ones that do nothing).
        self.value_embeds = value_embeddings(config)                  # per-token values, or none
        self.skips = UNetSkips(config.n_layer) if config.skip_connections else NoSkips()
        # One weight per skip, from 1: at the start each skip is a plain sum.
        self.register_parameter("skip_weights", nn.Parameter(torch.ones(config.n_layer // 2))
                                if config.skip_connections else None)
        self.norm_f = NORMS[config.norm](config) if block.final_norm else nn.Identity()
        readout = READOUTS[config.readout]
        self.output = readout.output()                               # (h, targets) -> logits, loss
        self.softcap = SoftCap(config.logit_softcap) if config.logit_softcap else nn.Identity()
        if readout.shortlisted:
            self.adaptive = AdaptiveReadout(config)
        elif not readout.scores_tokens:
            self.head_transform, self.lm_head = nn.Identity(), NoOutputLayer()
        else:
            # BERT's masked-LM head puts a dense layer, GELU and a LayerNorm first and
            # gives every vocabulary entry a bias; the plain output layer is one matrix.
            self.head_transform = MaskedLMTransform(config) if readout.transform else nn.Identity()
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=readout.transform)
            if config.tie_embeddings:
                # The same matrix reads tokens in and scores them out (arXiv:1608.05859).
                self.lm_head.weight = self.wte.weight
        if not self.wte.weight.is_meta:      # on the meta device (sizes only) no values exist
            self._init_all(config)

    def _init_all(self, config: ModelConfig):
        self.apply(self._init_weights)
        # GPT-2: scale the layers that write into the residual stream by 1/√(2·n_layer),
        # so the stream's variance does not grow with depth; each mechanism says how its
        # own layer starts (Mechanism.init).
        for block, mechanism in zip(self.blocks, mechanisms_of(config)):
            mechanism.init(block.attn, config)
            if block.mlp.has_weights:
                nn.init.normal_(block.mlp.proj.weight, mean=0.0, std=0.02 / (2 * config.n_layer) ** 0.5)
        if config.zero_head:
            # Every logit 0 at the start: the first steps move the readout towards the
            # tokens' frequencies before any gradient reaches the blocks through it.
            nn.init.zeros_(self.lm_head.weight)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameters, counting a tied matrix once; non_embedding leaves out the
        token and position tables (the usual count for scaling laws) and an adaptive
        readout."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.wte.weight.numel()
            n -= sum(p.numel() for p in self.positions.parameters())
            n -= sum(p.numel() for p in self.value_embeds.parameters())
            if READOUTS[self.config.readout].shortlisted:
                # Left out like the tied readout it replaces: the adaptive softmax exists to
                # make a large vocabulary cheap, not to add capacity to the model.
                n -= sum(p.numel() for p in self.adaptive.parameters())
            # An untied output layer stays in the count (its matmul does work), once: it is
            # already among the parameters.
        return n

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token (forward + backward): 6 per weight that multiplies
        (the output layer included) plus three times each layer's mechanism's own forward
        FLOPs (for softmax attention 4·d·T, the scores and the weighted sum: PaLM's
        12·L·d·T, arXiv:2204.02311, appendix B)."""
        c = self.config
        T = seq_len or c.block_size
        matmul_weights = self.num_params(non_embedding=True)
        if READOUTS[c.readout].shortlisted:
            # the tail counted for the 5% of tokens a 95% shortlist leaves it (the default rule)
            matmul_weights += head_macs(c.n_embd, c.vocab_size, c.readout_shortlist)
        elif c.tie_embeddings:
            matmul_weights += self.lm_head.weight.numel()
        return int(6 * matmul_weights + 3 * sum(m.flops(c, T) for m in mechanisms_of(c)))

    def forward(self, idx, targets=None, cache: KVCache | None = None,
                return_attention: bool = False, attention_mask: torch.Tensor | None = None,
                token_types: torch.Tensor | None = None) -> Output:
        """idx (B, T) token ids; targets (B, T) with -1 where no loss is taken;
        attention_mask (B, T), 1 at real tokens and 0 at padding (a batch of unequal
        lengths: padded keys are hidden from every query); token_types (B, T) the
        segment of each token, for a model with model.n_token_types."""
        B, T = idx.shape
        c = self.config
        window, n_global = c.sliding_window, c.n_global
        if cache is None:
            start, k_pos, k_first = 0, torch.arange(T, device=idx.device), 0
        else:
            k_pos, k_first = cache.begin(T, idx.device)
            start = cache.length                 # after begin: a renumbering cache moves it
            # The cache's own window: a streaming cache rolls over a model trained without one.
            window, n_global = cache.window, cache.n_global
        padding = None if attention_mask is None else attention_mask == 0      # (B, T)
        mask = Mask(q_start=start, q_len=T, k_pos=k_pos, k_first=k_first, window=window,
                    n_global=n_global, bias_fn=self.positions.score_bias(), causal=c.causal,
                    key_padding=padding)
        # Token, then segment, then position, summed in BERT's order (so BERT's weights
        # give BERT's values to the last bit).
        x = self.positions.embed(self.token_types(self.wte(idx), token_types), start)
        x = self.drop(self.norm_emb(x))                              # (B, T, C)
        attentions, saved = [], []
        for i, block in enumerate(self.blocks):
            x = self.skips.join(i, x, saved, self.skip_weights)
            x, weights = block(x, self.positions, mask, cache,
                               return_attention and self.has_weights[i], self.value_embeds(i, idx))
            self.skips.keep(i, x, saved)
            attentions.append(weights)
        if cache is not None:
            cache.end(T)
        h = self.norm_f(x)
        logits, loss = self.output(self, h, targets)
        return Output(logits, loss, attentions if return_attention else None, h)

    def readout(self, h: torch.Tensor) -> torch.Tensor:
        """Scores for every vocabulary entry from final-norm hidden states (B, T, C):
        the output layer alone, for tools that read the residual stream through it."""
        readout = READOUTS[self.config.readout]
        if not readout.scores_tokens:
            raise ModelError("this encoder has no output layer (model.readout=none): its hidden "
                             "states cannot be read as token scores")
        return self.output(self, h, None)[0]

    def new_cache(self, max_len: int) -> KVCache:
        return KVCache(self.config.n_layer, max_len, self.config.sliding_window,
                       self.config.n_global)

    def new_stream_cache(self, window: int, sinks: int) -> KVCache:
        """A rolling cache of the first `sinks` tokens and the newest `window`, renumbered
        as it rolls (StreamingLLM, arXiv:2309.17453), for any model, windowed or not."""
        return KVCache(self.config.n_layer, window, window, sinks, shift=self.positions.shift)

    @property
    def decodes_with_rolling_cache(self) -> bool:
        """A windowed model whose positions are relative (or absent) can decode for
        ever from a rolling cache; learned and sinusoidal positions are absolute."""
        return bool(self.config.sliding_window) and not self.positions.absolute

    def check_generates(self) -> None:
        """ModelError, saying why, for a model that cannot write text token by token."""
        if not self.config.causal:
            raise ModelError("this model is an encoder (model.causal=false): every token sees "
                             "the whole text, the future included, so it cannot write one token "
                             "after another; fill in a [MASK] instead (python -m attnlab.fill)")
        if not READOUTS[self.config.readout].scores_tokens:
            raise ModelError("this model has no output layer (model.readout=none), so it scores "
                             "no tokens and cannot generate")

    def new_static_cache(self, max_len: int) -> StaticKVCache:
        return StaticKVCache(self.config.n_layer, max_len, self.config.sliding_window,
                             self.config.n_global)

    def generate(self, idx, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
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
        self.check_generates()
        return self._generate(idx, max_new_tokens, temperature, top_k, top_p, generator,
                              use_cache, on_step, decode, sinks, stream_window, forced)

    def _decode_mode(self, decode: str, use_cache: bool, sinks: int | None, device) -> str:
        """The decode mode generate runs, after refusing what cannot run, saying why."""
        if decode not in DECODERS:
            raise ModelError(f"decode must be one of {', '.join(DECODERS)}, not {decode!r}")
        if not use_cache:
            decode = "full"
        if decode == "graph" and device.type != "cuda":
            raise ModelError("decode='graph' records a CUDA graph: it needs a CUDA device; "
                             "use 'static' or 'cache' elsewhere")
        if sinks is not None:
            window = self.config.block_size
            if decode == "full":
                raise ModelError("sinks keep keys in a rolling KV cache; use a cache to decode")
            mechanisms = mechanisms_of(self.config)
            if not any(m.cache.per_token(self.config) for m in mechanisms):
                raise ModelError(f"sinks choose which keys a rolling cache keeps, and model."
                                 f"mechanism={self.config.mechanism} keeps no keys: its fixed-size "
                                 "state already reads past the context; sample without sinks")
            for name, mechanism in zip(layer_names(self.config), mechanisms):
                if mechanism.stream_refusal:
                    raise ModelError(f"sinks renumber a rolling cache's keys, and model.mechanism="
                                     f"{name} cannot be renumbered: {mechanism.stream_refusal}")
            if not 0 <= sinks < window:
                raise ModelError(f"sinks must be between 0 and block_size-1 ({window - 1}), not {sinks}")
            decode = "cache"
        return decode

    @torch.no_grad()
    def _generate(self, idx, max_new_tokens, temperature, top_k, top_p, generator, use_cache,
                  on_step, decode, sinks, stream_window, forced):
        decode = self._decode_mode(decode, use_cache, sinks, idx.device)
        if forced is not None:
            max_new_tokens = forced.shape[1]
        window = self.config.block_size
        steps = CachedSteps(self, decode, idx.shape[0])
        if decode == "full":
            logits_of = self._decode_full(idx[:, -window:])
        elif sinks is not None:
            logits_of = self._decode_streaming(idx, steps, sinks, stream_window)
        elif self.decodes_with_rolling_cache:
            logits_of = self._decode_rolling(idx, steps, self.new_cache(window))
        else:
            logits_of = self._decode_reprefill(idx[:, -window:], steps)
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

    def _decode_full(self, context):
        """No cache: every step re-reads the newest block_size tokens, sliding the context
        one token at a time past it."""
        window = self.config.block_size
        while True:
            token = yield self(context[:, -window:]).logits
            context = torch.cat([context, token], dim=1)[:, -window:]

    def _decode_reprefill(self, context, steps: CachedSteps):
        """A growing cache of at most block_size tokens: read the prompt once, then one
        token a step; when the cache is full, keep the newest half of the context and
        re-read it in one pass (positions restart at 0)."""
        window = self.config.block_size
        while True:
            logits = steps.prefill(context, self.new_cache(window))
            for _ in range(window - context.shape[1]):
                token = yield logits
                context = torch.cat([context, token], dim=1)
                logits = steps.step(token)
            token = yield logits
            context = torch.cat([context, token], dim=1)[:, -(window // 2 or 1):]

    def _decode_rolling(self, context, steps: CachedSteps, cache: KVCache):
        """A cache that rolls (a windowed model with relative positions, or a stream):
        the prompt read once, then one token a step, for ever."""
        token = yield steps.prefill(context, cache)
        while True:
            token = yield steps.step(token)

    def _decode_streaming(self, context, steps: CachedSteps, sinks: int, stream_window: int):
        """StreamingLLM (arXiv:2309.17453): a rolling cache of the first `sinks` tokens and
        the newest `stream_window` (by default (block_size - sinks) // 2, so renumbered
        positions stay inside the context), for any model."""
        window = stream_window or max(1, (self.config.block_size - sinks) // 2)
        return self._decode_rolling(context, steps, self.new_stream_cache(window, sinks))


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

    def __init__(self, model: GPT, decode: str, batch: int):
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
                    self.static = self.model.new_static_cache(self.model.config.block_size)
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
