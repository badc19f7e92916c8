"""Turning the model's last-position logits into the next token."""
from __future__ import annotations

import torch


def next_token_distribution(logits: torch.Tensor, temperature: float = 1.0,
                            top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Probabilities over the vocabulary for the next token, (B, V) -> (B, V).

    Temperature divides the logits (below 1 sharpens, above 1 flattens); top-k keeps
    the k most likely tokens; top-p keeps the smallest set whose probability reaches p
    (nucleus sampling, arXiv:1904.09751). Temperature 0 means greedy: all mass on the
    arg-max."""
    logits = logits.float()
    # A NaN scores nothing and +inf beats every finite logit; a row with no finite logit
    # says nothing, so it is drawn uniformly. Either way the softmax below has a 0 to
    # anchor on and never hands the sampler NaN (weights that overflowed do this).
    logits = torch.nan_to_num(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max)
    logits = logits.masked_fill(~torch.isfinite(logits).any(-1, keepdim=True), 0.0)
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.size(-1)).float()
    # Shifted so the largest is 0 first (the softmax is the same), and divided by no less than
    # float32's smallest normal: a temperature of 1e-40 or 1e-320 overflowed to inf (NaN).
    temperature = min(max(temperature, torch.finfo(logits.dtype).tiny), torch.finfo(logits.dtype).max)
    logits = (logits - logits.max(-1, keepdim=True).values) / temperature
    if 0 < top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # Drop a token when the tokens before it already reach top_p (the first always stays).
        drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= top_p
        drop_sorted[..., 0] = False      # a top_p below float32's range compares as 0
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.softmax(logits, dim=-1)


def sample_next(logits, temperature=1.0, top_k=0, top_p=1.0, generator=None) -> torch.Tensor:
    """Draw one token per row: (B, V) logits -> (B, 1) token ids."""
    probs = next_token_distribution(logits, temperature, top_k, top_p)
    if temperature == 0:
        return probs.argmax(-1, keepdim=True)
    return torch.multinomial(probs, 1, generator=generator)
