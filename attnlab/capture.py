"""The one way every tool reads what happens inside a model: one forward pass, and the
activations asked for, by a readable name.

    from attnlab.capture import run_with_cache, attention
    logits, cache = run_with_cache(model, tokens)
    cache["blocks.1.pattern"]           # (B, H, T, T) attention weights of layer 1
    maps = attention(model, tokens)     # [layer] -> (B, H, T, T), the patterns alone

Names, for each layer l (B batch, T tokens, H heads, D = d_k, C = n_embd):
  blocks.l.resid_pre   (B, T, C)     the residual stream entering the block
  blocks.l.q / .k / .v (B, H|H_kv, T, D)   queries, keys (positions applied) and values
  blocks.l.pattern     (B, H, T, T)  attention weights (from the eager path: every backend;
                                     differential attention's is its difference map)
  blocks.l.z           (B, T, H, D)  each head's output, before W_O mixes the heads
  blocks.l.attn_out    (B, T, C)     the attention sublayer's output (after W_O)
  blocks.l.mlp_out     (B, T, C)     the MLP sublayer's output
  blocks.l.resid_post  (B, T, C)     the residual stream leaving the block
and, where a layer has the piece (the model-card mechanisms and the experts):
  blocks.l.sink        (B, H, T)     the weight each query's row gives its head's learned sink
                                     (model.mechanism=sinks): 1 - the row's sum over the keys
  blocks.l.gate        (B, T, H)     each head's gate openness per token, the mean of
                                     σ(x·W_G) over its d_k channels (model.mechanism=gated)
  blocks.l.index       (B, T, T)     the lightning indexer's scores I_{t,s} (model.mechanism=
                                     sparse), -inf where the mask hides the key
  blocks.l.chosen      (B, T, T)     True at the keys the indexer chose for each query (and
                                     the mask lets it see): the only keys its softmax reads
  blocks.l.full_pattern (B, H, T, T) the softmax over every visible key that the same q and k
                                     give: what dense attention would weigh
  blocks.l.experts     (B, T, k)     the routed experts each token went to, heaviest first
                                     (model.mlp=moe), and blocks.l.expert_weights (B, T, k) their
                                     gate weights
and final_norm (B, T, C), the last residual stream after the final norm, whose product
with the output layer is the logits. In a model with model.value_embeds, `v` is x·W_V
with the token's value embedding added (what the weighted sum uses); with
model.skip_connections, a late block's resid_pre includes the skip from its mirror
block (so it is not the previous resid_post). A layer whose mechanism has no weights
(or no q/k/v reading point, or no W_O) has no pattern (q, k, v, z): layer_reads says which.

Everything is read with forward hooks on the model's own modules and removed
afterwards; q, k and v come from the attention module's reading point (hook_qkv, a
function set on that one layer while capturing and deleted afterwards), so they are what
the softmax used, QK-norm and positions included, and a model no tool reads runs nothing
for it. What a piece decides inside its
own forward (the indexer's choice, the router's) is read by wrapping that method of the
one module while capturing (the instance's attribute, deleted afterwards), so the
record is the model's own decision, not a second computation of it. attnlab/lens.py switches parts
off and swaps them between prompts with the same hooks.
"""
from __future__ import annotations

import math
import sys
from contextlib import contextmanager
from typing import Iterable

import torch
import torch.nn.functional as F

from attnlab.plotting import WEIGHT
from common.errors import AttnlabError
from model.mechanisms import MECHANISMS, names_used

from model.layers import layer_names, mechanisms_of
PER_LAYER = ("resid_pre", "q", "k", "v", "pattern", "z", "attn_out", "mlp_out", "resid_post")
# What the model-card pieces add, read only where a layer has the piece (pieces_of).
PIECES = ("sink", "gate", "index", "chosen", "full_pattern", "experts", "expert_weights")


def pieces_of(model, layer: int) -> tuple[str, ...]:
    """The names of PIECES that layer `layer` has, known by the parts each piece brings:
    a learned sink logit per head, a gate matrix W_G, an indexer that selects keys, a
    router that sends tokens to experts."""
    block = model.blocks[layer]
    attn, mlp = block.attn, block.mlp
    has = set()
    if isinstance(getattr(attn, "sinks", None), torch.nn.Parameter):
        has.add("sink")
    if isinstance(getattr(attn, "w_gate", None), torch.nn.Linear):
        has.add("gate")
    if getattr(attn, "selects_keys", False):
        has |= {"index", "chosen", "full_pattern"}
    if getattr(mlp, "routes_tokens", False):
        has |= {"experts", "expert_weights"}
    return tuple(n for n in PIECES if n in has)


