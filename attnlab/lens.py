"""Every intermediate activation of a model by a readable name, and switching parts off
or swapping them between prompts: the next step after attention heatmaps.

    from attnlab.lens import run_with_cache, ablate, patch
    logits, cache = run_with_cache(model, tokens)
    cache["blocks.1.pattern"]           # (B, H, T, T) attention weights of layer 1
    with ablate(model, heads=[(1, 3)]):  # layer 1, head 3 switched off
        loss = model(tokens, targets).loss
    with patch(model, clean_cache, ["blocks.0.resid_post"], positions=[5]):
        logits = model(corrupt_tokens).logits

Names, for each layer l (B batch, T tokens, H heads, D = d_k, C = n_embd):
  blocks.l.resid_pre   (B, T, C)     the residual stream entering the block
  blocks.l.q / .k / .v (B, H|H_kv, T, D)   queries, keys (positions applied) and values
  blocks.l.pattern     (B, H, T, T)  attention weights (from the eager path: every backend)
  blocks.l.z           (B, T, H, D)  each head's output, before W_O mixes the heads
  blocks.l.attn_out    (B, T, C)     the attention sublayer's output (after W_O)
  blocks.l.mlp_out     (B, T, C)     the MLP sublayer's output
  blocks.l.resid_post  (B, T, C)     the residual stream leaving the block
and final_norm (B, T, C), the last residual stream after the final norm, whose product
with the output layer is the logits. In a model with model.value_embeds, `v` is x·W_V
with the token's value embedding added (what the weighted sum uses); with
model.skip_connections, a late block's resid_pre includes the skip from its mirror
block (so it is not the previous resid_post).

Everything is read with forward hooks on the model's own modules and removed
afterwards; q, k and v come from the attention module's identity hook points (hook_q,
hook_k, hook_v), so they are what the softmax used, QK-norm and positions included,
and a model with no hook set runs exactly as before.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable

import torch

from common.errors import AttnlabError


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

        def read(name, p=p):
            def hook(module, args, output):
                if want(p + name):
                    cache[p + name] = output.detach()
            return hook

        def w_o_pre(module, args, p=p, H=c.n_head, D=c.head_dim):
            if want(p + "z"):
                B, T, _ = args[0].shape
                cache[p + "z"] = args[0].detach().view(B, T, H, D)

        def mlp_post(module, args, output, p=p):
            if want(p + "mlp_out"):
                cache[p + "mlp_out"] = output.detach()

        out += [(block, "pre", block_pre), (block, "post", block_post),
                (block.attn, "post", attn_post),
                *((getattr(block.attn, f"hook_{n}"), "post", read(n)) for n in "qkv"),
                (block.attn.w_o, "pre", w_o_pre), (block.mlp, "post", mlp_post)]

    def final(module, args, output):
        if want("final_norm"):
            cache["final_norm"] = output.detach()
    out.append((model.norm_f, "post", final))
    return out


@contextmanager
def _installed(hooks):
    handles = []
    try:
        for module, kind, fn in hooks:
            register = module.register_forward_pre_hook if kind == "pre" else module.register_forward_hook
            handles.append(register(fn))
        yield
    finally:
        for h in handles:
            h.remove()


def names(model) -> list[str]:
    """Every name run_with_cache fills, in the order the forward pass meets them."""
    per_layer = ["resid_pre", "q", "k", "v", "pattern", "z", "attn_out", "mlp_out", "resid_post"]
    return [f"blocks.{l}.{n}" for l in range(model.config.n_layer) for n in per_layer] + ["final_norm"]


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
        raise AttnlabError(f"no activation named {sorted(unknown)[0]!r}; see attnlab.lens.names(model)")
    need_weights = wanted is None or any(n.endswith(".pattern") for n in wanted)
    cache: dict = {}
    with _installed(_hooks_for(model, cache, wanted)):
        logits = model(tokens, return_attention=need_weights, **inputs).logits
    return logits, cache


def _layer_head(model, layer: int, head: int | None = None) -> None:
    c = model.config
    if not 0 <= layer < c.n_layer or (head is not None and not 0 <= head < c.n_head):
        raise AttnlabError(f"this model has layers 0-{c.n_layer - 1} and heads 0-{c.n_head - 1}; "
                           f"got layer {layer}" + (f", head {head}" if head is not None else ""))


@contextmanager
def ablate(model, heads: Iterable[tuple[int, int]] = (), mlps: Iterable[int] = (),
           mode: str = "zero", means: dict | None = None):
    """Switch off attention heads (layer, head) and MLPs (layer) while inside the block.

    zero: the head's output before W_O (its slice of W_O's input) is zeroed, which is
    the same as zeroing that head's columns of W_O; an MLP's output is zeroed.
    mean: they are replaced by their mean over batch and positions, taken from `means`
    (a run_with_cache result on reference text: blocks.l.z and blocks.l.mlp_out)."""
    if mode not in ("zero", "mean"):
        raise AttnlabError(f"ablation mode {mode!r}: choose zero or mean")
    if mode == "mean" and means is None:
        raise AttnlabError("mean ablation needs `means`: a cache from run_with_cache on reference text")
    D = model.config.head_dim
    by_layer: dict[int, list[int]] = {}
    for layer, head in heads:
        _layer_head(model, layer, head)
        by_layer.setdefault(layer, []).append(head)
    hooks = []
    for layer, hs in by_layer.items():
        def w_o_pre(module, args, hs=hs, layer=layer):
            z = args[0].clone()                                      # (B, T, H·D)
            for h in hs:
                if mode == "zero":
                    z[..., h * D:(h + 1) * D] = 0
                else:
                    mean = means[f"blocks.{layer}.z"][..., h, :].mean(dim=(0, 1))
                    z[..., h * D:(h + 1) * D] = mean.to(z.dtype)
            return (z,)
        hooks.append((model.blocks[layer].attn.w_o, "pre", w_o_pre))
    for layer in mlps:
        _layer_head(model, layer)

        def mlp_post(module, args, output, layer=layer):
            if mode == "zero":
                return torch.zeros_like(output)
            return means[f"blocks.{layer}.mlp_out"].mean(dim=(0, 1)).to(output.dtype).expand_as(output)
        hooks.append((model.blocks[layer].mlp, "post", mlp_post))
    with _installed(hooks):
        yield


PATCHABLE = ("resid_pre", "attn_out", "mlp_out", "z")


@contextmanager
def patch(model, source: dict, names: Iterable[str], positions: Iterable[int] | None = None):
    """Replace the named activations, at `positions` (default: all), by the values
    `source` (a run_with_cache result on another prompt of the same length) holds.
    Patchable: blocks.l.resid_pre, .attn_out, .mlp_out and .z."""
    pos = None if positions is None else list(positions)
    hooks = []
    for name in names:
        layer_s, _, kind = name.removeprefix("blocks.").partition(".")
        if kind not in PATCHABLE or not layer_s.isdigit() or name not in source:
            raise AttnlabError(f"cannot patch {name!r}: patchable are blocks.L.{{{', '.join(PATCHABLE)}}} "
                               "present in the source cache")
        layer, value = int(layer_s), source[name]

        def replace(x, value=value):
            if x.shape[:2] != value.shape[:2]:
                raise AttnlabError(f"the source holds {tuple(value.shape[:2])} (batch, tokens) but "
                                   f"this run has {tuple(x.shape[:2])}: patch between prompts "
                                   "of the same length")
            x = x.clone()
            where = slice(None) if pos is None else pos
            if kind == "z":
                x = x.view(*value.shape)
            x[:, where] = value[:, where].to(x.dtype)
            return x.flatten(2) if kind == "z" else x

        block = model.blocks[layer]
        if kind == "resid_pre":
            hooks.append((block, "pre", lambda m, args, r=replace: (r(args[0]), *args[1:])))
        elif kind == "attn_out":
            hooks.append((block.attn, "post", lambda m, a, out, r=replace: (r(out[0]), out[1])))
        elif kind == "mlp_out":
            hooks.append((block.mlp, "post", lambda m, a, out, r=replace: r(out)))
        else:
            hooks.append((block.attn.w_o, "pre", lambda m, args, r=replace: (r(args[0]),)))
    with _installed(hooks):
        yield
