"""The article's claims about a real encoder, measured on it (all-MiniLM-L6-v2 or any
BERT-family folder):

    python -m attnlab.article bank     --run DIR   # §02: one word, two meanings
    python -m attnlab.article distance --run DIR   # §05: local early, longer range later

bank: "bank" enters "the river bank eroded" and "the savings bank collapsed" as the same
vector (same token, same position) and leaves each layer as a different one; printed is
the cosine similarity of the two "bank" vectors entering each layer and leaving the last.

distance: for each layer, the mean over heads and queries of Σ_k w_qk·|q − k| (how far
a query looks, in tokens), and the share of attention parked on [CLS] and [SEP] (the
separator heads), over a few sentences.
"""
from __future__ import annotations

import sys

import torch

from common.errors import AttnlabError
from attnlab.capture import attention_maps, run_with_cache
from attnlab.options import add_run_options, load
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


def main(argv=None) -> int:
    parser = Parser("python -m attnlab.article", __doc__)
    parser.add_argument("what", choices=["bank", "distance"])
    add_run_options(parser, "a BERT-family folder such as all-MiniLM-L6-v2 (or any run)")
    args = parser.parse_args(argv)
    model, _, tokenizer, _ = load(args)
    if args.what == "bank":
        print(f"cosine of 'bank' in {BANK[0]!r} and {BANK[1]!r}:")
        for layer, cos in enumerate(bank_cosines(model, tokenizer)):
            where = "input (embeddings)" if layer == 0 else f"after layer {layer}"
            print(f"  {where:<20} {cos:.4f}")
    else:
        print("layer  mean distance (tokens)  share on [CLS]/[SEP]")
        for layer, (distance, share) in enumerate(distance_per_layer(model, tokenizer)):
            print(f"{layer + 1:>5}  {distance:22.2f}  {share:20.2f}")
    return 0


if __name__ == "__main__":
    with errors_as_lines():
        sys.exit(main())
