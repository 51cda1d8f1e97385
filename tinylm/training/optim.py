"""AdamW with decoupled weight decay on matrices only, and the learning-rate schedule."""

from __future__ import annotations

import math

import torch

from tinylm.config import TrainConfig
from tinylm.errors import TinyLMError


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay weight matrices (linear layers, embeddings); never biases or norm gains."""
    decay, no_decay, seen = [], [], set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:  # tied weights appear twice
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


def lr_at(step: int, cfg: TrainConfig, wall_fraction: float | None = None) -> float:
    """Linear warmup over ``warmup_steps``, then cosine (or linear) decay to ``min_lr`` at ``max_steps``.

    ``wall_fraction`` (elapsed / wall budget, for ``schedule_clock="wall"``) replaces the step-based
    progress of the decay: the run reaches ``min_lr`` when its time is up, however fast it steps.
    Warmup stays in steps."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    if wall_fraction is not None:
        progress = min(1.0, max(0.0, wall_fraction))
    else:
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    if cfg.schedule == "linear":
        return cfg.lr + (cfg.min_lr - cfg.lr) * progress
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def wall_schedule_enabled(cfg: TrainConfig) -> bool:
    """True when the decay follows the wall clock; an unusable setting is a user error."""
    if cfg.schedule_clock not in ("steps", "wall"):
        raise TinyLMError(f"train.schedule_clock={cfg.schedule_clock!r} is not one of steps, wall")
    if cfg.schedule_clock == "wall" and not cfg.max_minutes:
        raise TinyLMError("train.schedule_clock=wall needs a wall budget: set train.max_minutes")
    return cfg.schedule_clock == "wall"
