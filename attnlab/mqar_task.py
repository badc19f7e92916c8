"""Multi-query associative recall (MQAR), as Zoology defines it (Arora et al.,
arXiv:2312.04927, section 3 and its `multiquery_ar` generator).

Zoology found that the gap in language modelling between attention and the fixed-state
models that replace it is mostly one skill: looking up, at many points of a text, what
followed an earlier token. MQAR asks for exactly that. A sequence starts with N
key-value pairs

    k1 v1 k2 v2 ... kN vN

and later each key comes back once, alone: at a queried key the target is its value,
and the input goes on with an unrelated token, never the value. Nothing but the pairs
at the start says which value a key has (values are drawn without any rule), so a model
scores above its floor only by matching the query against the keys it kept. A softmax
head does that by comparing the query with every earlier key (its cache grows with the
text); a model with a state of fixed size has to fit all N pairs in it, and fails once N
outgrows the state.

The floor. A model that never matches a key to its value can still see which tokens are
the example's values (they follow the keys at the start) and guess among them: 1/N. If
values could be seen later in the input (an earlier query's answer written after it), a
key-blind model could also skip the values already used and score more than 1/N; here no
value appears after the pairs, and `floors` measures both guesses on the very examples
scored, so a generator that leaked would show it beside every score.

As in Zoology: the vocabulary is split in two halves, keys from the lower (1..vocab/2-1)
and values from the upper (vocab/2..vocab-1), distinct within an example; after the pairs
come slots of two tokens, and a query's slot follows a power law that puts most queries
near the pairs (slot i, from 1, drawn with weight i^(a-1), a = 0.01); every other
position holds 0, as in the runs behind Zoology's figure 2 (`random_non_queries=False`),
or with `noise=True` a random token, its generator's default. Two differences, both to
close a shortcut: a random token is never one of this example's keys or values (a stray
key would be an unscored query, a stray value a hint), and which key is asked at which
slot is a fresh random order (Zoology's draw gives the first pair the likeliest, nearest
slot, so "the i-th query asks the i-th pair" scores above 1/N there).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

IGNORE = -1                      # the model's "no loss here" target


@dataclass(frozen=True)
class Vocabulary:
    """What a trainer reads of a task's tokenizer: its size."""
    vocab_size: int


@dataclass
class Example:
    ids: torch.Tensor          # (length,) the model's input
    answer: torch.Tensor       # (N,) the value of each query, in query order
    answer_at: torch.Tensor    # (N,) input positions of the queried keys (their target is the value)
    keys: torch.Tensor         # (N,) the keys, in the order the pairs give them
    values: torch.Tensor       # (N,) their values, in the same order


def most_pairs(length: int) -> int:
    """Pairs a sequence of `length` tokens holds: 2 tokens a pair, and after them a slot
    of 2 tokens for each query (Zoology's 4·N <= length)."""
    return length // 4


class MQARTask:
    """Seeded MQAR examples over a vocabulary of `vocab_size` tokens (Zoology's split:
    keys the lower half, values the upper). `pairs` is the most pairs a training batch
    draws (each example 1..pairs unless told); `power_a` shapes where queries fall
    (1: uniformly after the pairs; Zoology's 0.01: mostly near them); `noise` fills the
    other positions with random tokens instead of 0."""

    def __init__(self, vocab_size: int = 256, pairs: int = 16, power_a: float = 0.01,
                 noise: bool = False):
        if vocab_size < 8:
            raise ValueError(f"MQAR needs a vocabulary of at least 8 tokens, got {vocab_size}")
        self.num_keys = vocab_size // 2 - 1              # keys 1..vocab/2-1 (0 only as noise)
        self.num_values = vocab_size - vocab_size // 2   # values vocab/2..vocab-1
        if not 1 <= pairs <= self.num_keys:
            raise ValueError(f"pairs={pairs}: keys are distinct within an example, so give "
                             f"between 1 and {self.num_keys} for a vocabulary of {vocab_size}")
        if not 0 < power_a <= 1:
            raise ValueError(f"power_a={power_a}: give a number in (0, 1]")
        self.vocab_size, self.pairs, self.power_a, self.noise = vocab_size, pairs, power_a, noise
        self.tokenizer = Vocabulary(vocab_size)

    def check(self, length: int, pairs: int) -> None:
        """ValueError, saying why, for a number of pairs this task cannot put in `length`."""
        if not 1 <= pairs <= self.num_keys:
            raise ValueError(f"{pairs} pairs: give between 1 and {self.num_keys} (distinct keys)")
        if pairs > most_pairs(length):
            raise ValueError(f"{pairs} pairs and their queries take {4 * pairs} tokens; a "
                             f"sequence of {length} holds at most {most_pairs(length)} pairs")

    def example(self, length: int, pairs: int, g: torch.Generator) -> Example:
        self.check(length, pairs)
        half = self.vocab_size // 2
        keys = torch.randperm(self.num_keys, generator=g)[:pairs] + 1
        values = torch.randperm(self.num_values, generator=g)[:pairs] + half
        ids = torch.zeros(length, dtype=torch.long)
        if self.noise:                           # any token but this example's keys and values
            allowed = torch.ones(self.vocab_size, dtype=torch.bool)
            allowed[keys], allowed[values] = False, False
            pool = allowed.nonzero().squeeze(1)
            ids = pool[torch.randint(len(pool), (length,), generator=g)]
        ids[0:2 * pairs:2], ids[1:2 * pairs:2] = keys, values
        # N of the slots after the pairs, without replacement, slot i (from 1) with weight
        # i^(a-1): the nearest is likeliest, as a repeated bigram in text is (Zoology).
        slots = (length - 2 * pairs) // 2
        weight = torch.arange(1, slots + 1, dtype=torch.float64) ** (self.power_a - 1)
        chosen = torch.multinomial(weight, pairs, replacement=False, generator=g).sort().values
        at = 2 * pairs + 2 * chosen                               # (N,) where each query goes
        order = torch.randperm(pairs, generator=g)                # which pair each query asks
        ids[at] = keys[order]
        return Example(ids, values[order], at, keys, values)

    def batch(self, n: int, length: int, g: torch.Generator, pairs: int | None = None,
              most: int | None = None):
        """(x, y): y holds each query's value at the query's position and IGNORE
        elsewhere. Each example draws fewest..self.pairs pairs (as many as fit) unless
        `pairs` is given (1..`most` if that is)."""
        x = torch.empty(n, length, dtype=torch.long)
        y = torch.full((n, length), IGNORE, dtype=torch.long)
        most = min(most or self.pairs, self.pairs, most_pairs(length))
        for i in range(n):
            k = pairs or int(torch.randint(1, most + 1, (), generator=g))
            ex = self.example(length, k, g)
            x[i], y[i, ex.answer_at] = ex.ids, ex.answer
        return x, y


