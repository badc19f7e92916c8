"""Two tokenizers behind one interface: encode, decode, vocab_size, save, load.

* `char`: one token per character of the corpus (nanoGPT's Shakespeare setting): a
  vocabulary of a few dozen symbols, every model output readable letter by letter.
* `bpe`: byte-level BPE trained on the corpus with Hugging Face `tokenizers` (the
  GPT-2 scheme): any UTF-8 text encodes, and frequent words become single tokens.
"""
from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import re
import sys
import tempfile
import threading
from pathlib import Path
from typing import Iterable

import numpy as np

from common.errors import TokenizerError
from common.files import inside, read_bounded, write_text_atomic

FILENAME = "tokenizer.json"
TOKENIZER_LIMIT = 256 << 20    # bytes of tokenizer.json (the largest vocabularies' are ~35 MB)


def tokenizer_limit(vocab_size: int) -> int:
    """The most bytes a tokenizer.json of `vocab_size` tokens may take: 1 KiB a token and
    1 MiB besides, several times what real ones take, so that the memory and time its
    reading costs follow the vocabulary a folder claims, not the file."""
    return min(TOKENIZER_LIMIT, (1 << 20) + 1024 * max(vocab_size, 0))


# -- what a Hugging Face tokenizer.json may hold before the Rust library builds it --
# The library panics on some inputs it accepts (a Replace normalizer with an empty
# pattern) and allocates whatever a padding length asks, so a file is held to the
# structure this project writes and reads (byte-level BPE, the character form export
# writes, the BERT family's WordPiece) before it is built.
VOCAB_LIMIT = 1 << 20          # tokens (the largest real vocabularies hold about 256K)
PAD_LIMIT = 1 << 16            # a fixed padding or truncation length, in tokens
WORD_LIMIT = 1 << 10           # WordPiece's longest word, in characters
SHOWN_UNKNOWN = 20             # an error line names this many characters a text has that a
                               # character tokenizer lacks, and counts the rest
SEQUENCE_LIMIT = 8             # parts of a Sequence normalizer, pre-tokenizer or decoder
PARTS = {
    # part: {type: the fields it may hold besides "type"}; None for a part may be absent
    "normalizer": {
        "BertNormalizer": {"clean_text", "handle_chinese_chars", "strip_accents", "lowercase"},
        "Lowercase": set(), "NFC": set(), "NFD": set(), "NFKC": set(), "NFKD": set(),
        "StripAccents": set(), "Strip": {"strip_left", "strip_right"},
    },
    "pre_tokenizer": {
        "ByteLevel": {"add_prefix_space", "trim_offsets", "use_regex"},
        "BertPreTokenizer": set(), "Whitespace": set(), "WhitespaceSplit": set(),
        "Split": {"pattern", "behavior", "invert"},
    },
    "decoder": {
        "ByteLevel": {"add_prefix_space", "trim_offsets", "use_regex"},
        "Fuse": set(), "WordPiece": {"prefix", "cleanup"},
    },
    "post_processor": {
        "ByteLevel": {"add_prefix_space", "trim_offsets", "use_regex"},
        "TemplateProcessing": {"single", "pair", "special_tokens"},
        "BertProcessing": {"sep", "cls"},
        "RobertaProcessing": {"sep", "cls", "trim_offsets", "add_prefix_space"},
    },
    "model": {
        "BPE": {"dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix",
                "fuse_unk", "byte_fallback", "ignore_merges", "vocab", "merges"},
        "WordLevel": {"vocab", "unk_token"},
        "WordPiece": {"unk_token", "continuing_subword_prefix", "max_input_chars_per_word", "vocab"},
    },
}
SEQUENCE_KEYS = {"normalizer": "normalizers", "pre_tokenizer": "pretokenizers",
                 "decoder": "decoders", "post_processor": "processors"}
# The one regular expression a Split may use: export's one-token-per-character pattern.
# Any other goes to the Rust regex engine, whose panics end the process or its thread.
CHARACTER_SPLIT = {"Regex": r"[\s\S]"}
TOP_LEVEL = {"version", "truncation", "padding", "added_tokens", "normalizer", "pre_tokenizer",
             "post_processor", "decoder", "model"}


