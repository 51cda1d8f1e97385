"""Choosing the next token from logits: greedy, or drawn after the distribution is shaped.

Every row of a batch may carry its own knobs (``RowKnobs``: greedy or not, temperature, top-k,
top-p, min-p, seed), and one step chooses the tokens of all rows in one set of tensor operations,
whatever their mix; a batch whose rows agree on a knob keeps it as one number (the cheaper path).

A seeded row draws from a counter-based stream: its n-th draw is a hash of (seed, n), made a
uniform number in [0, 1) and inverted through the row's cumulative distribution. The draw depends
on nothing but the row's seed and how many tokens it chose before, so a row gets the same tokens
alone, in any batch, in ``tinylm generate`` and in the server, and no per-row generator has to be
stepped in a Python loop. One torch generator shared by the whole batch (Hugging Face's batched
sampling) draws with ``torch.multinomial`` instead, which is what matching HF token for token needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from tinylm.constants import SOS_ID
from tinylm.generation.processors import GenerationConfig, shape_distribution


@dataclass
class RowKnobs:
    """The sampling knobs of B rows: a Python value where every row agrees, else a tensor.

    greedy: bool or (B,) bool; temperature: float or (B, 1) (1 on greedy rows); top_k: int, None
    or (B,) long (0: off); top_p: float, None or (B, 1) (inf: off); min_p: float, None or (B, 1)
    (0: off); keys: None (draw with torch's generator) or (B,) uint64, each row's seed mixed."""

    greedy: bool | torch.Tensor = False
    temperature: float | torch.Tensor = 1.0
    top_k: int | torch.Tensor | None = None
    top_p: float | torch.Tensor | None = None
    min_p: float | torch.Tensor | None = None
    keys: np.ndarray | None = None

    @classmethod
    def of(cls, cfgs: Sequence[GenerationConfig], seeds: Sequence[int] | None = None, device="cpu") -> "RowKnobs":
        """Knobs of rows with these configs; ``seeds`` (one int per row) makes each row draw from
        its own counter-based stream."""
        greedy = [c.greedy for c in cfgs]
        sampled = [c for c in cfgs if not c.greedy]
        keys = None if seeds is None else seed_keys(seeds)
        if not sampled:
            return cls(greedy=True, keys=keys)

        def per_row(values: list, off, shape) -> object:
            if all(v == values[0] for v in values):
                return None if values[0] == off else values[0]
            return torch.tensor(values, device=device).view(shape)

        def knob(get) -> list:  # greedy rows take any sampled row's value: their draw is dropped
            fill = get(sampled[0])
            return [get(c) if not c.greedy else fill for c in cfgs]

        top_p = knob(lambda c: float("inf") if c.top_p is None or c.top_p >= 1.0 else c.top_p)
        return cls(
            greedy=torch.tensor(greedy, device=device) if any(greedy) else False,
            temperature=per_row(knob(lambda c: c.temperature), None, (-1, 1)),
            top_k=per_row(knob(lambda c: c.top_k or 0), 0, (-1,)),
            top_p=per_row(top_p, float("inf"), (-1, 1)),
            min_p=per_row(knob(lambda c: c.min_p or 0.0), 0.0, (-1, 1)),
            keys=keys,
        )


# ---------------------------------------------------------------------- the counter-based stream
# SplitMix64 (Steele, Lea and Flood's generator; its output function is Stafford's "Mix13") on
# numpy uint64 arrays, whose multiplications wrap modulo 2**64 as the hash needs; for a batch of
# rows it is about 15 microseconds of array operations, where torch's per-op overhead made the
# same hash on int64 tensors some 15 times slower.
GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def seed_keys(seeds: Sequence[int]) -> np.ndarray:
    """Each row's seed (any int; taken modulo 2**64) mixed into the key of its stream: (B,) uint64."""
    return _mix64(np.array([int(s) & (2**64 - 1) for s in seeds], dtype=np.uint64) + GOLDEN)


def stream_uniforms(keys: np.ndarray, draws) -> torch.Tensor:
    """The ``draws``-th uniform number in [0, 1) of each row's stream ((B,) float64 with 52 random
    bits: u times a row's total stays below the total, so the inverse CDF never lands past the
    last token)."""
    z = _mix64(keys + (np.asarray(draws, dtype=np.uint64) + np.uint64(1)) * GOLDEN)
    return torch.from_numpy((z >> np.uint64(12)).astype(np.float64) * 2.0**-52)


def draw_inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row: the first whose cumulative probability exceeds u times the row's total
    (a token of probability 0 is never chosen)."""
    cdf = probs.double().cumsum(-1)
    target = (uniforms * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=probs.size(-1) - 1)


# ------------------------------------------------------------------------------ choosing tokens
def choose(
    logits: torch.Tensor,
    knobs: RowKnobs,
    generator: torch.Generator | None = None,
    draws: Sequence[int] | np.ndarray | None = None,
) -> torch.Tensor:
    """logits (B, V) -> next ids (B,). Greedy rows: argmax (lowest id on ties). Sampled rows: one
    draw from softmax of the shaped logits; from each row's stream at ``draws`` (the tokens it
    chose before, one int per row) when ``knobs.keys`` is set, else ``torch.multinomial`` from
    ``generator`` (torch's global generator when None)."""
    if knobs.greedy is True:
        return logits.argmax(dim=-1)
    probs = torch.softmax(shape_distribution(logits.float(), knobs), dim=-1)
    if knobs.keys is not None:
        sampled = draw_inverse_cdf(probs, stream_uniforms(knobs.keys, draws).to(probs.device))
    else:
        sampled = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    if isinstance(knobs.greedy, torch.Tensor):
        sampled = torch.where(knobs.greedy, logits.argmax(dim=-1), sampled)
    return sampled


def select_next(logits: torch.Tensor, cfg: GenerationConfig, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits (B, V) -> next ids (B,), every row with ``cfg``'s knobs, draws from ``generator``."""
    return choose(logits, RowKnobs.of([cfg]), generator)


def sample_from_context(
    next_logits: Callable[[list[int]], torch.Tensor], prompt_ids: Iterable[int], cfg: GenerationConfig
) -> list[int]:
    """Continue ``prompt_ids`` with a cache-less model (the n-gram and neural bigram baselines):
    ``next_logits(context)`` gives (V,) logits or log probabilities. ``<sos>`` is never drawn (it
    would start a document inside this one); the continuation ends before any of ``cfg.stop_ids``;
    draws come from a generator seeded with ``cfg.seed``."""
    cfg.validate()
    generator = torch.Generator().manual_seed(cfg.seed or 0)
    context, out = [int(t) for t in prompt_ids], []
    for _ in range(cfg.max_new_tokens):
        logits = next_logits(context).clone()
        logits[SOS_ID] = float("-inf")
        token = int(select_next(logits[None], cfg, generator)[0])
        if token in cfg.stop_ids:
            break
        out.append(token)
        context.append(token)
    return out
