"""The article's claims about a real encoder, measured on it (all-MiniLM-L6-v2 or any
BERT-family folder):

    python -m attnlab.article bank     --run DIR   # §02: one word, two meanings
    python -m attnlab.article distance --run DIR   # §05: local early, longer range later
    python -m attnlab.article leak                 # §04: why a decoder needs the causal mask

bank: "bank" enters "the river bank eroded" and "the savings bank collapsed" as the same
vector (same token, same position) and leaves each layer as a different one; printed is
the cosine similarity of the two "bank" vectors entering each layer and leaving the last.

distance: for each layer, the mean over heads and queries of Σ_k w_qk·|q − k| (how far
a query looks, in tokens), and the share of attention parked on [CLS] and [SEP] (the
separator heads), over a few sentences.

leak: the tiny preset trained twice as a language model on the bundled plays, with the
causal mask and without it (model.causal=false). Without it, position i reads token
i + 1, the very token it is asked to predict: the training loss collapses far below the
causal run's, one head puts its weight one step ahead, and the model has learned to copy,
not to predict, so what it writes falls apart (at the last position there is no next
token to copy). Both write the same way: each new character from a full re-read of the
text so far, temperature 0.8. (sample.py refuses such a run and sends its user here.)
"""
from __future__ import annotations

import contextlib
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from common.errors import AttnlabError
from attnlab.capture import attention_maps, run_with_cache
from attnlab.options import add_run_options, load, out_option
from attnlab.plotting import NUMBERING
from engine.cli import Parser, errors_as_lines

BANK = ("the river bank eroded", "the savings bank collapsed")
SENTENCES = ("The trophy didn't fit in the suitcase because it was too big.",
             "The animal didn't cross the street because it was too tired.",
             "She read the letter twice before she put it back in the drawer.")


@torch.no_grad()
def bank_cosines(model, tokenizer, texts=BANK, word: str = "bank") -> list[float]:
    """Cosine of `word`'s vectors in the two texts entering each block, then leaving
    the last: n_layer + 1 values, the first the embedding layer's output."""
    L = model.config.n_layer
    vectors = []
    for text in texts:
        ids = tokenizer.encode(text)
        pieces = tokenizer.token_strings(ids)
        if word not in pieces:
            raise AttnlabError(f"{word!r} is not one token of {text!r}")
        at = pieces.index(word)
        names = [f"blocks.{l}.resid_pre" for l in range(L)] + [f"blocks.{L - 1}.resid_post"]
        idx = torch.tensor([ids], device=next(model.parameters()).device)
        _, cache = run_with_cache(model, idx, only=names)
        vectors.append(torch.stack([cache[n][0, at].float().cpu() for n in names]))
    return torch.cosine_similarity(vectors[0], vectors[1], dim=-1).tolist()


@torch.no_grad()
def distance_per_layer(model, tokenizer, texts=SENTENCES) -> list[tuple[float, float]]:
    """(mean attention distance in tokens, share of weight on special tokens) per layer."""
    special = getattr(tokenizer, "special_ids", set())
    sums = torch.zeros(model.config.n_layer, 2)
    for text in texts:
        ids = tokenizer.encode(text)
        _, maps = attention_maps(model, tokenizer, text)
        T = len(ids)
        gap = (torch.arange(T)[:, None] - torch.arange(T)[None, :]).abs().float()
        on_special = torch.tensor([i in special for i in ids])
        for layer, w in enumerate(maps):                          # (H, T, T)
            sums[layer, 0] += (w * gap).sum(-1).mean()
            sums[layer, 1] += w[..., on_special].sum(-1).mean()
    return [(d / len(texts), s / len(texts)) for d, s in sums.tolist()]


# -- §04: the leak --------------------------------------------------------------------

LEAK_STEPS = 300                # the tiny preset's model: 12 s of CPU time for both runs
LEAK_PROMPT = "ROMEO:\n"


