"""BERT's masked-language-modelling objective (arXiv:1810.04805, §3.1): choose 15% of
the tokens; of those, 80% become [MASK], 10% a random token and 10% stay as they are;
the model is scored on the chosen tokens only. The random and kept ones stop it from
learning that only [MASK] positions matter, since at use time there is no [MASK]."""
from __future__ import annotations

import torch

MASK_RATE = 0.15
AS_MASK, AS_RANDOM = 0.8, 0.1          # the rest (0.1) are kept


def mask_tokens(ids: torch.Tensor, mask_id: int, vocab_size: int,
                generator: torch.Generator | None = None, rate: float = MASK_RATE,
                keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) for a batch of token ids (B, T): targets hold the original
    token where one was chosen and -1 (no loss) elsewhere. `keep` (B, T) bool marks
    tokens never chosen ([CLS], [SEP], padding)."""
    draw = torch.rand(ids.shape, generator=generator, device=ids.device)
    chosen = draw < rate
    if keep is not None:
        chosen &= ~keep
    # One more uniform draw splits the chosen into mask / random / keep.
    split = torch.rand(ids.shape, generator=generator, device=ids.device)
    random_ids = torch.randint(0, vocab_size, ids.shape, generator=generator, device=ids.device)
    inputs = torch.where(chosen & (split < AS_MASK), torch.full_like(ids, mask_id), ids)
    inputs = torch.where(chosen & (split >= AS_MASK) & (split < AS_MASK + AS_RANDOM), random_ids, inputs)
    targets = torch.where(chosen, ids, torch.full_like(ids, -1))
    return inputs, targets
