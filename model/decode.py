"""Generation: one token at a time from a model, and the caches that make a step cheap.

The model (model/gpt.py) exposes what decoding needs: a forward pass that reads and
advances a cache, and `new_cache`. Everything else lives here: how earlier tokens are
kept (`DECODERS`: re-read in full, a growing cache, a preallocated static cache, or that
static step recorded as a CUDA graph), what happens when the context fills up, and
StreamingLLM's rolling cache (arXiv:2309.17453), and self-speculative decoding with the
model's own multi-token prediction module (`mtp`, DeepSeek-V3)."""
from __future__ import annotations

import weakref
from typing import Iterator

import torch
import torch.nn as nn

from model.cache import CapturedStep, KVCache, StaticKVCache
from model.config import ModelError
from model.mechanisms import MECHANISMS
from model.layers import layer_names
from model.positions import POSITION_ENCODINGS
from model.sampling import next_token_distribution, sample_next

# How generate keeps earlier tokens: none, a growing cache, a static one, a CUDA graph;
# or a growing cache that checks two tokens a pass, the second drafted by the model's
# multi-token prediction module.
DECODERS = ("full", "cache", "static", "graph", "mtp")


def static_cache(model, max_len: int) -> StaticKVCache:
    """A preallocated cache for `model`, stepped by tensors alone."""
    return StaticKVCache(model.config.n_layer, max_len, model.kept_window(), model.config.n_global)


def stream_cache(model, window: int, sinks: int) -> KVCache:
    """A rolling cache of the first `sinks` tokens and the newest `window`, renumbered
    as it rolls (StreamingLLM, arXiv:2309.17453), for any model, windowed or not."""
    return KVCache(model.config.n_layer, window, window, sinks, shift=model.positions.shift)


