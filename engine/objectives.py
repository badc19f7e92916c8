"""What a run learns to predict (train.objective), as registry entries with their facts.

* `next`: the next token at every position (a language model, GPT's objective). The
  training window's targets are its inputs shifted by one.
* `mlm`: BERT's masked-language modelling (arXiv:1810.04805, §3.1, data/masking.py):
  15% of the tokens are chosen, most replaced by [MASK], and the model is scored on
  recovering them. It needs a mask token and bidirectional attention: a blank is
  guessed from the words on both sides of it.

The loop asks the entry for each batch's (inputs, targets) and never compares names.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from data.masking import mask_tokens


def next_token(x: torch.Tensor, y: torch.Tensor, mask_id, vocab_size, generator):
    return x, y


def masked_tokens(x: torch.Tensor, y: torch.Tensor, mask_id, vocab_size, generator):
    return mask_tokens(x, mask_id, vocab_size, generator)


@dataclass(frozen=True)
class Objective:
    batch: Callable              # (x, y, mask_id, vocab_size, generator) -> (inputs, targets)
    needs_mask_token: bool       # the tokenizer gets a [MASK] token (Tokenizer.with_mask)
    bidirectional: bool          # needs model.causal=false (a blank is read from both sides)
    draws: bool                  # its batches take random draws (the masking)
    loss_name: str               # what the eval line calls its loss
    reports_accuracy: bool       # the share of targets the model's top guess gets right
    per_byte: bool               # its loss reads as bits per byte of text (a compression rate)
    writes: bool                 # its model can write text left to right (sample.py)


OBJECTIVES = {
    "next": Objective(next_token, needs_mask_token=False, bidirectional=False, draws=False,
                      loss_name="val loss", reports_accuracy=False, per_byte=True, writes=True),
    "mlm": Objective(masked_tokens, needs_mask_token=True, bidirectional=True, draws=True,
                     loss_name="val masked-token loss", reports_accuracy=True, per_byte=False,
                     writes=False),
}


def auxiliary_loss(model: torch.nn.Module) -> torch.Tensor | float:
    """The losses a model's layers leave as `aux_loss` in a training pass, summed, for the
    step to add to the objective's: DeepSeek sparse attention's indexer learns from its KL
    to the main attention alone (model/sparse_attention.py). 0 where no layer has one."""
    losses = [m.aux_loss for m in model.modules() if getattr(m, "aux_loss", None) is not None]
    return sum(losses) if losses else 0.0


def warm_indexers(model: torch.nn.Module, on: bool) -> None:
    """Put every layer with a lightning indexer in, or out of, DeepSeek-V3.2's dense warm-up
    (model/sparse_attention.py: dense attention, the indexer's KL over every visible key)."""
    for m in model.modules():
        if hasattr(m, "dense_warmup"):
            m.dense_warmup = on


def draw_generator(seed: int, index: int, device: torch.device) -> torch.Generator:
    """The masking draw for batch `index` of a stream: a function of (seed, index) alone,
    so a resumed run masks each step exactly as the run it continues would have, and
    every evaluation masks the same validation positions (comparable losses)."""
    return torch.Generator(device=device).manual_seed((seed * 1_000_003 + index) % 2 ** 63)


def masked_accuracy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[int, int]:
    """(targets whose top-scored token is right, targets), over positions not -1."""
    scored = targets != -1
    right = (logits.argmax(-1) == targets) & scored
    return int(right.sum()), int(scored.sum())