def accuracy(predicted: torch.Tensor, targets: torch.Tensor) -> float:
    """Share of query positions (targets >= 0) whose predicted token is the value; every
    other position, noise and the pairs themselves, is not scored."""
    scored = targets >= 0
    if not scored.any():
        raise ValueError("no query positions to score")
    return (predicted[scored] == targets[scored]).float().mean().item()


def floors(x: torch.Tensor, y: torch.Tensor, vocab_size: int) -> dict[str, float]:
    """What models that never match a query to its key score on these examples, exactly
    (the expectation of a uniform guess, not a sample of it):

    - `among_values`: guess uniformly among the example's values (the tokens after the
      keys at the start, whose count the number of queries gives);
    - `skip_seen`: the same, leaving out any of them seen in the input after the pairs
      and before the query (an earlier answer written into the input).

    Both are 1/N where the input shows no value after the pairs; more means a leak."""
    half = vocab_size // 2
    among, skip, count = 0.0, 0.0, 0
    for row, target in zip(x, y):
        queries = (target >= 0).nonzero().squeeze(1).tolist()
        n = len(queries)
        values = set(row[1:2 * n:2].tolist())
        for q in queries:
            answer = int(target[q])
            among += (answer in values) / len(values)
            later = row[2 * n:q + 1]
            seen = set(later[later >= half].tolist())
            left = values - seen
            skip += (answer in left) / len(left) if left else 0.0
            count += 1
    if not count:
        raise ValueError("no query positions to score")
    return {"among_values": among / count, "skip_seen": skip / count}


def floor(x: torch.Tensor, y: torch.Tensor, vocab_size: int) -> float:
    """The higher of the two key-blind floors: the score a model must beat to show recall."""
    return max(floors(x, y, vocab_size).values())


def test_batch(task: MQARTask, length: int, pairs: int, n: int, seed: int = 0):
    """The held-out examples a model is scored on: seeded apart from any training batch."""
    g = torch.Generator().manual_seed(1_000_003 + seed + 7919 * pairs + 31 * length)
    return task.batch(n, length, g, pairs=pairs)


@torch.no_grad()
def score(model, task: MQARTask, length: int, pairs: int, n: int, seed: int = 0) -> tuple[float, float]:
    """(accuracy, key-blind floor) of a model on n examples of `pairs` pairs each, its
    top choice at every query."""
    x, y = test_batch(task, length, pairs, n, seed)
    device = next(model.parameters()).device
    predicted = torch.cat([model(part.to(device)).logits.argmax(-1).cpu() for part in x.split(256)])
    return accuracy(predicted, y), floor(x, y, task.vocab_size)


def train(task: MQARTask, model_fields: dict, length: int, steps: int, batch: int = 32,
          lr: float = 3e-3, seed: int = 0, log=print):
    """A model of `model_fields` (a ModelConfig's fields but the vocabulary and the
    context) trained on MQAR in sequences of `length`: AdamW, a short warm-up, then
    cosine decay, the loss at the queries only.

    A curriculum: over the first half of the steps the most pairs an example may draw
    grows from 1 to all that fit. Given every count from the start, a small model sits
    at the key-blind floor (it learns which tokens are values, then guesses) for longer
    than a laptop's budget; with one pair the lookup pays at once, and it carries over
    as the pairs crowd in. (Zoology trains many epochs over a fixed set instead.)"""
    from engine.loop import after_step
    from model import GPT, ModelConfig
    torch.manual_seed(seed)
    cfg = ModelConfig(**{**model_fields, "vocab_size": task.vocab_size, "block_size": length})
    model = GPT(cfg)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.98))
    warmup = max(1, steps // 20)
    most = min(task.pairs, most_pairs(length))
    g = torch.Generator().manual_seed(seed + 1)
    for step in range(steps):
        rate = (step + 1) / warmup if step < warmup else \
            0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))
        for group in opt.param_groups:
            group["lr"] = lr * rate
        grown = max(1, min(most, round(most * 2 * (step + 1) / steps)))
        x, y = task.batch(batch, length, g, most=grown)
        loss = model(x, y).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        after_step(model)                   # a mixture of experts' balancing bias
        if step % 100 == 0 or step == steps - 1:
            log(f"  step {step:>4}: loss at the queries {loss.item():.3f}")
    return model.eval()
