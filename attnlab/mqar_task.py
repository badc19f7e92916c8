"""Multi-query associative recall (MQAR), the task behind the frontier's second recall column.

Zoology (Arora et al., arXiv:2312.04927, section 3) found that the gap in language
modelling between attention and the fixed-state models that replace it is mostly one
skill: looking up, at many points of a text, what followed an earlier token. MQAR asks
for exactly that. A sequence starts with N key-value pairs

    k1 v1 k2 v2 ... kN vN

and then, at random places in the rest of the sequence, each key comes back once (in
a random order) followed by its value; everything else is padding. At a queried key
the model must predict that key's value, which it can only have from the pairs at the
start: the values are drawn without any rule, so the only way is to keep every pair.
A softmax head does that by matching the query against every earlier key (the cache
grows with the text); a model with a state of fixed size has to fit all N pairs in it,
and fails once N outgrows the state.

Tokens: 0 is padding, 1..K are keys and K+1..K+V values (disjoint, as in Zoology).
Keys within an example are distinct, and so are values (drawn without replacement),
so a constant guess scores 1/V on average. Only the query positions are scored
(`accuracy`). One difference from Zoology: queries are placed uniformly in the rest of
the sequence, not with its power law that puts most of them near the pairs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

PAD = 0


@dataclass(frozen=True)
class Vocabulary:
    """What recall.train_variant reads of a task's tokenizer: its size."""
    vocab_size: int


@dataclass
class Example:
    ids: torch.Tensor          # (length,) the model's input
    answer: torch.Tensor       # (N,) the value of each query, in query order
    answer_at: torch.Tensor    # (N,) input positions of the queried keys (the next token is the value)
    keys: torch.Tensor         # (N,) the keys, in the order the pairs give them
    values: torch.Tensor       # (N,) their values, in the same order


class MQARTask:
    """Seeded MQAR examples over K keys and V values. `pairs` is the largest number of
    key-value pairs a training batch holds (each example draws 1..pairs); a sequence of
    `length` input tokens holds at most length // 4 pairs (2 tokens a pair, 2 a query).

    Speaks TokenTask's `batch` and `tokenizer.vocab_size`, so recall.train_variant
    trains a model on it with the recall lab's optimizer and schedule."""

    def __init__(self, num_keys: int = 64, num_values: int = 64, pairs: int = 16):
        if num_keys < 1 or num_values < 2:
            raise ValueError(f"MQAR needs at least 1 key and 2 values, got {num_keys} and "
                             f"{num_values}")
        if not 1 <= pairs <= min(num_keys, num_values):
            raise ValueError(f"pairs={pairs}: keys and values are distinct within an example, so "
                             f"give between 1 and {min(num_keys, num_values)} (the fewer of keys "
                             "and values)")
        self.num_keys, self.num_values, self.pairs = num_keys, num_values, pairs
        self.tokenizer = Vocabulary(1 + num_keys + num_values)
        self.chance = 1.0 / num_values

    def check(self, length: int, pairs: int) -> None:
        """ValueError, saying why, for a number of pairs this task cannot put in `length`."""
        if not 1 <= pairs <= min(self.num_keys, self.num_values):
            raise ValueError(f"{pairs} pairs: give between 1 and "
                             f"{min(self.num_keys, self.num_values)} (distinct keys and values)")
        if 4 * pairs > length:
            raise ValueError(f"{pairs} pairs and their queries take {4 * pairs} tokens; a "
                             f"sequence of {length} holds at most {length // 4} pairs")

    def example(self, length: int, pairs: int, g: torch.Generator) -> Example:
        self.check(length, pairs)
        keys = torch.randperm(self.num_keys, generator=g)[:pairs] + 1
        values = torch.randperm(self.num_values, generator=g)[:pairs] + 1 + self.num_keys
        seq = torch.full((length + 1,), PAD, dtype=torch.long)   # input and the last target
        seq[0:2 * pairs:2], seq[1:2 * pairs:2] = keys, values
        # The rest holds (query, value) slots of two tokens; N of them, chosen at random.
        slots = (length + 1 - 2 * pairs) // 2
        chosen = torch.randperm(slots, generator=g)[:pairs].sort().values
        at = 2 * pairs + 2 * chosen                               # (N,) where each query goes
        order = torch.randperm(pairs, generator=g)                # which pair each query asks
        seq[at], seq[at + 1] = keys[order], values[order]
        return Example(seq[:-1], values[order], at, keys, values)

    def batch(self, n: int, length: int, g: torch.Generator, depth=None, reach: float = 1.0,
              pairs: int | None = None):
        """(x, y): y holds each query's value at the query's position and -1 (no loss)
        elsewhere. Each example draws 1..self.pairs pairs unless `pairs` is given.
        (`depth` and `reach` are TokenTask's, for recall.train_variant: MQAR has none.)"""
        x = torch.empty(n, length, dtype=torch.long)
        y = torch.full((n, length), -1, dtype=torch.long)
        for i in range(n):
            most = min(self.pairs, length // 4)
            k = pairs or int(torch.randint(1, most + 1, (), generator=g))
            ex = self.example(length, k, g)
            x[i], y[i, ex.answer_at] = ex.ids, ex.answer
        return x, y


def accuracy(predicted: torch.Tensor, targets: torch.Tensor) -> float:
    """Share of query positions (targets >= 0) whose predicted token is the value; every
    other position, padding and the pairs themselves, is not scored."""
    scored = targets >= 0
    if not scored.any():
        raise ValueError("no query positions to score")
    return (predicted[scored] == targets[scored]).float().mean().item()


@torch.no_grad()
def score(model, task: MQARTask, length: int, pairs: int, n: int, seed: int = 0) -> float:
    """MQAR accuracy of a model on n examples of `pairs` pairs each, its top choice at
    every query."""
    g = torch.Generator().manual_seed(seed + 7919 * pairs)
    x, y = task.batch(n, length, g, pairs=pairs)
    device = next(model.parameters()).device
    return accuracy(model(x.to(device)).logits.argmax(-1).cpu(), y)
