"""Look inside a trained model's attention: every layer × head as a heatmap, the
head where one word looks most at another, and what each head tends to do.

    python -m attnlab.heads grid   --run runs/NAME --text "The trophy did not fit" [--layer L]
    python -m attnlab.heads head   --run runs/NAME --text "..." --layer 1 --head 2
    python -m attnlab.heads search --run runs/NAME --text "..." --from "it" --to "trophy"
    python -m attnlab.heads stats  --run runs/NAME --text "..."
    python -m attnlab.heads html   --run runs/NAME --text "..." --out view.html
    python -m attnlab.heads sinks  --run runs/NAME --text "..."   # a learned sink's share of each row
    python -m attnlab.heads gates  --run runs/NAME --text "..."   # each head's gate openness
    python -m attnlab.heads chosen --run runs/NAME --text "..."   # the indexer's keys vs full attention
                                                                  # (and a figure of them)

Rows of a heatmap are the tokens looking (queries), columns the tokens looked at
(keys); each row sums to 1 (a softmax's; differential attention's rows sum to 1 - λ and
may go below 0, drawn on a scale centred on 0, and stats gives them no entropy) and, in a
decoder, is zero right of the diagonal (the causal mask). --run also takes a BERT-family folder (an encoder: rows see both directions),
such as the article's all-MiniLM-L6-v2. Layers and heads are numbered from 0 in every
option, printout and plot (the article counts from 1: its layer 4, head 2 is layer 3,
head 1 here). In a hybrid (model.mechanism=deltanet,mha) the layers whose mechanism has
no weights are left out of grid, search and stats, which say so, and refused by head.

sinks, gates and chosen show what a model-card piece adds (attnlab/pieces.py): a table per
layer and head, then each token of --layer (default: the layer where the piece does most).
Each experts' routing per token is python -m attnlab.experts.

One layer deeper are tools of their own, with the same --run, --checkpoint and
--device: python -m attnlab.lens (logit, ablate, patch) and python -m attnlab.induction
--run. `heads lens`, `heads ablate`, `heads patch` and `heads induction` run them.
"""
from __future__ import annotations

import json
import re
import sys
import textwrap
from pathlib import Path

import torch

from attnlab.capture import (attention_maps, not_distributions, other_paths, weight_label,
                             weightless_layers)
from attnlab import pieces
from attnlab.options import add_run_options, load, positive, out_option
from attnlab.plotting import (NUMBERING, WEIGHT, check_figure_out, default_out, draw_weights,
                              label_tokens, layer_head, make_folder_for, out_path, pyplot,
                              refuse_a_path_through_a_file, save_figure, weight_scale)
from common.errors import AttnlabError
from model.layers import layer_names
from common.files import write_text_atomic
from engine.cli import Parser, errors_as_lines


def token_spans(tokenizer, text: str) -> list[tuple[int, int]]:
    """(start, end) character offsets of each token of `text`."""
    return tokenizer.spans(text)


# A word is a run of letters: "it" is one in "because it was" and "it's", not in "fit".
# Matching the text's characters keeps the rule the same for every tokenizer (GPT-2's
# leading-space tokens, WordPiece's ## pieces and character models alike).
def _word_at(text: str, word: str, after: int = 0) -> int:
    """Where `word` first occurs at or after `after` as a whole word; -1 if nowhere."""
    found = re.compile(rf"(?<![^\W\d_]){re.escape(word)}(?![^\W\d_])").search(text, after)
    return found.start() if found else -1


def _words(text: str, limit: int = 30) -> str:
    """The text's words, as the error line that names a missing one lists them."""
    words = list(dict.fromkeys(re.findall(r"[^\W\d_]+", text)))
    return " ".join(map(repr, words[:limit])) + (" ..." if len(words) > limit else "")


# What a refusal calls the two words: this command's options; the page has its own fields.
SEARCH_FIELDS = ("--from", "--to")


def find_word(text: str, word: str, spans, after: int = 0, fields=SEARCH_FIELDS) -> list[int]:
    """Indices of the tokens that make up the first whole-word occurrence of `word` at
    or after character `after` (several where the tokenizer splits it). A word found
    only inside another, or inside a token holding more letters, is refused, as the
    ranking would otherwise be of some other token than the one named; the refusal
    calls the two words by `fields` (looking, looked at)."""
    source, target = fields
    where = f"; the text's words are {_words(text)}"
    start = _word_at(text, word, after)
    if start < 0 and after and _word_at(text, word) >= 0:
        raise AttnlabError(f"{word!r} occurs only before the word it should look at; the "
                           f"causal mask lets a token look back only, so put {source} after {target}")
    if start < 0:
        inside = " (only inside another word)" if word in text else ""
        raise AttnlabError(f"{word!r} does not occur in the text as a whole word{inside}: "
                           f"give {source} and {target} words of the text{where}")
    end = start + len(word)
    found = [i for i, (a, b) in enumerate(spans) if a < end and b > start]
    a, b = spans[found[0]][0], spans[found[-1]][1]
    if re.search(r"[^\W\d_]", text[a:start] + text[end:b]):
        raise AttnlabError(f"{word!r} is part of the token(s) {text[a:b]!r}, which hold more "
                           f"letters; give {source} and {target} words the tokenizer keeps apart{where}")
    return found


