"""Choosing the next token from logits: greedy or sampled after the distribution is shaped."""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from tinylm.constants import SOS_ID
from tinylm.generation.processors import GenerationConfig, shape_distribution


def select_next(
    logits: torch.Tensor, cfg: GenerationConfig, generator: torch.Generator | list[torch.Generator] | None = None
) -> torch.Tensor:
    """logits (B, V) -> next ids (B,). Greedy (argmax, lowest id on ties) when temperature is 0;
    otherwise one draw per row from softmax of the shaped logits, from ``generator`` (or from
    ``generator[r]`` for row r when given one generator per row)."""
    if cfg.greedy:
        return logits.argmax(dim=-1)
    probs = torch.softmax(shape_distribution(logits.float(), cfg), dim=-1)
    if isinstance(generator, list):
        return draw_per_row(probs, generator)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def draw_per_row(probs: torch.Tensor, generators: list) -> torch.Tensor:
    """``torch.multinomial(probs[r:r+1], 1, generator=generators[r])`` for every row r, batched.

    One draw is torch's own algorithm for a single sample: the argmax of p / q with q ~ Exp(1)
    drawn from the row's generator. Drawing q row by row keeps each generator's stream (the
    tests check it against torch.multinomial row by row), and the division and argmax run once for the
    batch instead of once per row."""
    q = torch.empty_like(probs)
    for row, generator in zip(q, generators):
        row.exponential_(generator=generator)
    return (probs / q).argmax(dim=-1)


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