def structure_problem(data) -> str | None:
    """What in a parsed Hugging Face tokenizer.json is outside the allow-list (PARTS and
    the bounds above), in words; None when it may be built."""
    if not isinstance(data, dict):
        return "is not a JSON object"
    unknown = sorted(set(data) - TOP_LEVEL)
    if unknown:
        return f"has the field {unknown[0]!r}, which no tokenizer this project reads has"
    for part in ("normalizer", "pre_tokenizer", "post_processor", "decoder", "model"):
        wrong = _part_problem(part, data.get(part), depth=0)
        if wrong:
            return wrong
    model = data.get("model")
    if not isinstance(model, dict):
        return "has no model"
    vocab, merges = model.get("vocab"), model.get("merges", [])
    if not isinstance(vocab, (dict, list)) or len(vocab) > VOCAB_LIMIT:
        return f"has a vocabulary that is not a table of at most {VOCAB_LIMIT:,} tokens"
    if not isinstance(merges, list) or len(merges) > VOCAB_LIMIT:
        return f"has merges that are not a list of at most {VOCAB_LIMIT:,}"
    if model.get("dropout") not in (None, 0, 0.0):
        return "has BPE dropout, which would encode the same text differently each time"
    if not _bounded(model.get("max_input_chars_per_word", 0), WORD_LIMIT):
        return f"has a WordPiece word limit above {WORD_LIMIT:,} characters"
    added = data.get("added_tokens", [])
    if not isinstance(added, list) or len(added) > VOCAB_LIMIT:
        return f"has added tokens that are not a list of at most {VOCAB_LIMIT:,}"
    return (_padding_problem(data.get("padding")) or _truncation_problem(data.get("truncation"))
            or _special_problem(data.get("post_processor"), _known_ids(vocab, added)))


def _known_ids(vocab, added) -> dict:
    """Token -> id, for the tokens a vocabulary table and the added tokens name."""
    known = dict(vocab) if isinstance(vocab, dict) else {}
    known.update((t.get("content"), t.get("id")) for t in added if isinstance(t, dict))
    return known


def _special_problem(processor, known: dict) -> str | None:
    """A post-processor's special tokens each the token and id the vocabulary gives it,
    and a template that keeps the text: a template naming a special token it does not
    define made the library panic on the first encode, one without the text (`A`)
    encoded every text to its special tokens alone, and an id past the vocabulary
    would reach the model's embedding."""
    if not isinstance(processor, dict):
        return None
    for part in processor.get("processors") or []:
        if wrong := _special_problem(part, known):
            return wrong
    kind = processor.get("type")
    if kind in ("BertProcessing", "RobertaProcessing"):
        for field in ("sep", "cls"):
            pair = processor.get(field)
            if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)
                    and type(pair[1]) is int and known.get(pair[0]) == pair[1]):
                return (f"has a {kind} whose {field} is not a token of its vocabulary with "
                        "that token's id")
    if kind != "TemplateProcessing":
        return None
    specials = processor.get("special_tokens")
    single, pair = processor.get("single"), processor.get("pair")
    if not (isinstance(specials, dict) and isinstance(single, list) and isinstance(pair, list)):
        return "has a TemplateProcessing that is not a template and its special tokens"
    texts = [item for item in single
             if isinstance(item, dict) and isinstance(item.get("Sequence"), dict)]
    if len(texts) != 1 or texts[0]["Sequence"].get("id") != "A":
        return "has a TemplateProcessing whose single template does not hold the text (A) once"
    for item in single + pair:
        named = item.get("SpecialToken") if isinstance(item, dict) else None
        name = named.get("id") if isinstance(named, dict) else None
        if named is not None and name not in specials:
            return f"has a TemplateProcessing that names the special token {name!r} it does not define"
    for name, special in specials.items():
        ids = special.get("ids") if isinstance(special, dict) else None
        tokens = special.get("tokens") if isinstance(special, dict) else None
        if not (isinstance(ids, list) and isinstance(tokens, list) and ids
                and len(ids) == len(tokens) and special.get("id") == name
                and all(type(i) is int and isinstance(t, str) and known.get(t) == i
                        for i, t in zip(ids, tokens))):
            return (f"has a TemplateProcessing whose special token {name!r} is not tokens of "
                    "its vocabulary with their ids")
    return None


