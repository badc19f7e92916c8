"""Multi-query associative recall (attnlab/mqar_task.py), as Zoology (arXiv:2312.04927)
defines it: keys and values from the two halves of the vocabulary, at a query only the
key in the input, queries placed by Zoology's power law; and no way to score above the
floor without matching keys: the input holds no value after the pairs, a key-blind
guess scores 1/N and no more, and two planted leaks are caught by the same checks."""
import numpy as np
import pytest
import torch

from attnlab.mqar_task import IGNORE, MQARTask, accuracy, floor, floors, most_pairs, score


def lookup(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A perfect reader, written from the task's description alone: at every query, the
    token that followed the same token among the pairs at the start."""
    out = torch.full_like(y, IGNORE)
    for i, (row, target) in enumerate(zip(x, y)):
        n = int((target >= 0).sum())
        table = {int(row[2 * j]): int(row[2 * j + 1]) for j in range(n)}
        for q in (target >= 0).nonzero().squeeze(1).tolist():
            out[i, q] = table[int(row[q])]
    return out


# ---------------------------------------------------------------- key-blind predictors

def guess_among_values(x, y, g, skip_seen=False):
    """Never looks at the query: a uniform draw among the example's values (those after
    the keys at the start), leaving out any seen later in the input if asked."""
    out = torch.full_like(y, IGNORE)
    for i, (row, target) in enumerate(zip(x, y)):
        queries = (target >= 0).nonzero().squeeze(1).tolist()
        n = len(queries)
        values = row[1:2 * n:2].tolist()
        for q in queries:
            seen = set(row[2 * n:q + 1].tolist()) if skip_seen else set()
            left = [v for v in values if v not in seen] or values
            out[i, q] = left[int(torch.randint(len(left), (), generator=g))]
    return out


def in_pair_order(x, y):
    """Never looks at the query: the j-th query is answered with the j-th pair's value."""
    out = torch.full_like(y, IGNORE)
    for i, (row, target) in enumerate(zip(x, y)):
        queries = (target >= 0).nonzero().squeeze(1).tolist()
        for j, q in enumerate(queries):
            out[i, q] = row[2 * j + 1]
    return out


def check_no_shortcut(task: MQARTask, length: int = 64, pairs: int = 4, n: int = 1500):
    """What a leak-free MQAR must satisfy; AssertionError at the first thing that fails."""
    x, y = task.batch(n, length, torch.Generator().manual_seed(11), pairs=pairs)
    for row, target in zip(x, y):
        queries = (target >= 0).nonzero().squeeze(1)
        values = set(row[1:2 * pairs:2].tolist())
        following = row[queries[queries + 1 < length] + 1]
        assert not values & set(following.tolist()), "a value follows a query in the input"
        assert not values & set(row[2 * pairs:].tolist()), "a value is in the input after the pairs"
    chance = 1 / pairs
    exact = floors(x, y, task.vocab_size)
    assert exact["among_values"] == pytest.approx(chance, abs=1e-9)
    assert exact["skip_seen"] == pytest.approx(chance, abs=1e-9), "values seen later lift the floor"
    # Sampled key-blind guesses: within 4 standard errors of 1/N.
    scored = int((y >= 0).sum())
    slack = 4 * (chance * (1 - chance) / scored) ** 0.5
    g = torch.Generator().manual_seed(12)
    for name, guess in (("uniform", guess_among_values(x, y, g)),
                        ("skipping seen values", guess_among_values(x, y, g, skip_seen=True)),
                        ("in pair order", in_pair_order(x, y))):
        assert accuracy(guess, y) < chance + slack, f"a key-blind guess ({name}) beats 1/N"
    assert accuracy(lookup(x, y), y) == 1.0


@pytest.mark.parametrize("noise", [False, True])
@pytest.mark.parametrize("power_a", [0.01, 1.0])
def test_a_key_blind_model_scores_the_floor_and_no_more(noise, power_a):
    check_no_shortcut(MQARTask(vocab_size=256, pairs=16, power_a=power_a, noise=noise))


class ValueAfterQuery(MQARTask):
    """The leak this task once had: each query's value written into the input after it."""

    def example(self, length, pairs, g):
        ex = super().example(length, pairs, g)
        ex.ids[(ex.answer_at + 1).clamp(max=length - 1)] = ex.answer
        return ex


class SlotsInDrawOrder(MQARTask):
    """Zoology's own assignment: the first pair takes the first slot drawn, which the power
    law makes the nearest, so queries come mostly in the pairs' order."""

    def example(self, length, pairs, g):
        ex = super().example(length, pairs, g)
        ex.ids[ex.answer_at] = ex.keys                      # j-th query asks the j-th pair
        return type(ex)(ex.ids, ex.values, ex.answer_at, ex.keys, ex.values)


@pytest.mark.parametrize("leaky", [ValueAfterQuery, SlotsInDrawOrder])
def test_a_planted_leak_is_caught(leaky):
    with pytest.raises(AssertionError):
        check_no_shortcut(leaky(vocab_size=256, pairs=16))


def test_the_floor_beside_a_leaky_generator_rises():
    """The frontier prints `floor` measured on the scored examples: a leak shows there."""
    task = ValueAfterQuery(vocab_size=256, pairs=16)
    x, y = task.batch(400, 64, torch.Generator().manual_seed(0), pairs=8)
    assert floor(x, y, 256) > 1.5 / 8
    x, y = MQARTask(256, 16).batch(400, 64, torch.Generator().manual_seed(0), pairs=8)
    assert floor(x, y, 256) == pytest.approx(1 / 8)


# ---------------------------------------------------------------- Zoology's layout

