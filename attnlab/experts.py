"""Where a mixture of experts (model.mlp=moe) sends each token of a text, and how evenly
each layer shares the text out among its routed experts.

    python -m attnlab.experts --run runs/NAME --text "To be, or not to be"

First a table: each layer's routed experts, the share of the text's tokens each got (an
even load is model.moe_top_k / model.moe_experts apiece) and its balancing bias (which
picks experts, never weights them). Then one line per token: in each layer, the experts
it went to with their gate weights, the heaviest first. Layers and experts are numbered
from 0; the shared experts, which every token uses, are not listed.
"""
from __future__ import annotations

import sys

import torch

from attnlab.capture import check_context, run_with_cache
from attnlab.options import add_run_options, load
from common.errors import AttnlabError
from engine.cli import Parser, errors_as_lines
from model.moe import MixtureOfExperts


def routing(model, tokenizer, text: str) -> tuple[list[str], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """(token strings, {layer: (gate weights (T, k), experts (T, k))}) for one text: what
    each expert layer's forward routed, as attnlab.capture records it (blocks.l.experts)."""
    layers = {f"blocks.{l}.mlp": b.mlp for l, b in enumerate(model.blocks)
              if isinstance(b.mlp, MixtureOfExperts)}
    if not layers:
        raise AttnlabError(f"this model has no mixture of experts (model.mlp="
                           f"{model.config.mlp}); train one with --model.mlp=moe to look at its routing")
    if not text:
        raise AttnlabError("give some text to route with --text")
    ids = tokenizer.encode(text)
    check_context(model, len(ids))
    # capture's record of what each layer's forward routed, heaviest first.
    layer_of = {name: int(name.split(".")[1]) for name in layers}     # blocks.L.mlp -> L
    wanted = [f"blocks.{l}.{n}" for l in layer_of.values() for n in ("experts", "expert_weights")]
    _, cache = run_with_cache(model, torch.tensor([ids], device=next(model.parameters()).device),
                              only=wanted)
    routes = {name: (cache[f"blocks.{l}.expert_weights"][0].cpu(), cache[f"blocks.{l}.experts"][0].cpu())
              for name, l in layer_of.items()}
    return tokenizer.token_strings(ids), routes


def load_table(model, routes) -> list[str]:
    """Per layer, each routed expert's share of the text's tokens and its bias."""
    lines = []
    for name, (_, chosen) in routes.items():
        layer = model.get_submodule(name)
        share = torch.bincount(chosen.flatten(), minlength=layer.n_routed) / chosen.shape[0]
        lines.append(f"{name}: expert " + " ".join(f"{e:>6}" for e in range(layer.n_routed)))
        lines.append(f"{'share':>{len(name) + 8}} " + " ".join(f"{s:6.2f}" for s in share.tolist()))
        lines.append(f"{'bias':>{len(name) + 8}} "
                     + " ".join(f"{b:+6.3f}" for b in layer.balance_bias.tolist()))
    return lines


def token_lines(tokens: list[str], routes) -> list[str]:
    """Each token and, per layer, its experts with their gate weights."""
    lines = []
    for t, token in enumerate(tokens):
        layers = ["  ".join(f"{int(e)}:{float(w):.2f}" for w, e in zip(weights[t], chosen[t]))
                  for weights, chosen in routes.values()]
        lines.append(f"{t:>4} {token!r:>8}  " + "  |  ".join(layers))
    return lines


def parser() -> Parser:
    p = Parser("python -m attnlab.experts", __doc__)
    add_run_options(p)
    p.add_argument("--text", default="", help="the text to route")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    model, _, tokenizer, _ = load(args)
    tokens, routes = routing(model, tokenizer, args.text)
    print("\n".join(load_table(model, routes)))
    print(f"\n{'':>4} {'token':>8}  experts:gate weight per layer (" + ", ".join(routes) + ")")
    print("\n".join(token_lines(tokens, routes)))
    return 0


if __name__ == "__main__":
    with errors_as_lines():
        sys.exit(main())