def layer_reads(model, layer: int) -> tuple[str, ...]:
    """The names of PER_LAYER that layer `layer` has: a mechanism without attention
    weights (its entry's no_weights) has no pattern, one without a q, k, v reading point or
    an output matrix W_O has no q, k, v or z, an attention-only block no mlp_out."""
    attn = model.blocks[layer].attn
    missing = set() if mechanisms_of(model.config)[layer].no_weights is None else {"pattern"}
    missing |= set() if hasattr(attn, "hook_qkv") else {"q", "k", "v"}
    missing |= set() if hasattr(attn, "w_o") else {"z"}
    missing |= set() if model.blocks[layer].mlp is not None else {"mlp_out"}   # model.mlp=none
    return tuple(n for n in PER_LAYER if n not in missing) + pieces_of(model, layer)


def names(model) -> list[str]:
    """Every name run_with_cache fills, in the order the forward pass meets them."""
    return [f"blocks.{l}.{n}" for l in range(model.config.n_layer)
            for n in layer_reads(model, l)] + ["final_norm"]


def no_weights(config) -> str | None:
    """Why a model has no attention weights to draw (its mechanisms' own reason, with
    the layers it applies to), or None when every layer has them."""
    for name, m in ((n, MECHANISMS[n]) for n in names_used(config)):
        if m.no_weights is not None:
            return f"model.mechanism={name} has no attention weights to draw: {m.no_weights}"
    return None


def weightless_layers(config) -> dict[int, str]:
    """Each layer whose mechanism has no attention weights to draw, and why in its entry's
    words: in a hybrid (model.mechanism=deltanet,mha) the mha layers still have them."""
    return {i: f"layer {i} is model.mechanism={name}, which has no attention weights to "
               f"draw: {MECHANISMS[name].no_weights}"
            for i, name in enumerate(layer_names(config)) if MECHANISMS[name].no_weights is not None}


def not_distributions(config) -> dict[int, str]:
    """Each layer whose weights are no distribution (a row need not sum to 1, and may go
    below 0, as differential attention's difference of two maps), and its mechanism."""
    return {i: name for i, name in enumerate(layer_names(config))
            if MECHANISMS[name].no_weights is None and not MECHANISMS[name].weights_sum_to_one}


def weight_label(config, layers=None) -> str:
    """The colour bar's words for the maps of `layers` (every layer by default): a row
    sums to 1 only where every drawn layer's mechanism makes a distribution."""
    others = ", ".join(dict.fromkeys(name for layer, name in not_distributions(config).items()
                                     if layers is None or layer in layers))
    return (f"attention weight (rows of model.mechanism={others} need not sum to 1)"
            if others else WEIGHT)


def _hooks_for(model, cache: dict, only: set[str] | None):
    """(module, kind, hook) triples that fill `cache` with the activations named."""
    want = (lambda n: True) if only is None else only.__contains__
    c = model.config
    out = []
    for layer, block in enumerate(model.blocks):
        p = f"blocks.{layer}."

        def block_pre(module, args, p=p):
            if want(p + "resid_pre"):
                cache[p + "resid_pre"] = args[0].detach()

        def block_post(module, args, output, p=p):
            if want(p + "resid_post"):
                cache[p + "resid_post"] = output[0].detach()
            if want(p + "pattern") and output[1] is not None:
                cache[p + "pattern"] = output[1].detach()

        def attn_post(module, args, output, p=p):
            if want(p + "attn_out"):
                cache[p + "attn_out"] = output[0].detach()

        def read_qkv(q, k, v, p=p):
            for name, t in zip("qkv", (q, k, v)):
                if want(p + name):
                    cache[p + name] = t.detach()
            return q, k, v

        def w_o_pre(module, args, p=p, H=c.n_head, D=c.head_dim):
            if want(p + "z"):
                B, T, _ = args[0].shape
                cache[p + "z"] = args[0].detach().view(B, T, H, D)

        def mlp_post(module, args, output, p=p):
            if want(p + "mlp_out"):
                cache[p + "mlp_out"] = output.detach()

        has = layer_reads(model, layer)
        out += _piece_hooks(block, p, has, want, cache)
        out += [(block, "pre", block_pre), (block, "post", block_post),
                (block.attn, "post", attn_post),
                *([(block.attn, "set:hook_qkv", read_qkv)] if "q" in has else []),
                *([(block.attn.w_o, "pre", w_o_pre)] if "z" in has else []),
                *([(block.mlp, "post", mlp_post)] if "mlp_out" in has else [])]

    def final(module, args, output):
        if want("final_norm"):                 # a post-norm stack's last block hands it on
            cache["final_norm"] = (output[0] if isinstance(output, tuple) else output).detach()
    out.append((model.norm_f if model.norm_f is not None else model.blocks[-1], "post", final))
    return out


