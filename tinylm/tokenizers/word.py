"""Word-level tokenizer: words and punctuation by a regex (or spaCy), vocabulary by frequency.

Options, as the word-level seeds used them: ``lowercase``; ``keep_punctuation`` (punctuation marks
are tokens of their own, or dropped); vocabulary = the ``vocab_size`` most frequent words and/or
the words seen at least ``min_count`` times; ``splitter="regex"`` (default, no dependency) or
``"spacy"`` (spaCy's rule-based English tokenizer, ``spacy.blank("en")``, when installed).

Special tokens: ``<pad> <unk> <sos> <eos>`` at ids 0-3 by default; ``special_tokens`` reorders
them and ``specials_at="end"`` puts them after the vocabulary (both as seed reports did).

Out-of-vocabulary words become ``<unk>``, or with ``oov="bpe"`` character-level BPE pieces (the
``word_bpe`` tokenizer's, trained on the training words, each OOV word ending with its ``__``
piece), so every word spelled with the training alphabet is kept. Decoding re-joins words with
spaces (no space before closing punctuation): what is lost is the original spacing, and with
``oov="unk"`` the unknown words (``coverage`` reports how many).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Iterable, get_args

from tinylm.config import SpecialsAt, WordOOV, WordSplitter
from tinylm.constants import SPECIAL_TOKENS
from tinylm.errors import TinyLMError
from tinylm.tokenizers.base import Tokenizer, count_pieces
from tinylm.tokenizers.word_bpe import END_OF_WORD, EOW_ID, WordBPETokenizer

WORD_PATTERN = r"\w+(?:'\w+)*|[^\w\s]"
NO_SPACE_BEFORE = set(".,!?;:)]}'\"") | {"n't", "'s"}
_PUNCT = re.compile(r"[^\w\s]+")
# the constructor's options besides the vocabulary, saved with it
OPTIONS = ("lowercase", "pattern", "keep_punctuation", "splitter", "special_tokens", "specials_at", "oov")


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
        return {
            **asdict(self),
            "token_coverage": self.token_coverage,
            "type_coverage": self.type_coverage,
            "unk_rate": self.unk_rate,
        }


class WordTokenizer(Tokenizer):
    type_name = "word"

    def __init__(
        self,
        words: list[str] | None = None,
        lowercase: bool = False,
        pattern: str = WORD_PATTERN,
        keep_punctuation: bool = True,
        splitter: str = "regex",
        special_tokens=SPECIAL_TOKENS,
        specials_at: str = "start",
        oov: str = "unk",
        oov_bpe: WordBPETokenizer | None = None,
    ):
        for name, value, choices in (
            ("splitter", splitter, WordSplitter),
            ("specials_at", specials_at, SpecialsAt),
            ("oov", oov, WordOOV),
        ):
            if value not in get_args(choices):
                raise TinyLMError(f"word {name} {value!r} is not one of {', '.join(get_args(choices))}")
        if sorted(special_tokens) != sorted(SPECIAL_TOKENS):
            raise TinyLMError(
                f"word special_tokens {list(special_tokens)} must be an ordering of {list(SPECIAL_TOKENS)}"
            )
        self.words = list(words or [])
        self.lowercase = lowercase
        self.pattern = pattern
        self.keep_punctuation = keep_punctuation
        self.splitter = splitter
        self.special_tokens = tuple(special_tokens)
        self.specials_at = specials_at
        self.oov = oov
        self.oov_bpe = oov_bpe if oov == "bpe" else None
        try:
            self._re = re.compile(pattern)
        except re.error as exc:
            raise TinyLMError(f"word pattern {pattern!r} is not a valid regex ({exc})") from exc
        self._nlp = _spacy_tokenizer() if splitter == "spacy" else None
        # id layout: [specials][words][OOV pieces: __, characters, merges], or the specials last
        n_pieces = self.oov_bpe.vocab_size - EOW_ID if self.oov_bpe is not None else 0
        first_word = self.word_ids.start
        self._piece_offset = first_word + len(self.words) - EOW_ID  # word_bpe id b (>= __) -> b + offset
        first_special = 0 if specials_at == "start" else len(self.words) + n_pieces
        ids = {name: first_special + i for i, name in enumerate(self.special_tokens)}
        self.pad_id, self.unk_id, self.sos_id, self.eos_id = (ids[t] for t in SPECIAL_TOKENS)
        self._special_names = {i: name for name, i in ids.items()}
        self.bos_id, self.stop_ids = self.sos_id, (self.eos_id,)
        self._size = len(SPECIAL_TOKENS) + len(self.words) + n_pieces
        self._word_to_id = {w: first_word + i for i, w in enumerate(self.words)}
        if len(self._word_to_id) != len(self.words):
            raise TinyLMError("word vocabulary has duplicate entries")
        self._pieces: list[str] = [""] * self._size  # what each id decodes to ("" for specials but <unk>)
        for w, i in self._word_to_id.items():
            self._pieces[i] = w
        if self.oov_bpe is not None:
            for b in range(EOW_ID, self.oov_bpe.vocab_size):
                self._pieces[b + self._piece_offset] = self.oov_bpe.pieces[b]
        self._pieces[self.unk_id] = "<unk>"
        self._eow = EOW_ID + self._piece_offset if self.oov_bpe is not None else None
        # ids of the OOV pieces that spell a word (after its __ id)
        self._spelling = range(self._eow + 1, self._eow + n_pieces) if self._eow is not None else range(0)

    @property
    def vocab_size(self) -> int:
        return self._size

    @property
    def word_ids(self) -> range:
        """The ids of the vocabulary's words: after the specials, or first with ``specials_at="end"``."""
        first = len(SPECIAL_TOKENS) if self.specials_at == "start" else 0
        return range(first, first + len(self.words))

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

    def train(
        self, texts: Iterable[str], vocab_size: int | None = None, min_count: int = 1, oov_merges: int = 1000
    ) -> "WordTokenizer":
        """Keep the most frequent words (ties alphabetical): at most ``vocab_size`` ids for the
        specials and words (None or 0 for no cap), and only words seen ``min_count`` times. With
        ``oov="bpe"``, ``oov_merges`` BPE merges learned on every training word (by frequency)
        spell the words left out, after the words' ids."""
        if vocab_size is not None and 0 < vocab_size <= len(SPECIAL_TOKENS):
            raise TinyLMError(
                f"word vocab_size {vocab_size} leaves no room for words after the {len(SPECIAL_TOKENS)} special tokens"
            )
        if min_count < 1:
            raise TinyLMError(f"word min_count must be at least 1 (got {min_count})")
        counts = count_pieces(texts, self.split)
        if not counts:
            raise TinyLMError("cannot train a word tokenizer on an empty corpus")
        ranked = [w for w, c in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if c >= min_count]
        if vocab_size:
            ranked = ranked[: vocab_size - len(SPECIAL_TOKENS)]
        bpe = None
        if self.oov == "bpe":  # words never hold whitespace, so word_bpe without normalisation keeps them whole
            bpe = WordBPETokenizer(normalization="none").train(
                [" ".join([w] * c) for w, c in counts.items()], merges=oov_merges
            )
        self.__init__(ranked, **{k: getattr(self, k) for k in OPTIONS}, oov_bpe=bpe)
        return self

    def encode(self, text: str) -> list[int]:
        get, out = self._word_to_id.get, []
        for w in self.split(text):
            i = get(w)
            if i is not None:
                out.append(i)
            elif self.oov_bpe is not None:
                out.extend(b + self._piece_offset if b >= EOW_ID else self.unk_id for b in self.oov_bpe.encode_word(w))
            else:
                out.append(self.unk_id)
        return out

    def decode(self, ids: Iterable[int]) -> str:
        words: list[str] = []
        spelled = ""  # an OOV word's pieces until its __
        for i in map(int, ids):
            if not 0 <= i < self._size:
                continue
            if i == self._eow:
                words.append(spelled)
                spelled = ""
            elif i in self._spelling:
                spelled += self._pieces[i]
            elif self._pieces[i]:
                words.append(self._pieces[i])
        if spelled:  # pieces of a word that was cut before its __
            words.append(spelled)
        return self.join(words)

    @staticmethod
    def join(words: list[str]) -> str:
        """Words re-joined with single spaces, none before closing punctuation."""
        out: list[str] = []
        for piece in words:
            if out and piece not in NO_SPACE_BEFORE and not piece.startswith("'"):
                out.append(" ")
            out.append(piece)
        return "".join(out)

    def normalize(self, text: str) -> str:
        return self.join(self.split(text))

    def coverage(self, texts: Iterable[str]) -> Coverage:
        """Share of running words and of distinct words of ``texts`` that are in the vocabulary."""
        counts = count_pieces(texts, self.split)
        known = self._word_to_id
        return Coverage(
            n_tokens=sum(counts.values()),
            n_types=len(counts),
            tokens_covered=sum(c for w, c in counts.items() if w in known),
            types_covered=sum(1 for w in counts if w in known),
        )

    def unk_rate(self, texts: Iterable[str]) -> float:
        """Share of the tokens of ``texts`` that are ``<unk>`` (words out of the vocabulary, or with
        ``oov="bpe"`` only characters out of the training alphabet)."""
        if self.oov_bpe is None:
            return self.coverage(texts).unk_rate
        ids = [i for t in ([texts] if isinstance(texts, str) else texts) for i in self.encode(t)]
        return sum(i == self.unk_id for i in ids) / len(ids) if ids else 0.0

    def id_to_piece(self, i: int) -> str:
        if i in self._special_names:
            return self._special_names[i]
        if i == self._eow:
            return END_OF_WORD
        return self._pieces[i]

    def _state(self) -> dict:
        state = {"words": self.words, **{k: getattr(self, k) for k in OPTIONS}}
        if self.oov_bpe is not None:
            state["oov_bpe"] = self.oov_bpe._state()
        return state

    @classmethod
    def _from_state(cls, state: dict) -> "WordTokenizer":
        if not isinstance(state.get("words"), list) or any(not isinstance(w, str) for w in state["words"]):
            raise TinyLMError('word tokenizer file: "words" must be a list of strings')
        bpe = WordBPETokenizer._from_state(state["oov_bpe"]) if state.get("oov_bpe") else None
        return cls(state["words"], **{k: state[k] for k in OPTIONS if k in state}, oov_bpe=bpe)


_NLP = None


def _spacy_tokenizer():
    """spaCy's rule-based English tokenizer (no model download needed), loaded once."""
    global _NLP
    if _NLP is None:
        try:
            import spacy  # deferred: optional, and slow to import; only splitter=spacy needs it
        except ImportError as exc:
            raise TinyLMError(
                "splitter 'spacy' needs spaCy (pip install spacy); the default 'regex' needs nothing"
            ) from exc
        _NLP = spacy.blank("en").tokenizer
    return _NLP
