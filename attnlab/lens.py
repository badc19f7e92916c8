"""One layer below the attention maps: each layer's guess (the logit lens), heads and
MLPs switched off (ablation), and activations swapped between prompts (patching).

    python -m attnlab.lens logit  --run runs/NAME --text "..."     # each layer's guess
    python -m attnlab.lens ablate --run runs/NAME --text "..."     # each head switched off
    python -m attnlab.lens patch  --run runs/NAME --clean "..." --corrupt "..."
    python -m attnlab.lens pieces --run runs/NAME --text "..."     # each model-card piece off

From Python (run_with_cache is attnlab.capture's, which lists every name it reads):

    from attnlab.lens import run_with_cache, ablate, patch
    logits, cache = run_with_cache(model, tokens)
    with ablate(model, heads=[(1, 3)]):  # layer 1, head 3 switched off
        loss = model(tokens, targets).loss
    with patch(model, clean_cache, ["blocks.0.resid_post"], positions=[5]):
        logits = model(corrupt_tokens).logits

Both edit the forward pass with the same removable hooks capture uses, so the model
runs as before once the `with` block is left.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterable

import torch

from attnlab.capture import check_context, installed, names, other_paths, run_with_cache  # noqa: F401  (lens users read and edit)
from attnlab.options import add_run_options, load, positive, out_option
from attnlab.plotting import check_figure_out, default_out, out_path, save_layer_map
from common.errors import AttnlabError
from engine.cli import Parser, errors_as_lines


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
        if model.blocks[layer].mlp is None:
            raise AttnlabError(f"layer {layer} has no MLP to switch off (model.mlp=none): "
                               "ablate its heads instead")

        def mlp_post(module, args, output, layer=layer):
            if mode == "zero":
                return torch.zeros_like(output)
            return means[f"blocks.{layer}.mlp_out"].mean(dim=(0, 1)).to(output.dtype).expand_as(output)
        hooks.append((model.blocks[layer].mlp, "post", mlp_post))
    with installed(hooks):
        yield


# What switching a model-card piece off means, in the words every printout uses.
PIECE_OFF = {"sink": "sink removed (each row's weights sum to 1 over the keys)",
             "gate": "gates held open (σ = 1: plain attention's output)",
             "chosen": "indexer off (every visible key read: dense attention)"}


@contextmanager
def switched_off(model, layer: int, piece: str, expert: int | None = None):
    """One layer's model-card piece switched off while inside the block: "sink" (its logit
    at -inf, so it takes no weight), "gate" (held open), "chosen" (the indexer picks every
    visible key), "experts" with `expert` (that routed expert's output zeroed for the
    tokens routed to it; the router still picks it). The piece's parameters are as before
    once the block is left."""
    from attnlab.capture import pieces_of
    _layer_head(model, layer)
    if piece not in pieces_of(model, layer):
        raise AttnlabError(f"layer {layer} has no {piece} to switch off")
    block = model.blocks[layer]
    if piece == "sink":
        kept = block.attn.sinks.detach().clone()
        with torch.no_grad():
            block.attn.sinks.fill_(float("-inf"))     # exp(-inf) = 0: the sink takes nothing
        try:
            yield
        finally:
            with torch.no_grad():
                block.attn.sinks.copy_(kept)
        return
    if piece == "chosen":
        own = vars(block.attn).get("dense_warmup")            # a setting of this layer's own
        object.__setattr__(block.attn, "dense_warmup", True)   # the indexer's dense stage
        try:
            yield
        finally:
            if own is None:
                object.__delattr__(block.attn, "dense_warmup")
            else:
                object.__setattr__(block.attn, "dense_warmup", own)
        return
    if piece == "gate":
        # W_O of the heads' outputs alone: σ = 1 everywhere. Through the layer's output
        # method, which the learner's gate (exercise 12) replaces, not its w_gate, which
        # the learner's code never calls.
        hooks = [(block.attn, "method:output", lambda args, result, attn=block.attn: attn.w_o(args[1]))]
    else:
        mlp = block.mlp
        if expert is None or not 0 <= expert < mlp.n_routed:
            raise AttnlabError(f"layer {layer} has routed experts 0-{mlp.n_routed - 1}; got {expert}")
        target = mlp.n_shared + expert                 # shared experts come first in `fc`

        def off(args, result):
            return torch.zeros_like(result) if args[0] == target else None
        hooks = [(mlp, "method:expert", off)]
    with installed(hooks):
        yield


@torch.no_grad()
def piece_ablation(model, ids: torch.Tensor):
    """The text's next-token loss; each attention piece's change when switched off in one
    layer ({(layer, piece): change}); and (layers with experts, routed experts) the change
    when each routed expert alone is switched off (None for a model without experts)."""
    from attnlab.capture import pieces_of
    inputs, targets = ids[:, :-1], ids[:, 1:]
    base = model(inputs, targets).loss.item()
    changes = {}
    for layer in range(model.config.n_layer):
        for piece in PIECE_OFF:
            if piece in pieces_of(model, layer):
                with switched_off(model, layer, piece):
                    changes[layer, piece] = model(inputs, targets).loss.item() - base
    moe = [l for l in range(model.config.n_layer) if "experts" in pieces_of(model, l)]
    experts = None
    if moe:
        experts = torch.zeros(len(moe), model.blocks[moe[0]].mlp.n_routed)
        for row, layer in enumerate(moe):
            for e in range(experts.shape[1]):
                with switched_off(model, layer, "experts", e):
                    experts[row, e] = model(inputs, targets).loss.item() - base
    return base, changes, moe, experts


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
    with installed(hooks):
        yield


# -- the three studies, as the command line runs them ---------------------------------

def token_ids(model, tokenizer, text: str, at_least: int = 1, check: bool = True,
              option: str = "--text") -> torch.Tensor:
    """The text's ids, (1, T), on the model's device; a refusal names `option`, the
    command-line option the text came from. A text past the trained context gets the
    same warning or refusal as the attention tools give (check_context)."""
    if not text:
        raise AttnlabError(f"give some text with {option}")
    ids = tokenizer.encode(text)
    if len(ids) < at_least:
        raise AttnlabError(f"{text!r} is {len(ids)} token(s); this needs at least {at_least} "
                           f"(each token is scored on predicting the next): give a longer {option}")
    if check:
        check_context(model, len(ids), option)
    return torch.tensor([ids], device=next(model.parameters()).device)


@torch.no_grad()
def logit_lens(model, ids: torch.Tensor):
    """For every layer, the residual stream after it read through the final norm and
    the output layer (nostalgebraist's logit lens): (layers, T) top token ids and
    (layers, T) probabilities each layer gives the actual next token."""
    L = model.config.n_layer
    logits, cache = run_with_cache(model, ids, only=[f"blocks.{l}.resid_post" for l in range(L)])
    final = model.norm_f if model.norm_f is not None else (lambda h: h)   # post-norm: none
    per_layer = torch.stack([model.readout(final(cache[f"blocks.{l}.resid_post"]))[0]
                             for l in range(L)]).float()               # (L, T, V)
    probs = torch.softmax(per_layer, -1)
    # A decoder predicts the next token; an encoder's masked-LM head the token itself.
    shift = int(model.config.causal)
    nxt = ids[0, shift:]
    p_next = probs[:, :probs.shape[1] - shift].gather(-1, nxt[None, :, None].expand(L, -1, 1))[..., 0]
    return per_layer.argmax(-1).cpu(), p_next.cpu()


@torch.no_grad()
def head_ablation(model, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    """The text's next-token loss, and (layers, heads) its change when each head alone
    is zero-ablated."""
    c = model.config
    # A decoder's loss is on the next token, an encoder's (masked-LM head) on each token.
    inputs, targets = (ids[:, :-1], ids[:, 1:]) if c.causal else (ids, ids)
    base = model(inputs, targets).loss.item()
    delta = torch.zeros(c.n_layer, c.n_head)
    for layer in range(c.n_layer):
        for head in range(c.n_head):
            with ablate(model, heads=[(layer, head)]):
                delta[layer, head] = model(inputs, targets).loss.item() - base
    return base, delta


@torch.no_grad()
def activation_patching(model, clean: torch.Tensor, corrupt: torch.Tensor):
    """Patch the clean run's residual stream into the corrupt run, one (layer,
    position) at a time, and measure how much of the clean answer comes back at the
    last position: 0 = the corrupt run's logit for the clean answer, 1 = the clean
    run's. Returns (the answer id, (layers, T) recovered share)."""
    if clean.shape != corrupt.shape:
        raise AttnlabError(f"--clean is {clean.shape[1]} tokens and --corrupt {corrupt.shape[1]}; "
                           "patching compares the same positions: give texts of equal length "
                           "in tokens (change one word for another of the same length)")
    L, T = model.config.n_layer, clean.shape[1]
    wanted = [f"blocks.{l}.resid_pre" for l in range(L)]
    clean_logits, cache = run_with_cache(model, clean, only=wanted)
    answer = int(clean_logits[0, -1].argmax())
    low = model(corrupt).logits[0, -1, answer].item()
    high = clean_logits[0, -1, answer].item()
    share = torch.zeros(L, T)
    for layer in range(L):
        for pos in range(T):
            with patch(model, cache, [wanted[layer]], positions=[pos]):
                got = model(corrupt).logits[0, -1, answer].item()
            share[layer, pos] = (got - low) / (high - low) if high != low else 0.0
    return answer, share


