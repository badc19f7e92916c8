"""Both tokenizers behind one interface (data/tokenizer.py)."""
import pytest

from common.errors import TokenizerError
from data.tokenizer import BPETokenizer, CharTokenizer, Tokenizer

TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n"
        * 20)


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_round_trip_save_and_load(kind, tmp_path):
    tok = CharTokenizer.train(TEXT) if kind == "char" else BPETokenizer.train([TEXT], 300)
    ids = tok.encode("Speak, speak.\n")
    assert tok.decode(ids) == "Speak, speak.\n"
    assert max(ids) < tok.vocab_size
    tok.save(tmp_path)
    again = Tokenizer.load(tmp_path)
    assert type(again) is type(tok)
    assert again.encode(TEXT[:200]) == tok.encode(TEXT[:200])
    assert again.fingerprint() == tok.fingerprint()


def test_char_vocabulary_is_the_sorted_characters():
    tok = CharTokenizer.train("hello")
    assert tok.vocab_size == 4 and tok.encode("hel") == [1, 0, 2]


def test_char_tokenizer_names_characters_it_never_saw():
    tok = CharTokenizer.train(TEXT)
    with pytest.raises(TokenizerError, match=r"'é', '€'.*data.tokenizer=bpe"):
        tok.encode("café €")


def test_bpe_encodes_any_text_and_merges_frequent_words():
    tok = BPETokenizer.train([TEXT], vocab_size=300)
    text = "naïve café — 東京 🙂"
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode("Speak, speak.")) < len("Speak, speak.")
    assert tok.vocab_size <= 300


def test_bpe_vocabulary_must_hold_the_bytes():
    with pytest.raises(TokenizerError, match="256"):
        BPETokenizer.train([TEXT], vocab_size=100)


def test_unreadable_tokenizer_file_is_explained(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not valid JSON"):
        Tokenizer.load(tmp_path)
    with pytest.raises(TokenizerError, match="no tokenizer"):
        Tokenizer.load(tmp_path / "missing")


def test_a_mask_token_is_added_after_every_other_id_and_survives_saving():
    """train.objective=mlm gives the corpus's tokenizer a [MASK] token: one id past the
    others, so text tokenized before reads the same; saved and read back, it stays."""
    from data.tokenizer import BPETokenizer, CharTokenizer, Tokenizer
    text = "to be or not to be, that is the question\n" * 20
    for tok in (CharTokenizer.train(text), BPETokenizer.train([text], 300)):
        masked = tok.with_mask()
        assert tok.mask_id is None and masked.mask_id == tok.vocab_size == masked.vocab_size - 1
        ids = masked.encode("to be[MASK]or")
        assert ids == tok.encode("to be") + [masked.mask_id] + tok.encode("or")
        assert masked.decode(ids) == "to be[MASK]or"
        again = Tokenizer.parse(masked.to_json())
        assert again.mask_id == masked.mask_id and again.encode("to be[MASK]or") == ids
    char = CharTokenizer.train(text).with_mask()
    assert char.spans("a[MASK]b".replace("a", "t").replace("b", "o")) == [(0, 1), (1, 7), (7, 8)]