def _part_problem(part: str, value, depth: int) -> str | None:
    if value is None:
        return None if part != "model" else "has no model"
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "Sequence" and part in SEQUENCE_KEYS and depth == 0:
        parts = value.get(SEQUENCE_KEYS[part])
        if set(value) != {"type", SEQUENCE_KEYS[part]} or not isinstance(parts, list) \
                or len(parts) > SEQUENCE_LIMIT:
            return f"has a {part} Sequence that is not a list of at most {SEQUENCE_LIMIT} parts"
        for item in parts:
            if item is None or (wrong := _part_problem(part, item, depth + 1)):
                return wrong or f"has an empty part in its {part} Sequence"
        return None
    allowed = PARTS[part]
    if kind not in allowed:
        return (f"has a {part} of type {kind!r}; the {part}s this project reads are "
                + ", ".join(sorted(allowed)))
    extra = sorted(set(value) - allowed[kind] - {"type"})
    if extra:
        return f"has a {kind} {part} with the field {extra[0]!r}, which it does not take"
    if kind == "Split" and value.get("pattern") != CHARACTER_SPLIT \
            and not (isinstance(value.get("pattern"), dict) and set(value["pattern"]) == {"String"}):
        return ("has a Split pre-tokenizer with a regular expression; the one this project "
                "reads splits every character (export's form)")
    return None


def _bounded(value, limit: int) -> bool:
    return value is None or (type(value) is int and 0 <= value <= limit)


def _padding_problem(padding) -> str | None:
    if padding is None:
        return None
    strategy = padding.get("strategy") if isinstance(padding, dict) else None
    fixed = strategy.get("Fixed") if isinstance(strategy, dict) else None
    if not (strategy == "BatchLongest" or (isinstance(strategy, dict) and set(strategy) == {"Fixed"}
                                           and _bounded(fixed, PAD_LIMIT))) \
            or not _bounded(padding.get("pad_to_multiple_of"), PAD_LIMIT):
        return f"pads to a length that is not a whole number of at most {PAD_LIMIT:,} tokens"
    return None


def _truncation_problem(truncation) -> str | None:
    if truncation is None:
        return None
    if not isinstance(truncation, dict) or not _bounded(truncation.get("max_length"), PAD_LIMIT) \
            or not _bounded(truncation.get("stride", 0), PAD_LIMIT):
        return f"truncates to a length that is not a whole number of at most {PAD_LIMIT:,} tokens"
    # Switched off when built (BPETokenizer), but no real file cuts every text to nothing,
    # and a stride not below the length makes the library panic on the first encode.
    length, stride = truncation.get("max_length"), truncation.get("stride") or 0
    if length == 0:
        return "truncates every text to 0 tokens"
    if length is not None and stride >= length:
        return f"truncates to {length} tokens with a stride of {stride}, not below that length"
    return None


def library(call, *args, hold_stderr: bool = True):
    """call(*args) into the Rust `tokenizers` library, a panic in it raised as a
    TokenizerError. pyo3 raises a Rust panic as PanicException, a BaseException and not
    an Exception, so `except Exception` lets it through: it ended sample.py with a
    traceback and killed the page's model thread. (`hold_stderr=False` for a call that
    runs while another thread may report a Ctrl-C: see _panic_text_held.)"""
    try:
        with _panic_text_held() if hold_stderr else contextlib.nullcontext():
            return call(*args)
    except Exception:
        raise
    except BaseException as err:
        if type(err).__name__ != "PanicException":
            raise                      # KeyboardInterrupt, SystemExit: not the library's
        reason = (str(err).strip().splitlines() or ["no reason given"])[0]
        raise TokenizerError(f"the tokenizer failed inside the tokenizers library ({reason}); "
                             "its tokenizer.json is damaged or was not written by this "
                             "project: prepare the data again or use another run") from None


_HELD_LOCK = threading.RLock()     # one thread at a time moves file descriptor 2
_held: list = []                   # the temporary file it is moved to, made once
_holding = threading.local()       # a call inside a call leaves it where it is


