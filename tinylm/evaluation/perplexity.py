"""Perplexity per token, per word, and bits per byte.

    token_ppl = exp(total NLL / predicted tokens)
    bpb       = total NLL / (ln 2 * UTF-8 bytes of the scored text)
    word_ppl  = exp(total NLL / whitespace-separated words of the scored text)

Each document is scored on its own from its ``<sos>`` start (the protocol used to compare with
other models on held-out stories): the targets are the document's tokens; ``<eos>`` is not
scored unless ``score_eos``. A document longer than the context is scored with strided windows:
every token once, each with as much preceding context as a window of ``context_length`` allows
(at least ``context_length - stride`` tokens after the first window).
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import numpy as np
import torch

from tinylm.constants import EOS_ID, IGNORE_INDEX, PAD_ID
from tinylm.data.tokens import pad_rows
from tinylm.models.gpt import eval_mode


def document_windows(ids: Sequence[int], context_length: int, stride: int | None = None):
    """Yield (input ids, target ids with IGNORE_INDEX where already scored) covering ``ids[1:]``."""
    ids = list(ids)
    n = len(ids)
    stride = stride or max(1, context_length // 2)
    scored, begin = 0, 0  # targets ids[1 .. scored] are done
    while scored < n - 1:
        end = min(begin + context_length, n - 1)  # inputs ids[begin:end], targets ids[begin+1 : end+1]
        targets = [ids[j] if j > scored else IGNORE_INDEX for j in range(begin + 1, end + 1)]
        yield ids[begin:end], targets
        scored = end
        begin = min(begin + stride, n - 1 - context_length)  # the last window ends at the last token


@torch.no_grad()
def score_token_documents(
    model: torch.nn.Module,
    documents: Iterable[Sequence[int]],
    context_length: int | None = None,
    batch_size: int = 32,
    stride: int | None = None,
) -> tuple[float, int]:
    """Sum of NLL (nats) and count of scored tokens over documents that start with ``<sos>``."""
    context_length = context_length or model.config.context_length
    device = next(model.parameters()).device
    windows = [w for doc in documents for w in document_windows(doc, context_length, stride)]
    windows.sort(key=lambda w: len(w[0]))  # batch similar lengths together: less padding
    with eval_mode(model):
        total_nll, total_tokens = 0.0, 0
        for b in range(0, len(windows), batch_size):
            chunk = windows[b : b + batch_size]
            x = pad_rows([inp for inp, _ in chunk], PAD_ID)
            y = pad_rows([tgt for _, tgt in chunk], IGNORE_INDEX)
            _, nll = model(x.to(device), y.to(device), loss_reduction="sum")
            total_nll += float(nll)
            total_tokens += int((y != IGNORE_INDEX).sum())
    return total_nll, total_tokens


def _perplexity(mean_nll: float) -> float:
    """exp(mean NLL); a mean too large for a float (above ~709.78 nats, e.g. the word perplexity
    of a binary file with few whitespace-separated words) is reported honestly as inf."""
    try:
        return math.exp(mean_nll)
    except OverflowError:
        return math.inf


def metrics(total_nll: float, n_tokens: int, n_bytes: int, n_words: int) -> dict:
    return {
        "token_ppl": _perplexity(total_nll / n_tokens) if n_tokens else float("nan"),
        "bpb": total_nll / (math.log(2) * n_bytes) if n_bytes else float("nan"),
        "word_ppl": _perplexity(total_nll / n_words) if n_words else float("nan"),
        "nll": total_nll,
        "tokens": n_tokens,
        "bytes": n_bytes,
        "words": n_words,
    }


def _strip_eos(ids: np.ndarray, score_eos: bool, eos_id: int = EOS_ID) -> list[int]:
    ids = [int(i) for i in ids]
    if not score_eos and ids and ids[-1] == eos_id:
        ids = ids[:-1]
    return ids


def evaluate_split(
    model, split, batch_size: int = 32, score_eos: bool = False, max_docs: int | None = None, eos_id: int = EOS_ID
) -> dict:
    """Metrics over a prepared TokenSplit (documents stored as ``<sos> ... <eos>``; ``eos_id``: the
    tokenizer's, when it orders its special tokens its own way)."""
    n = split.n_docs if max_docs is None else min(max_docs, split.n_docs)
    docs = [_strip_eos(split.document(i), score_eos, eos_id) for i in range(n)]
    nll, tokens = score_token_documents(model, docs, batch_size=batch_size)
    if n < split.n_docs:  # bytes/words are stored for the whole split; scale to the part scored
        frac = sum(len(d) for d in docs) / max(1, split.n_tokens)
        return metrics(nll, tokens, int(split.n_bytes * frac), int(split.n_words * frac))
    return metrics(nll, tokens, split.n_bytes, split.n_words)


def evaluate_texts(model, tokenizer, texts: list[str], batch_size: int = 32) -> dict:
    """Metrics over raw documents, each encoded alone and scored from the tokenizer's start id
    (<sos> for tinylm, BOS=1 for llama2.c, none for a tokenizer without one)."""
    start = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    docs = [start + list(tokenizer.encode(t)) for t in texts]
    nll, tokens = score_token_documents(model, docs, batch_size=batch_size)
    return metrics(nll, tokens, sum(len(t.encode("utf-8")) for t in texts), sum(len(t.split()) for t in texts))
