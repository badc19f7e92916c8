"""Cross-attention at work: an encoder-decoder learns to reverse a string.

    python -m attnlab.seq2seq --out figures        # about a minute on a 2-core CPU

The encoder reads a string of 3 to 10 letters; the decoder writes it backwards, one
letter at a time, each step asking with cross-attention which input letter it needs.
To reverse, output step i must look at input position n - 1 - i, so the decoder's
cross-attention weights draw an anti-diagonal: the figure this writes. Accuracy is
exact match (the whole string right) on held-out strings, which training never sees
(a string is held out when a hash of it says so, so the split is fixed).
"""
from __future__ import annotations

import sys
import time
import zlib
from pathlib import Path

import torch

from attnlab.plotting import WEIGHT, pyplot, save_figure
from attnlab.options import out_option
from engine.cli import Parser, errors_as_lines

LETTERS = "abcdefghijklmnopqrstuvwxyz"
PAD, BOS, EOS = 0, 1, 2                     # then the letters from 3 on
VOCAB = 3 + len(LETTERS)
MIN_LEN, MAX_LEN = 3, 10


def held_out(word: str) -> bool:
    return zlib.crc32(word.encode()) % 10 == 0


def random_words(n: int, g: torch.Generator, want_held_out: bool) -> list[str]:
    words = []
    while len(words) < n:
        length = int(torch.randint(MIN_LEN, MAX_LEN + 1, (), generator=g))
        word = "".join(LETTERS[i] for i in torch.randint(0, 26, (length,), generator=g).tolist())
        if held_out(word) == want_held_out:
            words.append(word)
    return words


def batch(words: list[str]):
    """(src, src_padding, decoder input, targets) for reversing `words`."""
    n, width = len(words), MAX_LEN + 1
    src = torch.full((n, MAX_LEN), PAD)
    dec = torch.full((n, width), PAD)
    tgt = torch.full((n, width), -1)
    for i, w in enumerate(words):
        ids = [3 + LETTERS.index(c) for c in w]
        src[i, :len(ids)] = torch.tensor(ids)
        out = ids[::-1] + [EOS]
        dec[i, :len(out)] = torch.tensor([BOS] + out[:-1])
        tgt[i, :len(out)] = torch.tensor(out)
    return src, src == PAD, dec, tgt


def train(steps: int = 1500, seed: int = 0, log=print):
    """The encoder-decoder after `steps` updates of 64 strings each. Bounded by steps,
    not by time, so the result is the same on every machine."""
    from model import ModelConfig
    from model.seq2seq import EncoderDecoder
    torch.manual_seed(seed)
    model = EncoderDecoder(ModelConfig(vocab_size=VOCAB, block_size=MAX_LEN + 1, n_layer=2,
                                       n_head=4, n_embd=64, position="learned"))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed + 1)
    for step in range(steps):
        src, pad, dec, tgt = batch(random_words(64, g, want_held_out=False))
        loss = model(src, dec, tgt, src_padding=pad).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 250 == 0:
            log(f"step {step:>4}: loss {loss.item():.3f}")
    return model.eval()


@torch.no_grad()
def accuracy(model, words: list[str]) -> float:
    src, pad, _, _ = batch(words)
    out = model.generate(src, BOS, MAX_LEN + 1, pad)
    right = 0
    for word, ids in zip(words, out.tolist()):
        ids = ids[:ids.index(EOS)] if EOS in ids else ids
        right += "".join(LETTERS[i - 3] if 3 <= i < VOCAB else "?" for i in ids) == word[::-1]
    return right / len(words)


@torch.no_grad()
def plot_cross_attention(model, word: str, path: Path) -> Path:
    src, pad, dec, _ = batch([word])
    n = len(word)
    maps = model(src, dec, src_padding=pad, return_attention=True).cross_attentions
    weights = maps[-1][0].mean(0)[: n + 1, :n]               # last layer, heads averaged
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(4.6, 4.2))
    image = ax.imshow(weights.detach().float().numpy(), cmap="viridis", vmin=0, vmax=1)
    fig.colorbar(image, ax=ax, label=WEIGHT)       # cross-attention is always a softmax
    ax.set_xticks(range(n))
    ax.set_xticklabels(list(word))
    ax.set_yticks(range(n + 1))
    ax.set_yticklabels(list(word[::-1]) + ["<end>"])
    ax.set_xlabel("input letter (encoder key)")
    ax.set_ylabel("letter being written (decoder query)")
    ax.set_title("cross-attention while reversing\n(last layer, heads averaged)", fontsize=10)
    return save_figure(fig, path)


def main(argv=None) -> int:
    parser = Parser("python -m attnlab.seq2seq", __doc__)
    parser.add_argument("--steps", type=int, default=1500, help="training steps (default 1500)")
    parser.add_argument("--out", type=out_option, default="figures", help="folder for the figure (default: "
                        "figures/, which git ignores)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    model = train(args.steps)
    test = random_words(1000, torch.Generator().manual_seed(12345), want_held_out=True)
    acc = accuracy(model, test)
    print(f"exact-match accuracy on 1,000 held-out strings: {acc:.1%} "
          f"({time.perf_counter() - started:.0f} s)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(plot_cross_attention(model, "attention", out / "cross_attention.png"))
    return 0


if __name__ == "__main__":
    with errors_as_lines():
        sys.exit(main())
