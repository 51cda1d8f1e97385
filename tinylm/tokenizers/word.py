"""Word-level tokenizer: words and punctuation by a regex (or spaCy), vocabulary by frequency.

Options, as the word-level seeds used them: ``lowercase``; ``keep_punctuation`` (punctuation marks
are tokens of their own, or dropped); vocabulary = the ``vocab_size`` most frequent words and/or
the words seen at least ``min_count`` times; ``splitter="regex"`` (default, no dependency) or
``"spacy"`` (spaCy's rule-based English tokenizer, ``spacy.blank("en")``, when installed).

Not lossless: out-of-vocabulary words become ``<unk>`` and decoding re-joins words with
spaces (no space before closing punctuation). ``coverage`` reports how much is lost.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Iterable

from tinylm.constants import SPECIAL_TOKENS, UNK_ID
from tinylm.errors import TinyLMError
from tinylm.tokenizers.base import Tokenizer

WORD_PATTERN = r"\w+(?:'\w+)*|[^\w\s]"
_NO_SPACE_BEFORE = set(".,!?;:)]}'\"") | {"n't", "'s"}
_PUNCT = re.compile(r"[^\w\s]+")
SPLITTERS = ("regex", "spacy")


@dataclass
class Coverage:
    """How much of a text the vocabulary covers (running tokens and distinct types)."""

    n_tokens: int
    n_types: int
    tokens_covered: int
    types_covered: int

    @property
    def token_coverage(self) -> float:
        return self.tokens_covered / self.n_tokens if self.n_tokens else 1.0

    @property
    def type_coverage(self) -> float:
        return self.types_covered / self.n_types if self.n_types else 1.0

    @property
    def unk_rate(self) -> float:
        return 1.0 - self.token_coverage

    def as_dict(self) -> dict:
        return {**asdict(self), "token_coverage": self.token_coverage, "type_coverage": self.type_coverage,
                "unk_rate": self.unk_rate}


class WordTokenizer(Tokenizer):
    type_name = "word"

    def __init__(self, words: list[str] | None = None, lowercase: bool = False, pattern: str = WORD_PATTERN,
                 keep_punctuation: bool = True, splitter: str = "regex"):
        if splitter not in SPLITTERS:
            raise TinyLMError(f"word splitter {splitter!r} is not one of {', '.join(SPLITTERS)}")
        self.words = list(words or [])
        self.lowercase = lowercase
        self.pattern = pattern
        self.keep_punctuation = keep_punctuation
        self.splitter = splitter
        try:
            self._re = re.compile(pattern)
        except re.error as exc:
            raise TinyLMError(f"word pattern {pattern!r} is not a valid regex ({exc})") from exc
        self._nlp = _spacy_tokenizer() if splitter == "spacy" else None
        self._word_to_id = {w: len(SPECIAL_TOKENS) + i for i, w in enumerate(self.words)}
        if len(self._word_to_id) != len(self.words):
            raise TinyLMError("word vocabulary has duplicate entries")

    @property
    def vocab_size(self) -> int:
        return len(SPECIAL_TOKENS) + len(self.words)

    def split(self, text: str) -> list[str]:
        if self.lowercase:
            text = text.lower()
        if self._nlp is not None:
            words = [t.text for t in self._nlp(text) if not t.is_space]
        else:
            words = self._re.findall(text)
        if not self.keep_punctuation:
            words = [w for w in words if not _PUNCT.fullmatch(w)]
        return words

    def train(self, texts: Iterable[str], vocab_size: int | None = None, min_count: int = 1) -> "WordTokenizer":
        """Keep the most frequent words (ties alphabetical): at most ``vocab_size`` ids in all
        (specials included; None or 0 for no cap), and only words seen ``min_count`` times."""
        if isinstance(texts, str):
            texts = [texts]
        if vocab_size is not None and 0 < vocab_size <= len(SPECIAL_TOKENS):
            raise TinyLMError(f"word vocab_size {vocab_size} leaves no room for words after the "
                              f"{len(SPECIAL_TOKENS)} special tokens")
        if min_count < 1:
            raise TinyLMError(f"word min_count must be at least 1 (got {min_count})")
        counts: Counter[str] = Counter()
        for t in texts:
            counts.update(self.split(t))
        if not counts:
            raise TinyLMError("cannot train a word tokenizer on an empty corpus")
        ranked = [w for w, c in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if c >= min_count]
        if vocab_size:
            ranked = ranked[: vocab_size - len(SPECIAL_TOKENS)]
        self.__init__(ranked, self.lowercase, self.pattern, self.keep_punctuation, self.splitter)
        self.word_counts = counts  # kept for coverage reports right after training (not saved)
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

    def coverage(self, texts: Iterable[str]) -> Coverage:
        """Share of running words and of distinct words of ``texts`` that are in the vocabulary."""
        if isinstance(texts, str):
            texts = [texts]
        counts: Counter[str] = Counter()
        for t in texts:
            counts.update(self.split(t))
        known = self._word_to_id
        return Coverage(
            n_tokens=sum(counts.values()), n_types=len(counts),
            tokens_covered=sum(c for w, c in counts.items() if w in known),
            types_covered=sum(1 for w in counts if w in known),
        )

    def unk_rate(self, texts: Iterable[str]) -> float:
        return self.coverage(texts).unk_rate

    def id_to_piece(self, i: int) -> str:
        return SPECIAL_TOKENS[i] if i < len(SPECIAL_TOKENS) else self.words[i - len(SPECIAL_TOKENS)]

    def _state(self) -> dict:
        return {"lowercase": self.lowercase, "pattern": self.pattern, "keep_punctuation": self.keep_punctuation,
                "splitter": self.splitter, "words": self.words}

    @classmethod
    def _from_state(cls, state: dict) -> "WordTokenizer":
        if not isinstance(state.get("words"), list) or any(not isinstance(w, str) for w in state["words"]):
            raise TinyLMError("word tokenizer file: \"words\" must be a list of strings")
        return cls(state["words"], state.get("lowercase", False), state.get("pattern", WORD_PATTERN),
                   state.get("keep_punctuation", True), state.get("splitter", "regex"))


_NLP = None


def _spacy_tokenizer():
    """spaCy's rule-based English tokenizer (no model download needed), loaded once."""
    global _NLP
    if _NLP is None:
        try:
            import spacy  # deferred: optional, and slow to import; only splitter=spacy needs it
        except ImportError as exc:
            raise TinyLMError("splitter 'spacy' needs spaCy (pip install spacy); the default 'regex' needs nothing") from exc
        _NLP = spacy.blank("en").tokenizer
    return _NLP
