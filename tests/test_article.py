"""The article's claims on its own model, all-MiniLM-L6-v2 (attnlab/article.py)."""
import pytest

from attnlab.article import bank_cosines, distance_per_layer
from engine.inference import load_run


@pytest.fixture(scope="module")
def loaded(minilm):
    model, _, tokenizer, _ = load_run(minilm)
    return model, tokenizer


def test_bank_enters_as_one_vector_and_leaves_as_two(loaded):
    cos = bank_cosines(*loaded)
    assert len(cos) == 7 and cos[0] == pytest.approx(1.0, abs=1e-6)    # same token, same position
    assert all(c < 0.95 for c in cos[1:])          # context separates them from the first layer on
    assert min(cos) == cos[-1]                       # most of all after the last layer (0.80)


def test_attention_reaches_further_in_later_layers_and_parks_on_separators(loaded):
    rows = distance_per_layer(*loaded)
    distance = [d for d, _ in rows]
    assert distance[0] < min(distance[1:])           # layer 1 is the most local (4.9 tokens)
    assert distance[4] > distance[1] > distance[0]   # and it grows to layer 5 (6.2)
    assert max(s for _, s in rows) > 0.5             # over half the weight on [CLS]/[SEP]


def test_sample_refuses_the_articles_encoder_as_an_encoder(minilm, capsys):
    """MiniLM was trained bidirectionally on purpose: sample.py points to fill, not to the
    leak demo meant for a decoder trained without its mask."""
    import sample
    from engine.cli import errors_as_lines
    with pytest.raises(SystemExit), errors_as_lines():
        sample.main(["--run", str(minilm)])
    err = [l for l in capsys.readouterr().err.splitlines() if l.startswith("error:")]
    assert len(err) == 1 and "encoder" in err[0] and "attnlab.fill" in err[0]
    assert "leak" not in err[0]