def test_keys_and_values_come_from_the_two_halves_and_queries_carry_the_key_only():
    task = MQARTask(vocab_size=256, pairs=16)
    x, y = task.batch(300, 128, torch.Generator().manual_seed(1))
    for row, target in zip(x, y):
        n = int((target >= 0).sum())
        keys, values = row[0:2 * n:2], row[1:2 * n:2]
        assert (1 <= keys).all() and (keys < 128).all() and (values >= 128).all()
        assert len(set(keys.tolist())) == n and len(set(values.tolist())) == n
        queries = (target >= 0).nonzero().squeeze(1)
        assert sorted(row[queries].tolist()) == sorted(keys.tolist())      # each key once
        assert ((queries - 2 * n) % 2 == 0).all() and (queries >= 2 * n).all()   # slots
        others = torch.ones(128, dtype=torch.bool)
        others[:2 * n], others[queries] = False, False
        assert (row[others] == 0).all()                 # as in Zoology's figure 2 runs
        table = dict(zip(keys.tolist(), values.tolist()))
        assert [table[int(k)] for k in row[queries]] == target[queries].tolist()
    assert (y[y != IGNORE] >= 128).all()


def test_random_fill_is_never_one_of_the_example_s_keys_or_values():
    task = MQARTask(vocab_size=256, pairs=16, noise=True)
    ex = task.example(128, 16, torch.Generator().manual_seed(2))
    fill = torch.ones(128, dtype=torch.bool)
    fill[:32], fill[ex.answer_at] = False, False
    assert not set(ex.ids[fill].tolist()) & set(ex.keys.tolist() + ex.values.tolist())
    assert len(set(ex.ids[fill].tolist())) > 30         # random, not one token


def test_queries_fall_by_zoology_s_power_law():
    """With one pair, the query's slot is drawn with weight i^(a-1) (i = 1..slots): the
    frequencies match NumPy's reading of Zoology's formula."""
    task = MQARTask(vocab_size=256, pairs=1)
    length, draws = 64, 6000
    g = torch.Generator().manual_seed(3)
    slots = [(int(task.example(length, 1, g).answer_at) - 2) // 2 for _ in range(draws)]
    space = (length - 2) // 2
    p = 0.01 * np.arange(1, space + 1) ** (0.01 - 1)
    p = p / p.sum()
    seen = np.bincount(slots, minlength=space) / draws
    assert np.abs(seen - p).max() < 4 * np.sqrt(p[0] * (1 - p[0]) / draws)
    uniform = MQARTask(vocab_size=256, pairs=1, power_a=1.0)
    slots = [(int(uniform.example(length, 1, g).answer_at) - 2) // 2 for _ in range(draws)]
    assert np.abs(np.bincount(slots, minlength=space) / draws - 1 / space).max() < 0.015


def test_pair_counts_vary_in_training_and_the_same_seed_gives_the_same_batch():
    task = MQARTask(vocab_size=256, pairs=8)
    a = task.batch(200, 40, torch.Generator().manual_seed(5))
    b = task.batch(200, 40, torch.Generator().manual_seed(5))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert {int((row >= 0).sum()) for row in a[1]} == set(range(1, 9))
    short = task.batch(200, 40, torch.Generator(), most=3)[1]
    assert {int((row >= 0).sum()) for row in short} == {1, 2, 3}
    assert max(int((row >= 0).sum()) for row in task.batch(64, 16, torch.Generator())[1]) == 4


def test_a_perfect_lookup_scores_one_and_a_constant_guess_one_in_the_values():
    task = MQARTask(vocab_size=64, pairs=8)
    x, y = task.batch(400, 48, torch.Generator().manual_seed(0))
    assert accuracy(lookup(x, y), y) == 1.0
    constant = torch.full_like(y, 40)              # one value, always
    assert accuracy(constant, y) == pytest.approx(1 / 32, abs=0.015)
    assert accuracy(torch.zeros_like(y), y) == 0.0


def test_score_reads_the_model_s_top_choice_at_the_queries():
    task = MQARTask(vocab_size=64, pairs=4)

    class Oracle(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, x):
            y = torch.full_like(x, IGNORE)
            for i, row in enumerate(x):               # rebuild the targets from the input
                n = 4
                table = {int(row[2 * j]): int(row[2 * j + 1]) for j in range(n)}
                for q in range(2 * n, len(row), 2):
                    if int(row[q]) in table:
                        y[i, q] = table[int(row[q])]
            logits = torch.nn.functional.one_hot(y.clamp(min=0), 64).float()
            return type("Out", (), {"logits": logits})

    got, low = score(Oracle(), task, 32, 4, 50)
    assert got == 1.0 and low == pytest.approx(1 / 4)


def test_most_pairs_is_zoology_s_bound():
    assert [most_pairs(n) for n in (16, 64, 65, 128)] == [4, 16, 16, 32]


@pytest.mark.parametrize("make", [lambda: MQARTask(vocab_size=4), lambda: MQARTask(pairs=0),
                                  lambda: MQARTask(vocab_size=16, pairs=8),
                                  lambda: MQARTask(power_a=0.0)])
def test_impossible_tasks_are_refused(make):
    with pytest.raises(ValueError, match="MQAR|pairs|power_a"):
        make()


def test_too_many_pairs_for_the_length_are_refused_saying_how_many_fit():
    task = MQARTask(vocab_size=256, pairs=8)
    with pytest.raises(ValueError, match="at most 4 pairs"):
        task.example(16, 5, torch.Generator())
    with pytest.raises(ValueError, match="no query"):
        accuracy(torch.zeros(2, 3), torch.full((2, 3), IGNORE))