def show_logit_lens(args, model, tokenizer, show) -> None:
    ids = token_ids(model, tokenizer, args.text, at_least=2)
    labels = [show(i) for i in ids[0]]
    top, p_next = logit_lens(model, ids)
    print("layer " + " ".join(f"{l:>8}" for l in labels))
    for layer, row in enumerate(top):
        print(f"{layer:>5} " + " ".join(f"{show(i):>8}" for i in row))
    # A column per position, as in the table above; in a decoder its value is the
    # probability of the token after it, so the label shows both.
    columns = ([f"{a}→{b}" for a, b in zip(labels, labels[1:])] if model.config.causal
               else labels)
    print("wrote", save_layer_map(out_path(args.out, "logit_lens.png"), p_next, columns,
                         "logit lens: probability of the actual next token after each layer"
                         if model.config.causal else
                         "logit lens: probability of the token itself after each layer",
                         xlabel="input token → the next token, whose probability is shown"
                         if model.config.causal else "input token",
                         scale="probability", cmap="viridis", center=False))


def show_ablation(args, model, tokenizer, show) -> None:
    ids = token_ids(model, tokenizer, args.text, at_least=2)
    base, delta = head_ablation(model, ids)
    ranked = sorted(((delta[l, h].item(), l, h) for l in range(delta.shape[0])
                     for h in range(delta.shape[1])), reverse=True)
    print(f"loss of the text {base:.4f}; change when one head is zero-ablated, largest first "
          "(layers and heads counted from 0, as --layer/--head take them):")
    for change, layer, head in ranked[:args.top]:
        print(f"  layer {layer}, head {head}: {change:+.4f}")
    print("wrote", save_layer_map(out_path(args.out, "head_ablation.png"), delta,
                         [str(h) for h in range(delta.shape[1])],
                         f"loss change when a head is zero-ablated (base {base:.3f}; "
                         "layers and heads from 0)",
                         xlabel="head (from 0)", scale="loss change (higher: the head mattered)"))