def _piece_hooks(block, p: str, has, want, cache: dict):
    """The hooks that read what layer `block`'s pieces add (PIECES), as _hooks_for's."""
    attn, out = block.attn, []
    if "sink" in has:
        def sink(module, args, output):
            # The sink's column is dropped from the weights handed back, so what a row
            # misses of 1 is exactly the sink's share of its softmax.
            if want(p + "sink") and output[1] is not None:
                cache[p + "sink"] = 1 - output[1].float().sum(-1)           # (B, H, T)
        out.append((attn, "post", sink))
    if "gate" in has:
        def gate(module, args):        # returns None: a pre-hook's value would replace args
            if want(p + "gate"):
                cache[p + "gate"] = gate_openness(module, args[0])
        out.append((attn, "pre", gate))
    if "chosen" in has:
        def select(args, chosen, module=attn):
            index, visible = args[0], args[1]                               # (B, Tq, Tk), mask
            if want(p + "index"):
                cache[p + "index"] = index.float().masked_fill(~visible[:, 0], float("-inf"))
            if want(p + "chosen"):
                picked = torch.zeros_like(index, dtype=torch.bool).scatter(-1, chosen[:, 0], True)
                cache[p + "chosen"] = picked & visible[:, 0]                 # (B, Tq, Tk)
            if want(p + "full_pattern"):
                cache["_visible" + p] = visible

        def masked(args, result, module=attn):
            q, k, mask = args[0], args[1], args[3]
            if want(p + "full_pattern"):
                k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)    # GQA: one per group
                # The layer's own scaling (√d_k, ALiBi's bias), every visible key kept.
                scores = module.scaled(q.float() @ k.float().transpose(-2, -1), mask)
                visible = cache.pop("_visible" + p)
                cache[p + "full_pattern"] = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
        out += [(attn, "method:select", select), (attn, "method:masked", masked)]
    if "experts" in has:
        routed = {}

        def route(args, result):
            routed["last"] = result                                         # (N, k) each

        def mlp_post(module, args, output):
            if "last" not in routed:
                # The learner's moe_layer (exercise 11) routes inside itself; the project's
                # router, which the checker found it equal to, names the same experts.
                module.route(args[0].reshape(-1, args[0].shape[-1]))
            weights, chosen = routed.pop("last")
            B, T = args[0].shape[:2]
            order = weights.argsort(dim=-1, descending=True, stable=True)   # heaviest first
            if want(p + "experts"):
                cache[p + "experts"] = chosen.gather(-1, order).view(B, T, -1)
            if want(p + "expert_weights"):
                cache[p + "expert_weights"] = weights.gather(-1, order).float().view(B, T, -1)
        out += [(block.mlp, "method:route", route), (block.mlp, "post", mlp_post)]
    return out