@contextlib.contextmanager
def _panic_text_held():
    """File descriptor 2 moved to a temporary file for one call into the library. A Rust
    panic's hook writes "thread panicked at ..." (and with RUST_BACKTRACE a backtrace)
    straight to it, before the panic reaches Python, where the one `error:` line that
    says what to do is made of it: that text is dropped. Anything else written there
    during the call is passed on when it returns. Where there is no descriptor 2 to move,
    the call runs as it is."""
    if getattr(_holding, "now", False):
        yield
        return
    with _HELD_LOCK:
        try:
            sys.stderr.flush()
            if not _held:
                _held.append(tempfile.TemporaryFile())
            held = _held[0]
            saved = os.dup(2)
        except (OSError, ValueError, AttributeError):
            yield
            return
        os.dup2(held.fileno(), 2)
        panicked, _holding.now = False, True
        try:
            yield
        except BaseException as err:
            panicked = type(err).__name__ == "PanicException"
            raise
        finally:
            _holding.now = False
            os.dup2(saved, 2)
            os.close(saved)
            fd = held.fileno()
            if os.lseek(fd, 0, os.SEEK_END):
                os.lseek(fd, 0, os.SEEK_SET)
                text = b"".join(iter(lambda: os.read(fd, 1 << 16), b""))
                os.ftruncate(fd, 0)
                os.lseek(fd, 0, os.SEEK_SET)
                while text and not panicked:
                    text = text[os.write(2, text):]


# Byte-level BPE learns and encodes within pre-tokens (a run of letters, of digits, of
# other symbols or of white space), and learning costs the square of a pre-token's
# length: a line of 500K letters took minutes, and Ctrl-C waited for the Rust library.
# A run longer than LONGEST_RUN characters is cut into pieces of that length before BPE
# sees it, so the cost grows with the text, not with its longest word; text without such
# a run (any prose) is handed over exactly as it is.
LONGEST_RUN = 1000
LONG_RUN = re.compile(r"\S{%d,}|\s{%d,}" % (LONGEST_RUN + 1, LONGEST_RUN + 1))


def bounded_runs(text: str) -> list[str]:
    """`text` in pieces, cut only inside runs of more than LONGEST_RUN characters without
    a space (or of white space alone), so no piece holds a longer run; [text] when it has
    none."""
    cuts = [at for run in LONG_RUN.finditer(text)
            for at in range(run.start() + LONGEST_RUN, run.end(), LONGEST_RUN)]
    if not cuts:
        return [text]
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


# The mask token under the names the BERT family gives it ([MASK] for the ones added here).
MASK_NAMES = ("[MASK]", "<mask>")


