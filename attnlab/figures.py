"""Pictures of the ideas: the mask patterns (causal, sliding window, local + global).

    python -m attnlab.figures masks --out masks.png --length 24 --window 6 --n_global 2
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from model.attention import visible


def mask_patterns(length: int, window: int, n_global: int) -> dict[str, torch.Tensor]:
    pos = torch.arange(length)
    return {
        "causal": visible(pos, pos),
        f"sliding window W={window}": visible(pos, pos, window),
        f"local (W={window}) + global (G={n_global})": visible(pos, pos, window, n_global),
    }


def save_mask_patterns(path: str | Path, length: int = 24, window: int = 6, n_global: int = 2):
    """One panel per pattern: rows are queries, columns keys, dark = may attend."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    patterns = mask_patterns(length, window, n_global)
    fig, axes = plt.subplots(1, len(patterns), figsize=(4 * len(patterns), 4.2))
    for ax, (title, mask) in zip(axes, patterns.items()):
        ax.imshow(mask.numpy(), cmap="Blues", vmin=0, vmax=1.3)
        ax.set_title(f"{title}\n{int(mask.sum())} of {length * length} scores computed", fontsize=9)
        ax.set_xlabel("key position (looked at)")
        ax.set_ylabel("query position (looking)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def main(argv=None):
    parser = argparse.ArgumentParser(description="Draw the attention mask patterns as a PNG.")
    parser.add_argument("figure", choices=["masks"])
    parser.add_argument("--out", default="masks.png")
    parser.add_argument("--length", type=int, default=24)
    parser.add_argument("--window", type=int, default=6)
    parser.add_argument("--n_global", type=int, default=2)
    args = parser.parse_args(argv)
    print(save_mask_patterns(args.out, args.length, args.window, args.n_global))


if __name__ == "__main__":
    main()
