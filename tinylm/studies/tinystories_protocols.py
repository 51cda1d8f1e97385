"""Why the four TinyStories reports' numbers disagree: one model scored under each report's protocol.

The reports published validation perplexities of 4.2 to 12.4 and BLEU-4 of 0.002 to 0.26 for the
same assignment. ``docs/notes/report-protocols.md`` lists, report by report, what each text says
about how it measured them and what it leaves unstated. The ``protocols`` part scores the one
model the quality parts judge under every one of those protocols, as far as the text describes
it, and over every combination of the choices the text leaves open. How far apart the numbers of
one model fall is then the part of the disagreement that is protocol, not model.

Each published number is a ``Published`` row: its choices, each an ordered list of options. The
first option of each choice is the *closest protocol*: what the report states (or its tables
show), and tinylm's own protocol for what it leaves unstated, so the closest number differs from
tinylm's only where the report says it does. The *range* is the minimum and maximum over every
combination of the options; the *effects* vary one choice at a time from the closest protocol.

The measurements behind every row are made once (``Measurements``):

    validation file   every story scored from <sos>: whole (strided windows, tinylm), the first
                      64 tokens (<sos> story <eos> cut to the reports' context), and each sentence
                      alone (<sos> sentence <eos>, cut to 64); every target's NLL is kept, so
                      <eos>/<unk> counted or not and pooled vs per-batch means are masks and sums
    50 samples        the BLEU protocol's stories (tinylm.evaluation.protocol.select_samples,
                      prompt = first ``prompt_tokens`` tokens); the reference continuation scored
                      once, whole, with the model (T 1) and at T 0.8
    decodings         each of the six decodings the reports name, generated once for the 50
                      prompts together (row k samples with seed + k, as the BLEU part), long enough
                      for every length rule; each rule cuts the same tokens, and the generated
                      text is scored by the model (T 1) and by the distribution it was sampled
                      from (temperature and top-k applied)

What one model cannot repeat (another vocabulary, another validation split, a model at another
stage of training) is listed per report under ``NOT_REPRODUCIBLE``, not emulated.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
import time
from dataclasses import dataclass

import numpy as np
import torch

from tinylm.config import GenerationConfig
from tinylm.constants import IGNORE_INDEX, PAD_ID
from tinylm.data.tokens import pad_rows
from tinylm.evaluation.bleu import (
    BleuStats,
    bleu_from_stats,
    bleu_tokens,
    brevity_penalty,
    corpus_stats,
    smoothed_precisions,
)
from tinylm.evaluation.perplexity import document_windows
from tinylm.evaluation.protocol import BleuProtocol, Decoding, Sample, select_samples
from tinylm.evaluation.report import Doc, read_json
from tinylm.generation.generate import generate_many
from tinylm.generation.processors import shape_distribution
from tinylm.models.gpt import eval_mode
from tinylm.studies.stages import start_part_section

# ------------------------------------------------------------------------------------ constants
REPORT_CONTEXT = 64  # every report's context (000 L87, 001 L71, 002 L74, 003 L153)
REPORT_NEW_TOKENS = REPORT_CONTEXT - 5  # 001 L99: "until maximum sequence length" with a 5-token prompt
WORDS = 50  # 000's CSV: every hypothesis is 50 whitespace words (report-protocols.md, 000 BLEU)
NEW_TOKENS_003 = 50  # 003 L261: "Maximum new tokens = 50" (its KV benchmark; 5.2 does not say)
MAX_SAMPLES = 50  # every report used 50 samples; more would only cost decoding time
# every decoding generates at least this many tokens (enough for 64 tokens and for 50 whitespace
# words, about 60 word tokens) and at least the longest reference that fits in the context
MIN_GENERATED = 80
SCORE_BATCH = 8  # rows per forward pass when scoring (the logits of a row are context x vocabulary)

# the decodings the reports name; one generation each, scored many ways
DECODINGS = {
    "T 0.8, top-k 50": Decoding("T0.8_k50", temperature=0.8, top_k=50),  # 000 L310, L435
    "T 0.8, no top-k": Decoding("T0.8", temperature=0.8),  # 002 L175, L478; 000 without top-k
    "T 0.85, top-k 50": Decoding("T0.85_k50", temperature=0.85, top_k=50),  # 003 L186-L189
    "T 0.7": Decoding("T0.7", temperature=0.7),  # 001 L104 (and tinylm's BLEU part)
    "T 1.0": Decoding("T1.0", temperature=1.0),
    "T 1.2": Decoding("T1.2", temperature=1.2),
}
MEAN_OF_001 = "mean of T 0.7 / 1.0 / 1.2"
REFERENCE_AT_T = 0.8  # 002 L175: "50 samples with temperature=0.8", which could scale the reference's logits

# option labels (the first option of a choice in a row is that row's closest protocol)
EOS = ("not counted", "counted")
UNK = ("counted", "not counted")
UNITS = {
    "whole stories (tinylm: strided windows)": "story",
    f"stories, first {REPORT_CONTEXT} tokens": "story64",
    f"sentences, first {REPORT_CONTEXT} tokens": "sentence64",
}
POOLED, BATCH_LOSS, BATCH_PPL, SAMPLE_PPL = (
    "pooled over tokens",
    "exp(mean of per-batch losses)",
    "mean of per-batch perplexities",
    "mean of per-sample perplexities",
)
HYPOTHESIS = {
    f"{WORDS} words": ("words", WORDS),
    f"{REPORT_NEW_TOKENS} tokens": ("tokens", REPORT_NEW_TOKENS),
    f"{REPORT_CONTEXT} tokens": ("tokens", REPORT_CONTEXT),
    f"{NEW_TOKENS_003} tokens": ("tokens", NEW_TOKENS_003),
    "len(reference) (tinylm)": ("reference", None),
}
REFERENCE = ("cut to the context (tinylm)", "whole rest of the story", "cut to the hypothesis's length")
PROMPT = ("not included (tinylm)", "in both texts")
KIND = ("cumulative (tinylm)", "individual n-gram")
SMOOTHING = {"method1 (tinylm)": "method1", "none": "none"}
BLEU_AVERAGING = ("corpus (tinylm)", "mean of sentence BLEU")
TOKENS = ("regex words and punctuation (tinylm)", "whitespace")
BREVITY = ("applied (tinylm)", "left out")  # one of report-protocols.md's explanations of 000's BLEU-1 0.48


def text_label(source: str, length: str, view: str) -> str:
    """A scored text of the 50-sample perplexities: the reference or a decoding's sample, its
    length rule, and the distribution that scores it."""
    return f"{source}, {length}, {view}"


MODEL_VIEW, SAMPLER_VIEW, REFERENCE_VIEW = "model at T 1", "its sampling distribution", f"logits at T {REFERENCE_AT_T}"
REF = "reference"


# ------------------------------------------------------------------------------- the published rows
@dataclass(frozen=True)
class Published:
    """One number a report published, and the choices that measuring it takes."""

    key: str
    report: str  # the report file
    where: str  # its line(s), as docs/notes/report-protocols.md quotes them
    quantity: str
    value: float
    measure: str  # "valid_ppl" (the validation file), "sample_ppl" (50 samples) or "bleu"
    choices: tuple  # ((choice, (option, ...)), ...): the first option of each is the closest protocol
    order: int = 4  # BLEU-n
    batch: int = 32  # sequences per batch, for per-batch means

    @property
    def options(self) -> dict[str, tuple[str, ...]]:
        return dict(self.choices)


R000, R001, R002, R003 = (
    "000_95aac6fc2548188d.txt",
    "001_8995c374b26d810d.txt",
    "002_4f59bef20b90b048.txt",
    "003_ce423e965cb4bb83.txt",
)
VALID_AVERAGING = (POOLED, BATCH_LOSS, BATCH_PPL)
SAMPLE_AVERAGING = (POOLED, SAMPLE_PPL)
WHOLE, STORY64, SENTENCES = list(UNITS)


REF_CONTEXT, REF_WHOLE, REF_59 = "cut to the context (tinylm)", "whole", f"first {REPORT_NEW_TOKENS} tokens"
LEN_REF = "len(reference) (tinylm)"
REPORT_TOKENS = f"{REPORT_NEW_TOKENS} tokens"
REF_LENGTHS = {REF_CONTEXT: ("context", None), REF_WHOLE: ("whole", None), REF_59: ("tokens", REPORT_NEW_TOKENS)}
# label of a scored text -> (decoding or None for the reference, (length rule, n), view)
TEXTS: dict[str, tuple] = {}


def _gen(decoding: str, length: str, views=(MODEL_VIEW, SAMPLER_VIEW)) -> tuple[str, ...]:
    labels = tuple(text_label(f"{decoding} sample", length, v) for v in views)
    TEXTS.update((label, (decoding, HYPOTHESIS[length], v)) for label, v in zip(labels, views))
    return labels


def _ref(*lengths: str, views=(MODEL_VIEW,)) -> tuple[str, ...]:
    pairs = [(text_label(REF, length, v), (None, REF_LENGTHS[length], v)) for length in lengths for v in views]
    TEXTS.update(pairs)
    return tuple(label for label, _ in pairs)


def _bleu_rows(report, lines, values, quantity, choices) -> list[Published]:
    return [
        Published(f"{report[:3]}-bleu{n}", report, line, f"{quantity} BLEU-{n}", v, "bleu", choices, order=n)
        for n, line, v in zip((1, 2, 3, 4), lines, values)
    ]


BLEU_COMMON = (("n-gram precision", KIND), ("smoothing", tuple(SMOOTHING)))
ROWS: tuple[Published, ...] = (
    Published(
        "000-valid", R000, "L112 (best: 11.87, L113)", "validation perplexity, final", 12.42, "valid_ppl",
        (("unit", (SENTENCES, STORY64)), ("<eos>", EOS), ("<unk>", UNK), ("averaging", VALID_AVERAGING)),
        batch=32,  # L100
    ),
    Published(
        "000-sample", R000, "L273", "perplexity per token, 50 samples", 13.85, "sample_ppl",
        (
            ("scored text", (*_ref(REF_WHOLE, REF_CONTEXT), *_gen("T 0.8, top-k 50", f"{WORDS} words"),
                             *_gen("T 0.8, no top-k", f"{WORDS} words"))),
            ("<eos>", EOS), ("<unk>", UNK), ("averaging", SAMPLE_AVERAGING),
        ),
    ),
    *_bleu_rows(
        R000, ("L274", "L275", "L276", "L277"), (0.48, 0.35, 0.26, 0.19), "50 samples,",
        (
            ("decoding", ("T 0.8, top-k 50", "T 0.8, no top-k")),
            ("hypothesis", (f"{WORDS} words",)),
            ("reference", (REFERENCE[1], REFERENCE[2], REFERENCE[0])),
            ("prompt", (PROMPT[0],)),
            *BLEU_COMMON,
            ("averaging", BLEU_AVERAGING),
            ("BLEU tokens", TOKENS),
            ("brevity penalty", BREVITY),
        ),
    ),
    Published(
        "001-valid", R001, "L93 (epoch 200)", "validation perplexity", 4.72, "valid_ppl",
        (("unit", (STORY64, WHOLE)), ("<eos>", EOS), ("<unk>", UNK), ("averaging", VALID_AVERAGING)),
        batch=64,  # L73
    ),
    Published(
        "001-sample", R001, "L104", "perplexity, 50 samples", 4.24, "sample_ppl",
        (
            ("scored text", (*_ref(REF_CONTEXT, REF_WHOLE, REF_59),
                             *(t for d in ("T 0.7", "T 1.0", "T 1.2") for t in _gen(d, REPORT_TOKENS)))),
            ("<eos>", EOS), ("<unk>", UNK), ("averaging", SAMPLE_AVERAGING),
        ),
    ),
    *_bleu_rows(
        R001, ("L109", "L110", "L111", "L112"), (0.7690, 0.5190, 0.3753, 0.2573), "50 samples,",
        (
            ("decoding", ("T 0.7", "T 1.0", "T 1.2", MEAN_OF_001)),
            ("hypothesis", (f"{REPORT_NEW_TOKENS} tokens", f"{REPORT_CONTEXT} tokens")),
            ("reference", REFERENCE),
            ("prompt", PROMPT),
            *BLEU_COMMON,
            ("averaging", BLEU_AVERAGING),
            ("BLEU tokens", TOKENS),
        ),
    ),
    Published(
        "002-valid", R002, "L157 (epoch 3)", "validation perplexity", 7.49, "valid_ppl",
        (("unit", (STORY64,)), ("<eos>", EOS), ("<unk>", UNK), ("averaging", VALID_AVERAGING)),
        batch=32,  # L119
    ),
    Published(
        "002-sample", R002, "L175", "perplexity, 50 samples at T 0.8", 9.41, "sample_ppl",
        (
            ("scored text", (*_gen("T 0.8, no top-k", LEN_REF), *_gen("T 0.8, no top-k", f"{REPORT_NEW_TOKENS} tokens"),
                             *_ref(REF_CONTEXT, views=(MODEL_VIEW, REFERENCE_VIEW)))),
            ("<eos>", EOS), ("<unk>", UNK), ("averaging", SAMPLE_AVERAGING),
        ),
    ),
    Published(
        "002-bleu", R002, "L187", "BLEU (order not stated), mean over 50 samples", 0.0176, "bleu",
        (
            ("decoding", ("T 0.8, no top-k", "T 0.8, top-k 50")),
            ("hypothesis", (LEN_REF, f"{REPORT_NEW_TOKENS} tokens")),
            ("reference", REFERENCE),
            ("prompt", (PROMPT[0],)),
            *BLEU_COMMON,
            ("averaging", (BLEU_AVERAGING[1],)),
            ("BLEU tokens", TOKENS),
        ),
    ),
    Published(
        "003-sample", R003, "L199", "average per-token perplexity, 50 generated continuations", 4.219, "sample_ppl",
        (
            ("scored text", (*_gen("T 0.85, top-k 50", f"{NEW_TOKENS_003} tokens"), *_gen("T 0.85, top-k 50", LEN_REF),
                             *_ref(REF_CONTEXT))),
            ("<eos>", EOS), ("<unk>", (UNK[1], UNK[0])), ("averaging", (SAMPLE_PPL, POOLED)),
        ),
    ),
    Published(
        "003-bleu", R003, "L200", "average BLEU (order not stated), 50 samples", 0.0020, "bleu",
        (
            ("decoding", ("T 0.85, top-k 50",)),
            ("hypothesis", (f"{NEW_TOKENS_003} tokens", LEN_REF)),
            ("reference", REFERENCE),
            ("prompt", (PROMPT[0],)),
            *BLEU_COMMON,
            ("averaging", (BLEU_AVERAGING[1],)),
            ("BLEU tokens", TOKENS),
        ),
    ),
)  # fmt: skip

NOT_REPRODUCIBLE = {
    R000: "its vocabulary (10,000 words of ~1.2M sentences of the Hugging Face TinyStories, L26, L36), its "
    "temperature scheduling and repetition penalty (L434-L436, values not stated), the 50-sample "
    "perplexity 13.85 itself (above every printed per_sample_ppl, max 12.86), and a model at the best "
    "checkpoint (11.87, L113)",
    R001: "its vocabulary (30,000 words plus BPE pieces for OOV words, L37, L66) and cleaning (L25-L30), "
    "its 2,000-story validation subset (L83), and its epoch-1 numbers (15.2, L93)",
    R002: "its vocabulary (15,487 lowercased words, L58-L59) and its validation split (10% of the training "
    "data, L57), and its epochs 1-2 (8.41, 7.77, L155-L156)",
    R003: "its vocabulary (56,333 spaCy tokens, case kept, built on train + validation so that no <unk> "
    "occurs, L46, L62, L66): '<unk> not counted' is the nearest this model comes",
}


# --------------------------------------------------------------------------------- token scoring
@torch.no_grad()
def token_nlls(model, docs: list[list[int]], views=(None,), batch_size: int = SCORE_BATCH) -> list[np.ndarray]:
    """Each document's NLL (nats) of every target ``doc[1:]``, one row per view: shape
    (len(views), len(doc) - 1). A view is None (the model's distribution) or a GenerationConfig
    whose temperature and top-k reshape the logits (the distribution a sampler drew from).

    A document longer than the context is scored in the strided windows of
    tinylm.evaluation.perplexity (every target once, each with as much left context as fits), so
    summing a row gives what ``score_token_documents`` gives; keeping every target lets one pass
    serve every mask (<eos>, <unk>) and every cut (the first 64 tokens, a continuation's length)."""
    ctx = model.config.context_length
    out = [np.zeros((len(views), max(len(d) - 1, 0))) for d in docs]
    windows = []  # (document, first target index this window fills, inputs, targets)
    for i, doc in enumerate(docs):
        filled = 0
        for inputs, targets in document_windows(doc, ctx):
            windows.append((i, filled, inputs, targets))
            filled += sum(t != IGNORE_INDEX for t in targets)
    windows.sort(key=lambda w: len(w[2]))
    device = next(model.parameters()).device
    with eval_mode(model):
        for b in range(0, len(windows), batch_size):
            chunk = windows[b : b + batch_size]
            x = pad_rows([w[2] for w in chunk], PAD_ID).to(device)
            y = pad_rows([w[3] for w in chunk], IGNORE_INDEX).to(device)
            logits = model(x)[0].float()
            nll = torch.stack([_view_nll(logits, y, v) for v in views], 1).cpu().numpy()  # (B, views, T)
            for r, (i, filled, _, targets) in enumerate(chunk):
                keep = np.asarray(targets) != IGNORE_INDEX
                out[i][:, filled : filled + int(keep.sum())] = nll[r][:, : len(targets)][:, keep]
    return out


def story_nlls(model, stories: list[list[int]], eos_id: int) -> list[np.ndarray]:
    """Each story's NLLs as tinylm scores it (``evaluate_split``: the story without <eos>, in
    strided windows past the context) followed by the NLL of its <eos>, predicted from the last
    ``context_length`` tokens, as the last window of the story with its <eos> would predict it.

    Scoring the stories with their <eos> in one pass would shift the last window of a story longer
    than the context, and so change its other targets' NLLs from tinylm's."""
    ctx = model.config.context_length
    fits = [len(s) <= ctx for s in stories]  # one window holds the story and its <eos> target
    docs = [[*s, eos_id] if f else s for s, f in zip(stories, fits)]
    tails = [[*s[-ctx:], eos_id] for s, f in zip(stories, fits) if not f]
    rows = token_nlls(model, docs + tails)
    out, tail = [], iter(rows[len(docs) :])
    for row, f in zip(rows, fits):
        out.append(row if f else np.concatenate([row, next(tail)[:, -1:]], axis=1))
    return out


def _view_nll(logits: torch.Tensor, y: torch.Tensor, view) -> torch.Tensor:
    """NLL of the targets ``y`` under the logits, reshaped by ``view``. A target the view's top-k
    drops (a sample whose top-k border differed by float rounding in the cached decoding step, or
    one drawn from a window that slid past the context) is scored within the top-k and itself,
    not as an infinite NLL."""
    index = y.clamp(min=0).unsqueeze(-1)
    if view is not None:
        shaped = shape_distribution(logits.reshape(-1, logits.size(-1)), view).view(logits.shape)
        logits = shaped.scatter(-1, index, logits.gather(-1, index) / view.temperature)
    logp = torch.log_softmax(logits, -1).gather(-1, index).squeeze(-1)
    return (-logp).masked_fill(y == IGNORE_INDEX, 0.0)


class Scored:
    """Scored sequences: each one's target ids and NLLs, reduced to (sum, count) per mask."""

    def __init__(self, targets: list[np.ndarray], nlls: list[np.ndarray]):
        self.targets, self.nlls, self._sums = targets, nlls, {}

    def sums(self, eos_id: int, unk_id: int, count_eos: bool, count_unk: bool) -> tuple[np.ndarray, np.ndarray]:
        """(sum of NLL, number of targets) of each sequence, <eos> and <unk> targets kept or not."""
        key = (eos_id, unk_id, count_eos, count_unk)
        if key not in self._sums:
            s, n = np.zeros(len(self.targets)), np.zeros(len(self.targets))
            for k, (t, v) in enumerate(zip(self.targets, self.nlls)):
                keep = np.ones(len(t), bool)
                if not count_eos:
                    keep &= t != eos_id
                if not count_unk:
                    keep &= t != unk_id
                s[k], n[k] = v[keep].sum(), keep.sum()
            self._sums[key] = s, n
        return self._sums[key]


def average_ppl(sums: np.ndarray, counts: np.ndarray, averaging: str, batch: int = 32) -> float:
    """Perplexity of sequences from their NLL sums and target counts: pooled over tokens, the mean
    of per-batch losses (then exp), the mean of per-batch perplexities (batches of ``batch``
    sequences in order), or the mean of per-sequence perplexities. Sequences with no target are
    left out of the means."""
    if averaging == POOLED:
        return math.exp(sums.sum() / counts.sum())
    if averaging == SAMPLE_PPL:
        keep = counts > 0
        return float(np.exp(sums[keep] / counts[keep]).mean())
    starts = range(0, len(sums), batch)
    losses = np.array(
        [sums[b : b + batch].sum() / counts[b : b + batch].sum() for b in starts if counts[b : b + batch].sum()]
    )
    if averaging == BATCH_LOSS:
        return math.exp(losses.mean())
    if averaging == BATCH_PPL:
        return float(np.exp(losses).mean())
    raise ValueError(f"unknown averaging {averaging!r}")


SENTENCE_END = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"'”’]))\s+|\s*\n\s*")


def split_sentences(text: str) -> list[str]:
    """The sentences of a story: split after . ! ? (and a closing quote) before whitespace, and at
    line breaks. Report 000 counted its data in sentences (L36-L38) without saying how it split."""
    return [s for s in SENTENCE_END.split(text.strip()) if s]


def first_tokens(ids: list[int], n: int = REPORT_CONTEXT) -> list[int]:
    """A sequence cut to its first ``n`` tokens (<sos> included): n - 1 targets, as a model with a
    context of n that truncates its rows scores it."""
    return list(ids[:n])


# ----------------------------------------------------------------------------------------- BLEU
def individual_bleu(stats: BleuStats, n: int, smoothing: str) -> float:
    """BLEU with all weight on order n (NLTK ``weights`` with a single 1): brevity penalty x the
    (smoothed) n-gram precision. Zero when no word matches, as cumulative BLEU."""
    if stats.matches[0] == 0:
        return 0.0
    return brevity_penalty(stats.hyp_len, stats.ref_len) * smoothed_precisions(stats, n, smoothing)[n - 1]


def sum_stats(stats: list[BleuStats]) -> BleuStats:
    """Corpus statistics as the sum of per-sample ones (what corpus_stats computes in one go)."""
    return BleuStats(
        [sum(s.matches[k] for s in stats) for k in range(len(stats[0].matches))],
        [sum(s.totals[k] for s in stats) for k in range(len(stats[0].totals))],
        sum(s.hyp_len for s in stats),
        sum(s.ref_len for s in stats),
    )


def bleu_value(
    per_sample: list[BleuStats], n: int, cumulative: bool, smoothing: str, corpus: bool, brevity: bool = True
) -> float:
    """BLEU-n of hypothesis/reference pairs from their per-sample statistics: cumulative (uniform
    weights over orders 1..n) or individual order n; corpus BLEU or the mean of sentence BLEU;
    with the brevity penalty or without it (a reference counted as long as its hypothesis)."""
    if not brevity:
        per_sample = [dataclasses.replace(s, ref_len=s.hyp_len) for s in per_sample]
    score = (lambda s: bleu_from_stats(s, n, smoothing)) if cumulative else (lambda s: individual_bleu(s, n, smoothing))
    if corpus:
        return score(sum_stats(per_sample))
    return sum(map(score, per_sample)) / len(per_sample)


def words_prefix(text: str, n: int) -> str:
    return " ".join(text.split()[:n])


# --------------------------------------------------------------------------------- measurements
class Measurements:
    """Every forward pass and generation the rows need, made once; ``evaluate`` reads a row's
    number under one combination of its options from them."""

    def __init__(self, model, tokenizer, texts: list[str], exp, seconds: dict | None = None):
        self.model, self.tok = model, tokenizer
        self.start = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
        self.eos_id, self.unk_id = tokenizer.eos_id, tokenizer.unk_id
        self.seconds = {} if seconds is None else seconds
        self.P = exp.prompt_tokens
        room = model.config.context_length - 1 - self.P
        self.cut = room if exp.max_continuation is None else min(exp.max_continuation, room)
        protocol = BleuProtocol(
            min(exp.bleu_samples, MAX_SAMPLES), self.P, None, exp.seed, exp.smoothing, exp.bleu_selection
        )
        # an unbounded context: the whole rest of each story; the rules cut it (as run_bleu's samples)
        self.samples: list[Sample] = select_samples(tokenizer, texts, protocol, 10**9).samples
        self.seed = exp.seed
        self._timed("validation file", self._score_valid, texts)
        self._timed("references", self._score_references)
        self._timed("decodings", self._generate)
        self._timed("generated texts", self._score_generated)
        self._stats: dict = {}
        self._texts: dict[str, Scored] = {}

    def _timed(self, name: str, fn, *args) -> None:
        t0 = time.perf_counter()
        fn(*args)
        self.seconds[name] = round(time.perf_counter() - t0, 2)

    def _scored(self, docs: list[list[int]], arrays: list[np.ndarray], first: int = 0, lengths=None, view: int = 0):
        """Scored sequences from whole-document NLLs: the targets from index ``first`` on, cut to
        ``lengths`` (one per document, None: all)."""
        lengths = lengths or [None] * len(docs)
        ends = [len(d) - 1 if n is None else first + n for d, n in zip(docs, lengths)]
        return Scored(
            [np.asarray(d[1 + first : 1 + e]) for d, e in zip(docs, ends)],
            [a[view, first:e] for a, e in zip(arrays, ends)],
        )

    def _score_valid(self, texts: list[str]) -> None:
        enc = [self.tok.encode(t) for t in texts]
        stories = [[*self.start, *ids, self.eos_id] for ids in enc if ids]
        whole = story_nlls(self.model, [d[:-1] for d in stories], self.eos_id)
        if self.model.config.context_length >= REPORT_CONTEXT:  # causal: the first window's first targets
            first = self._scored(stories, whole, lengths=[min(len(d), REPORT_CONTEXT) - 1 for d in stories])
        else:
            cut = [first_tokens(d) for d in stories]
            first = self._scored(cut, token_nlls(self.model, cut))
        sentences = [
            first_tokens([*self.start, *self.tok.encode(s), self.eos_id]) for t in texts for s in split_sentences(t)
        ]
        sentences = [s for s in sentences if len(s) > 1 + len(self.start)]
        self.valid = {
            "story": self._scored(stories, whole),
            "story64": first,
            "sentence64": self._scored(sentences, token_nlls(self.model, sentences)),
        }
        self.valid_counts = {"stories": len(stories), "sentences": len(sentences)}

    def _context_docs(self, continuations: list[list[int]]) -> list[list[int]]:
        return [[*self.start, *s.prompt_ids, *c] for s, c in zip(self.samples, continuations)]

    def _score_references(self) -> None:
        self.ref_docs = self._context_docs([[*s.reference_ids, self.eos_id] for s in self.samples])
        views = (None, GenerationConfig(temperature=REFERENCE_AT_T))
        self.ref_nlls = token_nlls(self.model, self.ref_docs, views)

    def _generate(self) -> None:
        """Each decoding once, the samples' prompts decoded together (row k draws with seed + k,
        as the BLEU part's sample k), long enough for every length rule."""
        prompts = self._context_docs([[] for _ in self.samples])
        longest = max(min(len(s.reference_ids), self.cut) for s in self.samples)
        self.max_new = max(MIN_GENERATED, longest)
        self.generated = {}
        for name, decoding in DECODINGS.items():
            cfg = decoding.generation(self.max_new, self.seed, tuple(self.tok.stop_ids))
            out = generate_many(self.model, prompts, dataclasses.replace(cfg, seed_per_row=True))
            self.generated[name] = ([o.tokens for o in out], [o.finish_reason == "stop_token" for o in out])

    def _score_generated(self) -> None:
        self.gen_docs, self.gen_nlls = {}, {}
        for name, (tokens, stopped) in self.generated.items():
            d = DECODINGS[name]
            docs = self._context_docs([[*t, self.eos_id] if s else t for t, s in zip(tokens, stopped)])
            views = (None, GenerationConfig(temperature=d.temperature, top_k=d.top_k))
            self.gen_docs[name], self.gen_nlls[name] = docs, token_nlls(self.model, docs, views)

    # ------------------------------------------------------------------------------ length rules
    def _tokens_for_words(self, ids: list[int], n: int) -> int:
        """The fewest leading tokens whose text holds the first ``n`` whitespace words of the whole
        continuation (a word's trailing punctuation included)."""
        words = words_prefix(self.tok.decode(ids), n)
        return next((k for k in range(len(ids) + 1) if words_prefix(self.tok.decode(ids[:k]), n) == words), len(ids))

    def _length(self, k: int, rule: tuple, ids: list[int]) -> int | None:
        """How many continuation tokens (targets) a rule keeps of sample k (None: all)."""
        kind, n = rule
        ref = len(self.samples[k].reference_ids)
        return {
            "tokens": lambda: n,
            "words": lambda: self._tokens_for_words(ids, n),
            "reference": lambda: min(ref, self.cut),
            "context": lambda: self.cut,
            "whole": lambda: None,
        }[kind]()

    def scored_text(self, label: str) -> Scored:
        if label not in self._texts:
            self._texts[label] = self._scored_text(label)
        return self._texts[label]

    def _scored_text(self, label: str) -> Scored:
        decoding, rule, view = TEXTS[label]
        first = len(self.start) + self.P - 1  # the first continuation target
        if decoding is None:
            docs, arrays, ids = self.ref_docs, self.ref_nlls, [s.reference_ids for s in self.samples]
        else:
            docs, arrays, ids = self.gen_docs[decoding], self.gen_nlls[decoding], self.generated[decoding][0]
        lengths = [self._length(k, rule, ids[k]) for k in range(len(docs))]
        lengths = [None if n is None or first + n >= len(d) - 1 else n for n, d in zip(lengths, docs)]
        return self._scored(docs, arrays, first, lengths, view=0 if view == MODEL_VIEW else 1)

    # ------------------------------------------------------------------------------------- BLEU
    def _continuation_text(self, ids: list[int], k: int, rule: tuple) -> str:
        kind, n = rule
        if kind == "words":
            return words_prefix(self.tok.decode(ids), n)
        cut = {"tokens": n, "reference": min(len(self.samples[k].reference_ids), self.cut), "context": self.cut}
        return self.tok.decode(ids[: cut.get(kind, len(ids))])

    def bleu_stats(self, decoding: str, hypothesis: str, reference: str, prompt: str, tokens: str) -> list[BleuStats]:
        """Per-sample BLEU statistics of one decoding's continuations against the references, the
        texts cut by the rules named (labels of HYPOTHESIS, REFERENCE, PROMPT, TOKENS)."""
        key = (decoding, hypothesis, reference, prompt, tokens)
        if key not in self._stats:
            rule = HYPOTHESIS[hypothesis]
            ref_rule = {REFERENCE[0]: ("context", None), REFERENCE[1]: ("whole", None), REFERENCE[2]: rule}[reference]
            split = bleu_tokens if tokens == TOKENS[0] else str.split
            stats = []
            for k, (s, gen) in enumerate(zip(self.samples, self.generated[decoding][0])):
                hyp = self._continuation_text(gen, k, rule)
                ref = self._continuation_text(s.reference_ids, k, ref_rule)
                if prompt == PROMPT[1]:
                    head = self.tok.decode(s.prompt_ids)
                    hyp, ref = f"{head} {hyp}", f"{head} {ref}"
                stats.append(corpus_stats([split(hyp)], [split(ref)]))
            self._stats[key] = stats
        return self._stats[key]

    def evaluate(self, row: Published, combo: dict[str, str]) -> float:
        """The row's number under one option of each of its choices."""
        if row.measure == "valid_ppl":
            scored = self.valid[UNITS[combo["unit"]]]
        elif row.measure == "sample_ppl":
            scored = self.scored_text(combo["scored text"])
        else:
            decodings = ["T 0.7", "T 1.0", "T 1.2"] if combo["decoding"] == MEAN_OF_001 else [combo["decoding"]]
            values = [
                bleu_value(
                    self.bleu_stats(d, combo["hypothesis"], combo["reference"], combo["prompt"], combo["BLEU tokens"]),
                    row.order,
                    cumulative=combo["n-gram precision"] == KIND[0],
                    smoothing=SMOOTHING[combo["smoothing"]],
                    corpus=combo["averaging"] == BLEU_AVERAGING[0],
                    brevity=combo.get("brevity penalty", BREVITY[0]) == BREVITY[0],
                )
                for d in decodings
            ]
            return sum(values) / len(values)
        sums, counts = scored.sums(self.eos_id, self.unk_id, combo["<eos>"] == "counted", combo["<unk>"] == "counted")
        return average_ppl(sums, counts, combo["averaging"], row.batch)

    def generation_summary(self) -> dict:
        return {
            DECODINGS[name].name: {
                "decoding": name,
                "stopped_at_eos": sum(stopped),
                "mean_new_tokens": sum(map(len, tokens)) / len(tokens),
            }
            for name, (tokens, stopped) in self.generated.items()
        }


# ------------------------------------------------------------------------------------- the part
def score_row(row: Published, m: Measurements) -> dict:
    """The row's closest-protocol number, its range over every combination of the options, and
    the effect of each choice alone (every other choice at the closest protocol)."""
    names = [c for c, _ in row.choices]
    closest = {c: options[0] for c, options in row.choices}
    grid = [dict(zip(names, combo)) for combo in itertools.product(*(options for _, options in row.choices))]
    values = [m.evaluate(row, combo) for combo in grid]
    lo, hi = int(np.nanargmin(values)), int(np.nanargmax(values))
    open_choices = [c for c, options in row.choices if len(options) > 1]
    effects = [
        {"choice": c, "values": [[o, m.evaluate(row, {**closest, c: o})] for o in row.options[c]]} for c in open_choices
    ]
    return {
        "key": row.key,
        "report": row.report,
        "where": row.where,
        "quantity": row.quantity,
        "published": row.value,
        "measure": row.measure,
        "order": row.order if row.measure == "bleu" else None,
        "batch": row.batch if row.measure == "valid_ppl" else None,
        "closest_protocol": closest,
        "closest": m.evaluate(row, closest),
        "min": values[lo],
        "max": values[hi],
        "min_protocol": {c: grid[lo][c] for c in open_choices},
        "max_protocol": {c: grid[hi][c] for c in open_choices},
        "variants": len(grid),
        "effects": effects,
    }


def tinylm_protocol(m: Measurements) -> dict:
    """tinylm's own protocol, recomputed from the same measurements: the report checks these
    against eval.json and bleu.json (the same model and stories scored by the other parts)."""
    ppl = Published("tinylm", "", "", "", 0.0, "valid_ppl", ())
    sample = dataclasses.replace(ppl, measure="sample_ppl")
    base = {"<eos>": EOS[0], "<unk>": UNK[0]}
    ref = {**base, "scored text": _ref(REF_CONTEXT)[0]}
    bleu = {"decoding": "T 0.7", "hypothesis": LEN_REF, "reference": REFERENCE[0], "prompt": PROMPT[0]}
    bleu |= {"n-gram precision": KIND[0], "smoothing": "method1 (tinylm)", "averaging": BLEU_AVERAGING[0]}
    bleu |= {"BLEU tokens": TOKENS[0]}
    return {
        "valid_token_ppl": m.evaluate(ppl, {**base, "unit": WHOLE, "averaging": POOLED}),
        "reference_ppl": m.evaluate(sample, {**ref, "averaging": POOLED}),
        "mean_per_sample_ppl": m.evaluate(sample, {**ref, "averaging": SAMPLE_PPL}),
        "bleu_T0.7": {
            f"bleu{n}": m.evaluate(dataclasses.replace(ppl, measure="bleu", order=n), bleu) for n in (1, 2, 3, 4)
        },
    }


def _spread(values: list[float]) -> dict:
    return {"min": min(values), "max": max(values), "factor": max(values) / min(values) if min(values) > 0 else None}


def summary(rows: list[dict]) -> dict:
    """How far one model's numbers spread against how far the reports' do: perplexity (every
    perplexity row) and BLEU-4 (the rows of order 4)."""
    out = {}
    for name, keep in (
        ("perplexity", lambda r: r["measure"] != "bleu"),
        ("bleu4", lambda r: r["measure"] == "bleu" and r["order"] == 4),
    ):
        chosen = [r for r in rows if keep(r)]
        out[name] = {
            "published": _spread([r["published"] for r in chosen]),
            "closest": _spread([r["closest"] for r in chosen]),
            "all_variants": _spread([v for r in chosen for v in (r["min"], r["max"])]),
            "rows": len(chosen),
        }
    return out


def part_protocols(study) -> dict:
    """Score the judged model under each report's protocol (see the module's docstring)."""
    torch.set_num_threads(study.exp.decode_threads)
    model, tok = study.model
    seconds: dict = {}
    t0 = time.perf_counter()
    m = Measurements(model, tok, study.valid_texts, study.exp, seconds)
    rows = [score_row(row, m) for row in ROWS]
    seconds["scoring"] = round(time.perf_counter() - t0 - sum(seconds.values()), 2)
    whole_ref = m.scored_text(_ref(REF_WHOLE)[0]).sums(m.eos_id, m.unk_id, False, True)
    per_sample = np.exp(whole_ref[0] / whole_ref[1])
    return {
        "threads": study.exp.decode_threads,
        "model": {"parameters": model.num_parameters(), "context_length": model.config.context_length},
        "vocab_size": tok.vocab_size,
        "valid": m.valid_counts,
        "samples": len(m.samples),
        "prompt_tokens": m.P,
        "reference_cut": m.cut,
        "max_new_tokens": m.max_new,
        "generation": m.generation_summary(),
        "per_sample_ppl_whole_reference": {"min": float(per_sample.min()), "max": float(per_sample.max())},
        "tinylm_protocol": tinylm_protocol(m),
        "rows": rows,
        "summary": summary(rows),
        "not_reproducible": NOT_REPRODUCIBLE,
        "timings": seconds,
    }


# ------------------------------------------------------------------------------------ the report
def _num(row: dict, v: float | None) -> str:
    if v is None:
        return "missing"
    return f"{v:.4f}" if row["measure"] == "bleu" else f"{v:.2f}"


def _largest_effect(row: dict) -> str:
    """The one choice that moves the row's number most, with its two extreme options."""
    if not row["effects"]:
        return "-"
    e = max(row["effects"], key=lambda e: max(v for _, v in e["values"]) - min(v for _, v in e["values"]))
    (lo_o, lo), (hi_o, hi) = min(e["values"], key=lambda x: x[1]), max(e["values"], key=lambda x: x[1])
    return f"{e['choice']}: {lo_o} {_num(row, lo)} / {hi_o} {_num(row, hi)}"


def _spread_sentence(name: str, s: dict, fmt: str) -> str:
    def span(d: dict) -> str:
        factor = f", a factor of {d['factor']:.1f}" if d.get("factor") else ""
        return f"{d['min']:{fmt}} to {d['max']:{fmt}}{factor}"

    return (
        f"{name}: the reports published {span(s['published'])}; one model gives {span(s['closest'])} under "
        f"their closest protocols, and {span(s['all_variants'])} over every variant ({s['rows']} published numbers)."
    )


def _checks(run, result: dict) -> str:
    """tinylm's own protocol recomputed here beside the other parts' files (same model, same stories)."""
    own = result["tinylm_protocol"]
    judged = run / result["judged"] if result.get("judged") else run
    ev = ((read_json(judged / "eval.json") or {}).get("eval") or {}).get("valid") or {}
    bleu = read_json(run / "bleu.json") or {}
    t07 = next((s for s in bleu.get("settings", []) if s.get("name") == "T0.7" and not s.get("top_k")), {})
    filed = lambda v: "not run" if v is None else f"{v:.4f}"  # noqa: E731
    return (
        f"tinylm's own protocol recomputed from these measurements: validation token perplexity "
        f"{own['valid_token_ppl']:.4f} (eval.json: {filed(ev.get('token_ppl'))}); reference continuation perplexity "
        f"{own['reference_ppl']:.4f} (bleu.json: {filed(bleu.get('reference_ppl'))}); BLEU-4 at T 0.7 "
        f"{own['bleu_T0.7']['bleu4']:.4f} (bleu.json: {filed(t07.get('bleu4'))}; the same samples and seeds, "
        "decoded here in one batch, so a token may differ by float rounding)."
    )


def section_protocols(doc: Doc, run, result: dict | None) -> None:
    heading = "Why the reports' numbers disagree: one model, each report's protocol"
    if not start_part_section(doc, heading, result, "protocols", "the reports' protocols"):
        return
    gen = ", ".join(f"{g['decoding']} ({g['stopped_at_eos']} ended at <eos>)" for g in result["generation"].values())
    doc.p(
        f"One model ({result['model']['parameters']:,} parameters, context {result['model']['context_length']}, "
        f"word vocabulary of {result['vocab_size']:,}) scored under each report's protocol as far as its text "
        "describes it (docs/notes/report-protocols.md quotes every line). **Closest protocol**: what the report "
        "states or its printed tables show, and tinylm's protocol for what it leaves unstated. **Range**: the "
        "lowest and highest number over every combination of the choices its text leaves open (**variants**). "
        "Reports: the files of shared/reports (000_95aac6fc2548188d.txt ...), lines as in their text copies. "
        f"Validation file: {result['valid']['stories']:,} stories, {result['valid']['sentences']:,} sentences. "
        f"50-sample numbers: the BLEU part's {result['samples']} stories (prompt = first {result['prompt_tokens']} "
        f"tokens, reference cut to {result['reference_cut']} tokens where tinylm cuts it). Each decoding generated "
        f"once for all prompts (sample k with seed + k), at most {result['max_new_tokens']} new tokens, then cut "
        f"by each length rule: {gen}. torch threads: {result['threads']}."
    )
    rows = result["rows"]
    doc.table(
        ["report", "line", "quantity", "published", "tinylm, closest protocol", "range over unstated choices",
         "variants", "the choice that moves it most"],
        [
            (r["report"][:3], r["where"], r["quantity"], f"{r['published']:g}", _num(r, r["closest"]),
             f"{_num(r, r['min'])} - {_num(r, r['max'])}", str(r["variants"]), _largest_effect(r))
            for r in rows
        ],
    )  # fmt: skip
    s = result["summary"]
    inside = sum(r["min"] <= r["published"] <= r["max"] for r in rows)
    doc.p(
        _spread_sentence("Perplexity", s["perplexity"], ".2f")
        + " "
        + _spread_sentence("BLEU-4", s["bleu4"], ".4f")
        + f" {inside} of the {len(rows)} published numbers fall inside one model's range; the rest need "
        "another model, another vocabulary or a protocol the text does not describe."
    )
    ps = result["per_sample_ppl_whole_reference"]
    doc.p(
        f"Per-sample perplexity of the whole reference continuation: {ps['min']:.2f} to {ps['max']:.2f} "
        "(report 000's printed per_sample_ppl column: 2.45 to 12.86). " + _checks(run, result)
    )
    _effects_table(doc, rows)
    doc.p("Not reproducible with one model (listed, not emulated):")
    doc.table(["report", "what one model cannot repeat"], list(result["not_reproducible"].items()))
    secs = ", ".join(f"{k} {v:.0f} s" for k, v in result["timings"].items())
    total = f"; {result['seconds']:.0f} s in all" if isinstance(result.get("seconds"), (int, float)) else ""
    doc.p(f"Time: {secs}{total}.")


def _effects_table(doc: Doc, rows: list[dict]) -> None:
    """Each perplexity and BLEU-4 row's choices, one at a time from the closest protocol (marked *)."""
    lines = []
    for r in rows:
        if r["measure"] == "bleu" and r["order"] != 4:
            continue
        name = f"{r['report'][:3]} {r['published']:g}"
        varied = {e["choice"]: e["values"] for e in r["effects"]}
        for choice, option in r["closest_protocol"].items():
            if choice not in varied:
                lines.append((name, choice, f"{option} (fixed by the report)"))
                continue
            cells = [f"{o}{' *' if o == option else ''}: {_num(r, v)}" for o, v in varied[choice]]
            lines.append((name, choice, "; ".join(cells)))
    doc.p(
        "Each choice alone, every other at the closest protocol (* marks the closest option); BLEU-1 to 3 of "
        "reports 000 and 001 take the same choices as their BLEU-4 (every value is in protocols.json)."
    )
    doc.table(["published", "choice", "option: tinylm"], lines)
