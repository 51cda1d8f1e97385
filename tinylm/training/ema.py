"""An exponential moving average of the weights, kept beside training and saved as its own model.

After update n the average is ema <- d_n * ema + (1 - d_n) * w with d_n = min(decay, (1 + n) / (10 + n)):
the early, fast-moving weights are forgotten quickly, and later the average spans about
1 / (1 - decay) steps. In a data-limited run (many passes over a small corpus) the average of
the last stretch of training usually scores better on unseen text than the last weights do.
"""

from __future__ import annotations

import copy

import torch

UPDATES_KEY = "__updates__"  # the update count, stored with the averaged tensors (exact resume)


class EMA:
    def __init__(self, model: torch.nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay must be in (0, 1) (got {decay})")
        self.decay = decay
        self.updates = 0
        # named_parameters lists a tied weight once; the average is kept in float32
        self.shadow = {name: p.detach().float().clone() for name, p in model.named_parameters()}

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        self.updates += 1
        d = min(self.decay, (1 + self.updates) / (10 + self.updates))
        for name, p in model.named_parameters():
            self.shadow[name].lerp_(p.detach().float(), 1.0 - d)

    @torch.no_grad()
    def averaged_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """A copy of ``model`` holding the averaged weights (the training model is untouched)."""
        twin = copy.deepcopy(model)
        for name, p in twin.named_parameters():
            p.copy_(self.shadow[name])
        return twin

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {**self.shadow, UPDATES_KEY: torch.tensor(self.updates, dtype=torch.int64)}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        missing = set(self.shadow) - set(tensors)
        if missing or UPDATES_KEY not in tensors:
            raise ValueError(f"the saved average lacks {sorted(missing)[:3] or [UPDATES_KEY]}")
        for name in self.shadow:
            self.shadow[name].copy_(tensors[name])
        self.updates = int(tensors[UPDATES_KEY])
