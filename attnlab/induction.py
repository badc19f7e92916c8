"""Induction heads, found and shown: the two-head circuit that copies what followed the
last occurrence of the current token (Olsson et al., "In-context Learning and
Induction Heads", 2022).

    python -m attnlab.induction --out figures/induction        # train, detect, ablate
    python -m attnlab.induction --run runs/NAME                # detect in any model

The experiment trains a 2-layer attention-only model (no MLPs) on sequences made of a
random span of tokens followed by the same span again; the span's length changes from
batch to batch, so no fixed positional offset can stand in for finding the token. The first half cannot be
predicted; the second half can, by looking back. Two heads learn to do it together:
  a previous-token head in layer 0 writes "the token before me was X" into each
  position;
  an induction head in layer 1 looks for the position whose previous token is the
  current token (via the layer-0 head's writing in its key) and copies what sits there.
Scores, as in the paper, on fresh repeated random sequences:
  previous-token score  mean weight a position puts on the position just before it;
  induction score       mean weight a second-half position t puts on t - span + 1, the
                        token after the current token's earlier occurrence.
Zero-ablating the induction head makes the second half as hard as the first again.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

from attnlab.capture import attention, weight_label
from attnlab.lens import ablate
from attnlab.options import add_run_options, load, positive, out_option, whole
from attnlab.plotting import (check_figure_out, default_out, draw_weights, layer_head, out_path,
                              pyplot, save_figure, weight_scale)
from common.errors import AttnlabError
from engine.cli import Parser, errors_as_lines


INDUCTION_THRESHOLD = 0.5          # a head scoring this on random repeats copies by content
# Spread evenly over a causal prefix of 20-40 tokens, a head gives the token just before
# about a tenth of its weight; one that gives it 0.3 or more is looking for it.
PREVIOUS_THRESHOLD = 0.3
# Spans of span/2..span tokens, tested at 3/4 of it, need 4 at least to leave 2. The
# longest keeps a batch's attention maps (32 sequences x 4 heads x (2·span)^2, kept for the
# backward pass) within a laptop's memory; the circuit shows at 16.
MAX_SPAN = 128


def repeated_sequences(n: int, span: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """(n, 2·span) token ids: a random span, then the same span again."""
    first = torch.randint(0, vocab, (n, span), generator=generator)
    return torch.cat([first, first], dim=1)


@torch.no_grad()
def head_scores(model, span: int = 20, n: int = 16, vocab: int | None = None, seed: int = 0):
    """(previous-token scores, induction scores), each (layers, heads), on repeated
    random sequences drawn from the model's vocabulary (or the first `vocab` ids)."""
    g = torch.Generator().manual_seed(seed)
    vocab = vocab or model.config.vocab_size
    span = min(span, model.config.block_size // 2)
    x = repeated_sequences(n, span, vocab, g).to(next(model.parameters()).device)
    _, maps = attention(model, x)
    T = 2 * span
    prev, induct = [], []
    t = torch.arange(span, T)                                # second-half positions
    for layer in range(model.config.n_layer):
        p = maps[layer].float()                              # (n, H, T, T)
        prev.append(p[:, :, torch.arange(1, T), torch.arange(0, T - 1)].mean(dim=(0, 2)))
        induct.append(p[:, :, t, t - span + 1].mean(dim=(0, 2)))
    return torch.stack(prev).cpu(), torch.stack(induct).cpu()


@torch.no_grad()
def half_losses(model, x: torch.Tensor, span: int, **ablation) -> tuple[float, float]:
    """Mean next-token loss on the first half and on the repeated half of x."""
    with ablate(model, **ablation):
        logits = model(x[:, :-1]).logits.float()
    loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none")
    return loss[:, :span - 1].mean().item(), loss[:, span:].mean().item()


def train_attention_only(vocab: int = 64, span: int = 16, steps: int = 3000, seed: int = 0,
                         log=print):
    """A 2-layer, attention-only model trained on repeated random spans, for exactly
    `steps` updates: a time limit would make what it learns depend on the machine."""
    from model import GPT, ModelConfig
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=vocab, block_size=2 * span, n_layer=2, n_head=4, n_embd=64,
                      mlp="none", position="learned")
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed + 1)
    for step in range(steps):
        # A span of a different length each batch: a head that attended to a fixed
        # offset would be right for one length only, so copying has to go by content.
        x = repeated_sequences(32, int(torch.randint(span // 2, span + 1, (), generator=g)), vocab, g)
        loss = model(x[:, :-1], x[:, 1:]).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step == 0:                       # what to expect, said once
            log(f"the loss falls to about half of ln {vocab} = {math.log(vocab):.2f} once the "
                "repeated half is learned")
        if step % 500 == 0 or step == steps - 1:
            log(f"step {step:>4}: loss {loss.item():.3f}")
    return model.eval()


def found_head(kind: str, scores: torch.Tensor, best: tuple[int, int], threshold: float) -> str:
    """The best head of a kind, or none where even the best scores under the threshold
    (the best of heads that do not do the job is not a head that does it)."""
    if scores.max() >= threshold:
        return f"{kind} head: layer {best[0]}, head {best[1]} (score {scores.max():.3f})"
    return (f"no {kind} head (none scores {threshold} or more; the best, layer {best[0]}, "
            f"head {best[1]}, scores {scores.max():.3f})")


def report(model, span: int, vocab: int | None = None, log=print):
    """The score table, and the best previous-token and induction heads."""
    prev, induct = head_scores(model, span=span, vocab=vocab)
    log(f"{'layer':>5} {'head':>4} {'previous-token':>15} {'induction':>10}")
    for layer in range(prev.shape[0]):
        for head in range(prev.shape[1]):
            log(f"{layer:>5} {head:>4} {prev[layer, head]:15.3f} {induct[layer, head]:10.3f}")
    best_prev = divmod(int(prev.argmax()), prev.shape[1])
    best_induct = divmod(int(induct.argmax()), induct.shape[1])
    log(f"{found_head('previous-token', prev, best_prev, PREVIOUS_THRESHOLD)}; "
        f"{found_head('induction', induct, best_induct, INDUCTION_THRESHOLD)}")
    return prev, induct, best_prev, best_induct


def plot_heads(model, span: int, heads: dict[str, tuple[int, int]], path: Path,
               vocab: int | None = None) -> Path:
    g = torch.Generator().manual_seed(7)
    x = repeated_sequences(1, min(span, 12, model.config.block_size // 2),
                           vocab or model.config.vocab_size, g)
    x = x.to(next(model.parameters()).device)
    _, maps = attention(model, x)
    # The token ids on the axes: the span written twice is what a learner looks for.
    ids = [str(i) for i in x[0].tolist()]
    plt = pyplot()
    fig, axes = plt.subplots(1, len(heads), figsize=(4.6 * len(heads) + 1, 4.4), squeeze=False,
                             layout="constrained")
    signed = any(bool((maps[layer][0, head] < 0).any()) for layer, head in heads.values())
    for ax, (title, (layer, head)) in zip(axes[0], heads.items()):
        image = draw_weights(ax, maps[layer][0, head].float().cpu(), keys=ids, signed=signed)
        ax.set_title(f"{title}\n{layer_head(layer, head)} (from 0)", fontsize=10)
        ax.set_xlabel("token looked at (key)")
        ax.set_ylabel("token looking (query)")
    weight_scale(fig, image, axes[0].tolist(), weight_label(model.config))
    return save_figure(fig, path)


def figure_path(given: str | None, folder: str) -> Path:
    """--out as a folder for induction_heads.png (made where missing), or as the figure's
    own name where it ends in an image suffix (check_figure_out has vetted that suffix):
    out_path's rule."""
    return out_path(given or folder, "induction_heads.png")


def detect(args) -> int:
    """Scores and the two heads' patterns in a model of the user's (--run)."""
    check_figure_out(args.out or "")
    model, _, _, ckpt = load(args)
    if not model.config.causal:
        raise AttnlabError("induction heads copy what followed an earlier occurrence of the "
                           "current token, a decoder's trick; this model is an encoder "
                           "(model.causal=false): look at it with python -m attnlab.heads")
    path = figure_path(args.out, default_out(ckpt))     # a refused folder refused first
    _, _, prev, induct = report(model, span=min(20, model.config.block_size // 2))
    print("wrote", plot_heads(model, 12, {"previous-token head": prev, "induction head": induct},
                              path))
    return 0


def main(argv=None) -> int:
    parser = Parser("python -m attnlab.induction", __doc__)
    add_run_options(parser, "detect the heads in this model: a run directory or name, "
                    "checkpoint folder, or transformers folder",
                    without="train a 2-layer model and detect them in it")
    parser.set_defaults(run=None)
    parser.add_argument("--steps", type=positive, default=3000, help="training steps (default 3000)")
    parser.add_argument("--span", type=whole(4, MAX_SPAN), default=16, help="length of the "
                        f"repeated span (4 to {MAX_SPAN}; default 16)")
    parser.add_argument("--out", type=out_option, default=None, help="folder for the figure "
                        "(induction_heads.png), or its own file name ending in .png, .svg or "
                        ".pdf (default: figures/induction, which git ignores; with --run, the "
                        "run's figures/)")
    args = parser.parse_args(argv)
    if args.run is not None:
        return detect(args)
    check_figure_out(args.out or "")
    vocab = 64
    model = train_attention_only(vocab, args.span, args.steps)
    test_span = args.span * 3 // 4                  # a length it was trained on, not the longest
    _, induct, best_prev, best_induct = report(model, test_span)
    # Heads often share the work: switch off every head that scores as an induction head.
    inductions = [divmod(i, induct.shape[1]) for i in (induct >= INDUCTION_THRESHOLD).flatten().nonzero()[:, 0].tolist()]
    x = repeated_sequences(64, test_span, vocab, torch.Generator().manual_seed(99))
    first, second = half_losses(model, x, test_span)
    _, one_off = half_losses(model, x, test_span, heads=[best_induct])
    _, all_off = half_losses(model, x, test_span, heads=inductions)
    _, prev_off = half_losses(model, x, test_span, heads=[best_prev])
    print(f"loss per token: first half {first:.3f}; repeated half {second:.3f}; repeated half "
          f"with the best induction head off {one_off:.3f}, with all {len(inductions)} induction "
          f"heads (score >= {INDUCTION_THRESHOLD}) off {all_off:.3f}, with the previous-token "
          f"head off {prev_off:.3f}")
    print("wrote", plot_heads(model, test_span, {"previous-token head": best_prev,
                                        "induction head": best_induct},
                              figure_path(args.out, "figures/induction")))
    return 0


if __name__ == "__main__":
    with errors_as_lines():
        sys.exit(main())
