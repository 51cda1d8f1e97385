"""Bits per byte, byte by byte: where in a text a model spends its bits.

A text is scored as ``tinylm evaluate`` scores a document (tinylm.evaluation.perplexity): encoded
alone, from the tokenizer's start id, every token after it predicted with the strided windows of
``document_windows``, ``<eos>`` not scored. Each predicted token's bits (-log2 p) are spread evenly
over the UTF-8 bytes it stands for, so

    sum(byte_bits) / len(text.encode("utf-8")) == evaluate_texts(model, tokenizer, [text])["bpb"]

and models with different tokenizers can be compared on the same bytes (or characters: the sum of
a character's bytes).

Which bytes a token stands for: its bytes (a byte-level BPE's table, a word tokenizer's word, else
its decoded text) are found in the text from where the previous token ended (a few bytes of skipped whitespace allowed,
then case-insensitively for lowercasing tokenizers); a token that cannot be found (``<unk>``, a
normalised piece) starts where the previous one ended. Each token then spans up to the next
token's start, so the spans cover the text, and a token with no byte of its own shares the bytes of
the token after it (the one before, at the end): every bit lands on some byte.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from tinylm.constants import IGNORE_INDEX, PAD_ID
from tinylm.data.tokens import pad_rows
from tinylm.errors import TinyLMError
from tinylm.evaluation.perplexity import document_windows
from tinylm.models.gpt import eval_mode

SKIP_BYTES = 8  # whitespace a tokenizer may drop between tokens (word tokenizers)


@dataclass
class ByteScore:
    ids: list[int]  # the text's token ids (no start id)
    spans: list[tuple[int, int]]  # byte span of each token
    token_logprobs: list[float | None]  # log p (nats) of each token; None for a first token nothing predicts
    top: list[list[tuple[int, float]]]  # the most likely (id, log p) where each token was predicted
    byte_bits: np.ndarray  # (bytes,) bits spent on each byte
    n_bytes: int

    @property
    def bits(self) -> float:
        return float(self.byte_bits.sum())

    @property
    def bpb(self) -> float:
        return self.bits / self.n_bytes if self.n_bytes else math.nan


def _token_pieces(tokenizer, text: str, ids: list[int]) -> list[bytes]:
    """What to look for in the text for each token: a word tokenizer's words as it split them (an
    ``<unk>`` is still its word), a byte-level BPE's bytes (a token may be part of a character), else
    the token's decoded text."""
    split = getattr(tokenizer, "split", None)
    if callable(split):
        words = split(text)
        if len(words) == len(ids):  # one id per word (no word spelled in pieces)
            return [w.encode("utf-8") for w in words]
    table = getattr(tokenizer, "token_bytes", None)
    if table is not None:
        return [table[i] if 0 <= i < len(table) else b"" for i in ids]
    return [tokenizer.decode([i]).encode("utf-8") for i in ids]


def token_byte_spans(tokenizer, text: str, ids: list[int]) -> list[tuple[int, int]]:
    """The bytes of ``text`` each of its tokens ``ids`` stands for (see the module docstring)."""
    data = text.encode("utf-8")
    folded = text.lower().encode("utf-8")
    folded = folded if len(folded) == len(data) else None
    starts, pos = [], 0
    for piece in _token_pieces(tokenizer, text, [int(i) for i in ids]):
        found = -1
        if piece:
            found = data.find(piece, pos, pos + len(piece) + SKIP_BYTES)
            if found < 0 and folded is not None:
                found = folded.find(piece.lower(), pos, pos + len(piece) + SKIP_BYTES)
        starts.append(found if found >= 0 else pos)
        pos = found + len(piece) if found >= 0 else pos
    if starts:
        starts[0] = 0  # bytes before the first token (whitespace a tokenizer drops) are its own
    ends = starts[1:] + [len(data)]
    spans = [(s, e) for s, e in zip(starts, ends)]
    for k in range(len(spans) - 2, -1, -1):  # an empty span shares the next token's bytes
        if spans[k][0] >= spans[k][1]:
            spans[k] = spans[k + 1]
    for k in range(1, len(spans)):  # the last ones: the previous token's
        if spans[k][0] >= spans[k][1]:
            spans[k] = spans[k - 1]
    return spans


@torch.no_grad()
def predicted_logprobs(
    model, ids: list[int], top: int = 0, batch_size: int = 32
) -> list[tuple[float, list[tuple[int, float]]]]:
    """(log p(ids[t] | ids[:t]), the ``top`` most likely (id, log p)) for t >= 1, each token with the
    context ``tinylm evaluate`` gives it: the windows of ``score_token_documents``, batched as it
    batches them, so the logits are the same numbers."""
    windows = list(document_windows(ids, model.config.context_length))
    order = sorted(range(len(windows)), key=lambda i: len(windows[i][0]))
    device = next(model.parameters()).device
    per_window: dict[int, list] = {}
    with eval_mode(model):
        for b in range(0, len(order), batch_size):
            chunk = order[b : b + batch_size]
            logits, _ = model(pad_rows([windows[i][0] for i in chunk], PAD_ID).to(device))
            # the loss's precision (at least float32), log-softmax as F.cross_entropy takes it
            logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1).cpu()
            k = min(top, logp.shape[-1])
            for row, i in enumerate(chunk):
                found = []
                for pos, target in enumerate(windows[i][1]):
                    if target != IGNORE_INDEX:
                        values, top_ids = logp[row, pos].topk(k)
                        found.append((float(logp[row, pos, target]), list(zip(top_ids.tolist(), values.tolist()))))
                per_window[i] = found
    return [item for i in range(len(windows)) for item in per_window[i]]


def score_bytes(model, tokenizer, text: str, top: int = 5, batch_size: int = 32) -> ByteScore:
    """Each token's log probability and top predictions, and the bits of each byte of ``text``
    (``batch_size`` windows per forward)."""
    ids = [int(i) for i in tokenizer.encode(text)]
    start = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    if len(start) + len(ids) < 2:
        raise TinyLMError("the text encodes to no token to score (give a longer text)")
    scored = predicted_logprobs(model, start + ids, top, batch_size)
    unscored = len(ids) - len(scored)  # the first token when there is no start id
    logprobs = [None] * unscored + [lp for lp, _ in scored]
    spans = token_byte_spans(tokenizer, text, ids)
    n_bytes = len(text.encode("utf-8"))
    byte_bits = np.zeros(n_bytes)
    for (s, e), lp in zip(spans, logprobs):
        if lp is not None:
            byte_bits[s:e] += -lp / math.log(2) / (e - s)
    return ByteScore(ids, spans, logprobs, [[]] * unscored + [t for _, t in scored], byte_bits, n_bytes)


def char_offsets(text: str) -> np.ndarray:
    """(characters + 1,) the byte offset where each character of ``text`` starts, then its length in bytes."""
    return np.concatenate([[0], np.cumsum([len(c.encode("utf-8")) for c in text])]).astype(np.int64)


def char_bits(byte_bits: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Bits of each character: the sum of its bytes'."""
    sums = np.concatenate([[0.0], np.cumsum(byte_bits)])
    return sums[offsets[1:]] - sums[offsets[:-1]]


def char_span(span: tuple[int, int], offsets: np.ndarray) -> tuple[int, int]:
    """A byte span as characters: each character goes to the token that holds its first byte."""
    return int(np.searchsorted(offsets[:-1], span[0])), int(np.searchsorted(offsets[:-1], span[1]))
