"""Look inside a trained model's attention: every layer × head as a heatmap, the
head where one word looks most at another, and what each head tends to do.

    python -m attnlab.heads grid   --run runs/NAME --text "The trophy did not fit"
    python -m attnlab.heads head   --run runs/NAME --text "..." --layer 1 --head 2
    python -m attnlab.heads search --run runs/NAME --text "..." --from "it" --to "trophy"
    python -m attnlab.heads stats  --run runs/NAME --text "..."
    python -m attnlab.heads html   --run runs/NAME --text "..." --out view.html
    python -m attnlab.heads lens   --run runs/NAME --text "..."     # each layer's guess
    python -m attnlab.heads ablate --run runs/NAME --text "..."     # each head switched off
    python -m attnlab.heads patch  --run runs/NAME --clean "..." --corrupt "..."
    python -m attnlab.heads induction --run runs/NAME               # induction-head scores

Rows of a heatmap are the tokens looking (queries), columns the tokens looked at
(keys); each row sums to 1 and, in a decoder, is zero right of the diagonal (the causal
mask). --run also takes a BERT-family folder (an encoder: rows see both directions),
such as the article's all-MiniLM-L6-v2. Layers and heads are numbered from 0 (--layer,
--head, the plots); search also prints them from 1, the article's numbering.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

from common.errors import AttnlabError
from attnlab.plotting import figures_folder, pyplot, save_figure
from engine.cli import Parser, errors_as_lines


def token_spans(tokenizer, text: str) -> list[tuple[int, int]]:
    """(start, end) character offsets of each token of `text`."""
    return tokenizer.spans(text)


@torch.no_grad()
def attention_maps(model, tokenizer, text: str):
    """(token strings, [layer] -> (heads, T, T) weights) for one text."""
    if not text:
        raise AttnlabError("give some text to look at with --text")
    ids = tokenizer.encode(text)
    if len(ids) > model.config.block_size and model.positions.has_length_limit:
        raise AttnlabError(f"the text is {len(ids)} tokens; this model reads at most "
                           f"{model.config.block_size}")
    from attnlab.lens import run_with_cache          # the one way every tool reads a model
    idx = torch.tensor([ids], device=next(model.parameters()).device)
    names = [f"blocks.{l}.pattern" for l in range(model.config.n_layer)]
    _, cache = run_with_cache(model, idx, only=names)
    return tokenizer.token_strings(ids), [cache[n][0].float().cpu() for n in names]


def _find(text: str, needle: str, after: int) -> int:
    """The first occurrence of needle at or after `after` as a whole word ("it" in
    "because it was", not in "fit"), else as any substring; -1 if none."""
    word = re.compile(rf"(?<!\w){re.escape(needle)}(?!\w)")
    found = word.search(text, after)
    return found.start() if found else text.find(needle, after)


def find_span(text: str, needle: str, spans, after: int = 0) -> list[int]:
    """Indices of the tokens covering the first occurrence of needle at or after
    character `after` (a whole word where there is one)."""
    start = _find(text, needle, after)
    if start < 0 and after and needle in text:
        raise AttnlabError(f"{needle!r} occurs only before the word it should look at; the "
                           "causal mask lets a token look back only, so put --from after --to")
    if start < 0:
        raise AttnlabError(f"{needle!r} does not occur in the text")
    end = start + len(needle)
    return [i for i, (a, b) in enumerate(spans) if a < end and b > start]


def search(maps, text: str, spans, source: str, target: str):
    """Rank every (layer, head) by how much the last token of `source` attends to the
    tokens of `target` (the article's "it -> trophy"). `target` must come first."""
    target_tokens = find_span(text, target, spans)
    source_tokens = find_span(text, source, spans, after=_find(text, target, 0) + len(target))
    query = source_tokens[-1]
    ranking = []
    for layer, weights in enumerate(maps):
        for head in range(weights.shape[0]):
            ranking.append((weights[head, query, target_tokens].sum().item(), layer, head))
    return sorted(ranking, reverse=True), query, target_tokens


def head_stats(weights: torch.Tensor) -> dict:
    """Statistics of one head's (T, T) weights, averaged over the query rows."""
    T = weights.shape[0]
    rows = torch.arange(T)
    entropy = -(weights * weights.clamp_min(1e-12).log()).sum(-1).mean().item()
    # |query - key|: a decoder's keys are never ahead, an encoder's may be.
    distance = (weights * (rows[:, None] - rows[None, :]).abs()).sum(-1)[1:].mean().item()
    previous = weights[rows[1:], rows[1:] - 1].mean().item() if T > 1 else 0.0
    following = weights[rows[:-1], rows[:-1] + 1].mean().item() if T > 1 else 0.0
    first = weights[1:, 0].mean().item() if T > 1 else 1.0
    if previous > 0.5:
        label = "previous-token head"
    elif following > 0.5:
        label = "next-token head"
    elif first > 0.5:
        label = "first-token (sink) head"
    elif distance < 3.0:
        label = "local head"
    else:
        label = "broad head"
    return {"entropy": entropy, "mean_distance": distance, "previous": previous,
            "next": following, "first": first, "label": label}


def _plot_one(ax, weights, tokens, title, labels=True):
    ax.imshow(weights.numpy(), cmap="viridis", vmin=0, vmax=1)
    ax.set_title(title, fontsize=8)
    if labels and len(tokens) <= 40:
        shown = [t.replace("\n", "\\n") for t in tokens]
        ax.set_xticks(range(len(tokens)), shown, rotation=90, fontsize=6)
        ax.set_yticks(range(len(tokens)), shown, fontsize=6)
    else:
        ax.set_xticks([])
        ax.set_yticks([])


def save_grid(path, tokens, maps) -> Path:
    plt = pyplot()
    L, H = len(maps), maps[0].shape[0]
    fig, axes = plt.subplots(L, H, figsize=(2.6 * H, 2.6 * L), squeeze=False)
    for layer in range(L):
        for head in range(H):
            _plot_one(axes[layer][head], maps[layer][head], tokens, f"layer {layer}, head {head}",
                      labels=len(tokens) <= 16)
    fig.supxlabel("token looked at (key)")
    fig.supylabel("token looking (query)")
    return save_figure(fig, path, dpi=100)


def save_head(path, tokens, weights, layer, head) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 7))
    _plot_one(ax, weights, tokens, f"layer {layer}, head {head}")
    ax.set_xlabel("token looked at (key)")
    ax.set_ylabel("token looking (query)")
    return save_figure(fig, path, dpi=110)