def gate_openness(attn, x: torch.Tensor) -> torch.Tensor:
    """Each head's mean σ(x·W_G), (B, T, H), from the layer's input and W_G: the learner's
    gate (exercise 12) takes W_G as a matrix and never calls w_gate, so no hook on w_gate
    would see it."""
    B, T, C = x.shape
    w, b = attn.w_gate.weight.float(), attn.w_gate.bias
    opened = torch.sigmoid(F.linear(x.float(), w, None if b is None else b.float()))
    return opened.view(B, T, attn.n_head, C // attn.n_head).mean(-1)


@contextmanager
def installed(hooks):
    """Forward hooks, as (module, "pre" | "post", function) triples, set while inside
    the block and removed however it is left. A kind "method:NAME" wraps the module's
    method NAME for the while: function(args, result) sees each call's arguments and
    result, and the wrapper (an attribute of that one module) is deleted afterwards. A
    kind "set:NAME" sets the module's attribute NAME to the function for the while (a
    reading point the module calls where it is set: hook_qkv)."""
    handles, wrapped = [], []
    try:
        for module, kind, fn in hooks:
            if kind.startswith("set:"):          # an attribute the module calls where set
                object.__setattr__(module, kind.removeprefix("set:"), fn)
                wrapped.append((module, kind.removeprefix("set:")))
                continue
            if kind.startswith("method:"):
                name = kind.removeprefix("method:")
                own = getattr(module, name)

                def call(*args, own=own, fn=fn):
                    result = own(*args)
                    replaced = fn(args, result)
                    return result if replaced is None else replaced
                object.__setattr__(module, name, call)
                wrapped.append((module, name))
                continue
            register = module.register_forward_pre_hook if kind == "pre" else module.register_forward_hook
            handles.append(register(fn))
        yield
    finally:
        for h in handles:
            h.remove()
        for module, name in wrapped:
            object.__delattr__(module, name)


@torch.no_grad()
def run_with_cache(model, tokens: torch.Tensor, only: Iterable[str] | None = None, **inputs):
    """(logits, {name: activation}) for one forward pass over `tokens` (B, T). With
    `only`, just those are kept. Attention patterns come from the eager path, so they
    exist for every backend; asking for none of them keeps the model's own backend.
    `inputs` go to the model as they are (attention_mask for a padded batch, token_types).
    An encoder without an output layer gives logits None."""
    wanted = None if only is None else set(only)
    unknown = set() if wanted is None else wanted - set(names(model))
    if unknown:
        raise AttnlabError(f"no activation named {sorted(unknown)[0]!r}; see attnlab.capture.names(model)")
    # The sink's share is read from the weights, so it asks for them too.
    need_weights = wanted is None or any(n.endswith((".pattern", ".sink")) for n in wanted)
    cache: dict = {}
    with installed(_hooks_for(model, cache, wanted)):
        logits = model(tokens, return_attention=need_weights, **inputs).logits
    return logits, cache


def attention(model, tokens: torch.Tensor, per_layer: bool = False,
              **inputs) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """(logits, [layer] -> (B, H, T, T) attention weights) for `tokens` (B, T); refused
    in one line for a model whose mechanism has none. With per_layer, a hybrid's layers
    without weights (weightless_layers) read None, and only a model with none is refused."""
    reason = no_weights(model.config)
    skipped = weightless_layers(model.config) if per_layer and reason else {}
    if reason and (not per_layer or len(skipped) == model.config.n_layer):
        raise AttnlabError(reason)
    wanted = [f"blocks.{l}.pattern" for l in range(model.config.n_layer) if l not in skipped]
    logits, cache = run_with_cache(model, tokens, only=wanted, **inputs)
    return logits, [cache.get(f"blocks.{l}.pattern") for l in range(model.config.n_layer)]


# The most bytes of attention weights a text past the model's context may take.
MAPS_BYTES = 1 << 30


def check_context(model, n_tokens: int, option: str = "--text") -> None:
    """A text longer than the context the model was trained with: refused where its
    positions end there (a learned table has no row past it), one warning line where
    they go on (RoPE, ALiBi, sinusoidal or none) to lengths it never saw. The refusal
    names `option`, the command-line option the text came from."""
    limit = model.config.block_size
    if n_tokens <= limit:
        return
    if model.positions.has_length_limit:
        raise AttnlabError(f"the text is {n_tokens} tokens; this model reads at most {limit} "
                           f"(its learned positions end there): give a shorter {option}")
    # Past the context the tools keep every head's (T, T) weights of every layer: the
    # length is bounded by what those take, not left to the text (a page of it took 81 GB).
    c = model.config
    longest = max(limit, math.isqrt(MAPS_BYTES // (4 * c.n_layer * c.n_head)))
    if n_tokens > longest:
        raise AttnlabError(f"the text is {n_tokens:,} tokens, past this model's context of "
                           f"{limit:,}; the study tools keep every head's weights over the whole "
                           f"text, and read at most {longest:,} tokens of this model: give a "
                           f"shorter {option}")
    print(f"warning: the text is {n_tokens} tokens, past the {limit} this model was trained on; "
          f"its {model.config.position} positions go on, but it never saw such lengths",
          file=sys.stderr)


def other_paths(config, so: str = "the weights show attention's share of what moves "
                                   "between positions, not all of it") -> str | None:
    """What looking at attention leaves out, in a sentence: with model.token_mix, each
    token is mixed with its neighbours before attention, so a token draws on the ones just
    before it through that mix as well as through the weights a heatmap shows. `so` says
    what that means for the tool at hand."""
    if config.token_mix > 1:
        return (f"each token is also mixed with the {config.token_mix - 1} before it ahead of "
                f"attention (model.token_mix={config.token_mix}): {so}")
    return None


def attention_maps(model, tokenizer, text: str, per_layer: bool = False):
    """(token strings, [layer] -> (heads, T, T) weights on the CPU) for one text; with
    per_layer, None for a hybrid's layers without weights (as attention())."""
    if not text:
        raise AttnlabError("give some text to look at with --text")
    ids = tokenizer.encode(text)
    check_context(model, len(ids))
    idx = torch.tensor([ids], device=next(model.parameters()).device)
    _, maps = attention(model, idx, per_layer)
    return tokenizer.token_strings(ids), [None if m is None else m[0].float().cpu() for m in maps]