def search(maps, text: str, spans, source: str, target: str, fields=SEARCH_FIELDS):
    """Rank every (layer, head) by how much the last token of `source` attends to the
    tokens of `target` (the article's "it -> trophy"). `target` must come first; both
    are whole words of the text (find_word, whose refusals name `fields`)."""
    target_tokens = find_word(text, target, spans, fields=fields)
    source_tokens = find_word(text, source, spans, after=_word_at(text, target) + len(target),
                              fields=fields)
    query = source_tokens[-1]
    ranking = []
    for layer, weights in enumerate(maps):
        for head in range(0 if weights is None else weights.shape[0]):    # None: no weights
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


# What every plot and table of layers and heads says about its numbering (one rule for
# every tool, attnlab.plotting's).
FROM_0 = NUMBERING


def save_grid(path, tokens, maps, left_out: str = "", label: str = WEIGHT) -> Path:
    """Every layer x head: the tokens beside the first column and under the last row, one
    colour scale for all (the panels share it, so they compare; centred on 0 if a weight
    is below it). A layer whose map is None is not drawn; `left_out` says which and why,
    under the title. `label` is the colour bar's (capture.weight_label)."""
    plt = pyplot()
    rows = [(layer, weights) for layer, weights in enumerate(maps) if weights is not None]
    signed = any(bool((weights < 0).any()) for _, weights in rows)
    L, H = len(rows), rows[0][1].shape[0]
    fig, axes = plt.subplots(L, H, figsize=(2.6 * H + 1.2, 2.6 * L + 0.6), squeeze=False,
                             layout="constrained")
    for row, (layer, weights) in enumerate(rows):
        for head in range(H):
            ax = axes[row][head]
            image = draw_weights(ax, weights[head].numpy(), layer_head(layer, head), signed=signed)
            label_tokens(ax, tokens, fontsize=6)
            if head:
                ax.tick_params(labelleft=False)
            if row < L - 1:
                ax.tick_params(labelbottom=False)
    # The note under the title, wrapped and smaller, fits a grid of two heads.
    fig.suptitle(FROM_0 + (f"\n{textwrap.fill(left_out, 60)}" if left_out else ""),
                 fontsize=9 if left_out else None)
    fig.supxlabel("token looked at (key)")
    fig.supylabel("token looking (query)")
    weight_scale(fig, image, axes.ravel().tolist(), label)
    return save_figure(fig, path, dpi=100)


def save_head(path, tokens, weights, layer, head, label: str = WEIGHT) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 7), layout="constrained")
    image = draw_weights(ax, weights.numpy(), f"{layer_head(layer, head)} (from 0, as "
                         "--layer/--head)", keys=tokens, signed=bool((weights < 0).any()))
    ax.set_xlabel("token looked at (key)")
    ax.set_ylabel("token looking (query)")
    weight_scale(fig, image, ax, label)
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
        raise AttnlabError("the HTML view needs bertviz, an optional package: "
                           "pip install -r requirements-extra.txt") from None
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
    make_folder_for(Path(path))
    write_text_atomic(Path(path), html)
    return Path(path)


# Studies one layer deeper, once subcommands here: (module, arguments put first).
FORWARDED = {"lens": ("attnlab.lens", ["logit"]), "ablate": ("attnlab.lens", ["ablate"]),
             "patch": ("attnlab.lens", ["patch"]), "induction": ("attnlab.induction", [])}


def forward(what: str, rest: list[str]) -> int:
    """Run `heads lens ...` as `lens logit ...` (and the others alike), same options."""
    import importlib
    module, first = FORWARDED[what]
    if what == "induction" and not any(a == "--run" or a.startswith("--run=") for a in rest):
        rest = ["--run", "", *rest]                # here, no --run meant the latest run
    return importlib.import_module(module).main(first + rest)