CDN_REQUIRE = '<script src="https://cdnjs.cloudflare.com/ajax/libs/require.js/2.3.6/require.min.js"></script>'
# bertviz loads d3 and jQuery through RequireJS; defining them as modules up front
# lets a page carry its own copies and work with no network.
DEFINE_INLINE = ("<script>define('d3', [], function () { return window.d3; });"
                 "define('jquery', [], function () { return window.jQuery; });</script>")


def export_head_view(path, tokens, maps, inline_js: str | Path | None = None) -> Path:
    """bertviz's interactive head view as one HTML file. With inline_js (a folder
    holding d3.min.js, jquery.min.js and require.js) the file carries those libraries
    and opens offline; without, the browser fetches them from a CDN."""
    try:
        from bertviz import head_view
    except ImportError:
        raise AttnlabError("the HTML view needs bertviz: pip install bertviz") from None
    shown = [t.replace("\n", "\\n") for t in tokens]
    body = head_view([m[None] for m in maps], shown, html_action="return").data
    # bertviz writes the tokens as JSON inside a <script>: a token holding "</" could end
    # that script early. "<\/" is the same string to JSON and JavaScript, and cannot.
    listed = json.dumps(shown)
    body = body.replace(listed, listed.replace("</", "<\\/"))
    if inline_js:
        folder = Path(inline_js)
        libs = []
        for name in ("d3.min.js", "jquery.min.js", "require.js"):
            file = folder / name
            if not file.is_file():
                raise AttnlabError(f"{file} is missing; --inline-js needs d3.min.js, "
                                   "jquery.min.js and require.js")
            libs.append(f"<script>{file.read_text(encoding='utf-8')}</script>")
        body = "".join(libs) + DEFINE_INLINE + body.replace(CDN_REQUIRE, "")
    html = ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>attention head view"
            f"</title></head><body>\n{body}\n</body></html>\n")
    Path(path).write_text(html, encoding="utf-8")
    return Path(path)


# -- one layer deeper: the logit lens, ablation, activation patching, induction -------

def _ids(tokenizer, text: str, device, at_least: int = 1) -> torch.Tensor:
    if not text:
        raise AttnlabError("give some text with --text")
    ids = tokenizer.encode(text)
    if len(ids) < at_least:
        raise AttnlabError(f"{text!r} is {len(ids)} token(s); this needs at least {at_least} "
                           "(each token is scored on predicting the next): give a longer --text")
    return torch.tensor([ids], device=device)


