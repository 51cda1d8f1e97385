"""Corpus BLEU, two ways.

1. ``sacrebleu_score``: the reference number, computed by the `sacrebleu` package with its
   defaults (13a tokenisation, exp smoothing) and reported with its signature, so a reader can
   reproduce it exactly.
2. ``corpus_bleu_n``: BLEU-1..4 the way the TinyStories reports computed them (NLTK's
   ``corpus_bleu`` with uniform weights 1/n over the first n orders), written here from the
   definition: clipped n-gram counts summed over the corpus, brevity penalty from the summed
   lengths, and a named smoothing of zero precisions:

   - ``"method1"`` (NLTK ``SmoothingFunction().method1``, the default here): a precision whose
     match count is 0 becomes ``epsilon / total`` (epsilon 0.1);
   - ``"exp"`` (sacrebleu's default, NIST mteval): the k-th zero precision becomes
     ``1 / (2**k * total)``;
   - ``"none"``: a zero precision makes the score 0.

   Without smoothing, a short continuation almost never shares a 4-gram with its reference and
   BLEU-4 collapses to ~0; that is why a smoothing method is always stated next to the number.

BLEU measures n-gram overlap with one reference continuation; a good story can go anywhere from
a 5-word prompt, so for stories it is a weak signal, useful only to compare decoders side by side.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import get_args

from tinylm.config import BleuSmoothing
from tinylm.errors import TinyLMError

# Words (with inner apostrophes) or single punctuation marks; lowercased. Stated in every report.
BLEU_TOKEN_PATTERN = r"\w+(?:'\w+)*|[^\w\s]"
_TOKEN_RE = re.compile(BLEU_TOKEN_PATTERN)
METHOD1_EPSILON = 0.1
BLEU_MEANING = (
    "BLEU: n-gram overlap (0-1) of each continuation with the story's own continuation; "
    "a weak metric for stories (many good continuations exist), use it to compare decoders only."
)


def bleu_tokens(text: str) -> list[str]:
    """The tokenisation used for BLEU-n: lowercased words and punctuation marks."""
    return _TOKEN_RE.findall(text.lower())


def ngram_counts(tokens: list[str], n: int) -> Counter:
    return Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))


@dataclass
class BleuStats:
    """Sufficient statistics of corpus BLEU up to ``max_order``."""

    matches: list[int]  # clipped n-gram matches per order 1..max_order
    totals: list[int]  # hypothesis n-grams per order (NLTK convention: at least 1 per sentence)
    hyp_len: int
    ref_len: int


def corpus_stats(
    hypotheses: list[list[str]], references: list[list[str]], max_order: int = 4, min_one_total: bool = True
) -> BleuStats:
    """Clipped n-gram matches against one reference per hypothesis.

    ``min_one_total``: count at least one n-gram per sentence in the denominator even when the
    hypothesis is shorter than n (what NLTK's ``modified_precision`` does); sacrebleu counts 0.
    """
    if len(hypotheses) != len(references):
        raise TinyLMError(f"BLEU needs one reference per hypothesis ({len(hypotheses)} vs {len(references)})")
    matches, totals = [0] * max_order, [0] * max_order
    hyp_len = ref_len = 0
    for hyp, ref in zip(hypotheses, references):
        hyp_len += len(hyp)
        ref_len += len(ref)
        for n in range(1, max_order + 1):
            h, r = ngram_counts(hyp, n), ngram_counts(ref, n)
            matches[n - 1] += sum(min(c, r[g]) for g, c in h.items())
            count = sum(h.values())
            totals[n - 1] += max(1, count) if min_one_total else count
    return BleuStats(matches, totals, hyp_len, ref_len)


def brevity_penalty(hyp_len: int, ref_len: int) -> float:
    if hyp_len == 0:
        return 0.0
    return 1.0 if hyp_len > ref_len else math.exp(1.0 - ref_len / hyp_len)


def smoothed_precisions(stats: BleuStats, order: int, smoothing: str) -> list[float]:
    if smoothing not in get_args(BleuSmoothing):
        raise TinyLMError(f"BLEU smoothing {smoothing!r} is not one of {', '.join(get_args(BleuSmoothing))}")
    out, zeros = [], 0
    for n in range(order):
        m, t = stats.matches[n], stats.totals[n]
        if t == 0:
            out.append(0.0)
        elif m > 0:
            out.append(m / t)
        elif smoothing == "method1":
            out.append(METHOD1_EPSILON / t)
        elif smoothing == "exp":
            zeros += 1
            out.append(1.0 / (2**zeros * t))
        else:
            out.append(0.0)
    return out


def bleu_from_stats(stats: BleuStats, order: int, smoothing: str = "method1") -> float:
    """Cumulative BLEU-``order``: BP * exp(mean over n <= order of log p_n), in [0, 1]."""
    if stats.matches[0] == 0:  # no word in common: 0 whatever the smoothing (as NLTK and sacrebleu)
        return 0.0
    precisions = smoothed_precisions(stats, order, smoothing)
    if any(p <= 0.0 for p in precisions):
        return 0.0
    return brevity_penalty(stats.hyp_len, stats.ref_len) * math.exp(sum(math.log(p) for p in precisions) / order)


def corpus_bleu_n(
    hypotheses: list[str], references: list[str], smoothing: str = "method1", max_order: int = 4
) -> dict[str, float]:
    """{"bleu1": ..., ..., "bleu4": ...} over detokenised strings (tokenised by ``bleu_tokens``)."""
    stats = corpus_stats([bleu_tokens(h) for h in hypotheses], [bleu_tokens(r) for r in references], max_order)
    return {f"bleu{n}": bleu_from_stats(stats, n, smoothing) for n in range(1, max_order + 1)}


def sentence_bleu_n(
    hypothesis: str, reference: str, smoothing: str = "method1", max_order: int = 4
) -> dict[str, float]:
    """BLEU-1..4 of one hypothesis against its reference (NLTK's ``sentence_bleu``: corpus BLEU
    of a corpus of one pair, with the same smoothing)."""
    return corpus_bleu_n([hypothesis], [reference], smoothing, max_order)


def sacrebleu_score(hypotheses: list[str], references: list[str]) -> dict:
    """sacrebleu's corpus BLEU (0-100, its defaults) with the signature that pins them down."""
    try:
        from sacrebleu.metrics import BLEU  # deferred: only the BLEU protocol needs sacrebleu
    except ImportError as exc:
        raise TinyLMError("BLEU needs the `sacrebleu` package: pip install sacrebleu") from exc
    metric = BLEU()
    score = metric.corpus_score(hypotheses, [references])
    return {
        "bleu": score.score,
        "precisions": list(score.precisions),
        "brevity_penalty": score.bp,
        "hyp_len": score.sys_len,
        "ref_len": score.ref_len,
        "signature": str(metric.get_signature()),
    }
