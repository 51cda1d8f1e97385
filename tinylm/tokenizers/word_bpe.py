"""Character-level BPE on whitespace-split words, with an end-of-word token (``word_bpe``).

This is the tokenizer of the Shakespeare four-stage report ("Building GPT from Scratch - A
Four-Stage Implementation Report"), kept so that its numbers can be checked against tinylm's:

1. the text is normalised: ``lower_nopunct`` folds case and removes punctuation (Unicode
   category P), ``aggressive`` folds case and keeps only letters, digits and whitespace, ``none``
   keeps it as is; then it is split on whitespace into words;
2. each word starts as its characters; BPE merges learned on the training words (the trainer and
   merge loop of tinylm.tokenizers.merges, shared with the byte-level BPE: most frequent pair
   first, ties to the smallest ids) join them, never across words;
3. every word is followed by the end-of-word token ``__``, which decodes as a space.

Ids: the 4 specials, ``__`` (id 4), the training text's characters in sorted order, then one
token per merge. A character never seen in training encodes as ``<unk>``. Lossless on normalised
text: ``decode(encode(t)) == normalize(t)`` (words joined by single spaces) whenever every
character of ``normalize(t)`` was seen in training. Tokens per word in the report's sense counts
the pieces of words, not the ``__`` after each.
"""

from __future__ import annotations

from itertools import islice
from typing import Iterable, get_args

import regex

from tinylm.config import Normalization
from tinylm.constants import SPECIAL_TOKENS, UNK_ID
from tinylm.errors import TinyLMError
from tinylm.tokenizers.base import Tokenizer, count_pieces
from tinylm.tokenizers.merges import learn_merges, merge_pairs

END_OF_WORD = "__"
EOW_ID = len(SPECIAL_TOKENS)
FIRST_CHAR_ID = EOW_ID + 1
_PUNCTUATION = regex.compile(r"\p{P}+")
_NOT_ALPHANUMERIC = regex.compile(r"[^\p{L}\p{N}\s]+")
_CACHE_LIMIT = 500_000


def normalize_text(text: str, normalization: str) -> str:
    """``text`` normalised and its words joined by single spaces."""
    if normalization == "lower_nopunct":
        text = _PUNCTUATION.sub("", text.lower())
    elif normalization == "aggressive":
        text = _NOT_ALPHANUMERIC.sub("", text.lower())
    elif normalization != "none":
        raise TinyLMError(
            f"word_bpe normalization {normalization!r} is not one of {', '.join(get_args(Normalization))}"
        )
    return " ".join(text.split())


class WordBPETokenizer(Tokenizer):
    type_name = "word_bpe"
    lossless = False  # lossless on normalised text only
    normalizes = True
    decode_with_prompt = True  # a prompt is shown as normalised, the way the model saw it

    def __init__(
        self,
        alphabet: Iterable[str] = (),
        merges: list[tuple[int, int]] | None = None,
        normalization: str = "lower_nopunct",
    ):
        normalize_text("", normalization)  # refuse an unknown normalisation now
        self.normalization = normalization
        self.alphabet = list(alphabet)
        if any(len(c) != 1 for c in self.alphabet) or len(set(self.alphabet)) != len(self.alphabet):
            raise TinyLMError("word_bpe alphabet must be distinct single characters")
        self.char_ids = {c: FIRST_CHAR_ID + i for i, c in enumerate(self.alphabet)}
        self.first_merge_id = FIRST_CHAR_ID + len(self.alphabet)
        self.merges = [tuple(int(x) for x in m) for m in (merges or [])]
        self.pieces = ["", "<unk>", "", "", " "] + self.alphabet  # what each id decodes to
        for i, (a, b) in enumerate(self.merges):
            if not (FIRST_CHAR_ID <= a < self.first_merge_id + i and FIRST_CHAR_ID <= b < self.first_merge_id + i):
                raise TinyLMError(f"word_bpe merge {i} = ({a}, {b}) refers to a token that does not exist yet")
            self.pieces.append(self.pieces[a] + self.pieces[b])
        self._pair_merges = {pair: (i, self.first_merge_id + i) for i, pair in enumerate(self.merges)}
        self._cache: dict[str, tuple[int, ...]] = {}

    @property
    def vocab_size(self) -> int:
        return self.first_merge_id + len(self.merges)

    def normalize(self, text: str) -> str:
        return normalize_text(text, self.normalization)

    def train(self, texts: Iterable[str], vocab_size: int = 0, merges: int | None = None) -> "WordBPETokenizer":
        """Learn ``merges`` merges (or as many as make ``vocab_size`` tokens), fewer when no pair is
        left to merge."""
        counts = count_pieces(texts, lambda text: self.normalize(text).split())
        if not counts:
            raise TinyLMError("cannot train word_bpe on an empty corpus (nothing left after normalisation)")
        alphabet = sorted(set("".join(counts)))
        first_merge = FIRST_CHAR_ID + len(alphabet)
        n_merges = merges if merges is not None else vocab_size - first_merge
        if n_merges < 0:
            raise TinyLMError(
                f"word_bpe vocab_size {vocab_size} is smaller than the specials, {END_OF_WORD} and "
                f"the {len(alphabet)} characters of the corpus ({first_merge})"
            )
        char_ids = {c: FIRST_CHAR_ID + i for i, c in enumerate(alphabet)}
        words = [[char_ids[c] for c in w] for w in counts]
        learned = learn_merges(words, list(counts.values()), n_merges, first_merge)
        self.__init__(alphabet, learned, self.normalization)
        # the words are merged as encode would merge them: they seed the cache
        self._cache.update(islice(((word, (*ids, EOW_ID)) for word, ids in zip(counts, words)), _CACHE_LIMIT))
        return self

    def encode_word(self, word: str) -> tuple[int, ...]:
        """The pieces of one (normalised, space-free) word and its ``__``; remembered per word."""
        ids = self._cache.get(word)
        if ids is None:
            if len(self._cache) >= _CACHE_LIMIT:
                self._cache.clear()
            chars = [self.char_ids.get(c, UNK_ID) for c in word]
            ids = self._cache[word] = (*merge_pairs(chars, self._pair_merges.get), EOW_ID)
        return ids

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for word in self.normalize(text).split():
            out.extend(self.encode_word(word))
        return out

    def decode(self, ids: Iterable[int]) -> str:
        pieces, n = self.pieces, len(self.pieces)
        out = []
        for i in map(int, ids):
            if not 0 <= i < n:
                raise TinyLMError(f"token id {i} is outside the word_bpe vocabulary of {n}")
            out.append(pieces[i])
        text = "".join(out)
        return text[:-1] if text.endswith(" ") else text

    def id_to_piece(self, i: int) -> str:
        return END_OF_WORD if i == EOW_ID else SPECIAL_TOKENS[i] if i < EOW_ID else self.pieces[i]

    def _state(self) -> dict:
        return {
            "normalization": self.normalization,
            "alphabet": self.alphabet,
            "merges": [list(m) for m in self.merges],
        }

    @classmethod
    def _from_state(cls, state: dict) -> "WordBPETokenizer":
        merges = state.get("merges")
        if not isinstance(merges, list) or any(not isinstance(m, list) or len(m) != 2 for m in merges):
            raise TinyLMError('word_bpe tokenizer file: "merges" must be a list of [left id, right id] pairs')
        return cls(state["alphabet"], [tuple(m) for m in merges], state.get("normalization", "lower_nopunct"))
