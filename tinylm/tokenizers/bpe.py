"""Byte-level BPE trained from scratch.

Vocabulary: 4 specials, 256 byte tokens (id = 4 + byte), then one token per merge.

Pre-tokenisation: text is first split into pre-tokens by a regex (GPT-2's by default, "gpt4" for
the cl100k-style split, or any pattern you give) so that merges never cross word boundaries. A
custom pattern need not match every character: characters it skips become one-character
pre-tokens, so encoding stays lossless whatever the pattern.

Training counts the unique pre-tokens once, then keeps per-pair counts and the set of pre-tokens
holding each pair; after a merge only those pre-tokens are rewritten and only the counts of
pairs they hold are updated (a lazy max-heap finds the next pair).

Tie-breaking (documented because reference trainers differ): among pairs with the highest
count, the pair with the smallest (left id, right id) is merged first. Adjacent pairs are
counted at every position (so "aaa" holds the pair (a, a) twice) and a merge replaces
occurrences left to right without overlap.

Special tokens: ``<pad> <unk> <sos> <eos>`` are recognised in text only when asked,
``encode(text, allowed_special="all")`` or a set of their strings, as tiktoken does. A
recognised special string is always exactly one id, never split or merged with its neighbours;
by default special strings are ordinary text, which keeps encoding lossless on any input.
"""

from __future__ import annotations

from itertools import chain, islice, repeat
from typing import Iterable

import regex

from tinylm.constants import SPECIAL_TOKENS
from tinylm.errors import TinyLMError
from tinylm.tokenizers.base import Tokenizer, count_pieces
from tinylm.tokenizers.merges import learn_merges, merge_pairs

GPT2_SPLIT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT4_SPLIT = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)
SPLIT_PATTERNS = {"gpt2": GPT2_SPLIT, "gpt4": GPT4_SPLIT}
BYTE_BASE = len(SPECIAL_TOKENS)
FIRST_MERGE_ID = BYTE_BASE + 256
_LONG_PIECE = 64  # bytes; longer pre-tokens are merged with a heap instead of repeated scans
_CACHE_LIMIT = 500_000
_NO_RANK = 1 << 62


def total_pattern(pattern: str) -> str:
    """The regex text actually used for ``pattern``: a named pattern as is (they match every
    character), a custom one extended so that a character it skips is a pre-token of its own."""
    return SPLIT_PATTERNS.get(pattern) or f"(?:{pattern})|[\\s\\S]"


def compile_split(pattern: str) -> "regex.Pattern":
    """The pre-tokenisation regex for a pattern name or a custom regex (made total: any
    character the pattern does not match becomes its own pre-token)."""
    if pattern in SPLIT_PATTERNS:
        return regex.compile(SPLIT_PATTERNS[pattern])
    try:
        compiled = regex.compile(pattern)
    except regex.error as exc:
        raise TinyLMError(f"BPE split pattern {pattern!r} is not a valid regex ({exc})") from exc
    if compiled.groups:
        raise TinyLMError(f"BPE split pattern {pattern!r} has capturing groups; use (?:...) instead")
    return regex.compile(total_pattern(pattern))


