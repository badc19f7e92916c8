"""The article's figures, regenerated from the code that implements each idea.

    python -m attnlab.figures all --out docs/figures     # every figure, numbers printed
    python -m attnlab.figures masks --out masks.png      # one of: softmax, sqrt_dk,
                                                         # blend, masks, cost, induction,
                                                         # cross_attention

softmax   softmax(1, 2, 3) and the same scores x8: why large scores saturate
sqrt_dk   the spread of q·k for random unit-variance vectors grows like √d_k (measured)
blend     the movie-night example: weights 0.5/0.3/0.2 over scores 9/2/5 give 6.1
masks     causal, sliding-window and local + global masks
cost      O(T²) against O(T·W): scores computed, and measured time when
          bench/attention_cost.py has written bench/out/attention_cost.json
induction the previous-token and induction heads a 2-layer model grows (attnlab.induction)
cross_attention  an encoder-decoder's cross-attention while reversing a word (attnlab.seq2seq)
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from model.attention import eager_attention
from model.attention import Mask, visible
from common.errors import AttnlabError
from attnlab.plotting import (check_figure_out, default_out, label_tokens, out_path, pyplot,
                              refuse_a_path_through_a_file, save_figure)
from attnlab.options import out_option
from engine.cli import Parser, errors_as_lines

COST_JSON = Path(__file__).resolve().parent.parent / "bench" / "out" / "attention_cost.json"


def softmax_saturation(out: Path) -> Path:
    scores = torch.tensor([1.0, 2.0, 3.0])
    rows = {"scores 1, 2, 3": torch.softmax(scores, 0), "same scores x8": torch.softmax(8 * scores, 0)}
    for name, p in rows.items():
        print(f"softmax({name}) = ({', '.join(f'{x:.2f}' for x in p.tolist())})")
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2), sharey=True)
    for ax, (name, p) in zip(axes, rows.items()):
        ax.bar(["key 1", "key 2", "key 3"], p.numpy(), color="tab:blue")
        ax.set_title(name)
        for i, v in enumerate(p.tolist()):
            ax.text(i, v + 0.02, f"{v:.2f}", ha="center")
    axes[0].set_ylabel("attention weight")
    return save_figure(fig, out, dpi=110)


def sqrt_dk_growth(out: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    dims = [4, 16, 64, 256, 512, 1024]
    raw, scaled = [], []
    for d in dims:
        q, k = torch.randn(20000, d, generator=g), torch.randn(20000, d, generator=g)
        dots = (q * k).sum(-1)
        raw.append(dots.std().item())
        scaled.append((dots / math.sqrt(d)).std().item())
        print(f"d_k = {d:>4}: spread of q·k {raw[-1]:6.2f} (√d_k = {math.sqrt(d):5.2f}); "
              f"after dividing by √d_k {scaled[-1]:.2f}")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(dims, raw, marker="o", label="spread of q·k (measured)")
    ax.plot(dims, [math.sqrt(d) for d in dims], linestyle="--", label="√d_k")
    ax.plot(dims, scaled, marker="o", label="spread of q·k / √d_k")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("d_k")
    ax.set_ylabel("standard deviation")
    ax.legend()
    ax.grid(alpha=0.3)
    return save_figure(fig, out, dpi=110)


def movie_night_blend(out: Path) -> Path:
    weights = torch.tensor([0.5, 0.3, 0.2])
    values = torch.tensor([9.0, 2.0, 5.0])
    q = torch.ones(1, 1, 1, 1)                               # d_k = 1: q·k = log w
    result, w = eager_attention(q, weights.log().view(1, 1, 3, 1), values.view(1, 1, 3, 1),
                                Mask.over(2, 1, 3), need_weights=True)
    print(f"movie night: 0.5·9 + 0.3·2 + 0.2·5 = {result.item():.1f} "
          f"(weights from the softmax: {', '.join(f'{x:.2f}' for x in w.flatten().tolist())})")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.2))
    names = ["friend A (9)", "friend B (2)", "friend C (5)"]
    ax.bar(names, (weights * values).numpy(), color="tab:orange", label="weight x value")
    ax.axhline(result.item(), color="black", linestyle="--", label=f"blend = {result.item():.1f}")
    ax.legend()
    ax.set_title("The output is a weighted average of the values")
    return save_figure(fig, out, dpi=110)


def mask_patterns(length: int, window: int, n_global: int) -> dict[str, torch.Tensor]:
    pos = torch.arange(length)
    return {
        "causal": visible(pos, pos),
        f"sliding window W={window}": visible(pos, pos, window),
        f"local (W={window}) + global (G={n_global})": visible(pos, pos, window, n_global),
    }


def save_mask_patterns(path: str | Path, length: int = 24, window: int = 6, n_global: int = 2):
    """One panel per pattern: rows are queries, columns keys, dark = may attend."""
    plt = pyplot()
    patterns = mask_patterns(length, window, n_global)
    fig, axes = plt.subplots(1, len(patterns), figsize=(4 * len(patterns) + 1, 4.2),
                             layout="constrained")
    positions = [str(i) for i in range(length)]
    from matplotlib.colors import ListedColormap
    two = ListedColormap(["#f7fbff", "#2171b5"])          # hidden, may attend
    for ax, (title, mask) in zip(axes, patterns.items()):
        image = ax.imshow(mask.numpy(), cmap=two, vmin=0, vmax=1)
        label_tokens(ax, positions)
        ax.set_title(f"{title}\n{int(mask.sum())} of {length * length} scores computed", fontsize=9)
        ax.set_xlabel("key position (looked at)")
        ax.set_ylabel("query position (looking)")
    # Two colours, so the scale is a key: what each means for the score there.
    scale = fig.colorbar(image, ax=list(axes), ticks=[0.25, 0.75], shrink=0.5)
    scale.ax.set_yticklabels(["hidden (-inf)", "may attend"])
    scale.set_label("the score at (query, key)")
    return save_figure(fig, path, dpi=110)


def cost_curve(out: Path, window: int = 256) -> Path:
    lengths = [2 ** i for i in range(8, 15)]
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].plot(lengths, [T * (T + 1) / 2 for T in lengths], marker="o", label="causal: T(T+1)/2")
    axes[0].plot(lengths, [T * window for T in lengths], marker="o", label=f"window: about T·{window}")
    axes[0].set_title("scores computed")
    if COST_JSON.is_file():
        rows = json.loads(COST_JSON.read_text())
        for label in ("sdpa causal", "banded window", "sdpa + window mask"):
            pts = [(r["T"], r["seconds"]) for r in rows
                   if r["backend"] == label and r["pass"] == "fwd+bwd" and r["device"] == "cpu"]
            if pts:
                axes[1].plot(*zip(*pts), marker="o", label=label)
        axes[1].set_title("measured forward + backward time (bench/attention_cost.py)")
        axes[1].set_ylabel("seconds")
    else:
        axes[1].text(0.5, 0.5, "run bench/attention_cost.py\nfor measured times",
                     ha="center", va="center", transform=axes[1].transAxes)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    out = save_figure(fig, out, dpi=110)
    print(f"at T = 8192: causal computes {8192 * 8193 // 2:,} scores, a window of {window} "
          f"about {8192 * window:,} ({8192 * window / (8192 * 8193 / 2):.2f}x)")
    return out


def induction_heads(out: Path) -> Path:
    """attnlab.induction's experiment (about 15 s): the previous-token head and the
    induction head of a 2-layer attention-only model trained on repeated spans."""
    from attnlab.induction import plot_heads, report, train_attention_only
    model = train_attention_only(log=lambda *a: None)
    _, _, prev, induct = report(model, 12, log=lambda *a: None)
    return plot_heads(model, 12, {"previous-token head": prev, "induction head": induct}, out)


def cross_attention(out: Path) -> Path:
    """attnlab.seq2seq's demo, shorter (about 20 s): the decoder's cross-attention
    while it reverses "attention", an anti-diagonal."""
    from attnlab.seq2seq import plot_cross_attention, train
    return plot_cross_attention(train(steps=1000, log=lambda *a: None), "attention", out)


FIGURES = {"softmax": softmax_saturation, "sqrt_dk": sqrt_dk_growth, "blend": movie_night_blend,
           "masks": save_mask_patterns, "cost": cost_curve, "induction": induction_heads,
           "cross_attention": cross_attention}
# The file each figure is written to, where not NAME.png: the name the README and the docs
# show it under, so that `all --out docs/figures` renews theirs instead of adding another.
FILES = {"induction": "induction_heads.png"}


def file_of(name: str) -> str:
    return FILES.get(name, f"{name}.png")


def main(argv=None):
    parser = Parser("python -m attnlab.figures", __doc__)
    parser.add_argument("figure", choices=["all", *FIGURES])
    parser.add_argument("--out", type=out_option, default=None, help="a PNG path or a folder (for `all`, a "
                        "folder; default: figures/, which git ignores)")
    args = parser.parse_args(argv)
    out = args.out or default_out()
    if args.figure == "all":
        if Path(out).suffix and not Path(out).is_dir():
            raise AttnlabError(f"--out {out}: `all` writes a figure each into a folder; give a "
                               "folder, or name one figure to write it to a file")
        refuse_a_path_through_a_file(str(Path(out) / "softmax.png"))
        for name, make in FIGURES.items():
            print(f"wrote {make(Path(out) / file_of(name))}")
    else:
        check_figure_out(out)
        print(f"wrote {FIGURES[args.figure](out_path(out, file_of(args.figure)))}")


if __name__ == "__main__":
    with errors_as_lines():
        main()
