"""Multi-query associative recall (attnlab/mqar_task.py): the sequence is what Zoology's
section 3 describes, only query positions are scored, a perfect lookup scores 1 and a
constant guess 1/num_values, and impossible sizes are refused."""
import pytest
import torch

from attnlab.mqar_task import PAD, MQARTask, accuracy


def lookup(ids: torch.Tensor, pairs: int) -> torch.Tensor:
    """A perfect reader, written from the task's description alone: at every position,
    the value that followed this token among the first `pairs` pairs (PAD if none)."""
    table = {int(ids[2 * i]): int(ids[2 * i + 1]) for i in range(pairs)}
    return torch.tensor([table.get(int(t), PAD) if i >= 2 * pairs else PAD
                         for i, t in enumerate(ids)])


def test_a_hand_built_example():
    task = MQARTask(num_keys=4, num_values=4, pairs=2)
    ex = task.example(8, 2, torch.Generator().manual_seed(3))
    # Keys are 1..4 and values 5..8; the pairs first, then both keys once more.
    k1, v1, k2, v2 = ex.ids[:4].tolist()
    assert {k1, k2} <= {1, 2, 3, 4} and {v1, v2} <= {5, 6, 7, 8} and k1 != k2 and v1 != v2
    rest = ex.ids[4:].tolist()
    queried = [t for t in rest if t != PAD]
    # With 8 input tokens and 2 pairs there are two (query, value) slots after the pairs,
    # and the last value is the target of the last input token.
    values = dict(((k1, v1), (k2, v2)))
    assert rest[0] in values and rest[1] == values[rest[0]] and rest[2] in values
    assert sorted(t for t in queried if t <= 4) == sorted([k1, k2])
    assert ex.answer_at.tolist() == [4, 6]
    assert ex.answer.tolist() == [values[rest[0]], values[rest[2]]]
    x, y = task.batch(1, 8, torch.Generator().manual_seed(3), pairs=2)
    assert x[0].tolist() == ex.ids.tolist()
    assert y[0].tolist() == [-1, -1, -1, -1, ex.answer[0], -1, ex.answer[1], -1]


@pytest.mark.parametrize("length,pairs", [(16, 1), (32, 5), (64, 16), (65, 16)])
def test_every_query_asks_for_one_of_the_pairs_and_the_rest_is_padding(length, pairs):
    task = MQARTask(num_keys=20, num_values=30, pairs=16)
    ex = task.example(length, pairs, torch.Generator().manual_seed(length + pairs))
    assert len(ex.ids) == length
    table = dict(zip(ex.keys.tolist(), ex.values.tolist()))
    assert len(table) == pairs and len(set(ex.values.tolist())) == pairs
    assert sorted(ex.ids[ex.answer_at].tolist()) == sorted(table)        # each key once
    for at, value in zip(ex.answer_at.tolist(), ex.answer.tolist()):
        assert table[int(ex.ids[at])] == value
        if at + 1 < length:
            assert int(ex.ids[at + 1]) == value        # the value follows, as in Zoology
    taken = set(range(2 * pairs)) | set(ex.answer_at.tolist()) | {a + 1 for a in ex.answer_at.tolist()}
    assert all(int(ex.ids[i]) == PAD for i in range(length) if i not in taken)
    assert lookup(ex.ids, pairs)[ex.answer_at].tolist() == ex.answer.tolist()


def test_a_perfect_lookup_scores_one_and_a_constant_guess_one_in_num_values():
    task = MQARTask(num_keys=16, num_values=10, pairs=8)
    x, y = task.batch(400, 48, torch.Generator().manual_seed(0))
    perfect = torch.stack([lookup(row, int((y[i] >= 0).sum())) for i, row in enumerate(x)])
    assert accuracy(perfect, y) == 1.0
    # Scoring every position would count the padding a lookup predicts there as wrong.
    assert (perfect[y < 0] != y[y < 0]).all()
    constant = torch.full_like(y, 1 + 16 + 3)          # always the fourth value
    assert accuracy(constant, y) == pytest.approx(1 / 10, abs=0.02)
    assert accuracy(torch.full_like(y, PAD), y) == 0.0


def test_the_same_seed_gives_the_same_batch_and_pair_counts_vary_in_training():
    task = MQARTask(num_keys=16, num_values=16, pairs=8)
    a = task.batch(64, 40, torch.Generator().manual_seed(5))
    b = task.batch(64, 40, torch.Generator().manual_seed(5))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    counts = {int((row >= 0).sum()) for row in a[1]}
    assert counts == set(range(1, 9))                  # 1..pairs, and never more than fit
    assert max(int((row >= 0).sum()) for row in task.batch(64, 16, torch.Generator())[1]) <= 4


@pytest.mark.parametrize("make", [lambda: MQARTask(num_keys=0), lambda: MQARTask(num_values=1),
                                  lambda: MQARTask(num_keys=4, pairs=5), lambda: MQARTask(pairs=0)])
def test_impossible_tasks_are_refused(make):
    with pytest.raises(ValueError, match="MQAR|pairs"):
        make()


def test_too_many_pairs_for_the_length_are_refused_saying_how_many_fit():
    task = MQARTask(num_keys=16, num_values=16, pairs=8)
    with pytest.raises(ValueError, match="at most 4 pairs"):
        task.example(16, 5, torch.Generator())
    with pytest.raises(ValueError, match="no query"):
        accuracy(torch.zeros(2, 3), torch.full((2, 3), -1))