class Tokenizer:
    """The facts other code asks about a tokenizer are class attributes, so nothing
    outside this registry compares a tokenizer's name with a string."""
    kind: str
    needs_every_symbol: bool     # learns a fixed symbol set: must read every split
    sized_by_setting: bool       # its vocabulary size is a setting (data.vocab_size)

    @classmethod
    def learn(cls, texts: Iterable[str], vocab_size: int, records: bool = False) -> "Tokenizer":
        """A new tokenizer from an iterator of texts; `records`: documents will be
        kept apart by a newline when there is no end-of-text token."""
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def to_json(self) -> str:
        raise NotImplementedError

    def encode_array(self, text: str) -> np.ndarray:
        """encode() for bulk tokenization: the same ids, as an int64 array, faster."""
        return np.asarray(self.encode(text), dtype=np.int64)

    @property
    def eot_id(self) -> int | None:
        """The end-of-document token placed between documents (None: no such token)."""
        return None

    @property
    def highest_id(self) -> int:
        """The largest id encode() can give (a model needs vocab_size above it)."""
        return self.vocab_size - 1

    @property
    def mask_id(self) -> int | None:
        """The id of the blank a masked-language model fills in (None: it has none)."""
        return None

    def with_mask(self) -> "Tokenizer":
        """This tokenizer with a [MASK] token added after every other id, for a model
        trained to fill blanks (train.objective=mlm); the other ids stay as they are, so
        text tokenized before still reads the same."""
        raise TokenizerError(f"the {self.kind} tokenizer cannot add a mask token")

    def spans(self, text: str) -> list[tuple[int, int]]:
        """(start, end) character offsets of each token of `text`."""
        raise NotImplementedError

    def token_strings(self, ids) -> list[str]:
        """Each token as the tools label it (a WordPiece shows its vocabulary entry,
        [CLS] and ##t included)."""
        return [self.decode([int(i)]) for i in ids]

    def can_encode(self, text: str) -> bool:
        try:
            self.encode(text)
        except TokenizerError:
            return False
        return True

    def fingerprint(self) -> str:
        """A hash of the saved form: equal fingerprints encode identically."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / FILENAME
        write_text_atomic(path, self.to_json())
        return path

    @staticmethod
    def load(directory: str | Path, limit: int = TOKENIZER_LIMIT) -> "Tokenizer":
        """The tokenizer.json of `directory`, at most `limit` bytes (tokenizer_limit of
        the vocabulary the folder claims, where it says one)."""
        path = Path(directory) / FILENAME
        found = inside(directory, FILENAME)
        if found is None:                 # a link to a file elsewhere is never read
            raise TokenizerError(f"tokenizer file {path} leads outside {directory}; a folder "
                                 "holds its own tokenizer.json")
        try:
            # Bounded and a plain file only: a token folder or run may come from elsewhere,
            # and a pipe or a link to /dev/zero in its place would never end.
            text = read_bounded(found, limit).decode("utf-8")
        except FileNotFoundError:
            raise TokenizerError(f"no tokenizer at {path}") from None
        except UnicodeDecodeError as err:
            raise TokenizerError(f"tokenizer file {path} is not valid JSON ({err})") from None
        except ValueError as err:
            raise TokenizerError(f"tokenizer file {path} {err}; it cannot be a tokenizer") from None
        except OSError as err:
            raise TokenizerError(f"tokenizer file {path} cannot be read ({err.strerror or err})") from None
        return Tokenizer.parse(text, path)

    @staticmethod
    def parse(text: str, path: Path | str = "<string>") -> "Tokenizer":
        """A tokenizer from its saved JSON form (either kind)."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise TokenizerError(f"tokenizer file {path} is not valid JSON ({err})") from None
        except RecursionError:
            raise TokenizerError(f"tokenizer file {path} is nested too deeply to be a "
                                 "tokenizer") from None
        if isinstance(data, dict) and data.get("type") == "char":
            chars, mask = data.get("chars"), data.get("mask")
            if (not isinstance(chars, list) or not chars
                    or not all(isinstance(c, str) and len(c) == 1 for c in chars)
                    or len(set(chars)) != len(chars)):
                raise TokenizerError(f"tokenizer file {path} is a character tokenizer whose "
                                     "\"chars\" is not a list of distinct single characters")
            if mask is not None and mask != MASK_NAMES[0]:
                raise TokenizerError(f"tokenizer file {path} is a character tokenizer whose "
                                     f"\"mask\" is {mask!r}; it can only be {MASK_NAMES[0]!r}")
            return CharTokenizer(chars, mask)
        if isinstance(data, dict) and isinstance(data.get("model"), dict) \
                and data["model"].get("type") == "WordPiece":
            return WordPieceTokenizer.from_json(text, path)
        bpe = BPETokenizer.from_json(text, path)
        chars = one_token_per_character(bpe.hf)
        return CharTokenizer(chars) if chars else bpe


