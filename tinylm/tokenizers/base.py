"""The tokenizer interface every tinylm tokenizer shares, and its versioned JSON file format.

Subclasses implement ``train``, ``encode``, ``decode`` and the two hooks ``_state`` /
``_from_state``; this base owns the special tokens and save/load.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

from tinylm.errors import TinyLMError

FORMAT_NAME = "tinylm-tokenizer"
FORMAT_VERSION = 1
SPECIAL_TOKENS = ("<pad>", "<unk>", "<sos>", "<eos>")  # ids 0, 1, 2, 3 in every tinylm tokenizer
PAD_ID, UNK_ID, SOS_ID, EOS_ID = range(4)


class Tokenizer:
    type_name = "base"
    lossless = False  # True when decode(encode(s)) == s for every string s

    pad_id, unk_id, sos_id, eos_id = PAD_ID, UNK_ID, SOS_ID, EOS_ID
    special_tokens = SPECIAL_TOKENS

    # -- to implement -------------------------------------------------------------------------
    def train(self, texts: Iterable[str], vocab_size: int) -> "Tokenizer":
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; special tokens (pad, sos, eos) are dropped."""
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def id_to_piece(self, i: int) -> str:
        """Human-readable form of one token (for attention plots and debugging)."""
        raise NotImplementedError

    def _state(self) -> dict:
        raise NotImplementedError

    @classmethod
    def _from_state(cls, state: dict) -> "Tokenizer":
        raise NotImplementedError

    # -- shared -------------------------------------------------------------------------------
    def decode_continuation(self, prompt_ids: list[int], new_ids: list[int]) -> str:
        """Text that the new tokens add after the prompt (with the space a word-level tokenizer
        puts between words, which decoding the new tokens alone would lose)."""
        prompt_text = self.decode(prompt_ids)
        full = self.decode(list(prompt_ids) + list(new_ids))
        return full[len(prompt_text):] if full.startswith(prompt_text) else self.decode(new_ids)

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def save(self, path: str | Path) -> None:
        data = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "type": self.type_name,
                "special_tokens": list(self.special_tokens), **self._state()}
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data, ensure_ascii=False))
        os.replace(tmp, path)  # never leave a half-written tokenizer behind

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load any tinylm tokenizer file; errors name what is wrong with it."""
    from tinylm.tokenizers import TOKENIZER_TYPES

    path = Path(path)
    if not path.is_file():
        raise TinyLMError(f"tokenizer file {path} does not exist")
    from tinylm.tokenizers.llama2c import Llama2cTokenizer, is_llama2c_file

    if is_llama2c_file(path):  # a llama2.c tokenizer.bin (binary, not JSON)
        return Llama2cTokenizer.from_file(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TinyLMError(f"tokenizer file {path} is not a tinylm JSON tokenizer ({exc})") from exc
    if isinstance(data, dict) and "model" in data and "pre_tokenizer" in data:
        from tinylm.tokenizers.hf_interop import import_hf  # a Hugging Face tokenizer.json

        return import_hf(path)
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        raise TinyLMError(f"{path} is not a tinylm tokenizer file (no \"format\": \"{FORMAT_NAME}\")")
    if data.get("version") != FORMAT_VERSION:
        raise TinyLMError(
            f"tokenizer file {path} has format version {data.get('version')}; "
            f"this tinylm reads version {FORMAT_VERSION}"
        )
    kind = data.get("type")
    if kind not in TOKENIZER_TYPES:
        raise TinyLMError(f"unknown tokenizer type {kind!r} in {path} (known: {', '.join(TOKENIZER_TYPES)})")
    return TOKENIZER_TYPES[kind]._from_state(data)