def show_patching(args, model, tokenizer, show) -> None:
    if not (args.clean and args.corrupt):
        raise AttnlabError("patch needs --clean TEXT and --corrupt TEXT (the same text with "
                           "one word changed)")
    # Only the clean text is checked: the corrupt one must be as long (activation_patching
    # says so), and one warning line is enough.
    clean = token_ids(model, tokenizer, args.clean, option="--clean")
    corrupt = token_ids(model, tokenizer, args.corrupt, check=False, option="--corrupt")
    answer, share = activation_patching(model, clean, corrupt)
    labels = [show(i) for i in clean[0]]
    print(f"answer (the clean run's top next token): {show(answer)!r}; share of its logit "
          "recovered by patching the clean residual stream in at one layer and position:")
    print("layer " + " ".join(f"{l:>8}" for l in labels))
    for layer, row in enumerate(share):
        print(f"{layer:>5} " + " ".join(f"{v:8.2f}" for v in row))
    print("wrote", save_layer_map(out_path(args.out, "patching.png"), share, labels,
                         f"activation patching: recovered share of logit({show(answer)})",
                         xlabel="position patched (its token)",
                         scale="share recovered (1: all of the clean run's)"))


def show_pieces(args, model, tokenizer, show) -> None:
    if not model.config.causal:
        raise AttnlabError("lens pieces scores the next token, and this model is an encoder")
    ids = token_ids(model, tokenizer, args.text, at_least=2)
    base, changes, moe, experts = piece_ablation(model, ids)
    if not changes and experts is None:
        raise AttnlabError(f"this model (model.mechanism={model.config.mechanism}, model.mlp="
                           f"{model.config.mlp}) has no model-card piece to switch off: sinks, "
                           "gated or sparse attention, or experts (--config gpt-oss, qwen3-next, "
                           "deepseek-v3.2)")
    print(f"loss of the text {base:.4f}; change when one piece is switched off in one layer "
          "(layers from 0; + means the piece helped on this text):")
    for (layer, piece), change in changes.items():
        print(f"  layer {layer}, {PIECE_OFF[piece]}: {change:+.4f}")
    if experts is not None:
        print("change when one routed expert's output is dropped (the router still picks it):")
        print(f"{'layer':>5} " + " ".join(f"{'expert ' + str(e):>9}" for e in range(experts.shape[1])))
        for layer, row in zip(moe, experts):
            print(f"{layer:>5} " + " ".join(f"{v:+9.4f}" for v in row.tolist()))
        print("wrote", save_layer_map(out_path(args.out, "expert_ablation.png"), experts,
                                      [str(e) for e in range(experts.shape[1])],
                                      f"loss change when a routed expert is switched off (base "
                                      f"{base:.3f}; rows: layers {', '.join(map(str, moe))})",
                                      xlabel="routed expert (from 0)",
                                      scale="loss change (higher: the expert mattered)"))