def parser() -> Parser:
    p = Parser("python -m attnlab.heads", __doc__)
    # The forwarded studies are choices too, so --help and a mistyped name list every
    # subcommand that runs; main hands them on before this parser reads their options.
    p.add_argument("what", choices=["grid", "head", "search", "stats", "html", *PIECE_VIEWS,
                                    *FORWARDED],
                   help="what to show; lens, ablate and patch run python -m attnlab.lens "
                   "(logit, ablate, patch) and induction python -m attnlab.induction, each "
                   "with its own options (heads lens --help)")
    add_run_options(p)
    p.add_argument("--text", default="", help="the sentence to look at")
    p.add_argument("--out", type=out_option, default=None, help="output path (PNG for grid, head and chosen, HTML for "
                   "html) or folder; default: the run's figures/ folder")
    p.add_argument("--layer", type=int, default=None,
                   help="head: the layer (default 0); grid: draw only this layer; sinks, gates, "
                   "chosen: the layer shown token by token")
    p.add_argument("--head", type=int, default=None, help="head: the head (default 0)")
    p.add_argument("--from", dest="source", default="", help="search: the word looking")
    p.add_argument("--to", dest="target", default="", help="search: the word looked at")
    p.add_argument("--top", type=positive, default=5,
                   help="search: how many heads to list (default 5)")
    p.add_argument("--inline-js", default="", help="html: folder with d3.min.js, "
                   "jquery.min.js and require.js to embed (opens offline)")
    return p


def refuse_unused_layer_options(args) -> None:
    """--layer and --head where the subcommand would not read them: refused, not ignored."""
    unused = [f"--{name}" for name in ("layer", "head") if getattr(args, name) is not None
              and not (args.what == "head" or (args.what in ("grid", *PIECE_VIEWS) and name == "layer"))]
    if unused:
        also = (" (grid takes --layer, to draw one layer)" if args.what == "grid" else
                f" (heads {args.what} takes --layer, the layer shown token by token)"
                if args.what in PIECE_VIEWS else "")
        raise AttnlabError(f"heads {args.what} reads every head and takes no {' or '.join(unused)}"
                           f"{also}; for one head: heads head --layer L --head H")


def layer_weights(maps, layer: int, weightless: dict[int, str]):
    """Layer `layer`'s (heads, T, T) weights, or one line on why there are none."""
    if not 0 <= layer < len(maps):
        raise AttnlabError(f"--layer {layer}: this model has layers 0-{len(maps) - 1}")
    if maps[layer] is None:
        drawn = ", ".join(str(l) for l, m in enumerate(maps) if m is not None)
        raise AttnlabError(f"{weightless[layer]}; layers with weights: {drawn}")
    return maps[layer]


def left_out(config) -> str:
    """Which layers a hybrid's figures and tables leave out, and why, in one line ("" when
    every layer has weights)."""
    weightless = weightless_layers(config)
    if not weightless:
        return ""
    names = layer_names(config)
    mechanisms = ", ".join(dict.fromkeys(f"model.mechanism={names[l]}" for l in weightless))
    return (f"{'layer' if len(weightless) == 1 else 'layers'} {', '.join(map(str, weightless))} "
            f"left out: {mechanisms} has no attention weights to draw")