class BPETokenizer(Tokenizer):
    type_name = "bpe"
    lossless = True

    def __init__(self, merges: list[tuple[int, int]] | None = None, pattern: str = "gpt2"):
        self.pattern = pattern
        self._split = compile_split(pattern)
        self.merges = [tuple(int(x) for x in m) for m in (merges or [])]
        self.ranks = {pair: i for i, pair in enumerate(self.merges)}
        self._pair_merges = {pair: (i, FIRST_MERGE_ID + i) for i, pair in enumerate(self.merges)}
        self.token_bytes: list[bytes] = [s.encode() for s in SPECIAL_TOKENS] + [bytes([b]) for b in range(256)]
        for i, (a, b) in enumerate(self.merges):
            if not (0 <= a < FIRST_MERGE_ID + i and 0 <= b < FIRST_MERGE_ID + i) or a < BYTE_BASE or b < BYTE_BASE:
                raise TinyLMError(f"BPE merge {i} = ({a}, {b}) refers to a token that does not exist yet")
            self.token_bytes.append(self.token_bytes[a] + self.token_bytes[b])
        self._cache: dict[str, tuple[int, ...]] = {}
        self._special_re: dict[frozenset, "regex.Pattern"] = {}

    @property
    def vocab_size(self) -> int:
        return FIRST_MERGE_ID + len(self.merges)

    def pretokenize(self, text: str) -> list[str]:
        return [p for p in self._split.findall(text) if p]

    # ---------------------------------------------------------------------------------- train
    def train(self, texts: Iterable[str], vocab_size: int) -> "BPETokenizer":
        """Learn ``vocab_size - 260`` merges (fewer when no pair is left to merge)."""
        if vocab_size < FIRST_MERGE_ID:
            raise TinyLMError(
                f"BPE vocab_size {vocab_size} is smaller than the byte alphabet plus specials "
                f"({FIRST_MERGE_ID}); use at least {FIRST_MERGE_ID}"
            )
        counts = count_pieces(texts, self._split.findall)
        counts.pop("", None)
        if not counts:
            raise TinyLMError("cannot train BPE on an empty corpus")
        words = [[BYTE_BASE + b for b in w.encode("utf-8", "surrogatepass")] for w in counts]
        freqs = list(counts.values())
        merges = learn_merges(words, freqs, vocab_size - FIRST_MERGE_ID, FIRST_MERGE_ID)
        self.__init__(merges, self.pattern)
        # the training pre-tokens end up merged exactly as encode would merge them (same merges in
        # the same order), so they seed the piece cache: encoding the training text starts warm
        self._cache.update(islice(zip(counts, map(tuple, words)), _CACHE_LIMIT))
        return self

    # --------------------------------------------------------------------------------- encode
    def _encode_piece(self, piece: str) -> tuple[int, ...]:
        """Merge the lowest-ranked adjacent pair, leftmost first, until none is a merge. Merging
        occurrences one at a time from the left gives the same result as merging all of them at
        once, since a merge only creates pairs of higher rank."""
        ids = [BYTE_BASE + b for b in piece.encode("utf-8", "surrogatepass")]
        n = len(ids)
        if n < 2:
            return tuple(ids)
        if n > _LONG_PIECE:
            return tuple(merge_pairs(ids, self._pair_merges.get))
        get, big = self.ranks.get, _NO_RANK
        ranks = list(map(get, zip(ids, ids[1:]), repeat(big, n - 1)))  # rank of pair (i, i+1)
        while True:
            rank = min(ranks)  # min / index run in C; only the two neighbours are looked up again
            if rank == big:
                break
            i = ranks.index(rank)
            new = FIRST_MERGE_ID + rank
            ids[i] = new
            del ids[i + 1]
            del ranks[i]
            if not ranks:
                break
            if i > 0:
                ranks[i - 1] = get((ids[i - 1], new), big)
            if i < len(ranks):
                ranks[i] = get((new, ids[i + 1]), big)
        return tuple(ids)

    def _encode_ordinary(self, text: str) -> list[int]:
        pieces = self._split.findall(text)
        cache = self._cache
        try:
            return list(chain.from_iterable(map(cache.__getitem__, pieces)))
        except KeyError:  # some pieces not seen yet: encode them once, then retry
            if len(cache) > _CACHE_LIMIT:
                cache.clear()
            for piece in set(pieces).difference(cache):
                cache[piece] = self._encode_piece(piece)
            return list(chain.from_iterable(map(cache.__getitem__, pieces)))

    def encode(self, text: str, allowed_special: str | Iterable[str] = ()) -> list[int]:
        """Token ids of ``text``. ``allowed_special``: "all", or the special strings (e.g.
        {"<eos>"}) to recognise as single tokens; by default none is (they are plain text)."""
        if allowed_special == "all":
            allowed = frozenset(SPECIAL_TOKENS)
        else:
            allowed = frozenset(allowed_special)
            unknown = allowed.difference(SPECIAL_TOKENS)
            if unknown:
                raise TinyLMError(f"unknown special tokens {sorted(unknown)}; known: {', '.join(SPECIAL_TOKENS)}")
        if not allowed:
            return self._encode_ordinary(text)
        splitter = self._special_re.get(allowed)
        if splitter is None:
            alternatives = "|".join(regex.escape(s) for s in sorted(allowed, key=len, reverse=True))
            splitter = self._special_re[allowed] = regex.compile(f"({alternatives})")
        out: list[int] = []
        for i, part in enumerate(splitter.split(text)):
            if i % 2:  # odd parts are the captured special strings
                out.append(SPECIAL_TOKENS.index(part))
            elif part:
                out.extend(self._encode_ordinary(part))
        return out

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Text of ``ids``. Special tokens are dropped, or written as their strings with
        ``skip_special=False`` (the inverse of ``encode(..., allowed_special="all")``)."""
        tb = self.token_bytes
        n = len(tb)
        ids = list(map(int, ids))
        if ids and (min(ids) < 0 or max(ids) >= n):
            bad = next(i for i in ids if not 0 <= i < n)
            raise TinyLMError(f"token id {bad} is outside the BPE vocabulary of {n}")
        raw = b"".join(tb[i] for i in ids if i >= BYTE_BASE or not skip_special)
        try:  # lone surrogates survive a round trip; anything else invalid is replaced
            return raw.decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            return raw.decode("utf-8", errors="replace")

    def id_to_piece(self, i: int) -> str:
        return self.token_bytes[i].decode("utf-8", errors="replace")

    def _state(self) -> dict:
        return {"pattern": self.pattern, "merges": [list(m) for m in self.merges]}

    @classmethod
    def _from_state(cls, state: dict) -> "BPETokenizer":
        merges = state.get("merges")
        if not isinstance(merges, list) or any(not isinstance(m, list) or len(m) != 2 for m in merges):
            raise TinyLMError('BPE tokenizer file: "merges" must be a list of [left id, right id] pairs')
        return cls([tuple(m) for m in merges], state.get("pattern", "gpt2"))
