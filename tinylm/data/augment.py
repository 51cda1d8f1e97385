"""Training-data augmentation: rewrite a seeded fraction of the training stories with the mojibake
of typographic punctuation, so that a byte-level model has seen it before it meets it.

The official TinyStories files carry text that went UTF-8 -> Windows-1252 -> UTF-8: a curly quote
U+201C (bytes E2 80 9C) appears as the three characters "â€œ". A model trained only on clean
text spends many bits on each such sequence. Only the training split is rewritten; validation
and test stay as they are.
"""

from __future__ import annotations

import random
import re

# typographic marks a story may hold, and what straight ASCII marks become first
CURLY = "\u201c\u201d\u2018\u2019\u2013\u2014\u2026"
_DOUBLE_QUOTE = re.compile(r'"')


def mojibake(text: str) -> str:
    """The text's UTF-8 bytes read as Windows-1252 (Latin-1 for the five bytes it leaves undefined)."""
    out = []
    for byte in text.encode("utf-8"):
        try:
            out.append(bytes([byte]).decode("cp1252"))
        except UnicodeDecodeError:
            out.append(chr(byte))
    return "".join(out)


_MOJIBAKE = {ch: mojibake(ch) for ch in CURLY}


def curly_punctuation(text: str) -> str:
    """Straight quotes as typographic ones: " alternates opening / closing, ' is a right quote
    (the apostrophe), as a word processor would write them."""
    count = iter(range(10**9))
    text = _DOUBLE_QUOTE.sub(lambda m: "\u201c" if next(count) % 2 == 0 else "\u201d", text)
    return text.replace("'", "\u2019")


def mojibake_punctuation(text: str) -> str:
    """Typographic punctuation (straight quotes made curly first) written as its mojibake."""
    return "".join(_MOJIBAKE.get(ch, ch) for ch in curly_punctuation(text))


def augment_mojibake(docs: list[str], fraction: float, seed: int) -> tuple[list[str], int]:
    """(docs with a seeded ``fraction`` of them rewritten by mojibake_punctuation, how many changed)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"the mojibake fraction must be in [0, 1] (got {fraction})")
    rng = random.Random(seed)
    out, changed = [], 0
    for doc in docs:
        if rng.random() < fraction:
            new = mojibake_punctuation(doc)
            changed += new != doc
            doc = new
        out.append(doc)
    return out, changed