@torch.no_grad()
def logit_lens(model, ids: torch.Tensor):
    """For every layer, the residual stream after it read through the final norm and
    the output layer (nostalgebraist's logit lens): (layers, T) top token ids and
    (layers, T) probabilities each layer gives the actual next token."""
    from attnlab.lens import run_with_cache
    L = model.config.n_layer
    logits, cache = run_with_cache(model, ids, only=[f"blocks.{l}.resid_post" for l in range(L)])
    per_layer = torch.stack([model.readout(model.norm_f(cache[f"blocks.{l}.resid_post"]))[0]
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
    from attnlab.lens import ablate
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
    from attnlab.lens import patch, run_with_cache
    if clean.shape != corrupt.shape:
        raise AttnlabError(f"--clean is {clean.shape[1]} tokens and --corrupt {corrupt.shape[1]}; "
                           "patching compares the same positions: give texts of equal length "
                           "in tokens (change one word for another of the same length)")
    L, T = model.config.n_layer, clean.shape[1]
    names = [f"blocks.{l}.resid_pre" for l in range(L)]
    clean_logits, cache = run_with_cache(model, clean, only=names)
    answer = int(clean_logits[0, -1].argmax())
    low = model(corrupt).logits[0, -1, answer].item()
    high = clean_logits[0, -1, answer].item()
    share = torch.zeros(L, T)
    for layer in range(L):
        for pos in range(T):
            with patch(model, cache, [names[layer]], positions=[pos]):
                got = model(corrupt).logits[0, -1, answer].item()
            share[layer, pos] = (got - low) / (high - low) if high != low else 0.0
    return answer, share


def save_layer_map(path, values, xlabels, title, ylabel="layer", cmap="RdBu_r", center=True):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(4, 0.45 * values.shape[1] + 2), max(2.5, 0.5 * values.shape[0] + 1.5)))
    lim = float(values.abs().max()) or 1.0
    image = ax.imshow(values, cmap=cmap, aspect="auto", **({"vmin": -lim, "vmax": lim} if center else {}))
    ax.set_xticks(range(len(xlabels)))
    ax.set_xticklabels(xlabels, rotation=90, fontsize=8)
    ax.set_yticks(range(values.shape[0]))
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    fig.colorbar(image, ax=ax)
    return save_figure(fig, path)


def out_path(given: str, default: str) -> Path:
    """--out as given; inside it when it is a folder; the default name when empty."""
    if not given:
        return Path(default)
    return Path(given) / default if Path(given).is_dir() else Path(given)


def check_figure_out(given: str) -> None:
    """Refuse, before any work, an --out whose suffix matplotlib cannot write."""
    from matplotlib.backend_bases import FigureCanvasBase
    suffix = Path(given).suffix.lower().lstrip(".")
    formats = FigureCanvasBase.get_supported_filetypes()
    if given and not Path(given).is_dir() and suffix and suffix not in formats:
        raise AttnlabError(f"--out {given}: a figure cannot be saved as .{suffix}; use .png "
                           f"(or {', '.join('.' + f for f in sorted(formats) if f != 'png')})")


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return value