class CharTokenizer(Tokenizer):
    kind = "char"
    needs_every_symbol = True       # so validation text never has an unknown character
    sized_by_setting = False

    def __init__(self, chars: Iterable[str], mask: str | None = None):
        self.chars = sorted(set(chars))
        self.stoi = {ch: i for i, ch in enumerate(self.chars)}
        # The blank of a masked-LM run: one id after the characters, written [MASK] in
        # text (a word, not a character, so no corpus character is given up for it).
        self.mask = mask

    @classmethod
    def train(cls, text: str) -> "CharTokenizer":
        if not text:
            raise TokenizerError("cannot build a character vocabulary from empty text")
        return cls(set(text))

    @classmethod
    def learn(cls, texts, vocab_size=0, records=False) -> "CharTokenizer":
        chars: set[str] = set()
        for text in texts:
            chars.update(text)
        return cls(chars | {"\n"} if records else chars)    # the newline between records

    @property
    def vocab_size(self) -> int:
        return len(self.chars) + (self.mask is not None)

    @property
    def mask_id(self) -> int | None:
        return len(self.chars) if self.mask is not None else None

    def with_mask(self) -> "CharTokenizer":
        return CharTokenizer(self.chars, MASK_NAMES[0])

    def encode(self, text: str) -> list[int]:
        if self.mask is not None and self.mask in text:
            pieces = [self.encode(piece) for piece in text.split(self.mask)]
            return [i for n, piece in enumerate(pieces) for i in ([self.mask_id] if n else []) + piece]
        try:
            return [self.stoi[ch] for ch in text]
        except KeyError:
            unknown = sorted(set(text) - self.stoi.keys())
            shown = ", ".join(repr(c) for c in unknown[:SHOWN_UNKNOWN])
            more = len(unknown) - SHOWN_UNKNOWN
            raise TokenizerError(
                "the character tokenizer never saw these characters in its corpus: " + shown
                + (f" and {more:,} more" if more > 0 else "")
                + "; remove them from the text, or train with data.tokenizer=bpe, "
                "which encodes any text") from None

    def decode(self, ids):
        ids = list(ids)
        past = [i for i in ids if not 0 <= i < self.vocab_size]
        if past:                  # a model wider than this vocabulary: not its tokenizer
            raise TokenizerError(f"token id {past[0]} is past the character tokenizer's "
                                 f"{self.vocab_size} tokens: the model and tokenizer are not a pair")
        return "".join(self.chars[i] if i < len(self.chars) else self.mask for i in ids)

    def spans(self, text):
        out, at = [], 0
        for i in self.encode(text):
            width = 1 if i < len(self.chars) else len(self.mask)
            out.append((at, at + width))
            at += width
        return out

    def encode_array(self, text: str) -> np.ndarray:
        if self.mask is not None and self.mask in text:
            return np.asarray(self.encode(text), dtype=np.int64)
        # Vectorized: the code points of the text looked up in the sorted vocabulary
        # (Python sorts strings by code point, so self.chars is sorted that way too).
        points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        if not hasattr(self, "_points"):
            self._points = np.array([ord(c) for c in self.chars], dtype=np.uint32)
        ids = np.searchsorted(self._points, points)
        if points.size and not np.array_equal(self._points[np.minimum(ids, len(self.chars) - 1)], points):
            self.encode(text)                          # raises, naming the unknown characters
        return ids.astype(np.int64)

    def to_json(self) -> str:
        saved = {"type": "char", "chars": self.chars} | ({"mask": self.mask} if self.mask else {})
        return json.dumps(saved, ensure_ascii=False)


