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


# -- a hostile tokenizer.json: held to what this project writes before it is built ----

def hf_form(**parts) -> dict:
    """A byte-level BPE tokenizer.json as this project writes it, `parts` replaced."""
    import json
    return {**json.loads(BPETokenizer.train([TEXT], 300).to_json()), **parts}


PANICS = {"type": "Replace", "pattern": {"Regex": ""}, "content": "x"}   # the library panics
HOSTILE = {
    "a normalizer with a regular expression": (dict(normalizer=PANICS), "normalizer of type 'Replace'"),
    "a normalizer Sequence hiding one": (dict(normalizer={"type": "Sequence", "normalizers": [
        {"type": "NFC"}, PANICS]}), "normalizer of type 'Replace'"),
    "a padding of 50M tokens": (dict(padding={"strategy": {"Fixed": 50_000_000}, "direction": "Right",
                                              "pad_to_multiple_of": None, "pad_id": 0,
                                              "pad_type_id": 0, "pad_token": "<|endoftext|>"}),
                                "pads to a length"),
    "a padding of 1e9 tokens": (dict(padding={"strategy": {"Fixed": 10 ** 9}, "direction": "Right",
                                              "pad_to_multiple_of": None, "pad_id": 0,
                                              "pad_type_id": 0, "pad_token": "<|endoftext|>"}),
                                "pads to a length"),
    "a truncation past any context": (dict(truncation={"max_length": 10 ** 12, "strategy": "LongestFirst",
                                                       "stride": 0, "direction": "Right"}),
                                      "truncates to a length"),
    "a truncation to 0 tokens": (dict(truncation={"max_length": 0, "strategy": "LongestFirst",
                                                  "stride": 0, "direction": "Right"}),
                                 "truncates every text to 0 tokens"),
    "a truncation whose stride is its length": (dict(truncation={"max_length": 2, "strategy": "LongestFirst",
                                                                 "stride": 5, "direction": "Right"}),
                                                "with a stride of 5"),
    "a template naming a special token it does not define": (dict(post_processor={
        "type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "[X]", "type_id": 0}},
                                                 {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [], "special_tokens": {}}), "names the special token '[X]' it does not define"),
    "a template without the text": (dict(post_processor={
        "type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}],
        "pair": [], "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [256],
                                                         "tokens": ["<|endoftext|>"]}}}),
                                     "does not hold the text (A) once"),
    "a special token's id past the vocabulary": (dict(post_processor={
        "type": "BertProcessing", "sep": ["<|endoftext|>", 10 ** 9], "cls": ["<|endoftext|>", 256]}),
                                                 "sep is not a token of its vocabulary"),
    "a Split by a regular expression": (dict(pre_tokenizer={"type": "Split", "pattern": {"Regex": "(a*)*b"},
                                                            "behavior": "Isolated", "invert": False}),
                                        "Split pre-tokenizer with a regular expression"),
    "a decoder of another kind": (dict(decoder={"type": "Replace", "pattern": {"String": "a"},
                                                "content": "b"}), "decoder of type 'Replace'"),
    "BPE dropout": (dict(model={**hf_form()["model"], "dropout": 0.5}), "BPE dropout"),
    "a field no tokenizer has": (dict(extra=1), "the field 'extra'"),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_tokenizer_file_is_refused_before_the_library_builds_it(name, tmp_path):
    """A Replace normalizer with an empty pattern made the Rust library panic (a
    PanicException traceback, a dead page thread); a fixed padding of 50M tokens took
    5.6 GB on the first encode and 1e9 aborted the process: each is refused by what the
    file says, in one error naming it, and nothing is built."""
    import json
    parts, says = HOSTILE[name]
    (tmp_path / "tokenizer.json").write_text(json.dumps(hf_form(**parts)))
    with pytest.raises(TokenizerError) as err:
        Tokenizer.load(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(err.value) and says in str(err.value)


def test_the_forms_this_project_writes_and_reads_pass_the_check(tmp_path):
    """Its own BPE and character forms, export's, and the BERT family's WordPiece (with
    its 128-token padding and truncation) are all built as before."""
    import json
    from conftest import wordpiece_tokenizer
    from data.tokenizer import WordPieceTokenizer, structure_problem
    from engine.interop import hf_tokenizer
    bpe, char = BPETokenizer.train([TEXT], 300), CharTokenizer.train(TEXT)
    for tok in (bpe, char):
        hf_tokenizer(tok).save_pretrained(tmp_path / tok.kind)
        again = Tokenizer.load(tmp_path / tok.kind)
        assert type(again) is type(tok) and again.encode(TEXT[:100]) == tok.encode(TEXT[:100])
    wordpiece = json.loads(wordpiece_tokenizer().to_str())
    wordpiece["padding"] = {"strategy": {"Fixed": 128}, "direction": "Right", "pad_to_multiple_of": None,
                            "pad_id": 0, "pad_type_id": 0, "pad_token": "[PAD]"}
    wordpiece["truncation"] = {"max_length": 128, "strategy": "LongestFirst", "stride": 0,
                               "direction": "Right"}
    assert structure_problem(wordpiece) is None
    assert WordPieceTokenizer.from_json(json.dumps(wordpiece)).encode("the cat sat") == [2, 5, 6, 7, 3]


@pytest.mark.parametrize("setting", [
    dict(truncation={"max_length": 1, "strategy": "LongestFirst", "stride": 0, "direction": "Right"}),
    dict(padding={"strategy": {"Fixed": 20}, "direction": "Right", "pad_to_multiple_of": None,
                  "pad_id": 0, "pad_type_id": 0, "pad_token": "<|endoftext|>"}),
    dict(padding={"strategy": "BatchLongest", "direction": "Left", "pad_to_multiple_of": 64,
                  "pad_id": 0, "pad_type_id": 0, "pad_token": "<|endoftext|>"}),
], ids=["truncation to 1 token", "padding to 20", "padding to a multiple of 64"])
def test_a_files_padding_or_truncation_never_cuts_or_pads_a_text(setting, tmp_path):
    """A run's or a transformers folder's tokenizer.json that truncates to 1 token made
    --train.init_from train on one token a word, and one that pads filled a prompt with
    padding: a text is encoded as it is, whatever the file says."""
    import json
    text = TEXT[:300]
    plain = BPETokenizer.from_json(json.dumps(hf_form())).encode(text)
    (tmp_path / "tokenizer.json").write_text(json.dumps(hf_form(**setting)))
    tok = Tokenizer.load(tmp_path)
    assert tok.encode(text) == plain and tok.encode_array(text).tolist() == plain
    assert tok.decode(tok.encode("to be")) == "to be"


def test_a_panics_own_text_is_not_printed_and_other_output_is_passed_on(capfd, monkeypatch):
    """The library's panic hook wrote "thread '<unnamed>' panicked at ..." (and with
    RUST_BACKTRACE a whole backtrace) to stderr before the one error line; what a call
    writes there without panicking still reaches stderr."""
    import os
    from tokenizers import Regex, normalizers
    from data.tokenizer import library
    monkeypatch.setenv("RUST_BACKTRACE", "1")
    tok = BPETokenizer.train([TEXT], 300)
    tok.hf.normalizer = normalizers.Replace(Regex(""), "x")
    capfd.readouterr()
    with pytest.raises(TokenizerError):
        tok.encode("Speak, speak.")
    library(os.write, 2, b"kept\n")
    assert capfd.readouterr().err == "kept\n"


def test_a_panic_in_the_library_is_a_tokenizer_error():
    """A tokenizer built in memory (no file to check) whose normalizer panics: pyo3
    raises the panic as a BaseException, which `except Exception` let through; every
    call that encodes says so as a TokenizerError instead."""
    from tokenizers import Regex, normalizers
    tok = BPETokenizer.train([TEXT], 300)
    tok.hf.normalizer = normalizers.Replace(Regex(""), "x")
    for call in (tok.encode, tok.encode_array, tok.spans):
        with pytest.raises(TokenizerError, match="failed inside the tokenizers library"):
            call("Speak, speak.")
    assert tok.decode([70, 71]) == BPETokenizer.train([TEXT], 300).decode([70, 71])


def test_a_text_of_many_unknown_characters_is_one_short_error_line():
    """Binary text names 20 of its unknown characters and counts the rest, on one line."""
    from data.tokenizer import CharTokenizer, TokenizerError
    tok = CharTokenizer("abc")
    with pytest.raises(TokenizerError) as err:
        tok.encode("".join(chr(c) for c in range(256, 1256)))
    message = str(err.value)
    assert "and 980 more" in message and len(message) < 400 and "\n" not in message
