"""Choosing the next token from logits: greedy or sampled after the distribution is shaped."""

from __future__ import annotations

import torch

from tinylm.generation.processors import GenerationConfig, shape_distribution


def select_next(logits: torch.Tensor, cfg: GenerationConfig,
                generator: torch.Generator | list[torch.Generator] | None = None) -> torch.Tensor:
    """logits (B, V) -> next ids (B,). Greedy (argmax, lowest id on ties) when temperature is 0;
    otherwise one draw per row from softmax of the shaped logits, from ``generator`` (or from
    ``generator[r]`` for row r when given one generator per row)."""
    if cfg.greedy:
        return logits.argmax(dim=-1)
    probs = torch.softmax(shape_distribution(logits.float(), cfg), dim=-1)
    if isinstance(generator, list):
        return torch.cat([torch.multinomial(probs[r : r + 1], 1, generator=g)[0] for r, g in enumerate(generator)])
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