class BPETokenizer(Tokenizer):
    kind = "bpe"
    needs_every_symbol = False      # bytes: any text encodes, so a sample is enough
    sized_by_setting = True
    END_OF_TEXT = "<|endoftext|>"

    # Positions where GPT-2's pre-tokenizer pattern always starts a new pre-token: before
    # a space that sits between two printable ASCII characters (" ?\p{L}+" and its kin
    # start there) and after a newline followed by one. Pieces cut there encode exactly as
    # the whole text does, so each distinct piece (mostly a word with its leading space)
    # is encoded once and cached: a large speed-up on real text, where words repeat.
    PIECE_BOUNDARY = re.compile(r"(?<=[!-~])(?= [!-~])|(?<=\n)(?=[!-~])")
    CACHE_LIMIT = 1_000_000

    def __init__(self, hf_tokenizer):
        # A text is encoded as it is, and the model's context (model.block_size) is the
        # only limit: a file's padding or truncation (a sentence-transformers file pads and
        # cuts every text to 128 tokens, its training batches; a forged one to 0) would
        # pad or cut a prompt, a corpus or a page's text without a word.
        hf_tokenizer.no_padding()
        hf_tokenizer.no_truncation()
        self.hf = hf_tokenizer
        self._cache: dict[str, list[int]] = {}

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> "BPETokenizer":
        from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

        if vocab_size < 257:
            raise TokenizerError(f"a byte-level BPE vocabulary needs more than the 256 "
                                 f"byte tokens plus one special; got {vocab_size}")
        hf = HFTokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=[cls.END_OF_TEXT], show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        pieces = (piece for text in texts for piece in bounded_runs(text))
        waited_for(lambda: library(hf.train_from_iterator, pieces, trainer, hold_stderr=False))
        return cls(hf)

    @classmethod
    def learn(cls, texts, vocab_size=4096, records=False) -> "BPETokenizer":
        return cls.train(texts, vocab_size)

    @classmethod
    def from_json(cls, text: str, path: Path | str = "<string>") -> "BPETokenizer":
        from tokenizers import Tokenizer as HFTokenizer
        try:
            wrong = structure_problem(json.loads(text))
        except (ValueError, RecursionError):
            wrong = "is not valid JSON"
        if wrong:
            raise TokenizerError(f"tokenizer file {path} {wrong}; use a tokenizer.json this "
                                 "project wrote (python -m data.prepare, or export)")
        try:
            return cls(library(HFTokenizer.from_str, text))
        except TokenizerError as err:
            raise TokenizerError(f"tokenizer file {path}: {err}") from None
        except Exception as err:  # tokenizers raises plain Exception for bad files
            raise TokenizerError(f"tokenizer file {path} cannot be read ({err})") from None

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._encoding(text).ids

    def _encoding(self, text: str):
        pieces = bounded_runs(text)
        if len(pieces) > 1:                  # as encode_array cuts them: the same ids
            return _Joined(pieces, [self._encoding(piece) for piece in pieces])
        try:
            return library(self.hf.encode, text)
        except TokenizerError:
            raise
        except Exception as err:   # a tokenizer without a byte fallback or [UNK] token
            raise self._cannot_encode([text], err) from None

    def _cannot_encode(self, texts: list[str], err: Exception) -> TokenizerError:
        """Name the pieces of `texts` (as its pre-tokenizer cuts them: characters, for a
        tokenizer of characters) this tokenizer has no token for."""
        def fails(piece):
            try:
                library(self.hf.encode, piece)
            except Exception:
                return True
            return False
        cut = self.hf.pre_tokenizer
        pieces = {p for text in texts for p, _ in library(cut.pre_tokenize_str, text)} \
            if cut is not None else {c for text in texts for c in text}
        unknown = sorted(p for p in pieces if fails(p))
        if not unknown:
            return TokenizerError(f"this tokenizer cannot encode the text ({err})")
        return TokenizerError("this tokenizer has no token for "
                              + ", ".join(repr(p) for p in unknown[:20])
                              + (f" and {len(unknown) - 20} more" if len(unknown) > 20 else "")
                              + f"; remove them from the text ({err})")

    def encode_array(self, text: str) -> np.ndarray:
        pieces = [piece for part in bounded_runs(text) for piece in self.PIECE_BOUNDARY.split(part)]
        cache = self._cache
        new = [p for p in set(pieces) if p not in cache]
        if new:
            if len(cache) + len(new) > self.CACHE_LIMIT:   # bounded memory on huge corpora
                cache.clear()
            encode = getattr(self.hf, "encode_batch_fast", self.hf.encode_batch)  # no offsets: faster
            try:
                encodings = library(encode, new)
            except TokenizerError:
                raise
            except Exception as err:
                raise self._cannot_encode(new, err) from None
            for piece, encoding in zip(new, encodings):
                cache[piece] = encoding.ids
        ids = itertools.chain.from_iterable(map(cache.__getitem__, pieces))
        return np.fromiter(ids, dtype=np.int64)

    @property
    def eot_id(self) -> int | None:
        return self.hf.token_to_id(self.END_OF_TEXT)

    @property
    def mask_id(self) -> int | None:
        for name in MASK_NAMES:
            if (i := self.hf.token_to_id(name)) is not None:
                return i
        return None

    def with_mask(self) -> "BPETokenizer":
        from tokenizers import AddedToken, Tokenizer as HFTokenizer
        hf = HFTokenizer.from_str(self.hf.to_str())       # a copy: this one stays as it was
        # Not `special`: decode() leaves special tokens out, and a blank should read as one.
        hf.add_tokens([AddedToken(MASK_NAMES[0], special=False, normalized=False)])
        return type(self)(hf)

    def decode(self, ids):
        return library(self.hf.decode, list(ids))

    def spans(self, text):
        return list(self._encoding(text).offsets)

    @property
    def highest_id(self) -> int:
        return max(self.hf.get_vocab(with_added_tokens=True).values(), default=-1)

    def to_json(self) -> str:
        return self.hf.to_str()