# name on the command line -> (what it is called in a sentence, what runs it)
STUDIES = {"logit": ("the logit lens", show_logit_lens), "ablate": ("ablation", show_ablation),
           "patch": ("patching", show_patching), "pieces": ("switching pieces off", show_pieces)}


def parser() -> Parser:
    p = Parser("python -m attnlab.lens", __doc__)
    p.add_argument("what", choices=list(STUDIES))
    add_run_options(p)
    p.add_argument("--text", default="", help="logit, ablate and pieces: the text to read")
    p.add_argument("--clean", default="", help="patch: the text whose activations are patched in")
    p.add_argument("--corrupt", default="", help="patch: the same text with one word changed")
    p.add_argument("--top", type=positive, default=5, help="ablate: how many heads to list (default 5)")
    p.add_argument("--out", type=out_option, default=None, help="a PNG path or a folder (default: the run's "
                   "figures/ folder)")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    check_figure_out(args.out)
    from model.readout import READOUTS
    model, _, tokenizer, ckpt = load(args)
    if not READOUTS[model.config.readout].scores_tokens:
        raise AttnlabError(f"{STUDIES[args.what][0]} reads the model's token scores, and this encoder has no "
                           "output layer (a sentence encoder keeps only hidden states); look at "
                           "its attention with python -m attnlab.heads, or give a folder with a "
                           "masked-LM head (BertForMaskedLM)")
    args.out = args.out or default_out(ckpt)
    if args.what == "ablate" and other_paths(model.config):
        print(f"note: {other_paths(model.config, 'a path between positions that switching every head off leaves open')}",
              file=sys.stderr)
    show = lambda i: repr(tokenizer.token_strings([int(i)])[0])[1:-1][:8]
    STUDIES[args.what][1](args, model, tokenizer, show)
    return 0


if __name__ == "__main__":
    with errors_as_lines():
        sys.exit(main())
