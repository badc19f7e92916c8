"""BERT's WordPiece tokenizer, read from a transformers folder's tokenizer.json.

Words are split into the longest pieces of a fixed vocabulary ("suitcase" is one piece,
"didn't" becomes didn ' t, a continuation piece is written ##ing), and the file's
post-processor adds the special tokens the model was trained with: [CLS] first and
[SEP] last for BERT, <s> and </s> for RoBERTa. Encoding is Hugging Face `tokenizers`
itself, so the ids are exactly what the model saw in training."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from common.errors import TokenizerError
from data.tokenizer import BPETokenizer

# The mask token under the names the BERT family gives it.
MASK_NAMES = ("[MASK]", "<mask>")


class WordPieceTokenizer(BPETokenizer):
    kind = "wordpiece"
    needs_every_symbol = False
    sized_by_setting = False       # the vocabulary comes with the model

    def __init__(self, hf_tokenizer):
        # A sentence-transformers file pads and truncates every text to 128 tokens (its
        # training batches); here a text is encoded as it is, and the model's context
        # (model.block_size) is the only limit.
        hf_tokenizer.no_padding()
        hf_tokenizer.no_truncation()
        super().__init__(hf_tokenizer)

    @classmethod
    def from_file(cls, path: Path) -> "WordPieceTokenizer":
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise TokenizerError(f"{path.parent} has no tokenizer.json (save the tokenizer with "
                                 "save_pretrained into the same folder)") from None
        except (OSError, UnicodeDecodeError) as err:
            raise TokenizerError(f"tokenizer file {path} cannot be read ({err})") from None
        return cls.from_json(text, path)

    @property
    def eot_id(self) -> int | None:
        return None                # an encoder's texts are not joined into one stream

    @property
    def mask_id(self) -> int | None:
        """The id of the token a masked-LM fills in, or None if the vocabulary has none."""
        for name in MASK_NAMES:
            if (i := self.hf.token_to_id(name)) is not None:
                return i
        return None

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
