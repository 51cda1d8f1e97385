"""The tokenizer interface every tinylm tokenizer shares, and its versioned JSON file format.

Subclasses implement ``train``, ``encode``, ``decode`` and the two hooks ``_state`` /
``_from_state``; this base owns the special tokens and save/load.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable

from tinylm.constants import EOS_ID, PAD_ID, SOS_ID, SPECIAL_TOKENS, UNK_ID

FORMAT_NAME = "tinylm-tokenizer"
FORMAT_VERSION = 1


def count_pieces(texts: str | Iterable[str], split: Callable[[str], Iterable[str]]) -> Counter[str]:
    """How often ``split`` yields each piece over ``texts`` (a single string is one text)."""
    counts: Counter[str] = Counter()
    for text in [texts] if isinstance(texts, str) else texts:
        counts.update(split(text))
    return counts


class Tokenizer:
    type_name = "base"
    lossless = False  # True when decode(encode(s)) == s for every string s
    normalizes = False  # True when encode works on normalize(text) (word_bpe), see ``represented``

    pad_id, unk_id, sos_id, eos_id = PAD_ID, UNK_ID, SOS_ID, EOS_ID
    special_tokens = SPECIAL_TOKENS
    # How a model trained with this tokenizer is talked to: every prompt and scored document
    # starts with ``bos_id`` (None: nothing is prepended), generation ends at any of ``stop_ids``,
    # and with ``decode_with_prompt`` the shown text is decode(prompt ids + new ids) rather than
    # the prompt string followed by decode(new ids).
    bos_id: int | None = SOS_ID
    stop_ids: tuple[int, ...] = (EOS_ID,)
    decode_with_prompt = False

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
    def represented(self, text: str) -> str:
        """The text the tokens of ``text`` stand for: ``text`` itself, or its normalised form for a
        tokenizer that normalises before encoding (``normalizes``, as word_bpe does). Bytes and
        words of a split are counted on it, and it is what a lossless decode gives back."""
        return self.normalize(text) if self.normalizes else text

    def decode_continuation(self, prompt_ids: list[int], new_ids: list[int]) -> str:
        """Text that the new tokens add after the prompt (with the space a word-level tokenizer
        puts between words, which decoding the new tokens alone would lose)."""
        return decode_after(self.decode, prompt_ids, new_ids)

    def save(self, path: str | Path) -> None:
        data = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "type": self.type_name,
            "special_tokens": list(self.special_tokens),
            **self._state(),
        }
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data, ensure_ascii=False))
        os.replace(tmp, path)  # never leave a half-written tokenizer behind

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"


def decode_after(decode: Callable[[list[int]], str], prompt_ids: list[int], new_ids: list[int]) -> str:
    """``Tokenizer.decode_continuation`` for any ``decode`` function."""
    prompt_text = decode(list(prompt_ids))
    full = decode(list(prompt_ids) + list(new_ids))
    return full[len(prompt_text) :] if full.startswith(prompt_text) else decode(list(new_ids))


class ContinuationText:
    """``decode_continuation(prompt_ids, tokens)`` (``decode_after``) kept up to date as tokens arrive (for
    streaming). Each update decodes only a window: the tokens since the last complete character,
    after the chunk before them as context (what joins the two: a word-level tokenizer's space,
    the first bytes of a character split across byte-level tokens), so a stream of n tokens costs
    O(n) decoding rather than O(n^2). Where a window's text does not extend the text of the same
    window without the new tokens (a decode that rewrites earlier text), the whole continuation is
    decoded again, so ``text`` is always what ``decode_continuation`` gives."""

    CONTEXT = 4  # prompt tokens decoded before the first new one

    def __init__(self, decode: Callable[[list[int]], str], prompt_ids: list[int]):
        self.decode = decode
        self.prompt_len = len(prompt_ids)
        self.ids = list(prompt_ids)
        self.start, self.read = max(0, self.prompt_len - self.CONTEXT), self.prompt_len
        self.done = self.text = ""  # done: the text of ids[:read], ending with a complete character

    def update(self, tokens: list[int]) -> str:
        """The continuation's text with ``tokens``: every new token so far (the same list growing)."""
        new = tokens[len(self.ids) - self.prompt_len :]
        if not new:
            return self.text
        self.ids.extend(new)
        decode = self.decode
        before = decode(self.ids[self.start : self.read])
        while not before and self.start > 0:  # context without text (special tokens) joins nothing: reach back
            self.start = max(0, self.start - self.CONTEXT)
            before = decode(self.ids[self.start : self.read])
        after = decode(self.ids[self.start :])
        if after.startswith(before):
            self.text = self.done + after[len(before) :]
        else:
            self.text = decode_after(decode, self.ids[: self.prompt_len], self.ids[self.prompt_len :])
        if not self.text.endswith("\ufffd"):  # a complete character: the next window starts here
            self.done, self.start, self.read = self.text, max(self.read, len(self.ids) - self.CONTEXT), len(self.ids)
        return self.text
