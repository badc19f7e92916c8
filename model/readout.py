"""The output layer: from the last hidden state to a probability for every vocabulary
entry, P(next token | context) = softmax(h·W_outᵀ).

With a large vocabulary that layer can cost more than the whole Transformer: a
character-level model of Chinese text has about 3,700 entries, so at 96 wide the output
matrix holds 354k weights against 332k in three blocks, and the softmax over every entry
for every position is as much work again. Most of those entries are rare. The adaptive
softmax (Grave et al. 2017, "Efficient softmax approximation for GPUs",
arXiv:1609.04309) gives the frequent tokens (a shortlist) a full-width softmax with one
extra entry standing for "some rarer token", and scores the rare ones only when they
are the target, through a narrower projection:

    P(w) = softmax(h·W_headᵀ)[w]                            w in the shortlist
    P(w) = softmax(h·W_headᵀ)[tail] · softmax((h·P)·W_tailᵀ)[w]   otherwise

Still one normalised distribution over the whole vocabulary, so its loss is an honest
cross-entropy, comparable with the full layer's. The module itself is torch's
nn.AdaptiveLogSoftmaxWithLoss; this file adds what it needs around it: the vocabulary
ranked by frequency (it assumes frequent tokens come first), the shortlist chosen from
the training data, and the scores put back in token order for sampling and inspection.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.config import ModelConfig, ModelError

# The shortlist holds the most frequent tokens that together make up this share of the
# training tokens, so 19 targets in 20 are scored by the head alone.
SHORTLIST_COVERAGE = 0.95
TAIL_DIVISOR = 4          # the tail's projection is n_embd / 4 wide (torch's default, Grave et al.'s)


@dataclass(frozen=True)
class Readout:
    """An output layer and the facts the rest of the project asks about it, so no code
    outside the registries compares a readout's name with a string."""
    shares_embedding: bool       # can be the token embedding's own matrix (tie_embeddings)
    scores_tokens: bool = True   # has an output layer at all (an encoder without a head has not)
    shortlisted: bool = False    # the adaptive softmax: a shortlist sized by readout_shortlist
    transform: bool = False      # BERT's masked-LM head: dense, GELU and LayerNorm first,
                                 # then the output layer with a bias per vocabulary entry
    plain: bool = False          # one linear layer over the whole vocabulary and nothing
                                 # else: what GPT-2, Llama and the rest have, and what
                                 # zero_head, logit_softcap and --budget's choice work on


READOUTS = {
    "full": Readout(shares_embedding=True, plain=True),   # softmax over every entry
    "adaptive": Readout(shares_embedding=False, shortlisted=True),  # shortlist and narrow tail
    "mlm": Readout(shares_embedding=True, transform=True),          # BERT's masked-LM head
    "none": Readout(shares_embedding=False, scores_tokens=False),   # hidden states only
}


class MaskedLMTransform(nn.Module):
    """BERT's masked-LM head before its output layer (arXiv:1810.04805, as released):
    one more dense layer, exact GELU and a LayerNorm, so the last block's states need
    not be token scores themselves (they also feed sentence-level heads)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(config.n_embd, config.n_embd)
        self.norm = nn.LayerNorm(config.n_embd, eps=config.norm_eps)

    def forward(self, h):
        return self.norm(F.gelu(self.dense(h)))


def shortlist_for(counts: torch.Tensor, coverage: float = SHORTLIST_COVERAGE) -> int:
    """The fewest most-frequent tokens whose counts reach `coverage` of all counts."""
    total = counts.sum()
    if total <= 0:
        raise ValueError("no tokens to count")
    covered = counts.sort(descending=True).values.cumsum(0)
    return int((covered < coverage * total).sum()) + 1


def frequency_rank(counts: torch.Tensor) -> torch.Tensor:
    """rank[token]: 0 for the most frequent token, ties in token order."""
    order = torch.sort(counts, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(order), device=order.device)
    return rank


def head_macs(n_embd: int, vocab_size: int, shortlist: int = 0,
              tail_share: float = 1 - SHORTLIST_COVERAGE) -> float:
    """Multiply-adds per token of the output layer: the full one (shortlist 0), or the
    adaptive one, whose tail works only for the `tail_share` of tokens it holds."""
    if not shortlist:
        return n_embd * vocab_size
    narrow = n_embd // TAIL_DIVISOR
    return n_embd * (shortlist + 1) + tail_share * (n_embd * narrow + narrow * (vocab_size - shortlist))


class AdaptiveReadout(nn.Module):
    """The adaptive softmax over a vocabulary ranked by frequency. `rank` is saved with
    the weights; a new model ranks tokens by id until set_frequencies is called."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.softmax = nn.AdaptiveLogSoftmaxWithLoss(
            config.n_embd, config.vocab_size, cutoffs=[config.readout_shortlist],
            div_value=float(TAIL_DIVISOR))
        self.register_buffer("rank", torch.arange(config.vocab_size))

    def set_frequencies(self, counts: torch.Tensor) -> None:
        self.rank.copy_(frequency_rank(counts.to(self.rank.device)))

    def logits_and_loss(self, h: torch.Tensor, targets: torch.Tensor | None):
        """Training needs only the targets' probabilities, which is what makes it cheap:
        (None, loss) with targets, the whole distribution (logits, None) without."""
        if targets is not None:
            return None, self.loss(h, targets)
        return self(h), None

    def loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean -log P(target) over the positions whose target is not -1: the formula
        above, read through the module's own matrices (one tail cluster). Written out
        rather than calling the module, whose forward refuses bf16 autocast (it copies
        bf16 tail scores into an fp32 buffer): so the shortlist's matmul, most of the
        work, runs in bf16 under autocast, and the log-softmaxes in fp32
        (docs/benchmarks.md, "The adaptive readout")."""
        h, targets = h.reshape(-1, h.size(-1)), targets.reshape(-1)
        keep = targets != -1
        if not keep.all():
            h, targets = h[keep], targets[keep]
        sm, k = self.softmax, self.softmax.shortlist_size
        r = self.rank[targets]
        in_tail = r >= k
        head = F.log_softmax(sm.head(h).float(), dim=-1)           # shortlist, then "the tail"
        logp = head.gather(1, torch.where(in_tail, k, r)[:, None])[:, 0]
        rows = in_tail.nonzero()[:, 0]
        tail = F.log_softmax(sm.tail[0](h[rows]).float(), dim=-1)
        logp = logp.index_add(0, rows, tail.gather(1, (r[rows] - k)[:, None])[:, 0])
        return -logp.mean()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """log P(token) for every vocabulary entry, in token order: (..., vocab_size).
        Normalised log-probabilities are logits (softmax gives them back unchanged).
        Through torch's log_prob, in fp32 (its mixed dtypes under autocast, above)."""
        with torch.autocast(h.device.type, enabled=False):
            logp = self.softmax.log_prob(h.reshape(-1, h.size(-1)).float())
        return logp[:, self.rank].reshape(*h.shape[:-1], -1)
