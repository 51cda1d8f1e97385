"""Deterministic train/valid/test splits, by whole document or by contiguous chunks."""

from __future__ import annotations

import random
import re

from tinylm.errors import TinyLMError

_GOLDEN = 0.6180339887498949


def split_documents(
    docs: list[str], valid_fraction: float, test_fraction: float, seed: int = 0
) -> dict[str, list[str]]:
    """Whole documents: a seeded shuffle, then the first shares go to valid and test (at least one
    document each whenever a share is asked for and there are documents enough)."""
    if valid_fraction < 0 or test_fraction < 0 or valid_fraction + test_fraction >= 1:
        raise TinyLMError("data.valid_fraction and data.test_fraction must be >= 0 and sum to less than 1")
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    n_valid = max(1, round(valid_fraction * len(docs))) if valid_fraction > 0 else 0
    n_test = max(1, round(test_fraction * len(docs))) if test_fraction > 0 else 0
    if n_valid + n_test >= len(docs):
        raise TinyLMError(
            f"{len(docs)} documents are too few to split by document into train/valid/test; use data.split_by=chunk"
        )
    pick = lambda idx: [docs[i] for i in sorted(idx)]  # noqa: E731  (keep corpus order inside a split)
    return {
        "valid": pick(order[:n_valid]),
        "test": pick(order[n_valid : n_valid + n_test]),
        "train": pick(order[n_valid + n_test :]),
    }


def split_chunks(
    docs: list[str], valid_fraction: float, test_fraction: float, chunk_chars: int = 20_000
) -> dict[str, list[str]]:
    """Contiguous chunks of about ``chunk_chars`` characters (cut at paragraph breaks), spread over
    the whole corpus by a low-discrepancy sequence, so that every split samples every part of it
    (e.g. every play) and no split is ever shorter than a few chunks."""
    if valid_fraction < 0 or test_fraction < 0 or valid_fraction + test_fraction >= 1:
        raise TinyLMError("data.valid_fraction and data.test_fraction must be >= 0 and sum to less than 1")
    chunks: list[str] = []
    for doc in docs:
        current = ""
        for para in re.split(r"(\n\s*\n)", doc):
            current += para
            if len(current) >= chunk_chars:
                chunks.append(current.strip())
                current = ""
        if current.strip():
            chunks.append(current.strip())
    out: dict[str, list[str]] = {"train": [], "valid": [], "test": []}
    for k, chunk in enumerate(chunks):
        u = ((k + 1) * _GOLDEN) % 1.0
        name = "valid" if u < valid_fraction else "test" if u < valid_fraction + test_fraction else "train"
        out[name].append(chunk)
    for name, frac in (("valid", valid_fraction), ("test", test_fraction)):
        if frac > 0 and not out[name]:
            raise TinyLMError(f"the corpus is too small for a {name} split of {frac:.0%} ({len(chunks)} chunks)")
    return out


def line_overlap(seen: list[str], query: list[str], sample: int = 100, min_words: int = 1, seed: int = 0) -> dict:
    """How many lines of ``query`` occur verbatim (stripped) as lines of ``seen``: over a seeded
    sample of ``sample`` lines (the report's x/100 check) and over all distinct lines. Lines of
    fewer than ``min_words`` words are left out (a stage direction like "Exit." repeats anyway)."""

    def lines(docs):
        return [
            s for d in docs for s in (line.strip() for line in d.splitlines()) if len(s.split()) >= max(min_words, 1)
        ]

    seen_set = set(lines(seen))
    query_lines = lines(query)
    distinct = set(query_lines)
    picked = random.Random(seed).sample(query_lines, min(sample, len(query_lines)))
    return {
        "sampled": len(picked),
        "sampled_found": sum(s in seen_set for s in picked),
        "distinct_lines": len(distinct),
        "distinct_found": len(distinct & seen_set),
    }