@dataclass
class LeakRow:
    causal: bool
    train_loss: float            # the mean of the last tenth of the steps' losses
    val_loss: float
    curve: list                  # (step, training loss)
    last_loss: float             # val loss at the last position, which has no next token to read
    next_mass: float             # mean weight a query puts on the key one step ahead, best head
    head: tuple                  # (layer, head) of that head, from 0
    pattern: torch.Tensor        # that head's weights on one validation window (T, T)
    sample: str
    tokens: list                 # that window's tokens, one by one


def train_lm(causal: bool, steps: int, out: Path, data: str = "", log=lambda *a, **k: None,
             extra: tuple = ()):
    """The tiny preset trained as a language model for `steps` steps, in out/ (with
    `extra` command-line overrides on top); its Run."""
    from engine import cli
    from engine.loop import train
    from engine.run import setup_run
    cfg = cli.build("tiny", [f"--model.causal={str(causal).lower()}", f"--train.max_iters={steps}",
                             f"--train.eval_interval={steps}", "--train.log_interval=1",
                             "--train.lr=1e-2", f"--train.warmup_iters={max(1, steps // 20)}",
                             f"--train.out_dir={out}", f"--train.run_name={'causal' if causal else 'not-causal'}",
                             *([f"--data.path={data}"] if data else []), *extra])
    run = setup_run(cfg, log=log)
    train(run)
    return run


@torch.no_grad()
def next_position_mass(model, x: torch.Tensor) -> tuple[float, tuple[int, int], torch.Tensor]:
    """(mean weight on key i + 1 over the queries of x (B, T), for the head with most of
    it; that head's (layer, head); its pattern on x[0])."""
    names = [f"blocks.{l}.pattern" for l in range(model.config.n_layer)]
    _, cache = run_with_cache(model, x, only=names)
    mass = torch.stack([cache[n].float().diagonal(offset=1, dim1=-2, dim2=-1).mean(dim=(0, -1))
                        for n in names])                                 # (L, H)
    layer, head = divmod(int(mass.argmax()), mass.shape[1])
    return mass.max().item(), (layer, head), cache[names[layer]][0, head].float().cpu()


@torch.no_grad()
def write(model, tokenizer, prompt: str, n: int, seed: int = 0, temperature: float = 0.8) -> str:
    """`n` tokens after `prompt`, each drawn from a full re-read of the newest
    block_size tokens (no cache: a cache would hand an encoder keys computed before
    the text after them existed)."""
    g = torch.Generator().manual_seed(seed)
    start = tokenizer.encode(prompt)
    ids = torch.tensor([start])
    for _ in range(n):
        logits = model(ids[:, -model.config.block_size:]).logits[0, -1].float()
        ids = torch.cat([ids, torch.multinomial((logits / temperature).softmax(-1), 1, generator=g)[None]], 1)
    return tokenizer.decode(ids[0, len(start):].tolist())


