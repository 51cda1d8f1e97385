"""Byte-level BPE trained from scratch.

Vocabulary: 4 specials, 256 byte tokens (id = 4 + byte), then one token per merge.
Text is first split into pre-tokens by a regex (GPT-2's by default) so that merges never cross
word boundaries. Training counts the unique pre-tokens once and then updates pair counts
incrementally after each merge, touching only the pre-tokens that contain the merged pair.

Tie-breaking (documented because reference trainers differ): among pairs with the highest
count, the pair with the smallest (left id, right id) is merged first.
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from typing import Iterable

import regex

from tinylm.errors import TinyLMError
from tinylm.tokenizers.base import SPECIAL_TOKENS, Tokenizer

GPT2_SPLIT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT4_SPLIT = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)
SPLIT_PATTERNS = {"gpt2": GPT2_SPLIT, "gpt4": GPT4_SPLIT}
BYTE_BASE = len(SPECIAL_TOKENS)
FIRST_MERGE_ID = BYTE_BASE + 256


class BPETokenizer(Tokenizer):
    type_name = "bpe"
    lossless = True

    def __init__(self, merges: list[tuple[int, int]] | None = None, pattern: str = "gpt2"):
        self.pattern = pattern
        self._split = regex.compile(SPLIT_PATTERNS.get(pattern, pattern))
        self.merges = [tuple(m) for m in (merges or [])]
        self.ranks = {pair: i for i, pair in enumerate(self.merges)}
        self.token_bytes: list[bytes] = [s.encode() for s in SPECIAL_TOKENS] + [bytes([b]) for b in range(256)]
        for a, b in self.merges:
            self.token_bytes.append(self.token_bytes[a] + self.token_bytes[b])
        self._cache: dict[str, list[int]] = {}

    @property
    def vocab_size(self) -> int:
        return FIRST_MERGE_ID + len(self.merges)

    def pretokenize(self, text: str) -> list[str]:
        return self._split.findall(text)

    # ---------------------------------------------------------------------------------- train
    def train(self, texts: Iterable[str], vocab_size: int) -> "BPETokenizer":
        if vocab_size < FIRST_MERGE_ID:
            raise TinyLMError(
                f"BPE vocab_size {vocab_size} is smaller than the byte alphabet plus specials "
                f"({FIRST_MERGE_ID}); use at least {FIRST_MERGE_ID}"
            )
        counts: Counter[str] = Counter()
        for t in texts:
            counts.update(self.pretokenize(t))
        if not counts:
            raise TinyLMError("cannot train BPE on an empty corpus")
        words = [[BYTE_BASE + b for b in w.encode("utf-8")] for w in counts]
        freqs = list(counts.values())

        pair_counts: dict[tuple[int, int], int] = defaultdict(int)
        where: dict[tuple[int, int], set[int]] = defaultdict(set)
        for wi, (w, f) in enumerate(zip(words, freqs)):
            for pair in zip(w, w[1:]):
                pair_counts[pair] += f
                where[pair].add(wi)
        heap = [(-c, p) for p, c in pair_counts.items()]
        heapq.heapify(heap)

        merges: list[tuple[int, int]] = []
        n_merges = vocab_size - FIRST_MERGE_ID
        while len(merges) < n_merges and heap:
            neg, pair = heapq.heappop(heap)
            if pair_counts.get(pair, 0) != -neg or -neg <= 0:
                continue  # stale heap entry
            new_id = FIRST_MERGE_ID + len(merges)
            merges.append(pair)
            changed: set[tuple[int, int]] = set()
            for wi in list(where[pair]):
                w, f = words[wi], freqs[wi]
                for p in zip(w, w[1:]):  # remove this word's old pairs
                    pair_counts[p] -= f
                    changed.add(p)
                merged = _merge(w, pair, new_id)
                words[wi] = merged
                for p in zip(merged, merged[1:]):
                    pair_counts[p] += f
                    where[p].add(wi)
                    changed.add(p)
            del where[pair]
            pair_counts.pop(pair, None)
            changed.discard(pair)
            for p in changed:
                c = pair_counts.get(p, 0)
                if c > 0:
                    heapq.heappush(heap, (-c, p))
                else:
                    pair_counts.pop(p, None)
        self.__init__(merges, self.pattern)
        return self

    # --------------------------------------------------------------------------------- encode
    def _encode_piece(self, piece: str) -> list[int]:
        ids = [BYTE_BASE + b for b in piece.encode("utf-8")]
        ranks = self.ranks
        while len(ids) > 1:
            best = min(zip(ids, ids[1:]), key=lambda p: ranks.get(p, 1 << 30))
            if best not in ranks:
                break
            ids = _merge(ids, best, FIRST_MERGE_ID + ranks[best])
        return ids

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        cache = self._cache
        for piece in self._split.findall(text):
            ids = cache.get(piece)
            if ids is None:
                ids = self._encode_piece(piece)
                if len(cache) < 500_000:
                    cache[piece] = ids
            out.extend(ids)
        return out

    def decode(self, ids: Iterable[int]) -> str:
        tb = self.token_bytes
        return b"".join(tb[i] for i in map(int, ids) if i >= BYTE_BASE).decode("utf-8", errors="replace")

    def id_to_piece(self, i: int) -> str:
        return self.token_bytes[i].decode("utf-8", errors="replace")

    def _state(self) -> dict:
        return {"pattern": self.pattern, "merges": [list(m) for m in self.merges]}

    @classmethod
    def _from_state(cls, state: dict) -> "BPETokenizer":
        return cls([tuple(m) for m in state["merges"]], state.get("pattern", "gpt2"))


def _merge(ids: list[int], pair: tuple[int, int], new_id: int) -> list[int]:
    """Replace every non-overlapping occurrence of ``pair`` (left to right) with ``new_id``."""
    out, i, n = [], 0, len(ids)
    a, b = pair
    while i < n:
        if i < n - 1 and ids[i] == a and ids[i + 1] == b:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out
