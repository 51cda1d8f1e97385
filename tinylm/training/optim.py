"""AdamW with decoupled weight decay on matrices only, and the learning-rate schedule."""

from __future__ import annotations

import math

import torch

from tinylm.config import TrainConfig


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


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup over ``warmup_steps``, then cosine (or linear) decay to ``min_lr`` at ``max_steps``."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    if cfg.schedule == "linear":
        return cfg.lr + (cfg.min_lr - cfg.lr) * progress
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))
