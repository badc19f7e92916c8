"""The retrieval task behind `python -m attnlab.recall`: one fact in a haystack of text.

A fact "The code for K is V." is set at a chosen depth in filler text, and the text
ends with the start of the same sentence, " The code for K is", so the next tokens
must be V (the passkey test of Mohtashami & Jaggi, arXiv:2305.16300, and the
needle-in-a-haystack test). V is a number of `digits` random digits and the filler
holds no digits, so the only place the answer can come from is the fact: a model
that has not found it can do no better than guess, 10^-digits for the whole number.

Depth is where the fact starts among the filler tokens: 0 puts it first, 1 puts it
right before the question, d puts round(d * F) filler tokens before it (F = filler
tokens in the example). Examples are built from token ids, so one generator serves
the project's character models (`char_task`) and any tokenizer (`TokenTask` with a
transformers folder's tokenizer): the fact, the question and the answer are encoded
on their own, which keeps the answer's ids in the fact the same as after the question
whatever the tokenizer merges.
"""
from __future__ import annotations

import gzip
import re
from dataclasses import dataclass

import torch

from data.tokenizer import CharTokenizer, Tokenizer

KEYS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
FACT = re.compile(r"The code for ([A-Z]) is (\d+)\.")


def filler_text(chars: int = 200_000) -> str:
    """Prose to hide the fact in: the bundled Shakespeare with its digits removed (so
    no number in it can pass for an answer) and its lines joined."""
    from data.tokens import BUNDLED_CORPUS
    with gzip.open(BUNDLED_CORPUS, "rt", encoding="utf-8") as f:
        text = f.read(chars * 2)
    text = re.sub(r"\d", "", text)
    return re.sub(r"\s+", " ", text)[:chars]


@dataclass
class Example:
    ids: torch.Tensor          # (length,) the model's input: haystack, question, answer but its last token
    answer: torch.Tensor       # (n,) the answer's ids; the model should predict them at `answer_at`
    answer_at: torch.Tensor    # (n,) input positions whose next token is an answer token
    fact_at: int               # index of the fact's first token
    value_at: int              # index of the fact's first answer token
    filler: int                # filler tokens in the example (F above)
    key: str
    value: str


class TokenTask:
    """Examples for any tokenizer. `length` counts the model's input tokens; `phrase`
    is the sentence before the value, said once in the fact and again as the question."""

    def __init__(self, tokenizer: Tokenizer, filler: str, digits: int = 2,
                 phrase: str = "The code for {key} is"):
        self.tokenizer, self.digits, self.phrase = tokenizer, digits, phrase
        self.filler = torch.tensor(tokenizer.encode(filler), dtype=torch.long)
        self.chance = 10.0 ** -digits
        self._encoded: dict[tuple[str, str], tuple] = {}

    def distance(self, ex: "Example") -> int:
        """How far back the answer lies: from where the question's answer goes to where
        the fact's answer is."""
        return int(ex.answer_at[0]) + 1 - ex.value_at

    def _parts(self, key: str, value: str):
        # Encoded once per (key, value): a training batch asks for hundreds.
        if (key, value) not in self._encoded:
            self._encoded[key, value] = self._encode_parts(key, value)
        return self._encoded[key, value]

    def _encode_parts(self, key: str, value: str):
        enc = lambda s: torch.tensor(self.tokenizer.encode(s), dtype=torch.long)
        question = enc(" " + self.phrase.format(key=key))
        answer = enc(f" {value}")
        fact = torch.cat([question, answer, enc(".")])
        return fact, question, answer

    def nearest(self) -> int:
        """The distance (as `distance` counts it) of a fact right before the question: its
        own length, every later filler token adding one."""
        return len(self._parts("W", "8" * self.digits)[0])

    def overhead(self) -> int:
        """Tokens of an example that are not filler (the longest over keys and values)."""
        fact, question, answer = self._parts("W", "8" * self.digits)
        return len(fact) + len(question) + len(answer) - 1 + 2

    def example(self, length: int, depth: float, g: torch.Generator) -> Example:
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth must be between 0 and 1, got {depth}")
        key = KEYS[int(torch.randint(len(KEYS), (), generator=g))]
        value = "".join(str(int(d)) for d in torch.randint(10, (self.digits,), generator=g))
        fact, question, answer = self._parts(key, value)
        n_filler = length - len(fact) - len(question) - (len(answer) - 1)
        if n_filler < 0:
            raise ValueError(f"an example of {length} tokens cannot hold the fact and the "
                             f"question ({length - n_filler} tokens)")
        if n_filler >= len(self.filler):
            raise ValueError(f"the filler has {len(self.filler)} tokens; {n_filler} needed")
        start = int(torch.randint(len(self.filler) - n_filler, (), generator=g))
        hay = self.filler[start:start + n_filler]
        at = round(depth * n_filler)
        ids = torch.cat([hay[:at], fact, hay[at:], question, answer[:-1]])
        first = length - len(answer)             # input position whose next token is answer[0]
        return Example(ids, answer, torch.arange(first, length), at, at + len(question), n_filler,
                       key, value)

    def batch(self, n: int, length: int, g: torch.Generator, depth: float | None = None,
              reach: float = 1.0):
        """(x, y) for training: y holds the answer's ids at their positions and -1 (no
        loss) everywhere else, so every step spends its gradient on retrieval alone.
        Depths are uniform in [1 - reach, 1] (the nearest `reach` of the text; all of it
        by default) unless one is given."""
        x = torch.empty(n, length, dtype=torch.long)
        y = torch.full((n, length), -1, dtype=torch.long)
        for i in range(n):
            d = 1.0 - reach * (1.0 - float(torch.rand((), generator=g))) if depth is None else depth
            ex = self.example(length, d, g)
            x[i] = ex.ids
            y[i, ex.answer_at] = ex.answer
        return x, y


def char_task(digits: int = 2, chars: int = 200_000, short: bool = False) -> TokenTask:
    """The task over characters, with a vocabulary of exactly the characters it uses.

    `short`: the fact is " K is V." and the filler Shakespeare's letters alone, lower
    case, so the question (" K is", 5 tokens) fits in a small sliding window and the
    fact's capital and digits are the only such tokens in the text: a windowed model
    can then learn to find the fact where a window reaches it, and a test of how far
    stacked windows reach is not a test of whether the question fits in one."""
    text = filler_text(chars)
    phrase = "The code for {key} is"
    if short:
        text = re.sub(r" +", " ", re.sub(r"[^a-z ]", "", text.lower()))
        phrase = "{key} is"
    tokenizer = CharTokenizer(set(text) | set(phrase.format(key="") + " .0123456789") | set(KEYS))
    return TokenTask(tokenizer, text, digits, phrase=phrase)