def deeper(args, model, tokenizer) -> int:
    """lens, ablate, patch and induction: one layer below the attention maps."""
    from model.readout import READOUTS
    device = next(model.parameters()).device
    show = lambda i: repr(tokenizer.token_strings([int(i)])[0])[1:-1][:8]
    if args.what in ("lens", "ablate", "patch") and not READOUTS[model.config.readout].scores_tokens:
        raise AttnlabError(f"{args.what} reads the model's token scores, and this encoder has no "
                           "output layer (a sentence encoder keeps only hidden states); look at "
                           "its attention with grid, head, search, stats or html, or give a folder "
                           "with a masked-LM head (BertForMaskedLM)")
    if args.what == "induction" and not model.config.causal:
        raise AttnlabError("induction heads copy what followed an earlier occurrence of the "
                           "current token, a decoder's trick; this model is an encoder "
                           "(model.causal=false): look at it with grid, head, search or stats")
    if args.what == "induction":
        from attnlab.induction import plot_heads, report
        _, _, prev, induct = report(model, span=min(20, model.config.block_size // 2))
        print(plot_heads(model, 12, {"previous-token head": prev, "induction head": induct},
                         out_path(args.out, "induction_heads.png")))
        return 0
    if args.what == "patch":
        clean, corrupt = _ids(tokenizer, args.clean, device), _ids(tokenizer, args.corrupt, device)
        answer, share = activation_patching(model, clean, corrupt)
        labels = [show(i) for i in clean[0]]
        print(f"answer (the clean run's top next token): {show(answer)!r}; share of its logit "
              "recovered by patching the clean residual stream in at one layer and position:")
        print("layer " + " ".join(f"{l:>8}" for l in labels))
        for layer, row in enumerate(share):
            print(f"{layer:>5} " + " ".join(f"{v:8.2f}" for v in row))
        print(save_layer_map(out_path(args.out, "patching.png"), share, labels,
                             f"activation patching: recovered share of logit({show(answer)})"))
        return 0
    ids = _ids(tokenizer, args.text, device, at_least=2)
    labels = [show(i) for i in ids[0]]
    if args.what == "lens":
        top, p_next = logit_lens(model, ids)
        print("layer " + " ".join(f"{l:>8}" for l in labels))
        for layer, row in enumerate(top):
            print(f"{layer:>5} " + " ".join(f"{show(i):>8}" for i in row))
        print(save_layer_map(out_path(args.out, "logit_lens.png"), p_next,
                             labels[int(model.config.causal):],
                             "logit lens: probability of the actual next token after each layer"
                             if model.config.causal else
                             "logit lens: probability of the token itself after each layer",
                             cmap="viridis", center=False))
        return 0
    base, delta = head_ablation(model, ids)
    ranked = sorted(((delta[l, h].item(), l, h) for l in range(delta.shape[0])
                     for h in range(delta.shape[1])), reverse=True)
    print(f"loss of the text {base:.4f}; change when one head is zero-ablated, largest first:")
    for change, layer, head in ranked[:args.top]:
        print(f"  layer {layer}, head {head}: {change:+.4f}")
    print(save_layer_map(out_path(args.out, "head_ablation.png"), delta,
                         [str(h) for h in range(delta.shape[1])],
                         f"loss change when a head is zero-ablated (base {base:.3f})"))
    return 0


def main(argv=None) -> int:
    parser = Parser("python -m attnlab.heads", __doc__)
    parser.add_argument("what", choices=["grid", "head", "search", "stats", "html", "lens",
                                         "ablate", "patch", "induction"])
    parser.add_argument("--run", default="", help="run directory, checkpoint or transformers "
                        "folder (default: the latest run)")
    parser.add_argument("--text", default="", help="the sentence to look at")
    parser.add_argument("--clean", default="", help="patch: the text whose activations are patched in")
    parser.add_argument("--corrupt", default="", help="patch: the same text with one word changed")
    parser.add_argument("--out", default="", help="output path (PNG for grid and head, HTML for "
                        "html) or folder; default: the run's figures/ folder")
    parser.add_argument("--layer", type=int, default=0)
    parser.add_argument("--head", type=int, default=0)
    parser.add_argument("--from", dest="source", default="", help="search: the word looking")
    parser.add_argument("--to", dest="target", default="", help="search: the word looked at")
    parser.add_argument("--top", type=positive, default=5,
                        help="search and ablate: how many heads to list (default 5)")
    parser.add_argument("--inline-js", default="", help="html: folder with d3.min.js, "
                        "jquery.min.js and require.js to embed (opens offline)")
    args = parser.parse_args(argv)
    if args.what != "html":
        check_figure_out(args.out)
    from engine.checkpoint import latest_run
    from engine.inference import load_run
    model, _, tokenizer, ckpt = load_run(args.run or latest_run(), "best")
    if not args.out:
        args.out = str(figures_folder(ckpt))
    if args.what in ("lens", "ablate", "patch", "induction"):
        return deeper(args, model, tokenizer)
    tokens, maps = attention_maps(model, tokenizer, args.text)
    if args.what == "html":
        print(export_head_view(out_path(args.out, "head_view.html"), tokens, maps, args.inline_js or None))
    elif args.what == "grid":
        print(save_grid(out_path(args.out, "attention_grid.png"), tokens, maps))
    elif args.what == "head":
        if not (0 <= args.layer < len(maps) and 0 <= args.head < maps[0].shape[0]):
            raise AttnlabError(f"this model has layers 0-{len(maps) - 1} and heads "
                               f"0-{maps[0].shape[0] - 1}")
        print(save_head(out_path(args.out, f"attention_l{args.layer}_h{args.head}.png"), tokens,
                        maps[args.layer][args.head], args.layer, args.head))
    elif args.what == "search":
        if not (args.source and args.target):
            raise AttnlabError("search needs --from WORD (looking) and --to WORD (looked at)")
        ranking, query, targets = search(maps, args.text, token_spans(tokenizer, args.text),
                                         args.source, args.target)
        print(f"token {query} ({tokens[query]!r}) looking at tokens {targets} "
              f"({''.join(tokens[t] for t in targets)!r}); layers and heads counted from 1 as "
              "the article does, this project's --layer/--head (from 0) beside:")
        for weight, layer, head in ranking[:args.top]:
            print(f"  layer {layer + 1}, head {head + 1}: {args.source} → {args.target} = "
                  f"{weight:.2f}   (--layer {layer} --head {head}, weight {weight:.3f})")
    else:
        print(f"{'layer':>5} {'head':>4} {'entropy':>8} {'distance':>8} {'prev':>6} {'next':>6} "
              f"{'first':>6}  pattern")
        for layer, weights in enumerate(maps):
            for head in range(weights.shape[0]):
                s = head_stats(weights[head])
                print(f"{layer:>5} {head:>4} {s['entropy']:8.3f} {s['mean_distance']:8.2f} "
                      f"{s['previous']:6.2f} {s['next']:6.2f} {s['first']:6.2f}  {s['label']}")
    return 0


if __name__ == "__main__":
    with errors_as_lines():
        sys.exit(main())