def leak(steps: int = LEAK_STEPS, runs: Path | None = None, data: str = "",
         sample_tokens: int = 120, log=lambda *a, **k: None, extra: tuple = ()) -> list[LeakRow]:
    """Train the causal and the non-causal language model and measure each."""
    from data.tokens import Batches
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(runs) if runs else Path(tmp)
        rows = []
        for causal in (True, False):
            log(f"training the tiny preset {steps} steps with model.causal={str(causal).lower()}")
            with contextlib.redirect_stdout(sys.stderr):     # the loop's eval lines: progress
                run = train_lm(causal, steps, out, data, extra=extra)
            records = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
            curve = [(r["step"], r["loss"]) for r in records if "loss" in r]
            tail = [loss for _, loss in curve[-max(1, len(curve) // 10):]]
            val = [r["val_loss"] for r in records if "val_loss" in r][-1]
            model = run.model.eval()
            x, y = next(Batches(run.data.val, 32, model.config.block_size, split="val").spaced(1))
            with torch.no_grad():
                last = torch.nn.functional.cross_entropy(model(x).logits[:, -1].float(), y[:, -1]).item()
            mass, head, pattern = next_position_mass(model, x)
            rows.append(LeakRow(causal, sum(tail) / len(tail), val, curve, last, mass, head, pattern,
                                write(model, run.data.tokenizer, LEAK_PROMPT, sample_tokens),
                                [run.data.tokenizer.decode([i]) for i in x[0].tolist()]))
    return rows


def leak_figure(rows: list[LeakRow], path: Path) -> Path:
    from attnlab.plotting import label_tokens, pyplot, save_figure, weight_scale
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.5), layout="constrained")
    for r in rows:
        steps, losses = zip(*r.curve)
        axes[0].plot(steps, losses, label="causal" if r.causal else "model.causal=false")
    axes[0].set(xlabel="step", ylabel="training loss (nats per character)",
                title="the loss: honest, and leaked")
    axes[0].legend()
    for ax, r in zip(axes[1:], rows):
        T = min(24, r.pattern.shape[0])
        image = ax.imshow(r.pattern[:T, :T].numpy(), cmap="viridis", vmin=0, vmax=1)
        label_tokens(ax, r.tokens[:T])
        ax.set(xlabel="key (looked at)", ylabel="query (looking)",
               title=f"{'causal' if r.causal else 'causal=false'}, layer {r.head[0]} head {r.head[1]}: "
                     f"{r.next_mass:.2f} on i+1")
    weight_scale(fig, image, list(axes[1:]))
    return save_figure(fig, path)


def main(argv=None) -> int:
    parser = Parser("python -m attnlab.article", __doc__)
    parser.add_argument("what", choices=["bank", "distance", "leak"])
    add_run_options(parser, "bank, distance: a BERT-family folder such as all-MiniLM-L6-v2 (or any run)")
    parser.add_argument("--steps", type=int, default=LEAK_STEPS, help="leak: training steps of each model")
    parser.add_argument("--data", default="", help="leak: corpus (default: the bundled plays)")
    parser.add_argument("--runs", default=None, help="leak: keep the two runs in this folder "
                                                     "(default: a temporary one)")
    parser.add_argument("--out", type=out_option, default=None, help="leak: the figure (default: figures/leak.png)")
    args = parser.parse_args(argv)
    if args.what == "leak":
        if args.steps < 1:
            raise AttnlabError(f"--steps must be positive, got {args.steps}")
        from attnlab.plotting import figures_folder
        rows = leak(args.steps, args.runs, args.data, log=lambda line: print(line, file=sys.stderr))
        print(f"the tiny preset trained {args.steps} steps as a language model, with and without "
              "the causal mask (losses in nats per character):")
        print(f"{'':<20} {'train loss':>10} {'val loss':>9} {'at the last position':>21} "
              f"{'weight on i+1':>14}  (best head)")
        for r in rows:
            print(f"{'causal' if r.causal else 'model.causal=false':<20} {r.train_loss:10.3f} "
                  f"{r.val_loss:9.3f} {r.last_loss:21.3f} {r.next_mass:14.2f}  "
                  + (f"(layer {r.head[0]}, head {r.head[1]})" if r.next_mass else "(masked: 0 by construction)"))
        print("the last position has no next token to read: there the leaked model's loss is "
              "what it has to write with")
        for r in rows:
            print(f"\n{'causal' if r.causal else 'model.causal=false'} writes, after {LEAK_PROMPT!r}:")
            print(r.sample)
        path = leak_figure(rows, Path(args.out) if args.out else figures_folder() / "leak.png")
        print(f"\nfigure: {path}")
        return 0
    model, _, tokenizer, _ = load(args)
    if args.what == "bank":
        print(f"cosine of 'bank' in {BANK[0]!r} and {BANK[1]!r} ({NUMBERING}):")
        for layer, cos in enumerate(bank_cosines(model, tokenizer), start=-1):
            where = "input (embeddings)" if layer < 0 else f"after layer {layer}"
            print(f"  {where:<20} {cos:.4f}")
    else:
        print(f"{NUMBERING} (the article counts from 1)")
        print("layer  mean distance (tokens)  share on [CLS]/[SEP]")
        for layer, (distance, share) in enumerate(distance_per_layer(model, tokenizer)):
            print(f"{layer:>5}  {distance:22.2f}  {share:20.2f}")
    return 0


if __name__ == "__main__":
    with errors_as_lines():
        sys.exit(main())