def waited_for(call):
    """call() in a thread of its own, waited for in short joins. Python runs a signal's
    handler only between its own instructions, and the Rust library learns its merges
    without returning for as long as that takes: a Ctrl-C waited for the end. The
    library lets go of the interpreter while it works, so the waiting thread takes the
    Ctrl-C at once; the worker is a daemon and ends with the process."""
    done: list = []

    def work():
        try:
            done.append((call(), None))
        except BaseException as err:         # handed to the waiting thread, raised there
            done.append((None, err))
    worker = threading.Thread(target=work, name="tokenizer", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.1)
    result, err = done[0]
    if err is not None:
        raise err
    return result


class _Joined:
    """The encodings of consecutive pieces of one text as one: ids in order, each
    piece's character offsets moved by the length of the pieces before it."""

    def __init__(self, pieces: list[str], parts):
        self.ids, self.offsets, at = [], [], 0
        for piece, part in zip(pieces, parts):
            self.ids += part.ids
            self.offsets += [(a + at, b + at) for a, b in part.offsets]
            at += len(piece)


def one_token_per_character(hf) -> list[str] | None:
    """The characters of a Hugging Face tokenizer that gives exactly one token per
    character, numbered in sorted order (the form python -m attnlab.export writes a
    character tokenizer in), or None for any other tokenizer. Checked by what it does,
    not by how its file is laid out: every character encodes to its own id, in both
    orders, and decodes back."""
    vocab = hf.get_vocab(with_added_tokens=True)
    chars = sorted(vocab)
    if not vocab or any(len(c) != 1 for c in chars) or [vocab[c] for c in chars] != list(range(len(chars))):
        return None
    text = "".join(chars)
    try:
        forward, backward = library(hf.encode, text).ids, library(hf.encode, text[::-1]).ids
        same_text = library(hf.decode, forward) == text
    except Exception:
        return None
    ids = list(range(len(chars)))
    return chars if forward == ids and backward == ids[::-1] and same_text else None


# -- BERT's WordPiece, read from a transformers folder ----------------------------------
# Words are split into the longest pieces of a fixed vocabulary ("suitcase" is one piece,
# "didn't" becomes didn ' t, a continuation piece is written ##ing), and the file's
# post-processor adds the special tokens the model was trained with: [CLS] first and
# [SEP] last for BERT, <s> and </s> for RoBERTa. Encoding is Hugging Face `tokenizers`
# itself, so the ids are exactly what the model saw in training.


class WordPieceTokenizer(BPETokenizer):
    kind = "wordpiece"
    needs_every_symbol = False
    sized_by_setting = False       # the vocabulary comes with the model

    @classmethod
    def from_file(cls, path: Path) -> "WordPieceTokenizer":
        try:
            text = read_bounded(path, TOKENIZER_LIMIT).decode("utf-8")
        except FileNotFoundError:
            raise TokenizerError(f"{path.parent} has no tokenizer.json (save the tokenizer with "
                                 "save_pretrained into the same folder)") from None
        except (OSError, ValueError) as err:       # ValueError: not UTF-8, not a plain file, too large
            raise TokenizerError(f"tokenizer file {path} cannot be read ({err})") from None
        return cls.from_json(text, path)

    @property
    def eot_id(self) -> int | None:
        return None                # an encoder's texts are not joined into one stream

    @property
    def special_ids(self) -> set[int]:
        """Ids of the tokens the file marks special ([CLS], [SEP], [PAD], [MASK], ...)."""
        added = json.loads(self.to_json()).get("added_tokens", [])
        return {t["id"] for t in added if t.get("special")}

    def encode_array(self, text: str) -> np.ndarray:
        # One post-processed sequence: the BPE class's piece-by-piece cache would add
        # [CLS] and [SEP] around every piece.
        return np.asarray(self.encode(text), dtype=np.int64)

    def token_strings(self, ids) -> list[str]:
        return [self.hf.id_to_token(int(i)) for i in ids]


TOKENIZERS = {"char": CharTokenizer, "bpe": BPETokenizer}
