"""The forward passes every decoder shares: prompts fitted to the context, a batched prefill into
a new KV cache (left-padded rows with a key mask and per-row positions), and the no-cache path.
The decoding batch (batch.py) and beam search (beam.py) are both built on these.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Iterable

import numpy as np
import torch

from tinylm.constants import PAD_ID
from tinylm.data.tokens import pad_rows
from tinylm.errors import TinyLMError


@dataclass
class Generated:
    tokens: list[int]  # new tokens only, without the stop token
    finish_reason: str  # "stop_token" | "stop_string" | "length"
    score: float | None = None  # beam search: length-normalised log probability


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def fit_prompts(prompts: Iterable[Iterable[int]], context_length: int) -> list[list[int]]:
    rows = []
    for ids in prompts:
        ids = torch.as_tensor(ids, dtype=torch.long).flatten().tolist() if not isinstance(ids, list) else list(ids)
        if not ids:
            raise TinyLMError("the prompt encodes to no tokens; give a non-empty prompt")
        if len(ids) > context_length:
            warnings.warn(
                f"prompt of {len(ids)} tokens is longer than the context ({context_length}); "
                f"keeping the last {context_length}"
            )
            ids = ids[-context_length:]
        rows.append(ids)
    if not rows:
        raise TinyLMError("no prompts given")
    return rows


SLOT_BUCKET = 64  # a bucketed cache has 64, 128, 256, ... slots (at most the context)


def cache_slots(needed: int, context_length: int, bucketed: bool) -> int:
    """KV-cache slots for rows that need ``needed``: exactly that (at most the context), or, for a
    compiled step (one compilation per shape), 64 times a power of two, so that few shapes serve
    every length. The compiled step reads every slot, so the buckets double rather than grow faster."""
    needed = min(needed, context_length)
    if not bucketed:
        return needed
    slots = SLOT_BUCKET
    while slots < needed:
        slots *= 2
    return min(context_length, slots)


def window(seq: list[int], context_length: int) -> list[int]:
    """What a row that filled the context continues from: its last half context (positions then
    restart at 0), so that it runs past the context length with room to grow."""
    return seq[-(context_length // 2) :]


def prefill(model, rows: list[list[int]], max_len: int, all_logits: bool = False):
    """Run left-padded ``rows`` through the model into a new cache of ``max_len`` slots.

    Returns (cache, logits of each row's last token (B, V), or with ``all_logits`` of every
    position (B, L, V) (to score the prompts), next position per row (B,) or None when no row is
    padded). Slots after the prompt are marked real in the key mask up front, so a decoding step
    needs no mask building beyond slicing."""
    device = model_device(model)
    ids = pad_rows(rows, PAD_ID, left=True).to(device)  # padding is never attended to: any id works
    B, L = ids.shape
    cache = model.new_kv_cache(B, max_len)
    if all(len(r) == L for r in rows):
        logits, _ = model(ids, kv_cache=cache, last_logits_only=not all_logits)
        return cache, logits if all_logits else logits[:, -1], None
    lengths = torch.tensor([len(r) for r in rows], device=device)
    real = torch.arange(L, device=device)[None, :] >= (L - lengths)[:, None]  # (B, L)
    cache.key_mask = torch.ones(B, max_len, dtype=torch.bool, device=device)
    cache.key_mask[:, :L] = real
    positions = (real.cumsum(1) - 1).clamp(min=0)
    logits, _ = model(ids, kv_cache=cache, position_ids=positions, last_logits_only=not all_logits)
    return cache, logits if all_logits else logits[:, -1], lengths.clone()


@dataclass(frozen=True)
class ScoredTokens:
    """Scored tokens as arrays: each token's log p given the tokens before it, and the ``top``
    likeliest (id, log p) there. A scored prompt of 16,384 tokens crosses the engine boundary as
    three arrays, not 16,384 x 6 Python tuples built and pickled while other rows decode."""

    logprobs: np.ndarray  # (N,) float32
    top_ids: np.ndarray  # (N, k) int64
    top_logprobs: np.ndarray  # (N, k) float32

    def __len__(self) -> int:
        return len(self.logprobs)

    def alternatives(self) -> "TopAlternatives":
        return TopAlternatives(self.top_ids, self.top_logprobs)

    @staticmethod
    def join(parts: list["ScoredTokens"], top: int) -> "ScoredTokens":
        if not parts:
            empty = np.zeros((0, top), dtype=np.float32)
            return ScoredTokens(np.zeros(0, dtype=np.float32), empty.astype(np.int64), empty)
        return ScoredTokens(*(np.concatenate(arrays) for arrays in zip(*(dataclasses.astuple(p) for p in parts))))


class TopAlternatives(Sequence):
    """Each token's alternatives as a list of (id, log p), built when read (a slice at a time as
    a long response is written)."""

    def __init__(self, ids: np.ndarray, logprobs: np.ndarray):
        self.ids, self.logprobs = ids, logprobs

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [list(zip(i, v)) for i, v in zip(self.ids[k].tolist(), self.logprobs[k].tolist())]
        return list(zip(self.ids[k].tolist(), self.logprobs[k].tolist()))


def scored_tokens(logp: torch.Tensor, targets: list[int], top: int) -> ScoredTokens:
    """For each row of log-probabilities ``logp`` (T, V): the log p of ``targets[t]`` and the ``top``
    likeliest (id, log p) (a scored prompt, echoed or in a prefill)."""
    picked = logp.gather(1, torch.tensor(targets, dtype=torch.long, device=logp.device)[:, None]).squeeze(1)
    values, ids = logp.topk(min(top, logp.size(-1)), dim=-1)
    return ScoredTokens(picked.float().cpu().numpy(), ids.cpu().numpy(), values.float().cpu().numpy())


def full_forward(model, rows: list[list[int]]) -> torch.Tensor:
    """No-cache path: the logits after each row's last token, recomputing everything."""
    if all(len(r) == len(rows[0]) for r in rows):
        logits, _ = model(torch.tensor(rows, device=model_device(model)), last_logits_only=True)
        return logits[:, -1]
    return prefill(model, rows, max(len(r) for r in rows))[1]
