"""Fill in the blanks: what a masked-language model (BERT's objective) puts where the
text says [MASK], its top guesses with their probabilities. The encoder's counterpart
of sample.py, which writes text left to right and so needs a decoder.

    python -m attnlab.fill --run bert-folder --text "The capital of France is [MASK]."
    python -m attnlab.fill --run runs/encoder-NAME --text "To be, or not to [MASK]e"

A run of the encoder preset (train.objective=mlm) fills one character per [MASK].
"""
from __future__ import annotations

import sys

import torch

from common.errors import AttnlabError
from attnlab.capture import check_context
from attnlab.options import add_run_options, load, whole
from engine.cli import Parser, errors_as_lines
from model.readout import READOUTS


@torch.no_grad()
def fill(model, tokenizer, text: str, top: int = 5) -> list[tuple[int, list[tuple[str, float]]]]:
    """For each [MASK] of `text`: (its token index, [(token, probability)] best first)."""
    mask_id = tokenizer.mask_id
    if model.config.causal:
        raise AttnlabError("this model is a decoder: it reads left to right, so it cannot use "
                           "the words after a blank; continue a prompt with sample.py instead")
    if not READOUTS[model.config.readout].scores_tokens:
        raise AttnlabError("this encoder has no masked-LM head (a sentence encoder keeps only "
                           "hidden states); give a folder saved from BertForMaskedLM or the like")
    if mask_id is None:
        raise AttnlabError("this tokenizer has no mask token ([MASK] or <mask>)")
    ids = tokenizer.encode(text)
    check_context(model, len(ids))
    where = [i for i, t in enumerate(ids) if t == mask_id]
    if not where:
        raise AttnlabError(f"the text has no {tokenizer.token_strings([mask_id])[0]} to fill in")
    idx = torch.tensor([ids], device=next(model.parameters()).device)
    probs = torch.softmax(model(idx).logits[0].float(), dim=-1)
    out = []
    for i in where:
        p, tok = probs[i].topk(min(top, probs.size(-1)))
        out.append((i, list(zip(tokenizer.token_strings(tok.tolist()), p.tolist()))))
    return out


def main(argv=None) -> int:
    parser = Parser("python -m attnlab.fill", __doc__)
    add_run_options(parser, "a masked-LM folder (BertForMaskedLM and the like) or run")
    parser.add_argument("--text", required=True, help="text with [MASK] where a word is missing")
    parser.add_argument("--top", type=whole(1, 100), default=5,
                        help="guesses shown per blank (1 to 100; default 5)")
    args = parser.parse_args(argv)
    model, _, tokenizer, _ = load(args)
    for position, guesses in fill(model, tokenizer, args.text, args.top):
        # A character model's guesses are often a space or a newline: shown quoted.
        shown = ", ".join(f"{t if t.strip() == t and t else repr(t)} {p:.3f}" for t, p in guesses)
        print(f"token {position}: {shown}")
    return 0


if __name__ == "__main__":
    with errors_as_lines():
        sys.exit(main())
