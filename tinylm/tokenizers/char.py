"""Character-level tokenizer with byte fallback, so that it is lossless on any Unicode text.

Vocabulary: the 4 specials, then 256 byte tokens (used only for characters never seen in
training, as their UTF-8 bytes), then the training characters by descending frequency.
"""

from __future__ import annotations

from typing import Iterable

from tinylm.constants import SPECIAL_TOKENS
from tinylm.errors import TinyLMError
from tinylm.tokenizers.base import Tokenizer, count_pieces

BYTE_BASE = len(SPECIAL_TOKENS)  # id of byte 0


class CharTokenizer(Tokenizer):
    type_name = "char"
    lossless = True

    def __init__(self, chars: list[str] | None = None):
        self.chars = list(chars or [])
        self._char_to_id = {c: BYTE_BASE + 256 + i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return BYTE_BASE + 256 + len(self.chars)

    def train(self, texts: Iterable[str], vocab_size: int | None = None) -> "CharTokenizer":
        counts = count_pieces(texts, list)  # characters
        if not counts:
            raise TinyLMError("cannot train a char tokenizer on an empty corpus")
        keep = None if vocab_size is None or vocab_size <= 0 else max(vocab_size - BYTE_BASE - 256, 0)
        chars = [c for c, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
        self.__init__(chars[:keep])
        return self

    def encode(self, text: str) -> list[int]:
        ids = []
        get = self._char_to_id.get
        for c in text:
            i = get(c)
            if i is None:
                ids.extend(BYTE_BASE + b for b in c.encode("utf-8"))
            else:
                ids.append(i)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        out = bytearray()
        for i in map(int, ids):
            if i < BYTE_BASE:
                continue
            if i < BYTE_BASE + 256:
                out.append(i - BYTE_BASE)
            elif i < self.vocab_size:
                out += self.chars[i - BYTE_BASE - 256].encode("utf-8")
        return out.decode("utf-8", errors="replace")

    def id_to_piece(self, i: int) -> str:
        if i < BYTE_BASE:
            return SPECIAL_TOKENS[i]
        if i < BYTE_BASE + 256:
            return f"<0x{i - BYTE_BASE:02X}>"
        return self.chars[i - BYTE_BASE - 256]

    def _state(self) -> dict:
        return {"chars": self.chars}

    @classmethod
    def _from_state(cls, state: dict) -> "CharTokenizer":
        chars = state.get("chars")
        if not isinstance(chars, list) or any(not isinstance(c, str) or len(c) != 1 for c in chars):
            raise TinyLMError('char tokenizer file: "chars" must be a list of single characters')
        return cls(chars)