def prompt_read(model, prompt_len: int, decode: str, sinks: int | None) -> int:
    """How many of a prompt's last tokens generation reads (_generate): every one where a
    rolling cache or sinks stream past the context, otherwise at most block_size."""
    if decode != "full" and (sinks is not None or decodes_with_rolling_cache(model)):
        return prompt_len
    return min(prompt_len, model.config.block_size)


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
    arXiv:2309.17453); sinks=0 keeps the window alone. It needs keys that can be
    renumbered (relative positions, or none: check_sinks refuses learned and sinusoidal
    ones) and decodes from the growing cache whatever `decode` says. `forced` (B, N) tokens are fed instead of sampled
    (teacher forcing), so `on_step` sees the logits the model gives a known text."""
    model.check_generates()
    check_request(idx, max_new_tokens, temperature, top_k, top_p)
    if decode == "mtp" and use_cache:
        check_speculation(model, sinks, forced)
    decode = decode_mode(model, decode, use_cache, sinks, idx.device)
    if decode == "mtp":
        return _generate_speculative(model, idx, max_new_tokens, temperature, top_k, top_p,
                                     generator, on_step)
    return _generate(model, idx, max_new_tokens, temperature, top_k, top_p, generator,
                     on_step, decode, sinks, stream_window, forced)


def check_request(idx, max_new_tokens, temperature, top_k, top_p) -> None:
    """ModelError, saying what to give, for a prompt or sampling setting that cannot be
    honoured (the Python API meets no command-line parser: a negative temperature was
    taken as greedy, an empty prompt failed deep in the first step)."""
    if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.shape[1] == 0:
        shape = tuple(idx.shape) if isinstance(idx, torch.Tensor) else type(idx).__name__
        raise ModelError(f"the prompt must be token ids of shape (batch, length) with at least "
                         f"one token, got {shape}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ModelError(f"max_new_tokens must be a whole number, 0 or more, got {max_new_tokens!r}")
    if not 0 <= temperature < float("inf"):
        raise ModelError(f"temperature must be 0 (always the likeliest token) or more, "
                         f"got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ModelError(f"top_k must be a whole number, 0 (off) or more, got {top_k!r}")
    if not 0 < top_p <= 1:
        raise ModelError(f"top_p must be more than 0 and at most 1 (1: off), got {top_p!r}")


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
                         "state already reads past the context; sample without sinks (--sinks=0)")
    if POSITION_ENCODINGS[config.position].absolute:
        # The position went into each token's input and so into every layer's keys; no
        # shift can take it back out, and the kept keys would keep positions past the
        # new queries'.
        raise ModelError(f"sinks renumber a rolling cache's keys, and model.position="
                         f"{config.position} adds each token's absolute position to its input, "
                         "where it cannot be renumbered; sample without sinks (--sinks=0): past "
                         "the context the newest half is re-read")
    if config.rope_local_theta:
        raise ModelError("sinks renumber a rolling cache's keys by turning them with the model's "
                         "RoPE, and model.rope_local_theta turns the windowed layers' keys by "
                         "another base; sample without sinks (--sinks=0)")
    for name in names:
        if MECHANISMS[name].stream_refusal:
            raise ModelError(f"sinks renumber a rolling cache's keys, and model.mechanism="
                             f"{name} cannot be renumbered: {MECHANISMS[name].stream_refusal}; "
                             "sample without sinks (--sinks=0)")
    if not 0 <= sinks < window:
        raise ModelError(f"sinks must be between 0 and block_size-1 ({window - 1}), not {sinks}")


def check_speculation(model, sinks, forced) -> None:
    """Why decode="mtp" cannot run here, if it cannot."""
    if getattr(model, "mtp", None) is None:
        raise ModelError("decode='mtp' drafts the token after next with the model's multi-token "
                         "prediction module, and this model has none (model.mtp_depth=0); "
                         "train one with --model.mtp_depth=1, or use decode='cache'")
    if sinks is not None or forced is not None:
        raise ModelError("decode='mtp' drafts tokens and checks them in a growing cache; "
                         + ("sinks stream from a rolling one" if sinks is not None
                            else "forced tokens are fed, not drafted")
                         + ": use decode='cache' with them")
    config = model.config
    for name in layer_names(config):
        if MECHANISMS[name].cache.fixed(config):
            raise ModelError(f"decode='mtp' takes a rejected draft back out of the cache, and "
                             f"model.mechanism={name} folds every token into a fixed-size "
                             "state that cannot give one back; use decode='cache'")
    if config.token_mix:
        raise ModelError("decode='mtp' takes a rejected draft back out of the cache, and "
                         "model.token_mix keeps the newest rows, which cannot give one back; "
                         "use decode='cache'")


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


def speculative_pick(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor,
                     generator: torch.Generator | None):
    """Speculative sampling's rule for one drafted token (Leviathan et al., arXiv:2211.17192,
    algorithm 1; Chen et al., arXiv:2302.01318): keep the draft d, drawn from q, with
    probability min(1, p(d)/q(d)); else draw from the residual max(0, p - q), normalised.
    The token is then distributed as p, whatever q is: P(d kept) = min(q(d), p(d)), and the
    residual holds exactly the rest of p. p, q (B, V); draft (B, 1). Returns the token
    (B, 1) and whether the draft was kept (B,)."""
    p_draft, q_draft = p.gather(-1, draft), q.gather(-1, draft)
    u = torch.rand(p_draft.shape, generator=generator, device=p.device)
    kept = u * q_draft < p_draft                     # u < p/q, with q(d) > 0 as d was drawn
    residual = (p - q).clamp_min(0)
    # Where p = q nothing is left over, and such a draft is always kept anyway.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
    other = torch.multinomial(residual / residual.sum(-1, keepdim=True), 1, generator=generator)
    return torch.where(kept, draft, other), kept[:, 0]


def _check_draft(logits, q_logits, draft, temperature, top_k, top_p, generator):
    """The token at the draft's place (B, 1) and whether the draft stood (B,). Greedy: the
    draft stands when it is the arg-max, which is then the token, as plain decoding's."""
    if temperature == 0:
        token = sample_next(logits.float(), 0)
        return token, (token == draft)[:, 0]
    chances = [next_token_distribution(x.float(), temperature, top_k, top_p)
               for x in (logits, q_logits)]
    return speculative_pick(*chances, draft, generator)