def draw_grid(args, tokens, maps, config) -> None:
    """Every layer's heads, or --layer's alone; a hybrid's layers without weights are left
    out, and the figure and one printed line say which and why."""
    left, drawn = "", None
    if args.layer is not None:
        drawn = [args.layer]
        layer_weights(maps, args.layer, weightless_layers(config))
        maps = [m if l == args.layer else None for l, m in enumerate(maps)]
    else:
        left = left_out(config)
    print("wrote", save_grid(out_path(args.out, "attention_grid.png"), tokens, maps, left,
                             weight_label(config, drawn)))


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in FORWARDED:
        return forward(argv[0], argv[1:])
    args = parser().parse_args(argv)
    if args.what in FORWARDED:                 # named after an option: its options are its own
        raise AttnlabError(f"heads {args.what} takes its options after its name: python -m "
                           f"attnlab.heads {args.what} [OPTIONS]")
    # Only grid, head, html and chosen write a file; the others print.
    writes = args.what in ("grid", "head", "html", "chosen")
    if args.out and not writes:                # else taken and ignored, as if written there
        raise AttnlabError(f"--out {args.out}: heads {args.what} prints its answer and writes "
                           "no file; drop --out (grid, head, html and chosen write one)")
    refuse_unused_layer_options(args)
    if args.what in ("grid", "head", "chosen"):
        check_figure_out(args.out)
    elif args.what == "html":
        refuse_a_path_through_a_file(args.out or ".")
        if Path(args.out or "").suffix.lower() not in ("", ".html", ".htm") and not Path(args.out or ".").is_dir():
            raise AttnlabError(f"--out {args.out}: the head view is a web page; name it .html")
    model, _, tokenizer, ckpt = load(args)
    if writes and not args.out:
        args.out = default_out(ckpt)
    if args.what in PIECE_VIEWS:
        print("\n".join(piece_view(args, model, tokenizer)))
        return 0
    # html hands bertviz every layer; the others draw or rank the layers that have weights.
    tokens, maps = attention_maps(model, tokenizer, args.text, per_layer=args.what != "html")
    if other_paths(model.config):
        print(f"note: {other_paths(model.config)}", file=sys.stderr)
    if left_out(model.config) and args.what != "head" and not (args.what == "grid" and args.layer is not None):
        print(f"note: {left_out(model.config)}", file=sys.stderr)
    if args.what == "html":
        print("wrote", export_head_view(out_path(args.out, "head_view.html"), tokens, maps, args.inline_js or None))
    elif args.what == "grid":
        draw_grid(args, tokens, maps, model.config)
    elif args.what == "head":
        layer, head = (0 if args.layer is None else args.layer), (0 if args.head is None else args.head)
        weights = layer_weights(maps, layer, weightless_layers(model.config))
        if not 0 <= head < weights.shape[0]:
            raise AttnlabError(f"--head {head}: this model has heads 0-{weights.shape[0] - 1}")
        print("wrote", save_head(out_path(args.out, f"attention_l{layer}_h{head}.png"), tokens,
                                 weights[head], layer, head, weight_label(model.config, [layer])))
    elif args.what == "search":
        if not (args.source and args.target):
            raise AttnlabError("search needs --from WORD (looking) and --to WORD (looked at)")
        ranking, query, targets = search(maps, args.text, token_spans(tokenizer, args.text),
                                         args.source, args.target)
        print(f"token {query} ({tokens[query]!r}) looking at tokens {targets} "
              f"({''.join(tokens[t] for t in targets)!r}); {FROM_0} (the article counts "
              "from 1):")
        for weight, layer, head in ranking[:args.top]:
            print(f"  {layer_head(layer, head)}: {args.source} → {args.target} = {weight:.3f}")
    else:
        if len(tokens) < 2:     # every statistic averages over the queries after the first
            raise AttnlabError(f"the text is {len(tokens)} token; heads stats averages over the "
                               "tokens after the first, so give a --text of at least 2 tokens "
                               "(a sentence shows the patterns)")
        print_stats(maps, model.config)
    return 0


PIECE_VIEWS = ("sinks", "gates", "chosen")


def piece_view(args, model, tokenizer) -> list[str]:
    """heads sinks, gates or chosen: the lines attnlab/pieces.py writes for the text."""
    tokens, reads = pieces.read(model, tokenizer, args.text, args.what)
    if args.what == "sinks":
        return pieces.sink_lines(tokens, reads, args.layer)
    if args.what == "gates":
        return pieces.gate_lines(tokens, reads, args.layer)
    top_k = model.blocks[next(iter(reads))].attn.top_k
    lines = pieces.chosen_lines(tokens, reads, args.layer, top_k)
    layer = pieces.pick_layer(reads, args.layer, lambda r: -pieces.chosen_numbers(r)[0].mean())
    return lines + ["wrote " + str(pieces.save_chosen(out_path(args.out, f"indexer_chosen_l{layer}.png"),
                                                      tokens, reads, layer))]


def print_stats(maps, config) -> None:
    """One line per head. Entropy measures a distribution: a layer whose rows are none
    (differential attention's sum to 1 - λ and may go below 0) gets n/a, and a note why."""
    apart = not_distributions(config)
    if apart:
        layers = ", ".join(map(str, apart))
        names = ", ".join(dict.fromkeys(f"model.mechanism={n}" for n in apart.values()))
        print(f"note: no entropy for layer{'s' if len(apart) > 1 else ''} {layers}: the "
              f"weights of {names} are no distribution (a row need not sum to 1 and may go "
              "below 0), so entropy does not apply", file=sys.stderr)
    print(f"{FROM_0} (the article counts from 1)")
    print(f"{'layer':>5} {'head':>4} {'entropy':>8} {'distance':>8} {'prev':>6} {'next':>6} "
          f"{'first':>6}  pattern")
    for layer, weights in enumerate(maps):
        for head in range(0 if weights is None else weights.shape[0]):
            s = head_stats(weights[head])
            entropy = "n/a" if layer in apart else f"{s['entropy']:.3f}"
            print(f"{layer:>5} {head:>4} {entropy:>8} {s['mean_distance']:8.2f} "
                  f"{s['previous']:6.2f} {s['next']:6.2f} {s['first']:6.2f}  {s['label']}")


if __name__ == "__main__":
    with errors_as_lines():
        sys.exit(main())
