"""Word-level tokenizer: a regex split into words and punctuation, top-N vocabulary by frequency.

Not lossless: out-of-vocabulary words become ``<unk>`` and decoding re-joins words with
spaces (no space before closing punctuation). ``unk_rate`` reports how much is lost.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Iterable

from tinylm.errors import TinyLMError
from tinylm.tokenizers.base import SPECIAL_TOKENS, UNK_ID, Tokenizer

WORD_PATTERN = r"\w+(?:'\w+)*|[^\w\s]"
_NO_SPACE_BEFORE = set(".,!?;:)]}'\"") | {"n't", "'s"}


class WordTokenizer(Tokenizer):
    type_name = "word"

    def __init__(self, words: list[str] | None = None, lowercase: bool = False, pattern: str = WORD_PATTERN):
        self.words = list(words or [])
        self.lowercase = lowercase
        self.pattern = pattern
        self._re = re.compile(pattern)
        self._word_to_id = {w: len(SPECIAL_TOKENS) + i for i, w in enumerate(self.words)}

    @property
    def vocab_size(self) -> int:
        return len(SPECIAL_TOKENS) + len(self.words)

    def split(self, text: str) -> list[str]:
        if self.lowercase:
            text = text.lower()
        return self._re.findall(text)

    def train(self, texts: Iterable[str], vocab_size: int, min_count: int = 1) -> "WordTokenizer":
        counts: Counter[str] = Counter()
        for t in texts:
            counts.update(self.split(t))
        if not counts:
            raise TinyLMError("cannot train a word tokenizer on an empty corpus")
        ranked = [w for w, c in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if c >= min_count]
        self.__init__(ranked[: max(vocab_size - len(SPECIAL_TOKENS), 0)], self.lowercase, self.pattern)
        return self

    def encode(self, text: str) -> list[int]:
        get = self._word_to_id.get
        return [get(w, UNK_ID) for w in self.split(text)]

    def decode(self, ids: Iterable[int]) -> str:
        out: list[str] = []
        for i in ids:
            i = int(i)
            if i == UNK_ID:
                piece = "<unk>"
            elif i < len(SPECIAL_TOKENS) or i >= self.vocab_size:
                continue
            else:
                piece = self.words[i - len(SPECIAL_TOKENS)]
            if out and piece not in _NO_SPACE_BEFORE and not piece.startswith("'"):
                out.append(" ")
            out.append(piece)
        return "".join(out)

    def unk_rate(self, texts: Iterable[str]) -> float:
        total = unk = 0
        for t in texts:
            ids = self.encode(t)
            total += len(ids)
            unk += sum(1 for i in ids if i == UNK_ID)
        return unk / total if total else 0.0

    def id_to_piece(self, i: int) -> str:
        return SPECIAL_TOKENS[i] if i < len(SPECIAL_TOKENS) else self.words[i - len(SPECIAL_TOKENS)]

    def _state(self) -> dict:
        return {"lowercase": self.lowercase, "pattern": self.pattern, "words": self.words}

    @classmethod
    def _from_state(cls, state: dict) -> "WordTokenizer":
        return cls(state["words"], state.get("lowercase", False), state.get("pattern", WORD_PATTERN))