@torch.no_grad()
def _generate_speculative(model, idx, max_new_tokens, temperature, top_k, top_p, generator,
                          on_step):
    """decode="mtp": the first max_new_tokens of _speculate, each shown to on_step."""
    steps = _speculate(model, idx, temperature, top_k, top_p, generator)
    for _ in range(max_new_tokens):
        logits, token = next(steps)
        if on_step is not None:
            on_step(logits, token)
        yield token
    steps.close()


def _speculate(model, context, temperature, top_k, top_p, generator):
    """Self-speculative decoding with the model's multi-token prediction module (DeepSeek-V3,
    arXiv:2412.19437, section 5.4.3): each pass of the main model reads the token it last
    chose and the module's draft of the one after it, two tokens through the cache. The
    pass's first logits decide whether the draft stands (speculative_pick); if it does, the
    second logits give one more token free, and two tokens come from one pass; if not, the
    draft's keys leave the cache and the pass gave one. The module's own cache runs behind
    the main one: a position enters it once the token after it is settled, so it never
    takes anything back. Yields (last-position logits (B, V), token (B, 1)) for ever.

    In a batch a draft stands only when it stands in every row (the rows share one cache
    length); a row whose draft stood still emits it, a token drawn as the rule says. The
    context limit is plain decoding's: a model with a rolling cache never fills up; another
    re-reads the newest half of its context when the cache is full, and a pass that would
    overfill it steps one token instead, so each token is drawn from the logits plain
    decoding draws it from and greedy decoding gives plain greedy decoding's tokens."""
    mtp, window = model.mtp, model.config.block_size
    mtp.drafted = mtp.accepted = 0

    def draw(logits):                                  # plain decoding's draw
        return sample_next(logits.float(), temperature, top_k, top_p, generator)

    rolling = decodes_with_rolling_cache(model)
    context = context[:, -window:]
    while True:
        cache, behind = model.new_cache(window), mtp.new_cache(model, window)
        out = model(context, cache=cache)
        token = draw(out.logits[:, -1])
        yield out.logits[:, -1].float(), token
        # The module's next input: each position's state and the token after it.
        hidden, ahead = out.hidden, torch.cat([context[:, 1:], token], dim=1)
        context = torch.cat([context, token], dim=1)
        while rolling or cache.length + 2 <= window:
            q_logits = mtp.depth(model, 0, hidden, ahead, behind)[1][:, -1]
            draft = draw(q_logits)
            out = model(torch.cat([token, draft], dim=1), cache=cache)   # (B, 2, V) logits
            logits = out.logits.float()
            token, kept = _check_draft(logits[:, 0], q_logits, draft, temperature, top_k, top_p,
                                       generator)
            mtp.drafted += kept.numel()
            mtp.accepted += int(kept.sum())
            yield logits[:, 0], token
            if kept.all():
                second = draw(logits[:, 1])
                yield logits[:, 1], second
                hidden, ahead = out.hidden, torch.cat([token, second], dim=1)
                token = second
            else:
                cache.truncate(1)                          # the draft was not the token
                hidden, ahead = out.hidden[:, :1], token
            if not rolling:
                context = torch.cat([context, ahead], dim=1)
        while cache.length < window:                       # no room to check a draft
            logits = model(token, cache=cache).logits[:, -1].float()
            token = draw(logits)
            yield logits, token
            context = torch.cat([context, token], dim=1)
        context = context[:, -(window // 2 or 1):]        # full: re-read the newest half


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


def default_stream_window(config, sinks: int) -> int:
    """The newest tokens a stream keeps beside `sinks` by default: (block_size - sinks) // 2,
    so the renumbered positions (sinks + 2·window at most) stay inside the context."""
    return max(1, (config.block_size - sinks) // 2)


def _decode_streaming(model, context, steps: CachedSteps, sinks: int, window: int):
    """StreamingLLM (arXiv:2309.17453): a rolling cache of the first `sinks` tokens and
    the newest `window` (by default default_stream_window's), for a model whose keys can
    be renumbered (check_sinks)."""
    window = window or default_stream_window(model.config, sinks)
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
